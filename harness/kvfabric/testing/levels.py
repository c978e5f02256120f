"""Pytest plugin: every test gets exactly one level of the test ladder as a marker.

The levels, cheapest first (README, "Tests"), are ``unit``, ``process``, ``images``, ``cluster``,
``fabric``, ``kubelet``, ``vllm`` and ``kind``. A test's level is the most expensive of:

- an explicit level marker on the test or its module (``pytestmark = pytest.mark.process``);
- ``fabric`` for everything under ``e2e/``;
- ``cluster`` when the test's fixture closure includes the session's control plane (``cluster``);
- otherwise ``unit``.

So ``pytest -m unit`` selects the fast tests (``make test-unit``) without anyone having to remember
to mark them, and a test that starts the control plane can never pass itself off as a unit test.
Loaded for every run through ``-p kvfabric.testing.levels`` in pyproject's pytest ``addopts``.

Two rules keep the ladder honest:

- every test carries exactly one level marker: an explicit marker below the computed level (a
  module's ``process`` on a test that takes the ``cluster`` fixture) would leave two, so collection
  stops with an error that names the test and the marker it needs;
- a ``unit`` test starts no child process: while one is set up or runs, an audit hook turns any
  ``fork``, ``exec``, ``posix_spawn`` or ``subprocess.Popen`` into :class:`ChildProcessInUnitTestError`,
  naming the marker the test needs (``process``, or a higher level).
"""

from __future__ import annotations

import sys
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

LEVELS: tuple[str, ...] = ("unit", "process", "images", "cluster", "fabric", "kubelet", "vllm", "kind")
DESCRIPTIONS: dict[str, str] = {
    "unit": "pure functions and in-process objects; no child process (enforced), no network beyond loopback",
    "process": "child processes: real cache servers and engines on loopback and Unix sockets, scripts",
    "images": "the built images run in containers by the harness's Docker engine (no kubelet)",
    "cluster": "the real local control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok)",
    "fabric": "the whole fabric: operator, cache-server DaemonSet and engines run by the pod runner",
    "kubelet": "built images run by a real kubelet on the local control plane",
    "vllm": "real vLLM (CPU) with the kvfabric connector",
    "kind": "a kind cluster from the offline node image (kvfabric kind), the e2e suite run against it",
}
CLUSTER_FIXTURES = frozenset({"cluster"})
# The audit events (sys.audit) that start a child process, by any route (subprocess, asyncio,
# multiprocessing, os.system, os.spawn*).
SPAWN_EVENTS = frozenset(
    {"subprocess.Popen", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system"}
)


class ChildProcessInUnitTestError(RuntimeError):
    """A test at level ``unit`` tried to start a child process."""


def level_of(explicit: list[str], path: Path, fixtures: list[str]) -> str:
    """The level of one test (pure; see the module docstring for the rules)."""
    found = set(explicit)
    if "e2e" in path.parts:
        found.add("fabric")
    if CLUSTER_FIXTURES & set(fixtures):
        found.add("cluster")
    ranked = [level for level in LEVELS if level in found]
    return ranked[-1] if ranked else "unit"


def conflict(explicit: list[str], level: str) -> str | None:
    """Why a test whose explicit level markers are ``explicit`` cannot carry exactly ``level``, or None.

    Pure: the collection hook turns a non-None answer into an error naming the test.
    """
    stray = sorted(set(explicit) - {level})
    if not stray:
        return None
    return f"marked {', '.join(stray)} but its level is {level}: mark it {level} (or nothing) instead"


class _UnitGuard:
    """The audit hook that refuses child processes while a unit test runs (installed once)."""

    def __init__(self) -> None:
        self.running: str | None = None  # the node id of the unit test now running, if any
        sys.addaudithook(self.hook)

    def hook(self, event: str, args: tuple[Any, ...]) -> None:
        if self.running is not None and event in SPAWN_EVENTS and not _library_lookup():
            test, self.running = self.running, None  # one error per test, not one per retry
            raise ChildProcessInUnitTestError(
                f"{test} is a unit test but starts a child process ({event}): unit tests run no "
                "child process; mark it process (pytest.mark.process) or a higher level"
            )


def _library_lookup() -> bool:
    """Whether the process is started by ``ctypes.util.find_library`` (``ldconfig -p``).

    Importing torch looks its libraries up that way the first time, in whichever test imports it
    first: a look-up at import, not a process the test runs.
    """
    frame: FrameType | None = sys._getframe(2)  # the caller of the audit hook's caller
    while frame is not None:
        if frame.f_globals.get("__name__") == "ctypes.util":
            return True
        frame = frame.f_back
    return False


_guard: _UnitGuard | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Register the level markers (so ``--strict-markers`` accepts them) and the unit-test guard."""
    global _guard  # noqa: PLW0603  (one audit hook per interpreter: they cannot be removed)
    for level in LEVELS:
        config.addinivalue_line("markers", f"{level}: test level: {DESCRIPTIONS[level]}")
    if _guard is None:
        _guard = _UnitGuard()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Add the computed level marker to every collected test; refuse a test that would carry two."""
    problems = []
    for item in items:
        explicit = [m.name for m in item.iter_markers() if m.name in LEVELS]
        fixtures = list(getattr(item, "fixturenames", ()))
        level = level_of(explicit, Path(str(item.path)), fixtures)
        why = conflict(explicit, level)
        if why is not None:
            problems.append(f"{item.nodeid}: {why}")
        elif level not in explicit:
            item.add_marker(getattr(pytest.mark, level))
    if problems:
        raise pytest.UsageError("every test carries exactly one level marker:\n" + "\n".join(problems))


@contextmanager
def _guarded(item: pytest.Item) -> Iterator[None]:
    if _guard is None or not any(m.name == "unit" for m in item.iter_markers()):
        yield
        return
    _guard.running = item.nodeid
    try:
        yield
    finally:
        _guard.running = None


# Set-up and call only: a session's fixtures (the control plane, say) are torn down in whichever test
# ran last, and their tear-down is not that test's doing.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    """Set up a unit test's fixtures under the child-process guard."""
    with _guarded(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """Run a unit test under the child-process guard."""
    with _guarded(item):
        yield
