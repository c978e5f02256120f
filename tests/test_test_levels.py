"""Every test gets exactly one level of the test ladder (the plugin kvfabric.testing.levels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvfabric.testing.levels import LEVELS, conflict, level_of

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("explicit", "path", "fixtures", "expected"),
    [
        ([], "tests/x/test_a.py", [], "unit"),
        (["process"], "tests/x/test_a.py", [], "process"),
        (["process"], "tests/x/test_a.py", ["cluster"], "cluster"),
        ([], "e2e/test_fabric.py", ["cluster"], "fabric"),
        (["vllm"], "tests/vllm/test_v.py", [], "vllm"),
        (["kubelet"], "e2e/test_k.py", [], "kubelet"),
        (["images"], "tests/test_i.py", [], "images"),
    ],
)
def test_every_test_gets_the_most_expensive_level(
    explicit: list[str], path: str, fixtures: list[str], expected: str
) -> None:
    assert level_of(explicit, Path(path), fixtures) == expected


@pytest.mark.parametrize(
    ("explicit", "level", "ok"),
    [
        ([], "unit", True),
        (["process"], "process", True),
        (["process", "process"], "process", True),  # the same marker on the module and the test
        (["process"], "cluster", False),  # a module's process on a test that takes the control plane
        (["process", "cluster"], "cluster", False),
        (["unit"], "fabric", False),
    ],
)
def test_a_test_that_would_carry_two_levels_is_a_conflict(explicit: list[str], level: str, ok: bool) -> None:
    why = conflict(explicit, level)
    assert (why is None) == ok
    if not ok:
        assert why is not None
        assert f"mark it {level}" in why


def run_pytest(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )


RECORDER = """
import json, os
LEVELS = {levels!r}
def pytest_collection_finish(session):
    found = {{i.nodeid: [m.name for m in i.iter_markers() if m.name in LEVELS] for i in session.items}}
    with open(os.environ["LEVELS_OUT"], "w") as f:
        json.dump(found, f)
"""


@pytest.mark.process
def test_every_collected_test_of_the_suite_carries_exactly_one_level_marker(tmp_path: Path) -> None:
    # The markers as pytest attaches them to the collected items of the real suite (what `-m unit`
    # selects on), not what level_of computes.
    (tmp_path / "levels_recorder.py").write_text(RECORDER.format(levels=list(LEVELS)))
    out = tmp_path / "levels.json"
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    proc = run_pytest(
        "--collect-only",
        "-q",
        "-p",
        "levels_recorder",
        "tests",
        "e2e",
        cwd=ROOT,
        env={"LEVELS_OUT": str(out), "PYTHONPATH": path},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found: dict[str, list[str]] = json.loads(out.read_text())
    assert len(found) > 100  # the whole suite was collected, not an empty directory
    wrong = {nodeid: levels for nodeid, levels in found.items() if len(levels) != 1}
    assert wrong == {}
    under_e2e = {levels[0] for nodeid, levels in found.items() if nodeid.startswith("e2e/")}
    assert under_e2e <= {"fabric", "kubelet", "vllm", "kind"}


INI = "[pytest]\naddopts = -p kvfabric.testing.levels\n"


@pytest.mark.process
def test_a_unit_test_that_starts_a_child_process_fails_naming_the_marker_it_needs(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text(INI)
    (tmp_path / "test_spawn.py").write_text(
        textwrap.dedent(
            """
            import os, subprocess, sys
            import pytest

            def test_unit_spawns():
                subprocess.run([sys.executable, "-c", "pass"], check=True)

            def test_unit_forks():
                pid = os.fork()
                if pid == 0:
                    os._exit(0)
                os.waitpid(pid, 0)

            def test_unit_stays_in_process():
                assert sum(range(4)) == 6

            @pytest.mark.process
            def test_process_spawns():
                subprocess.run([sys.executable, "-c", "pass"], check=True)
            """
        )
    )
    proc = run_pytest("-q", "-rf", "test_spawn.py", cwd=tmp_path)
    assert "2 failed, 2 passed" in proc.stdout, proc.stdout
    for name in ("test_unit_spawns", "test_unit_forks"):
        assert f"test_spawn.py::{name} is a unit test but starts a child process" in proc.stdout
    assert "mark it process" in proc.stdout


@pytest.mark.process
def test_a_test_marked_below_its_level_stops_collection_naming_it(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text(INI)
    (tmp_path / "test_two.py").write_text(
        textwrap.dedent(
            """
            import pytest

            pytestmark = pytest.mark.process

            @pytest.fixture
            def cluster():
                return None

            def test_needs_the_control_plane(cluster):
                pass

            def test_runs_processes():
                pass
            """
        )
    )
    proc = run_pytest("-q", "test_two.py", cwd=tmp_path)
    assert proc.returncode == 4, proc.stdout + proc.stderr  # a usage error: nothing ran
    assert "test_two.py::test_needs_the_control_plane: marked process but its level is cluster" in proc.stderr
    assert "test_runs_processes" not in proc.stderr
