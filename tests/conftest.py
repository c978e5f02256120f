"""Fixtures shared by every test directory."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# The connector gives up a same-node load whose server sends no first reply within its reply bound
# (floor 25 ms: a hung server then costs a request milliseconds, not the heartbeat's 0.5 s). On this
# loaded 2-core test machine a live server's reply is sometimes later than that, and each such false
# suspicion is a recompute: tests that count exact hits would flake. So the suite's connectors (this
# process and the engines it starts, which inherit the variable; vLLM servers get it through
# kvfabric.testing.vllmenv.connector_config) wait up to the staleness bound, as before the reply
# bound existed; the tests of the reply bound itself (tests/client/test_client_suspect_server.py,
# test_client_suspicion.py, tests/connector/test_connector_hung_published_index.py) build their
# clients with the client's own default or an explicit floor.
os.environ.setdefault("KVFABRIC_REPLY_FLOOR_MS", "500")

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
