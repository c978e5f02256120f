"""A deleted pool's local-disk blocks are wiped from its nodes, after its servers stopped, by pods that
can touch nothing else (docs/security.md, "A deleted pool's blocks")."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.operator.api.v1alpha1 import KIND
from kvfabric.operator.kube import ApiError, KubeClient
from kvfabric.operator.render import names
from kvfabric.operator.render.wipe import (
    WIPE_MOUNT,
    render_wipe_pod,
    wipe_dir,
    wipe_labels,
    wipe_pod_name,
    wipe_script,
)
from kvfabric.operator.wipe import sweep_finished_wipe_pods, wipe_deleted_pool

_LABEL = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,6}[a-z0-9])?", fullmatch=True)
HOST = {"hostPath": {"path": "/mnt/nvme"}, "capacity": "10Gi"}


def pool(
    ns: str = "llm", name: str = "pool-a", disk: dict[str, Any] | None = HOST, uid: str = "u1"
) -> dict[str, Any]:
    tiers: dict[str, Any] = {"memory": {"size": "1Gi"}}
    if disk is not None:
        tiers["localDisk"] = disk
    return {"metadata": {"namespace": ns, "name": name, "uid": uid}, "spec": {"tiers": tiers}}


def test_the_wipe_pod_holds_no_privilege_and_runs_the_operators_script() -> None:
    pod = render_wipe_pod(pool(), "gpu-3", "kvfabric-system")
    assert pod is not None
    spec = pod["spec"]
    assert pod["metadata"]["namespace"] == "kvfabric-system"
    assert spec["nodeName"] == "gpu-3"
    # The disk path (not the pool's directory, which the kubelet would resolve through a symlink).
    assert spec["volumes"] == [{"name": "disk", "hostPath": {"path": "/mnt/nvme", "type": "Directory"}}]
    (container,) = spec["containers"]
    assert container["volumeMounts"] == [{"name": "disk", "mountPath": WIPE_MOUNT}]
    assert container["command"] == ["sh", "-c", wipe_script("llm.pool-a")]
    assert container["image"] == names.operator_image(), "the operator's image, never the pool's"
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert spec["securityContext"]["runAsUser"] == 65532
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["automountServiceAccountToken"] is False


@pytest.mark.process
def test_the_script_empties_only_the_pools_directory_and_refuses_a_symlink(tmp_path: Path) -> None:
    """The script itself, run by sh on a real directory tree (WIPE_MOUNT replaced by a temp dir)."""
    disk = tmp_path / "disk"
    mine, other, victim = disk / "llm.pool-a", disk / "llm.pool-b", tmp_path / "victim"
    for d in (mine / "ab" / "cd", other, victim):
        d.mkdir(parents=True)
    (mine / "ab" / "cd" / "block").write_bytes(b"prompt")
    (mine / "top").write_bytes(b"prompt")
    (mine / "link").symlink_to(victim)  # a symlink inside is removed, never followed
    (other / "block").write_bytes(b"theirs")
    (victim / "file").write_bytes(b"victim")

    def run(name: str) -> subprocess.CompletedProcess[str]:
        script = wipe_script(name).replace(WIPE_MOUNT, str(disk))
        return subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=False)

    done = run("llm.pool-a")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "wiped"
    assert mine.is_dir()
    assert list(mine.iterdir()) == []
    assert (other / "block").read_bytes() == b"theirs"
    assert (victim / "file").read_bytes() == b"victim"
    # A pool directory that is a symlink (a server sharing the disk path could plant one): refused.
    (disk / "llm.pool-c").symlink_to(other)
    refused = run("llm.pool-c")
    assert refused.returncode == 3
    assert "symlink" in refused.stderr
    assert (other / "block").read_bytes() == b"theirs"
    assert run("llm.never-ran").stdout.strip() == "nothing to wipe"


def test_nothing_to_wipe_without_a_host_path_disk() -> None:
    assert wipe_dir(pool(disk=None)) is None
    assert wipe_dir(pool(disk={"emptyDir": {}, "capacity": "1Gi"})) is None
    assert render_wipe_pod(pool(disk=None), "n", "kvfabric-system") is None


@settings(max_examples=200, deadline=None)
@given(a=st.tuples(_LABEL, _LABEL), b=st.tuples(_LABEL, _LABEL), node=_LABEL)
def test_one_pools_wipe_never_reaches_another_pools_directory(
    a: tuple[str, str], b: tuple[str, str], node: str
) -> None:
    da, db = wipe_dir(pool(*a)), wipe_dir(pool(*b))
    assert da is not None
    assert db is not None
    assert da.startswith("/mnt/nvme/")
    if a != b:
        assert da != db
        assert not da.startswith(db + "/")
        assert not db.startswith(da + "/")
        assert wipe_pod_name(pool(*a), node) != wipe_pod_name(pool(*b), node)
    # A re-created pool (new uid) never meets the old incarnation's pods.
    assert wipe_pod_name(pool(*a, uid="u1"), node) != wipe_pod_name(pool(*a, uid="u2"), node)


class FakeClient:
    """The API server as the wipe sees it: the pool's cache pods stop after a while, wipe pods finish."""

    def __init__(
        self, server_polls: int, fail_node: str | None = None, pools: list[dict[str, Any]] | None = None
    ) -> None:
        self.server_polls = server_polls  # lists before the cache servers are gone
        self.fail_node = fail_node
        self.pools = pools or []
        self.created: list[dict[str, Any]] = []
        self.deleted: list[str] = []
        self.log: list[str] = []
        self.hang_on_wipe_list = False

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        assert kind == KIND
        return next((p for p in self.pools if p["metadata"]["name"] == name), None)

    async def list(self, kind: str, namespace: str | None = None, **kw: Any) -> list[dict[str, Any]]:
        if kind == KIND:
            return self.pools
        if namespace == "llm":  # the cache servers, by the selector the informer serves
            assert kw["label_selector"] == names.owned_pod_selector("pool-a")
            self.log.append("servers?")
            if self.server_polls > 0:
                self.server_polls -= 1
                return [{"spec": {"nodeName": "gpu-0"}}, {"spec": {"nodeName": "gpu-1"}}]
            return []
        assert kw["label_selector"] == ",".join(f"{k}={v}" for k, v in wipe_labels(pool()).items())
        if self.hang_on_wipe_list:
            await asyncio.sleep(3600)
        return [{**p, "status": {"phase": self._phase(p)}} for p in self.created]

    def _phase(self, pod: dict[str, Any]) -> str:
        return "Failed" if pod["spec"]["nodeName"] == self.fail_node else "Succeeded"

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.log.append("create")
        self.created.append(obj)
        return obj

    async def delete(self, kind: str, namespace: str | None, name: str) -> bool:
        self.deleted.append(name)
        return True


def kube(client: FakeClient) -> KubeClient:
    return cast(KubeClient, client)


def wipe(client: FakeClient, **kw: Any) -> dict[str, str]:
    return asyncio.run(
        wipe_deleted_pool(
            kube(client), pool(), {"gpu-0", "gpu-1"}, operator_namespace="kvfabric-system", poll=0, **kw
        )
    )


def test_the_wipe_waits_for_the_servers_then_wipes_each_node_and_cleans_up() -> None:
    client = FakeClient(server_polls=3)
    assert wipe(client) == {"gpu-0": "wiped", "gpu-1": "wiped"}
    # No wipe pod while a server could still write blocks back.
    assert client.log[:4] == ["servers?"] * 4
    assert "create" not in client.log[:4]
    assert sorted(client.deleted) == sorted(wipe_pod_name(pool(), n) for n in ("gpu-0", "gpu-1"))


def test_a_node_whose_server_does_not_stop_is_never_wiped_and_a_failed_wipe_is_reported() -> None:
    client = FakeClient(server_polls=10**6)
    out = wipe(client, servers_gone_timeout=0.05)
    assert out == {n: "skipped: its cache server did not stop" for n in ("gpu-0", "gpu-1")}
    assert client.created == []
    assert wipe(FakeClient(server_polls=0, fail_node="gpu-1")) == {
        "gpu-0": "wiped",
        "gpu-1": "failed: the wipe pod failed",
    }


def test_a_pool_of_the_same_name_again_or_a_pool_nested_inside_is_never_wiped_under() -> None:
    again = FakeClient(server_polls=0, pools=[pool(uid="u2")])
    out = wipe(again)
    assert set(out.values()) == {"skipped: KVCachePool llm/pool-a exists again and uses that directory"}
    assert again.created == []
    nested = pool("team", "inner", disk={"hostPath": {"path": "/mnt/nvme/llm.pool-a/sub"}, "capacity": "1Gi"})
    inside = FakeClient(server_polls=0, pools=[nested])
    assert all("keeps its disk inside /mnt/nvme/llm.pool-a" in v for v in wipe(inside).values())
    assert inside.created == []


def test_a_cancelled_wipe_still_deletes_its_pods() -> None:
    client = FakeClient(server_polls=0)
    client.hang_on_wipe_list = True

    async def scenario() -> None:
        task = asyncio.ensure_future(
            wipe_deleted_pool(kube(client), pool(), {"gpu-0"}, operator_namespace="kvfabric-system", poll=0)
        )
        for _ in range(1000):  # until the pod is created and the wipe waits for it
            if client.created:
                break
            await asyncio.sleep(0)
        assert client.created
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert client.deleted == [wipe_pod_name(pool(), "gpu-0")]


def test_finished_wipe_pods_a_previous_leader_left_are_swept() -> None:
    class Left(FakeClient):
        async def list(self, kind: str, namespace: str | None = None, **kw: Any) -> list[dict[str, Any]]:
            assert kw["label_selector"] == ",".join(f"{k}={v}" for k, v in wipe_labels().items())
            return [
                {"metadata": {"name": "a"}, "status": {"phase": "Succeeded"}},
                {"metadata": {"name": "b"}, "status": {"phase": "Running"}},
                {"metadata": {"name": "c"}, "status": {"phase": "Failed"}},
            ]

    client = Left(server_polls=0)
    assert asyncio.run(sweep_finished_wipe_pods(kube(client), "kvfabric-system")) == 2
    assert client.deleted == ["a", "c"]


@pytest.mark.parametrize("disk", [None, {"emptyDir": {}, "capacity": "1Gi"}])
def test_a_pool_without_blocks_on_its_nodes_makes_no_pod(disk: dict[str, Any] | None) -> None:
    client = FakeClient(server_polls=0)
    out = asyncio.run(
        wipe_deleted_pool(kube(client), pool(disk=disk), {"gpu-0"}, operator_namespace="x", poll=0)
    )
    assert out == {}
    assert client.created == []


def test_a_create_refused_by_the_api_is_reported() -> None:
    class Refusing(FakeClient):
        async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
            raise ApiError(403, "forbidden", method="POST", path="/api/v1/namespaces/x/pods")

    outcomes = set(wipe(Refusing(server_polls=0)).values())
    assert len(outcomes) == 1
    assert "HTTP 403" in outcomes.pop()
