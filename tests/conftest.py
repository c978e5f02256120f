"""Fixtures shared by every test directory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvfabric.localcluster.testing import ClusterHandle, session_cluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    """A real control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok) for the session."""
    with session_cluster(tmp_path_factory.mktemp("k8s")) as handle:
        yield handle


@pytest.fixture
def namespace(cluster: ClusterHandle) -> Iterator[str]:
    """A fresh namespace in the session's cluster, deleted after the test."""
    with cluster.namespace() as name:
        yield name
