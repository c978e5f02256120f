"""The ``kvfabric engine`` and ``kvfabric bench ttft`` entry points."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_CHECK = """
import sys
import kvfabric.refengine.cli, kvfabric.bench.ttft
heavy = sorted(m for m in ("torch", "grpc", "pydantic", "numpy") if m in sys.modules)
print(",".join(heavy))
"""

pytestmark = pytest.mark.process  # real processes (test level, see kvfabric.testing.levels)


def test_cli_modules_import_only_the_standard_library() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHECK], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == ""


def test_engine_run_reads_prompt_file(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('[1, 2, 3, 4]\n\n{"prompt_token_ids": [5, 6, 7], "max_tokens": 3}\n')
    out = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli.main", "engine", "run", "--no-cache", "--prompts", str(prompts)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(d["request"], d["prompt_tokens"], len(d["output_token_ids"])) for d in lines] == [
        (0, 4, 1),
        (2, 3, 3),
    ]
    assert all(d["hit_tokens"] == 0 and d["tier"] is None for d in lines)
    assert all(d["ttft_ms"] > 0 for d in lines)


def test_bench_ttft_is_offered() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli.main", "bench", "ttft", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "--quick" in out.stdout
    assert "--json" in out.stdout
