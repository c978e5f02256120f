"""``kvfabric operator`` parses its options without importing kopf at import time."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from kvfabric.operator import cli

pytestmark = pytest.mark.process  # real processes (test level, see kvfabric.testing.levels)


def test_options_parse() -> None:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args(
        ["-n", "a", "-n", "b", "--webhook-port", "1234", "--register-webhook", "--webhook-service", "ns/svc"]
    )
    assert args.namespace == ["a", "b"]
    assert args.webhook_port == 1234
    assert args.register_webhook
    assert args.webhook_service == "ns/svc"
    assert args.webhook_addr == "127.0.0.1"


def test_cli_module_imports_only_the_stdlib() -> None:
    code = (
        "import sys, kvfabric.operator.cli; "
        "print(sorted(m for m in ('kopf', 'kubernetes', 'aiohttp') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_help_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "operator", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--register-webhook" in out
