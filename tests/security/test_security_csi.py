"""The CSI node plugin: a pod gets its own namespace's pool socket, read-only, and nothing else.

The pure decision (:func:`kvfabric.csi.publish.plan_publish`) is checked against every attribute a
pod author controls; the plugin itself is then driven as the kubelet drives it, over its real gRPC
sockets, with real bind mounts (in a private mount namespace) and a real cache server behind the
published directory (docs/security.md, "Same node without a hostPath").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.contract.node_paths import host_dir
from kvfabric.csi.plugin import Mounter, NodePlugin, start
from kvfabric.csi.publish import (
    EPHEMERAL_KEY,
    POD_NAME_KEY,
    POD_NAMESPACE_KEY,
    Code,
    Publication,
    Refused,
    cross_namespace_refusal,
    plan_publish,
)
from kvfabric.csi.v1 import csi_pb2, csi_pb2_grpc, pluginregistration_pb2, pluginregistration_pb2_grpc
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for

KUBELET = "/var/lib/kubelet"
TARGET = f"{KUBELET}/pods/0c8a/volumes/kubernetes.io~csi/kvfabric-run/mount"
_LABEL = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,6}[a-z0-9])?", fullmatch=True)


def context(pod_namespace: str = "team-a", /, **attributes: str) -> dict[str, str]:
    """What the kubelet passes for an inline volume with these attributes."""
    return {POD_NAMESPACE_KEY: pod_namespace, POD_NAME_KEY: "engine-0", EPHEMERAL_KEY: "true", **attributes}


def refusal(**kw: object) -> Refused:
    args: dict[str, object] = {
        "volume_id": "csi-1",
        "target_path": TARGET,
        "volume_context": context(pool="pool-a"),
        "block": False,
        "kubelet_root": KUBELET,
    }
    with pytest.raises(Refused) as info:
        plan_publish(**(args | kw))  # type: ignore[arg-type]
    return info.value


def test_a_pod_gets_its_own_namespaces_pool_directory() -> None:
    p = plan_publish(
        volume_id="csi-1",
        target_path=TARGET,
        volume_context=context(pool="pool-a"),
        block=False,
        kubelet_root=KUBELET,
    )
    assert (p.source, p.target) == ("/run/kvfabric/team-a.pool-a", TARGET)
    assert (p.namespace, p.pool) == ("team-a", "pool-a")
    # Naming its own namespace is allowed (and changes nothing).
    named = plan_publish(
        volume_id="csi-1",
        target_path=TARGET,
        volume_context=context(pool="pool-a", namespace="team-a"),
        block=False,
        kubelet_root=KUBELET,
    )
    assert named.source == p.source


@settings(max_examples=300, deadline=None)
@given(pod_ns=_LABEL, asked_ns=_LABEL, pool=_LABEL)
def test_the_directory_is_the_named_pools_and_another_namespace_is_flagged_for_the_api(
    pod_ns: str, asked_ns: str, pool: str
) -> None:
    p = plan_publish(
        volume_id="v",
        target_path=TARGET,
        volume_context=context(pod_ns, pool=pool, namespace=asked_ns),
        block=False,
        kubelet_root=KUBELET,
    )
    assert p.source == host_dir(asked_ns, pool)
    assert p.cross_namespace == (asked_ns != pod_ns)
    assert p.pod_namespace == pod_ns


def _pool(selector: Any) -> dict[str, Any]:
    consumers = {} if selector is None else {"namespaceSelector": selector}
    return {"metadata": {"namespace": "llm", "name": "pool-a"}, "spec": {"consumers": consumers}}


def test_only_the_pools_namespace_selector_grants_another_namespace() -> None:
    assert cross_namespace_refusal(None, "apps", {}) == "no such KVCachePool"
    assert "no spec.consumers.namespaceSelector" in str(cross_namespace_refusal(_pool(None), "apps", {}))
    team_a = {"matchLabels": {"team": "a"}}
    assert cross_namespace_refusal(_pool(team_a), "apps", {"team": "a"}) is None
    assert "does not select namespace apps" in str(
        cross_namespace_refusal(_pool(team_a), "apps", {"team": "b"})
    )
    expr = {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gold"]}]}
    assert cross_namespace_refusal(_pool(expr), "apps", {"tier": "gold"}) is None
    assert cross_namespace_refusal(_pool(expr), "apps", {}) is not None
    unknown = {"matchExpressions": [{"key": "tier", "operator": "Gt", "values": ["1"]}]}
    assert cross_namespace_refusal(_pool(unknown), "apps", {"tier": "2"}) is not None  # fail closed


@pytest.mark.parametrize(
    ("change", "code", "names"),
    [
        ({"volume_context": context(pool="pool-a", namespace="../x")}, Code.INVALID_ARGUMENT, "namespace"),
        ({"volume_context": context()}, Code.INVALID_ARGUMENT, "volumeAttributes.pool"),
        ({"volume_context": context(pool="../etc")}, Code.INVALID_ARGUMENT, "volumeAttributes.pool"),
        ({"volume_context": context(pool="a.b")}, Code.INVALID_ARGUMENT, "volumeAttributes.pool"),
        ({"volume_context": context(pool="pool-a", path="/etc")}, Code.INVALID_ARGUMENT, "'path'"),
        (
            {"volume_context": {POD_NAMESPACE_KEY: "team-a", "pool": "pool-a"}},
            Code.FAILED_PRECONDITION,
            "ephemeral",
        ),
        (
            {"volume_context": {EPHEMERAL_KEY: "true", "pool": "pool-a"}},
            Code.FAILED_PRECONDITION,
            "podInfoOnMount",
        ),
        ({"block": True}, Code.INVALID_ARGUMENT, "block"),
        ({"volume_id": ""}, Code.INVALID_ARGUMENT, "volume_id"),
        ({"target_path": "/etc"}, Code.INVALID_ARGUMENT, "target_path"),
        ({"target_path": f"{KUBELET}/pods/../../../etc"}, Code.INVALID_ARGUMENT, "target_path"),
        ({"target_path": "relative/mount"}, Code.INVALID_ARGUMENT, "target_path"),
    ],
)
def test_a_request_outside_the_contract_is_refused_naming_the_field(
    change: dict[str, object], code: Code, names: str
) -> None:
    exc = refusal(**change)
    assert exc.code is code
    assert names in exc.message


class FakeMounts(Mounter):
    """Records binds instead of making them (the gRPC layer's test; the real mounts are below)."""

    def _unmount(self, target: str) -> None:
        self.mounted.pop(target, None)

    def __init__(self) -> None:
        self.mounted: dict[str, str] = {}
        self.dirs: list[str] = []
        super().__init__(
            bind_read_only=lambda s, t: self.mounted.__setitem__(t, s),
            unmount=self._unmount,
            is_mounted=lambda t: t in self.mounted,
            ensure_directory=self.dirs.append,
        )


def test_the_kubelets_calls_over_the_real_sockets(short_dir: Path) -> None:
    mounts = FakeMounts()
    kubelet = str(short_dir / "kubelet")
    grants: set[tuple[str, str, str]] = set()
    asked: list[tuple[str, str, str]] = []

    def authorizer(p: Publication) -> str | None:
        asked.append((p.namespace, p.pool, p.pod_namespace))
        return None if asked[-1] in grants else "the selector does not select it"

    plugin = NodePlugin(
        node_name="gpu-0",
        kubelet_root=kubelet,
        run_root="/run/kvfabric",
        mounter=mounts,
        authorizer=authorizer,
    )
    running = start(plugin)
    target = f"{kubelet}/pods/uid-1/volumes/kubernetes.io~csi/run/mount"
    try:
        # Discovery: the watcher finds the registration socket and learns the CSI endpoint.
        with grpc.insecure_channel(f"unix://{plugin.registration_socket}") as ch:
            reg = pluginregistration_pb2_grpc.RegistrationStub(ch)  # type: ignore[no-untyped-call]
            info = reg.GetInfo(pluginregistration_pb2.InfoRequest(), timeout=5)
            assert (info.type, info.name, info.endpoint) == ("CSIPlugin", "csi.kvfabric.io", plugin.endpoint)
            assert list(info.supported_versions) == ["1.0.0"]
            reg.NotifyRegistrationStatus(pluginregistration_pb2.RegistrationStatus(plugin_registered=True))
        assert plugin.registered.is_set()
        with grpc.insecure_channel(f"unix://{info.endpoint}") as ch:
            identity = csi_pb2_grpc.IdentityStub(ch)  # type: ignore[no-untyped-call]
            node = csi_pb2_grpc.NodeStub(ch)  # type: ignore[no-untyped-call]
            assert identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=5).name == "csi.kvfabric.io"
            assert identity.Probe(csi_pb2.ProbeRequest(), timeout=5).ready.value
            assert node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=5).node_id == "gpu-0"

            def publish(path: str, **attributes: str) -> None:
                node.NodePublishVolume(
                    csi_pb2.NodePublishVolumeRequest(
                        volume_id="csi-abc",
                        target_path=path,
                        volume_capability=csi_pb2.VolumeCapability(
                            mount=csi_pb2.VolumeCapability.MountVolume()
                        ),
                        readonly=True,
                        volume_context=context("team-a", **attributes),
                    ),
                    timeout=5,
                )

            publish(target, pool="pool-a")
            publish(target, pool="pool-a")  # the kubelet retries: idempotent, one bind
            assert mounts.mounted == {target: "/run/kvfabric/team-a.pool-a"}
            assert mounts.dirs[-1] == "/run/kvfabric/team-a.pool-a"  # created if the server is not up yet
            # Another namespace's pool: only what the authorizer (the API, below) grants.
            other = target.replace("uid-1", "uid-2")
            with pytest.raises(grpc.RpcError) as denied:
                publish(other, pool="pool-a", namespace="team-b")
            assert denied.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "does not select" in str(denied.value.details())
            assert other not in mounts.mounted
            asked.clear()
            grants.add(("team-b", "pool-a", "team-a"))
            publish(other, pool="pool-a", namespace="team-b")
            assert mounts.mounted[other] == "/run/kvfabric/team-b.pool-a"
            assert asked == [("team-b", "pool-a", "team-a")]
            publish(target, pool="pool-a")
            assert len(asked) == 1, "the pod's own namespace needs no API call"
            # Republishing a target from another pool is refused, never silently rebound.
            with pytest.raises(grpc.RpcError) as clash:
                publish(target, pool="pool-b")
            assert clash.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            for path in (target, target, other):  # unpublish is idempotent too
                node.NodeUnpublishVolume(
                    csi_pb2.NodeUnpublishVolumeRequest(volume_id="csi-abc", target_path=path), timeout=5
                )
            assert mounts.mounted == {}
            with pytest.raises(grpc.RpcError) as staged:
                node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(volume_id="x"), timeout=5)
            assert staged.value.code() is grpc.StatusCode.UNIMPLEMENTED
    finally:
        running.stop()
    # Stopping deregisters: the watcher sees the registration socket go.
    assert not os.path.exists(plugin.registration_socket)


def test_without_api_access_a_pod_gets_only_its_own_namespaces_pools() -> None:
    plugin = NodePlugin(node_name="n", kubelet_root=KUBELET, mounter=FakeMounts())
    foreign = plan_publish(
        volume_id="v",
        target_path=TARGET,
        volume_context=context("team-a", pool="pool-a", namespace="team-b"),
        block=False,
        kubelet_root=KUBELET,
    )
    with pytest.raises(Refused) as info:
        plugin.publish(foreign)
    assert info.value.code is Code.PERMISSION_DENIED
    assert "own namespace" in info.value.message
    own = plan_publish(
        volume_id="v",
        target_path=TARGET,
        volume_context=context("team-a", pool="pool-a"),
        block=False,
        kubelet_root=KUBELET,
    )
    plugin.publish(own)
    assert plugin.published == {TARGET: own}


NS = digest("csi")


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: a Unix socket's path must stay under 108 bytes."""
    d = Path(tempfile.mkdtemp(prefix="csi-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProcess]:
    with cache_server(dram_bytes=64 * MiB) as s:
        yield s


@pytest.mark.process
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_published_volume_serves_the_pool_read_only_and_goes_with_unpublish(
    srv: ServerProcess, tmp_path: Path, short_dir: Path
) -> None:
    """Real mount(2) binds in a private mount namespace, a real server behind them, a real client."""
    key = digest("csi-load")
    payload = payload_for(key, 128 * 1024)
    from kvfabric.client import CacheClient

    with CacheClient(srv.unix_target, shared_memory=True) as c:
        assert c.store(NS, [key], [payload], timeout=10).accepted == 1
    run_root = short_dir / "run"
    kubelet = short_dir / "kubelet"
    pool_dir = run_root / "team-a.pool-a"
    sock_name = srv.config.listen.unix_socket.name
    script = textwrap.dedent(
        f"""
        import json, os, socket, grpc
        from kvfabric.client import CacheClient
        from kvfabric.csi import mounts
        from kvfabric.csi.plugin import NodePlugin, start
        from kvfabric.csi.v1 import csi_pb2, csi_pb2_grpc
        out = {{}}
        plugin = NodePlugin(node_name="gpu-0", kubelet_root={str(kubelet)!r}, run_root={str(run_root)!r})
        running = start(plugin)
        target = {str(kubelet)!r} + "/pods/uid-1/volumes/kubernetes.io~csi/run/mount"
        os.makedirs(os.path.dirname(target))  # the kubelet makes the parent, the plugin the target
        def publish(path, **attrs):
            ctx = {{"csi.storage.k8s.io/pod.namespace": "team-a", "csi.storage.k8s.io/ephemeral": "true"}}
            with grpc.insecure_channel("unix://" + plugin.endpoint) as ch:
                csi_pb2_grpc.NodeStub(ch).NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
                    volume_id="v", target_path=path, volume_context={{**ctx, **attrs}},
                    volume_capability=csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume())),
                    timeout=5)
        publish(target, pool="pool-a")
        out["mounted"] = mounts.is_mounted(target)
        opts = [l.split()[5] for l in open("/proc/self/mountinfo") if l.split()[4] == target]
        out["options"] = opts[-1].split(",")
        sock = target + "/{sock_name}"
        with CacheClient("unix://" + sock, shared_memory=True) as c:
            out["loaded"] = c.load({NS!r}, [{key!r}], timeout=10) == [{payload!r}]
        errs = []
        for attempt in (lambda: os.unlink(sock), lambda: open(target + "/impostor", "w"),
                        lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).bind(target + "/x.sock")):
            try:
                attempt()
                errs.append(0)
            except OSError as exc:
                errs.append(exc.errno)
        out["write_errnos"] = errs
        # The pool directory was made by the plugin beside the one the server lives in.
        os.makedirs(os.path.dirname(target.replace("uid-1", "uid-2")))
        publish(target.replace("uid-1", "uid-2"), pool="pool-b")
        out["made_pool_b"] = os.path.isdir({str(run_root)!r} + "/team-a.pool-b")
        with grpc.insecure_channel("unix://" + plugin.endpoint) as ch:
            csi_pb2_grpc.NodeStub(ch).NodeUnpublishVolume(
                csi_pb2.NodeUnpublishVolumeRequest(volume_id="v", target_path=target), timeout=5)
        out["after_unpublish"] = [mounts.is_mounted(target), os.path.exists(target)]
        out["server_dir_intact"] = os.path.exists({str(pool_dir)!r} + "/{sock_name}")
        running.stop()
        print(json.dumps(out))
        """
    )
    (tmp_path / "node.py").write_text(script)
    # The pool's run directory is where the server's sockets are: bind its work directory there.
    cmd = (
        f"mkdir -p {pool_dir} && mount --bind {srv.config.listen.unix_socket.parent} {pool_dir} "
        f"&& exec {sys.executable} {tmp_path / 'node.py'}"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", cmd],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    if proc.returncode != 0 and "unshare failed" in proc.stderr:
        pytest.skip(f"no mount namespaces here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["mounted"]
    assert {"ro", "nosuid", "nodev", "noexec"} <= set(out["options"])
    assert out["loaded"], "a client loads through the published directory"
    assert out["write_errnos"] == [30, 30, 30]  # EROFS even for root: no unlink, no file, no impostor
    assert out["made_pool_b"]
    assert out["after_unpublish"] == [False, False]
    assert out["server_dir_intact"]
    assert srv.config.listen.unix_socket.is_socket()
