"""The alert rules are valid, their thresholds unit-tested by promtool, and each is documented."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from kvfabric.testing.opstools import OpsToolsError, prometheus_binaries

pytestmark = [pytest.mark.process]

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "charts" / "kvfabric" / "files" / "monitoring" / "alerts.yaml"
UNIT_TESTS = Path(__file__).with_name("alerts_test.yaml")


def _promtool() -> Path:
    try:
        return prometheus_binaries()[1]
    except OpsToolsError as exc:
        pytest.skip(str(exc))


def _alert_names() -> list[str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_checks_the_rules() -> None:
    result = subprocess.run(
        [str(_promtool()), "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_alert_names())} rules found" in result.stdout


def test_promtool_unit_tests_of_the_thresholds_pass() -> None:
    result = subprocess.run(
        [str(_promtool()), "test", "rules", UNIT_TESTS.name],
        cwd=UNIT_TESTS.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    for name in _alert_names():
        mine = [case for case in cases if case["alertname"] == name]
        assert any(case["exp_alerts"] for case in mine), f"{name}: no case where it fires"
        assert any(not case["exp_alerts"] for case in mine), f"{name}: no case where it does not"


def test_every_alert_has_a_section_in_the_operations_guide() -> None:
    guide = (ROOT / "docs" / "operations.md").read_text()
    headings = set(re.findall(r"^#+ .*?`?(KVFabric\w+)`?", guide, flags=re.MULTILINE))
    assert sorted(set(_alert_names()) - headings) == []
