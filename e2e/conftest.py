"""Fixtures of the whole-fabric tests: the local cluster with pod-runner GPU nodes and the operator."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvfabric.demo.fabric import Fabric, running_fabric


@pytest.fixture(scope="session")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fabric]:
    """The whole fabric, once per session (or ``KVFABRIC_TEST_KUBECONFIG``'s cluster)."""
    with running_fabric(tmp_path_factory.mktemp("fabric"), progress=lambda _m: None) as f:
        yield f
