"""Fixtures of the whole-fabric tests: the local cluster with pod-runner GPU nodes and the operator."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvfabric.demo.fabric import Fabric, running_fabric

# The existing cluster of this run (KVFABRIC_TEST_KUBECONFIG), if any.
_HOST_GUARD = pytest.StashKey[str | None]()


@pytest.fixture(scope="session")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fabric]:
    """The whole fabric, once per session (or ``KVFABRIC_TEST_KUBECONFIG``'s cluster).

    With a real S3 server for the object-tier pool (``test_fabric_object_tier.py``); the bootstrap
    builds it.
    """
    with running_fabric(tmp_path_factory.mktemp("fabric"), progress=lambda _m: None, object_store=True) as f:
        yield f


def pytest_configure(config: pytest.Config) -> None:
    """Against an existing cluster, refuse to start any node process on this host (see hostnodes)."""
    from kvfabric.testing import hostnodes

    config.stash[_HOST_GUARD] = hostnodes.install()


def pytest_report_header(config: pytest.Config) -> str | None:
    """Say, at the top of the run, that the guard is on (the kind level checks this line)."""
    cluster = config.stash.get(_HOST_GUARD, None)
    return None if cluster is None else f"existing cluster {cluster}: no node process may start on this host"
