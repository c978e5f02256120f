"""The CSI node plugin: a pod gets its namespace's pool socket and payload key, read-only, only.

The pure decision (:func:`kvfabric.csi.publish.plan_publish`) is checked against every attribute a
pod author controls; the plugin itself is then driven as the kubelet drives it, over its real gRPC
sockets, with real bind mounts (in a private mount namespace) and a real cache server behind the
published directory (docs/security.md, "Same node without a hostPath").
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.contract.consumer_env import consumer_keys_entry
from kvfabric.contract.consumer_keys import KEY_FILE_NAME, consumer_root, encode_key, scope_key
from kvfabric.contract.node_paths import host_dir
from kvfabric.csi.plugin import Mounter, NodePlugin, start
from kvfabric.csi.publish import (
    EPHEMERAL_KEY,
    POD_NAME_KEY,
    POD_NAMESPACE_KEY,
    POD_UID_KEY,
    Code,
    ConsumerKey,
    Publication,
    Refused,
    consumer_root_from_secret,
    cross_namespace_refusal,
    plan_publish,
)
from kvfabric.csi.v1 import csi_pb2, csi_pb2_grpc, pluginregistration_pb2, pluginregistration_pb2_grpc
from kvfabric.testing.mountns import run_in_private_mount_namespace
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for

KUBELET = "/var/lib/kubelet"
UID = "0c8a"
TARGET = f"{KUBELET}/pods/{UID}/volumes/kubernetes.io~csi/kvfabric-run/mount"
_LABEL = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,6}[a-z0-9])?", fullmatch=True)


def context(pod_namespace: str = "team-a", /, uid: str = UID, **attributes: str) -> dict[str, str]:
    """What the kubelet passes for an inline volume with these attributes."""
    return {
        POD_NAMESPACE_KEY: pod_namespace,
        POD_NAME_KEY: "engine-0",
        POD_UID_KEY: uid,
        EPHEMERAL_KEY: "true",
        **attributes,
    }


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
            {"volume_context": context(pool="pool-a", content="pool-secret")},
            Code.INVALID_ARGUMENT,
            "volumeAttributes.content",
        ),
        (
            {"volume_context": context(pool="pool-a", content="")},
            Code.INVALID_ARGUMENT,
            "volumeAttributes.content",
        ),
        (
            {"volume_context": {POD_NAMESPACE_KEY: "team-a", POD_UID_KEY: UID, "pool": "pool-a"}},
            Code.FAILED_PRECONDITION,
            "ephemeral",
        ),
        (
            {"volume_context": {EPHEMERAL_KEY: "true", "pool": "pool-a"}},
            Code.FAILED_PRECONDITION,
            "podInfoOnMount",
        ),
        ({"volume_context": context(pool="pool-a\n")}, Code.INVALID_ARGUMENT, "volumeAttributes.pool"),
        ({"volume_context": context(pool="pool-a", namespace="llm\n")}, Code.INVALID_ARGUMENT, "namespace"),
        ({"volume_context": context(pool="pool-a", uid="other-pod")}, Code.FAILED_PRECONDITION, "pod.uid"),
        (
            {"volume_context": {k: v for k, v in context(pool="pool-a").items() if k != POD_UID_KEY}},
            Code.FAILED_PRECONDITION,
            "podInfoOnMount",
        ),
        ({"readonly": False}, Code.INVALID_ARGUMENT, "readOnly: true"),
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


class FakeApi:
    """The API server's answers: which pools exist, which cross-namespace uses their selectors grant,
    which pools share one key space, and the consumer-keys Secret's data (None: no Secret)."""

    def __init__(self, pools: set[tuple[str, str]]) -> None:
        self.pools = pools
        self.grants: set[tuple[str, str, str]] = set()
        self.asked: list[tuple[str, str, str]] = []
        self.shared: set[tuple[str, str]] = set()
        self.consumer_keys: dict[str, str] | None = None

    def __call__(self, p: Publication) -> str | None:
        self.asked.append((p.namespace, p.pool, p.pod_namespace))
        return None if self.asked[-1] in self.grants else "the selector does not select it"

    def pool_exists(self, namespace: str, pool: str) -> bool:
        return (namespace, pool) in self.pools

    def consumer_key(self, namespace: str, pool: str) -> ConsumerKey:
        # The real parsing of the Secret's data (kvfabric.csi.access.ApiAuthorizer does the same).
        if (namespace, pool) not in self.pools:
            raise Refused(Code.FAILED_PRECONDITION, f"no KVCachePool {namespace}/{pool}")
        root = consumer_root_from_secret(self.consumer_keys, namespace, pool)
        return ConsumerKey(root, (namespace, pool) in self.shared)

    def set_root(self, namespace: str, pool: str, root: bytes) -> None:
        """The operator's side: write the pool's consumer root into the Secret."""
        data = dict(self.consumer_keys or {})
        data[consumer_keys_entry(namespace, pool)] = base64.b64encode(encode_key(root).encode()).decode()
        self.consumer_keys = data


class FakeMounts(Mounter):
    """Records binds instead of making them (the gRPC layer's test; the real mounts are below)."""

    def _unmount(self, target: str) -> None:
        self.mounted.pop(target, None)

    def __init__(self) -> None:
        self.mounted: dict[str, str] = {}
        self.dirs: list[str] = []
        super().__init__(
            bind_read_only=lambda s, t, _staging: self.mounted.__setitem__(t, s),
            unmount=self._unmount,
            is_mounted=lambda t: t in self.mounted,
            ensure_directory=self.dirs.append,
        )


def test_the_kubelets_calls_over_the_real_sockets(short_dir: Path) -> None:
    mounts = FakeMounts()
    kubelet = str(short_dir / "kubelet")
    run_root = str(short_dir / "run")
    authorizer = FakeApi(pools={("team-a", "pool-a"), ("team-b", "pool-a")})
    grants, asked = authorizer.grants, authorizer.asked
    plugin = NodePlugin(
        node_name="gpu-0", kubelet_root=kubelet, run_root=run_root, mounter=mounts, authorizer=authorizer
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

            def publish(path: str, readonly: bool = True, **attributes: str) -> None:
                uid = path.split("/pods/", 1)[1].split("/", 1)[0]
                node.NodePublishVolume(
                    csi_pb2.NodePublishVolumeRequest(
                        volume_id="csi-abc",
                        target_path=path,
                        volume_capability=csi_pb2.VolumeCapability(
                            mount=csi_pb2.VolumeCapability.MountVolume()
                        ),
                        readonly=readonly,
                        volume_context=context("team-a", uid=uid, **attributes),
                    ),
                    timeout=5,
                )

            publish(target, pool="pool-a")
            publish(target, pool="pool-a")  # the kubelet retries: idempotent, one bind
            assert mounts.mounted == {target: f"{run_root}/team-a.pool-a"}
            assert (
                mounts.dirs[-1] == f"{run_root}/team-a.pool-a"
            )  # made: the pool exists, its server is not up
            # A pool nobody created never becomes a directory on the node.
            with pytest.raises(grpc.RpcError) as absent:
                publish(target.replace("uid-1", "uid-3"), pool="made-up")
            assert absent.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert not any("made-up" in d for d in mounts.dirs)
            # A writable volume is refused (the kubelet then mounts it read-only in every container).
            with pytest.raises(grpc.RpcError) as writable:
                publish(target.replace("uid-1", "uid-4"), readonly=False, pool="pool-a")
            assert writable.value.code() is grpc.StatusCode.INVALID_ARGUMENT
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
            assert mounts.mounted[other] == f"{run_root}/team-b.pool-a"
            assert asked == [("team-b", "pool-a", "team-a")]
            publish(target, pool="pool-a")
            assert len(asked) == 1, "the pod's own namespace needs no API call"
            # Republishing a target from another pool is refused, never silently rebound.
            with pytest.raises(grpc.RpcError) as clash:
                publish(target, pool="pool-b")
            assert clash.value.code() is grpc.StatusCode.ALREADY_EXISTS
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


ROOT = consumer_root("the pool's payload-key Secret")


def _publish_request(path: str, pod_namespace: str, **attributes: str) -> csi_pb2.NodePublishVolumeRequest:
    uid = path.split("/pods/", 1)[1].split("/", 1)[0]
    return csi_pb2.NodePublishVolumeRequest(
        volume_id="csi-key",
        target_path=path,
        volume_capability=csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume()),
        readonly=True,
        volume_context=context(pod_namespace, uid=uid, **attributes),
    )


def test_a_key_volume_holds_the_scope_key_of_the_namespace_the_kubelet_names(short_dir: Path) -> None:
    """Over the plugin's real sockets: a pod of namespace B gets B's scope key, whatever its volume's
    attributes say; C's gets C's; a pool that shares its key space gives both the same; without the
    operator's Secret or the pool's entry nothing is published; nothing is left behind."""
    mounts = FakeMounts()
    kubelet, key_root = str(short_dir / "kubelet"), str(short_dir / "keys")
    api = FakeApi(pools={("llm", "pool-a"), ("llm", "pool-s")})
    api.grants |= {(pool_ns, pool, ns) for pool_ns, pool in api.pools for ns in ("team-b", "team-c")}
    plugin = NodePlugin(
        node_name="gpu-0", kubelet_root=kubelet, key_root=key_root, mounter=mounts, authorizer=api
    )
    running = start(plugin)

    def target(uid: str) -> str:
        return f"{kubelet}/pods/{uid}/volumes/kubernetes.io~csi/kvfabric-key/mount"

    def key_of(path: str) -> str:
        # What the pod reads at /var/run/kvfabric/key/payload.key: the file in the bound directory.
        return (Path(mounts.mounted[path]) / KEY_FILE_NAME).read_text()

    try:
        with grpc.insecure_channel(f"unix://{plugin.endpoint}") as ch:
            node = csi_pb2_grpc.NodeStub(ch)  # type: ignore[no-untyped-call]

            def publish(path: str, pod_ns: str, **attributes: str) -> grpc.StatusCode:
                try:
                    node.NodePublishVolume(_publish_request(path, pod_ns, **attributes), timeout=5)
                except grpc.RpcError as exc:
                    code: grpc.StatusCode = exc.code()
                    return code
                return grpc.StatusCode.OK

            def unpublish(path: str) -> None:
                node.NodeUnpublishVolume(
                    csi_pb2.NodeUnpublishVolumeRequest(volume_id="csi-key", target_path=path), timeout=5
                )

            key = {"pool": "pool-a", "namespace": "llm", "content": "payload-key"}
            # No Secret yet, then a Secret without the pool's entry: refused, retried by the kubelet.
            for _ in range(2):
                with pytest.raises(grpc.RpcError) as missing:
                    node.NodePublishVolume(_publish_request(target("b0"), "team-b", **key), timeout=5)
                assert missing.value.code() is grpc.StatusCode.UNAVAILABLE
                assert "kvfabric-consumer-keys" in str(missing.value.details())
                assert mounts.mounted == {}
                assert not os.path.exists(key_root) or os.listdir(key_root) == []
                api.set_root("other", "pool-a", bytes(32))
            api.set_root("llm", "pool-a", ROOT)
            api.set_root("llm", "pool-s", ROOT)
            # A pod of B: B's scope key, even when its attributes name the pool's namespace (the
            # webhook's volume does) or when the pod asks twice (the kubelet retries).
            assert publish(target("b1"), "team-b", **key) == grpc.StatusCode.OK
            assert publish(target("b1"), "team-b", **key) == grpc.StatusCode.OK
            want_b = encode_key(scope_key(ROOT, "team-b")) + "\n"
            assert key_of(target("b1")) == want_b
            assert key_of(target("b1")) != encode_key(scope_key(ROOT, "llm")) + "\n"
            source = Path(mounts.mounted[target("b1")])
            assert (source.stat().st_mode & 0o777, (source / KEY_FILE_NAME).stat().st_mode & 0o777) == (
                0o755,
                0o444,
            )
            assert source.parent == Path(key_root)
            # A pod of C: C's key. Nothing a pod's author writes picks another scope (unknown
            # attributes, such as a "scope", are refused; content must be known).
            assert publish(target("c1"), "team-c", **key) == grpc.StatusCode.OK
            assert key_of(target("c1")) == encode_key(scope_key(ROOT, "team-c")) + "\n" != want_b
            assert publish(target("c2"), "team-c", **key, scope="team-b") == grpc.StatusCode.INVALID_ARGUMENT
            assert (
                publish(target("c3"), "team-c", **{**key, "content": "root"})
                == grpc.StatusCode.INVALID_ARGUMENT
            )
            # Authorized like the socket: a namespace the pool's selector does not select gets nothing.
            assert publish(target("d1"), "team-d", **key) == grpc.StatusCode.PERMISSION_DENIED
            # A pool that shares its key space: both namespaces get the one shared key.
            api.shared.add(("llm", "pool-s"))
            shared = {**key, "pool": "pool-s"}
            assert publish(target("b2"), "team-b", **shared) == grpc.StatusCode.OK
            assert publish(target("c4"), "team-c", **shared) == grpc.StatusCode.OK
            assert key_of(target("b2")) == key_of(target("c4")) == encode_key(scope_key(ROOT, "*")) + "\n"
            # The operator's entry gone: new pods wait, running ones keep theirs.
            api.consumer_keys = {}
            assert publish(target("b3"), "team-b", **key) == grpc.StatusCode.UNAVAILABLE
            assert target("b3") not in mounts.mounted
            published = [target(u) for u in ("b1", "c1", "b2", "c4")]
            assert sorted(os.listdir(key_root)) == sorted(Path(mounts.mounted[t]).name for t in published)
            for path in [*published, *published]:  # idempotent
                unpublish(path)
            assert mounts.mounted == {}
            assert os.listdir(key_root) == []
    finally:
        running.stop()
    assert plugin._locks == {}, "every target's lock entry goes with its call"


@settings(max_examples=60, deadline=None)
@given(pod_ns=_LABEL, named_ns=_LABEL, pool=_LABEL, shared=st.booleans())
def test_the_key_is_always_the_kubelet_namespaces_whatever_the_volume_names(
    pod_ns: str, named_ns: str, pool: str, shared: bool
) -> None:
    with tempfile.TemporaryDirectory(prefix="keys-", dir="/tmp") as d:
        api = FakeApi(pools={(named_ns, pool)})
        api.grants.add((named_ns, pool, pod_ns))
        api.set_root(named_ns, pool, ROOT)
        if shared:
            api.shared.add((named_ns, pool))
        mounts = FakeMounts()
        plugin = NodePlugin(node_name="n", kubelet_root=KUBELET, key_root=d, mounter=mounts, authorizer=api)
        p = plan_publish(
            volume_id="v",
            target_path=TARGET,
            volume_context=context(pod_ns, pool=pool, namespace=named_ns, content="payload-key"),
            block=False,
            kubelet_root=KUBELET,
            key_root=d,
        )
        plugin.publish(p)
        got = (Path(mounts.mounted[TARGET]) / KEY_FILE_NAME).read_text()
        assert got == encode_key(scope_key(ROOT, "*" if shared else pod_ns)) + "\n"
        plugin.unpublish(TARGET)
        assert os.listdir(d) == []


def test_the_per_target_lock_map_does_not_grow(short_dir: Path) -> None:
    mounts = FakeMounts()
    plugin = NodePlugin(node_name="n", kubelet_root=KUBELET, run_root=str(short_dir), mounter=mounts)
    (short_dir / "team-a.pool-a").mkdir()
    for i in range(200):
        target = TARGET.replace(UID, f"pod-{i}")
        p = plan_publish(
            volume_id="v",
            target_path=target,
            volume_context=context("team-a", uid=f"pod-{i}", pool="pool-a"),
            block=False,
            kubelet_root=KUBELET,
            run_root=str(short_dir),
        )
        plugin.publish(p)
        plugin.unpublish(target)
        with pytest.raises(Refused):  # a refused call leaves no entry either
            plugin.publish(dataclasses.replace(p, namespace="team-b"))
    assert plugin._locks == {}
    # While one call holds a target, a second waits on the same lock; the entry goes after both.
    entered, release, order = threading.Event(), threading.Event(), []

    def first() -> None:
        with plugin.target_lock(TARGET):
            entered.set()
            release.wait(10)
            order.append("first")

    t = threading.Thread(target=first)
    t.start()
    assert entered.wait(10)

    def second_call() -> None:
        plugin.unpublish(TARGET)
        order.append("second")

    second = threading.Thread(target=second_call)
    second.start()
    assert len(plugin._locks) == 1
    release.set()
    t.join(10)
    second.join(10)
    assert order == ["first", "second"]
    assert plugin._locks == {}


def test_without_api_access_a_pod_gets_only_its_own_namespaces_pools_that_are_up(tmp_path: Path) -> None:
    plugin = NodePlugin(node_name="n", kubelet_root=KUBELET, run_root=str(tmp_path), mounter=FakeMounts())

    def plan(**attributes: str) -> Publication:
        return plan_publish(
            volume_id="v",
            target_path=TARGET,
            volume_context=context("team-a", **attributes),
            block=False,
            kubelet_root=KUBELET,
            run_root=str(tmp_path),
        )

    with pytest.raises(Refused) as info:
        plugin.publish(plan(pool="pool-a", namespace="team-b"))
    assert info.value.code is Code.PERMISSION_DENIED
    assert "own namespace" in info.value.message
    # No API to confirm the pool exists: only a directory its server already made is published.
    with pytest.raises(Refused) as down:
        plugin.publish(plan(pool="pool-a"))
    assert down.value.code is Code.FAILED_PRECONDITION
    (tmp_path / "team-a.pool-a").mkdir()
    own = plan(pool="pool-a")
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


PLUGIN = """
import os, signal, sys, threading
from kvfabric.csi.plugin import NodePlugin, start
from kvfabric.csi.publish import Code, ConsumerKey, Refused
kubelet, run_root, staging = sys.argv[1:4]
class Api:  # no pool exists for the run directory; one consumer root for the key volume
    def __call__(self, p):
        return "not granted"
    def pool_exists(self, namespace, pool):
        return False
    def consumer_key(self, namespace, pool):
        if (namespace, pool) != ("team-a", "pool-a"):
            raise Refused(Code.UNAVAILABLE, "no entry")
        return ConsumerKey(bytes(range(32)), False)
running = start(NodePlugin(node_name="gpu-0", kubelet_root=kubelet, run_root=run_root, staging_root=staging,
                           key_root=staging + "/keys", authorizer=Api()))
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
stop.wait()
running.stop()
"""

NODE = """
import json, os, socket, subprocess, sys, time, grpc
from kvfabric.client import CacheClient
from kvfabric.csi import mounts
from kvfabric.csi.v1 import csi_pb2, csi_pb2_grpc
kubelet, run_root, staging, plugin_script, sock_name, ns, key, payload_file = sys.argv[1:9]
payload = open(payload_file, "rb").read()
# The plugin's container: a mount namespace of its own in which the kubelet's directory stays a peer
# of the node's (Bidirectional), everything else private.
plugin = subprocess.Popen(["unshare", "--mount", "--propagation", "unchanged", sys.executable, plugin_script,
                           kubelet, run_root, staging])
endpoint = kubelet + "/plugins/csi.kvfabric.io/csi.sock"
for _ in range(300):
    if os.path.exists(endpoint):
        break
    time.sleep(0.05)
out = {}
def publish(uid, **attrs):
    target = kubelet + "/pods/" + uid + "/volumes/kubernetes.io~csi/run/mount"
    os.makedirs(os.path.dirname(target), exist_ok=True)  # the kubelet makes the parent, the plugin the target
    ctx = {"csi.storage.k8s.io/pod.namespace": "team-a", "csi.storage.k8s.io/pod.uid": uid,
           "csi.storage.k8s.io/ephemeral": "true", **attrs}
    with grpc.insecure_channel("unix://" + endpoint) as ch:
        try:
            csi_pb2_grpc.NodeStub(ch).NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
                volume_id="v", target_path=target, volume_context=ctx, readonly=True,
                volume_capability=csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume())),
                timeout=10)
        except grpc.RpcError as exc:
            return target, exc.code().name
    return target, "OK"
try:
    target, out["publish"] = publish("uid-1", pool="pool-a")
    # Everything below is read in the node's namespace, the one the kubelet and containerd use.
    out["node_options"] = sorted(mounts.mount_options(target))
    sock = target + "/" + sock_name
    with CacheClient("unix://" + sock, shared_memory=True) as c:
        out["loaded"] = c.load(ns, [key], timeout=10) == [payload]
    errs = []
    for attempt in (lambda: os.unlink(sock), lambda: open(target + "/impostor", "w"),
                    lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).bind(target + "/x.sock")):
        try:
            attempt()
            errs.append(0)
        except OSError as exc:
            errs.append(exc.errno)
    out["write_errnos"] = errs
    # No API here to confirm a pool exists: a made-up one is refused and no directory appears.
    _, out["made_up"] = publish("uid-2", pool="made-up")
    out["made_up_dir"] = os.path.exists(run_root + "/team-a.made-up")
    # The key volume: the pod's scope key in a directory of the plugin's own, bound read-only.
    key_target, out["key_publish"] = publish("uid-3", pool="pool-a", content="payload-key")
    out["key_options"] = sorted(mounts.mount_options(key_target))
    key_file = key_target + "/payload.key"
    out["key"] = open(key_file).read()
    out["key_modes"] = [oct(os.stat(key_target).st_mode & 0o777), oct(os.stat(key_file).st_mode & 0o777)]
    errs = []
    for attempt in (lambda: os.unlink(key_file), lambda: open(key_file, "w"),
                    lambda: open(key_target + "/other.key", "w")):
        try:
            attempt()
            errs.append(0)
        except OSError as exc:
            errs.append(exc.errno)
    out["key_write_errnos"] = errs
    out["staging_left"] = sorted(os.listdir(staging))
    with grpc.insecure_channel("unix://" + endpoint) as ch:
        for t in (target, key_target):
            csi_pb2_grpc.NodeStub(ch).NodeUnpublishVolume(
                csi_pb2.NodeUnpublishVolumeRequest(volume_id="v", target_path=t), timeout=10)
    out["after_unpublish"] = [mounts.is_mounted(target), os.path.exists(target)]
    out["key_after_unpublish"] = [mounts.is_mounted(key_target), os.path.exists(key_target),
                                  os.listdir(staging + "/keys")]
    out["server_socket_intact"] = os.path.exists(run_root + "/team-a.pool-a/" + sock_name)
finally:
    plugin.terminate()
    plugin.wait(10)
print(json.dumps(out))
"""


@pytest.mark.process
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_published_volume_is_read_only_on_the_node_and_goes_with_unpublish(
    srv: ServerProcess, tmp_path: Path, short_dir: Path
) -> None:
    """Real mount(2) as on a node: the plugin in a mount namespace of its own whose kubelet directory
    is a peer of the node's, the checks in the node's namespace (what containers get), a real cache
    server behind the published directory and a real client through it."""
    key = digest("csi-load")
    payload = payload_for(key, 128 * 1024)
    from kvfabric.client import CacheClient

    with CacheClient(srv.unix_target, shared_memory=True) as c:
        assert c.store(NS, [key], [payload], timeout=10).accepted == 1
    run_root, kubelet, staging = short_dir / "run", short_dir / "kubelet", short_dir / "staging"
    staging.mkdir()
    pool_dir = run_root / "team-a.pool-a"
    (tmp_path / "plugin.py").write_text(PLUGIN)
    (tmp_path / "node.py").write_text(NODE)
    (tmp_path / "payload").write_bytes(payload)
    args = [kubelet, run_root, staging, tmp_path / "plugin.py", srv.config.listen.unix_socket.name, NS, key]
    # The node: a shared kubelet directory (as systemd makes /), and the pool's run directory where
    # the server's sockets are.
    cmd = (
        f"mkdir -p {kubelet}/pods {pool_dir} && mount --bind {kubelet} {kubelet} "
        f"&& mount --make-rshared {kubelet} "
        f"&& mount --bind {srv.config.listen.unix_socket.parent} {pool_dir} "
        f"&& exec {sys.executable} {tmp_path / 'node.py'} {' '.join(map(str, args))} {tmp_path / 'payload'}"
    )
    proc = run_in_private_mount_namespace(cmd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["publish"] == "OK", proc.stderr
    # Read-only where it counts: in the node's copy of the mount, not only in the plugin's.
    assert {"ro", "nosuid", "nodev", "noexec"} <= set(out["node_options"]), out["node_options"]
    assert out["loaded"], "a client loads through the published directory"
    assert out["write_errnos"] == [30, 30, 30]  # EROFS even for root: no unlink, no file, no impostor
    assert (out["made_up"], out["made_up_dir"]) == ("FAILED_PRECONDITION", False)
    assert out["staging_left"] == ["keys"]  # no bind left in the staging directory
    assert out["after_unpublish"] == [False, False]
    # The key volume: read-only on the node, the scope key of the kubelet's namespace, world-readable
    # (the consumer's uid is not known) and gone with the unpublish, its directory too.
    assert out["key_publish"] == "OK", proc.stderr
    assert {"ro", "nosuid", "nodev", "noexec"} <= set(out["key_options"]), out["key_options"]
    assert out["key"] == encode_key(scope_key(bytes(range(32)), "team-a")) + "\n"
    assert out["key_modes"] == ["0o755", "0o444"]
    assert out["key_write_errnos"] == [30, 30, 30]
    assert out["key_after_unpublish"] == [False, False, []]
    assert out["server_socket_intact"]
    assert srv.config.listen.unix_socket.is_socket()
