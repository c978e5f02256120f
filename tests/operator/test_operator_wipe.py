"""A deleted pool's local-disk blocks are wiped from its nodes, after its servers stopped, by pods that
can touch nothing else (docs/security.md, "A deleted pool's blocks")."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.operator.kube import ApiError, KubeClient
from kvfabric.operator.render import names
from kvfabric.operator.render.wipe import WIPE_MOUNT, render_wipe_pod, wipe_dir, wipe_pod_name
from kvfabric.operator.wipe import wipe_deleted_pool

_LABEL = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,6}[a-z0-9])?", fullmatch=True)


def pool(ns: str = "llm", name: str = "pool-a", disk: dict[str, Any] | None = None) -> dict[str, Any]:
    tiers: dict[str, Any] = {"memory": {"size": "1Gi"}}
    if disk is not None:
        tiers["localDisk"] = disk
    return {"metadata": {"namespace": ns, "name": name}, "spec": {"tiers": tiers}}


HOST = {"hostPath": {"path": "/mnt/nvme"}, "capacity": "10Gi"}


def test_the_wipe_pod_mounts_only_the_pools_directory_and_holds_no_privilege() -> None:
    pod = render_wipe_pod(pool(disk=HOST), "gpu-3", "kvfabric-system")
    assert pod is not None
    spec = pod["spec"]
    assert pod["metadata"]["namespace"] == "kvfabric-system"
    assert spec["nodeName"] == "gpu-3"
    assert spec["volumes"] == [
        {"name": "blocks", "hostPath": {"path": "/mnt/nvme/llm.pool-a", "type": "Directory"}}
    ]
    (container,) = spec["containers"]
    assert container["volumeMounts"] == [{"name": "blocks", "mountPath": WIPE_MOUNT}]
    assert container["image"] == names.operator_image(), "the operator's image, never the pool's"
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert spec["securityContext"]["runAsUser"] == 65532
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["automountServiceAccountToken"] is False
    assert "-mindepth 1 -delete" in container["command"][-1]


def test_nothing_to_wipe_without_a_host_path_disk() -> None:
    assert wipe_dir(pool()) is None
    assert wipe_dir(pool(disk={"emptyDir": {}, "capacity": "1Gi"})) is None
    assert render_wipe_pod(pool(), "n", "kvfabric-system") is None


@settings(max_examples=200, deadline=None)
@given(a=st.tuples(_LABEL, _LABEL), b=st.tuples(_LABEL, _LABEL), node=_LABEL)
def test_one_pools_wipe_never_reaches_another_pools_directory(
    a: tuple[str, str], b: tuple[str, str], node: str
) -> None:
    da, db = wipe_dir(pool(*a, disk=HOST)), wipe_dir(pool(*b, disk=HOST))
    assert da is not None
    assert db is not None
    assert da.startswith("/mnt/nvme/")
    assert da != "/mnt/nvme"
    if a != b:
        assert da != db
        assert not da.startswith(db + "/")
        assert not db.startswith(da + "/")
        assert wipe_pod_name(*a, node) != wipe_pod_name(*b, node)


class FakeClient:
    """The API server as the wipe sees it: the pool's cache pods stop after a while, wipe pods finish."""

    def __init__(self, server_polls: int, fail_node: str | None = None) -> None:
        self.server_polls = server_polls  # lists before the cache servers are gone
        self.fail_node = fail_node
        self.created: list[dict[str, Any]] = []
        self.deleted: list[str] = []
        self.log: list[str] = []

    async def list(self, kind: str, namespace: str | None = None, **kw: Any) -> list[dict[str, Any]]:
        if namespace == "llm":  # the cache servers
            self.log.append("servers?")
            if self.server_polls > 0:
                self.server_polls -= 1
                return [{"spec": {"nodeName": "gpu-0"}}, {"spec": {"nodeName": "gpu-1"}}]
            return []
        return [{**p, "status": {"phase": self._phase(p)}} for p in self.created]

    def _phase(self, pod: dict[str, Any]) -> str:
        return "Failed" if pod["spec"]["nodeName"] == self.fail_node else "Succeeded"

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.log.append("create")
        if obj["spec"]["nodeName"] == "gpu-1" and any(c["spec"]["nodeName"] == "gpu-1" for c in self.created):
            raise ApiError(409, "exists", method="POST", path="/api/v1/namespaces/x/pods")
        self.created.append(obj)
        return obj

    async def delete(self, kind: str, namespace: str | None, name: str) -> bool:
        self.deleted.append(name)
        return True


def kube(client: FakeClient) -> KubeClient:
    return cast(KubeClient, client)


def test_the_wipe_waits_for_the_servers_then_wipes_each_node_and_cleans_up() -> None:
    client = FakeClient(server_polls=3)
    out = asyncio.run(
        wipe_deleted_pool(
            kube(client), pool(disk=HOST), {"gpu-0", "gpu-1"}, operator_namespace="kvfabric-system", poll=0
        )
    )
    assert out == {"gpu-0": "wiped", "gpu-1": "wiped"}
    # No wipe pod while a server could still write blocks back.
    assert client.log[:4] == ["servers?"] * 4
    assert "create" not in client.log[:4]
    assert sorted(client.deleted) == sorted(wipe_pod_name("llm", "pool-a", n) for n in ("gpu-0", "gpu-1"))


def test_a_node_whose_server_does_not_stop_is_never_wiped_and_a_failed_wipe_is_reported() -> None:
    client = FakeClient(server_polls=10**6, fail_node="gpu-1")
    out = asyncio.run(
        wipe_deleted_pool(
            kube(client),
            pool(disk=HOST),
            {"gpu-0", "gpu-1"},
            operator_namespace="kvfabric-system",
            poll=0,
            servers_gone_timeout=0.05,
        )
    )
    assert out == {n: "skipped: its cache server did not stop" for n in ("gpu-0", "gpu-1")}
    assert client.created == []
    client = FakeClient(server_polls=0, fail_node="gpu-1")
    out = asyncio.run(
        wipe_deleted_pool(
            kube(client), pool(disk=HOST), {"gpu-0", "gpu-1"}, operator_namespace="kvfabric-system", poll=0
        )
    )
    assert out == {"gpu-0": "wiped", "gpu-1": "failed: the wipe pod failed"}


@pytest.mark.parametrize("disk", [None, {"emptyDir": {}, "capacity": "1Gi"}])
def test_a_pool_without_blocks_on_its_nodes_makes_no_pod(disk: dict[str, Any] | None) -> None:
    client = FakeClient(server_polls=0)
    assert (
        asyncio.run(
            wipe_deleted_pool(kube(client), pool(disk=disk), {"gpu-0"}, operator_namespace="x", poll=0)
        )
        == {}
    )
    assert client.created == []
