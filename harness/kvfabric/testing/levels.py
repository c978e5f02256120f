"""Pytest plugin: every test gets exactly one level of the test ladder as a marker.

The levels, cheapest first (README, "Tests"), are ``unit``, ``process``, ``images``, ``cluster``,
``fabric``, ``kubelet`` and ``vllm``. A test's level is the most expensive of:

- an explicit level marker on the test or its module (``pytestmark = pytest.mark.process``);
- ``fabric`` for everything under ``e2e/``;
- ``cluster`` when the test's fixture closure includes the session's control plane (``cluster``);
- otherwise ``unit``.

So ``pytest -m unit`` selects the fast tests (``make test-unit``) without anyone having to remember
to mark them, and a test that starts the control plane can never pass itself off as a unit test.
Loaded for every run through ``-p kvfabric.testing.levels`` in pyproject's pytest ``addopts``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

LEVELS: tuple[str, ...] = ("unit", "process", "images", "cluster", "fabric", "kubelet", "vllm")
DESCRIPTIONS: dict[str, str] = {
    "unit": "pure functions and in-process objects; no child process, no network beyond loopback sockets",
    "process": "real cache-server (or engine) processes on loopback and Unix sockets",
    "images": "the built images run in containers by the harness's Docker engine (no kubelet)",
    "cluster": "the real local control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok)",
    "fabric": "the whole fabric: operator, cache-server DaemonSet and engines run by the pod runner",
    "kubelet": "built images run by a real kubelet on the local control plane",
    "vllm": "real vLLM (CPU) with the kvfabric connector",
}
CLUSTER_FIXTURES = frozenset({"cluster"})


def level_of(explicit: list[str], path: Path, fixtures: list[str]) -> str:
    """The level of one test (pure; see the module docstring for the rules)."""
    found = set(explicit)
    if "e2e" in path.parts:
        found.add("fabric")
    if CLUSTER_FIXTURES & set(fixtures):
        found.add("cluster")
    ranked = [level for level in LEVELS if level in found]
    return ranked[-1] if ranked else "unit"


def pytest_configure(config: pytest.Config) -> None:
    """Register the level markers (so ``--strict-markers`` accepts them)."""
    for level in LEVELS:
        config.addinivalue_line("markers", f"{level}: test level: {DESCRIPTIONS[level]}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Add the computed level marker to every collected test."""
    for item in items:
        explicit = [m.name for m in item.iter_markers() if m.name in LEVELS]
        fixtures = list(getattr(item, "fixturenames", ()))
        level = level_of(explicit, Path(str(item.path)), fixtures)
        if level not in explicit:
            item.add_marker(getattr(pytest.mark, level))
