"""Fixtures of the whole-fabric tests: the local cluster with pod-runner GPU nodes and the operator."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvfabric.demo.fabric import Fabric, running_fabric


@pytest.fixture(scope="session")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fabric]:
    """The whole fabric, once per session (or ``KVFABRIC_TEST_KUBECONFIG``'s cluster).

    With a real S3 server for the object-tier pool (``test_fabric_object_tier.py``); the bootstrap
    builds it.
    """
    with running_fabric(tmp_path_factory.mktemp("fabric"), progress=lambda _m: None, object_store=True) as f:
        yield f
