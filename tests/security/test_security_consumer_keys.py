"""End to end: two consumer namespaces of one pool, each keyed through the CSI node plugin.

Pool ``pool-a`` lives in namespace ``llm``; engines in ``team-b`` and ``team-c`` consume it from
another namespace, so they get no pool secret: the webhook gives each pod a second CSI volume, and
the node plugin (its real code over its real gRPC socket; a recording mounter stands for mount(2),
whose read-only mechanics ``tests/security/test_security_csi.py`` tests for real) publishes the
pod's scope key there, for the namespace the kubelet names. The engines are reference engines with
the real connector, against a real cache-server process.

1. B's cached prefix is no hit for C: C cannot compute B's keys (B's key is in B's namespace, and
   B's chunk keys chain from a keyed digest of it: knowing B's namespace digest is not enough).
2. An attacker in C who is *given* B's namespace and chunk keys, and stores chunks sealed with C's
   own key under them, gets them refused by B (``corrupt``): B recomputes, its logits are exact.
3. A pool that says its namespaces share one key space (``spec.consumers.keySpace: Shared``): B's
   prefix is a hit for C, and for a consumer of the pool's own namespace that derives its key from
   the pool secret.

Before consumer key scopes, every cross-namespace consumer sealed with the public all-zero key in
one pool-wide namespace: 1 and 2 failed (C hit B's prefix; B loaded C's forged chunks).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tests.security.test_security_csi import FakeApi, FakeMounts, context

from kvfabric.client import CacheClient
from kvfabric.connector import keys, layout
from kvfabric.connector.resilient import CircuitBreaker, Endpoint, ResilientCache, transport_factory
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.contract.consumer_env import KEY_VOLUME_CONTENT
from kvfabric.contract.consumer_keys import KEY_FILE_NAME, SHARED_SCOPE, consumer_root
from kvfabric.csi.plugin import NodePlugin, RunningPlugin, start
from kvfabric.csi.v1 import csi_pb2, csi_pb2_grpc
from kvfabric.refengine.engine import Engine
from kvfabric.refengine.model import RefModel
from kvfabric.refengine.testing import TINY, prompt
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, wait_until

pytestmark = pytest.mark.process

POOL_NS = "llm"
SECRET = "pool-a's payload-key Secret"
SHARED_SECRET = "pool-s's payload-key Secret"
CHUNK = 32


class Node:
    """The node plugin as the kubelet drives it, and the key file each pod then reads."""

    def __init__(self, root: Path) -> None:
        self.kubelet = str(root / "kubelet")
        self.api = FakeApi(pools={(POOL_NS, "pool-a"), (POOL_NS, "pool-s")})
        self.api.grants |= {
            (POOL_NS, pool, ns) for pool in ("pool-a", "pool-s") for ns in ("team-b", "team-c")
        }
        self.api.shared.add((POOL_NS, "pool-s"))
        # The operator's side: each pool's consumer root in kvfabric-consumer-keys.
        self.api.set_root(POOL_NS, "pool-a", consumer_root(SECRET))
        self.api.set_root(POOL_NS, "pool-s", consumer_root(SHARED_SECRET))
        self.mounts = FakeMounts()
        self.plugin = NodePlugin(
            node_name="gpu-0",
            kubelet_root=self.kubelet,
            key_root=str(root / "keys"),
            mounter=self.mounts,
            authorizer=self.api,
        )
        self.running: RunningPlugin = start(self.plugin)

    def key_file(self, pod_uid: str, pod_namespace: str, pool: str) -> str:
        """Publish the key volume of a pod (as the webhook writes it) and return its key file."""
        target = f"{self.kubelet}/pods/{pod_uid}/volumes/kubernetes.io~csi/kvfabric-key/mount"
        attributes = {"pool": pool, "namespace": POOL_NS, "content": KEY_VOLUME_CONTENT}
        with grpc.insecure_channel(f"unix://{self.plugin.endpoint}") as ch:
            csi_pb2_grpc.NodeStub(ch).NodePublishVolume(  # type: ignore[no-untyped-call]
                csi_pb2.NodePublishVolumeRequest(
                    volume_id=f"csi-{pod_uid}",
                    target_path=target,
                    volume_capability=csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume()),
                    readonly=True,
                    volume_context=context(pod_namespace, uid=pod_uid, **attributes),
                ),
                timeout=10,
            )
        # The pod reads the file in the directory bound at its target.
        return os.path.join(self.mounts.mounted[target], KEY_FILE_NAME)


@pytest.fixture
def node() -> Iterator[Node]:
    d = Path(tempfile.mkdtemp(prefix="keys-", dir="/tmp"))  # a socket path must stay short
    n = Node(d)
    try:
        yield n
    finally:
        n.running.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def srv() -> Iterator[ServerProcess]:
    with cache_server(dram_bytes=64 * MiB, tcp=False) as s:
        yield s


def consumer(key_file: str | None, scope: str, *, secret: str | None = None) -> ConnectorSettings:
    """What the webhook injects: the key file (other namespaces) or the pool secret, and the scope."""
    return ConnectorSettings(
        chunk_tokens=CHUNK,
        lookup_deadline_ms=2000,
        load_deadline_ms=5000,
        payload_key_file=key_file,
        payload_key=secret,
        key_scope=scope,
    )


def engine(srv: ServerProcess, settings: ConnectorSettings, model: RefModel) -> Engine:
    factory = transport_factory(srv.unix_target, shared_memory=True)
    cache = ResilientCache([Endpoint("srv", factory, CircuitBreaker(3, 60.0))])
    return Engine(TINY, num_blocks=64, settings=settings, cache=cache, model=model)


def warm(
    srv: ServerProcess, settings: ConnectorSettings, model: RefModel, tokens: list[int]
) -> tuple[str, list[str]]:
    """Cache ``tokens`` as this consumer; return its namespace and the prompt's chunk keys."""
    e = engine(srv, settings, model)
    assert e.generate(tokens, 1).hit_tokens == 0
    assert e.worker_conn is not None
    assert e.worker_conn.wait_for_stores(60)
    again = e.generate(tokens, 1)
    assert again.hit_tokens >= 3 * CHUNK, "the consumer's own prefix is a hit (its key file works)"
    ns = e.worker_conn.namespace
    assert e.scheduler_conn is not None
    chunk_keys = keys.chunk_keys(e.scheduler_conn.key_chain, tokens, CHUNK)
    e.close()
    return ns, chunk_keys


def test_a_prefix_of_one_consumer_namespace_is_no_hit_for_another(node: Node, srv: ServerProcess) -> None:
    model = RefModel(TINY)
    tokens = prompt(100, 11)
    b = consumer(node.key_file("pod-b", "team-b", "pool-a"), "team-b")
    c = consumer(node.key_file("pod-c", "team-c", "pool-a"), "team-c")
    assert b.key.usable
    assert c.key.usable
    ns_b, keys_b = warm(srv, b, model, tokens)
    victim = engine(srv, c, model)
    r = victim.generate(tokens, 1)
    assert victim.worker_conn is not None
    assert victim.worker_conn.namespace != ns_b
    assert r.hit_tokens == 0, "C hit B's cached prefix"
    victim.close()
    # Even knowing B's namespace digest (the pool's status and the server's metrics show it), C
    # cannot compute B's chunk keys for the prompt: they chain from a keyed digest of it.
    with CacheClient(srv.unix_target) as c_client:
        assert c_client.lookup(ns_b, keys_b, timeout=10).matched == len(keys_b) == 3
        guessed = keys.chunk_keys(ns_b, tokens, CHUNK)
        assert c_client.lookup(ns_b, guessed, timeout=10).matched == 0


def test_a_chunk_forged_in_one_consumer_namespace_is_refused_by_another(
    node: Node, srv: ServerProcess
) -> None:
    model = RefModel(TINY)
    tokens = prompt(100, 7)
    baseline = Engine(TINY, num_blocks=64, model=model).generate(tokens, 1).first_logits
    b = consumer(node.key_file("pod-b", "team-b", "pool-a"), "team-b")
    c = consumer(node.key_file("pod-c", "team-c", "pool-a"), "team-c")
    ns_b, chunk_keys = warm(srv, b, model, tokens)
    assert len(chunk_keys) == 3
    # The attacker in C is given B's namespace and chunk keys (the worst case: a leaked log) and
    # seals its own bytes as well as C can: with C's key, the only one its pod was given.
    with CacheClient(srv.unix_target) as attacker:
        genuine = attacker.load(ns_b, chunk_keys, timeout=10)
        assert len(genuine) == 3
        attacker.delete(ns_b, chunk_keys, timeout=10)
        forged = []
        for key, payload in zip(chunk_keys, genuine, strict=True):
            buf = bytearray(payload)
            buf[layout.HEADER_SIZE :] = os.urandom(len(buf) - layout.HEADER_SIZE)
            layout.seal(
                buf, namespace=ns_b, key=key, num_tokens=CHUNK, num_layers=TINY.num_layers, mac_key=c.mac_key
            )
            forged.append(bytes(buf))
        # A deleted key takes no store for the delete margin (engine/ordering.py): wait it out.
        wait_until(
            lambda: attacker.store(ns_b, chunk_keys, forged, timeout=10).accepted == 3,
            timeout=60,
            what="the forged store after the delete margin",
        )
    victim = engine(srv, b, model)
    r = victim.generate(tokens, 1)
    # The lookup finds the keys; every load fails verification and the engine recomputes.
    assert r.fallback_reason == "corrupt", "B loaded chunks sealed in C"
    assert r.recomputed_after_load_error
    assert (r.first_logits - baseline).abs().max().item() <= 1e-5
    victim.close()


def test_a_pool_that_shares_its_key_space_shares_prefixes_between_namespaces(
    node: Node, srv: ServerProcess
) -> None:
    model = RefModel(TINY)
    tokens = prompt(100, 5)
    baseline = Engine(TINY, num_blocks=64, model=model).generate(tokens, 1).first_logits
    b = consumer(node.key_file("pod-b", "team-b", "pool-s"), SHARED_SCOPE)
    c = consumer(node.key_file("pod-c", "team-c", "pool-s"), SHARED_SCOPE)
    assert b.mac_key == c.mac_key
    warm(srv, b, model, tokens)
    # A consumer of the pool's own namespace holds the pool secret and derives the same shared key.
    own = consumer(None, SHARED_SCOPE, secret=SHARED_SECRET)
    for settings in (c, own):
        e = engine(srv, settings, model)
        r = e.generate(tokens, 1)
        assert r.hit_tokens >= 3 * CHUNK
        assert r.fallback_reason is None
        assert (r.first_logits - baseline).abs().max().item() <= 1e-5
        e.close()
    # The per-namespace pool's keys are none of these.
    assert consumer(node.key_file("pod-b2", "team-b", "pool-a"), "team-b").mac_key != b.mac_key
