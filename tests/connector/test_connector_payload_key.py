"""The payload key a connector seals with: one key space per consumer namespace of a pool.

A consumer of the pool's own namespace derives its scope key from the pool secret and its scope; one
of another namespace reads the scope key the CSI node plugin published. Distinct scopes never share
a key or a namespace; a pool that shares one key space gives every namespace the same; a key file
that cannot be used turns the cache off and is never replaced by the public key
(``kvfabric.connector.payloadkey``, docs/security.md "Payload authenticity").
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.client.results import LookupResult, StoreResult
from kvfabric.connector import keys, layout
from kvfabric.connector.resilient import CircuitBreaker, Endpoint, ResilientCache, build_cache
from kvfabric.connector.scheduler import SchedulerHalf, keyed_spec
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.connector.steps import RequestInfo
from kvfabric.contract.consumer_env import KEY_FILE_PATH, ConsumerVar, key_env
from kvfabric.contract.consumer_keys import (
    SHARED_SCOPE,
    consumer_root,
    encode_key,
    scope_for,
    scope_key,
)
from kvfabric.refengine.engine import Engine
from kvfabric.refengine.model import RefModel
from kvfabric.refengine.testing import TINY, prompt

POOL_SECRET = "the pool's payload-key Secret"
CHUNK = 32
_NAMESPACE = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,10}[a-z0-9])?", fullmatch=True)


def scoped(scope: str, secret: str = POOL_SECRET) -> ConnectorSettings:
    return ConnectorSettings(payload_key=secret, key_scope=scope, chunk_tokens=CHUNK)


def spec_of(s: ConnectorSettings) -> str:
    return keyed_spec(Engine.namespace_spec(TINY, s, 16), s).digest()


@settings(max_examples=100, deadline=None)
@given(a=_NAMESPACE, b=_NAMESPACE, secret=st.text(min_size=1, max_size=40))
def test_each_consumer_namespace_has_a_key_and_namespaces_of_its_own(a: str, b: str, secret: str) -> None:
    ka, kb = scoped(a, secret), scoped(b, secret)
    assert (ka.mac_key == kb.mac_key) == (a == b)
    assert (layout.key_id(ka.mac_key) == layout.key_id(kb.mac_key)) == (a == b)
    assert (spec_of(ka) == spec_of(kb)) == (a == b)
    for k in (ka, kb):
        assert k.mac_key not in (layout.PUBLIC_KEY, scoped(a, secret + "x").mac_key)
        # Nor the old unscoped key, which every consumer holding the pool secret could compute.
        assert k.mac_key != ConnectorSettings(payload_key=secret).mac_key
    # A pool that shares one key space: every namespace gets the one shared scope (same key, same
    # namespaces), and it is none of the per-namespace ones.
    sa, sb = scope_for(a, shared=True), scope_for(b, shared=True)
    assert sa == sb == SHARED_SCOPE
    assert scoped(sa, secret).mac_key == scoped(sb, secret).mac_key != ka.mac_key
    assert spec_of(scoped(sa, secret)) == spec_of(scoped(sb, secret))


@settings(max_examples=50, deadline=None)
@given(ns=_NAMESPACE)
def test_the_key_file_route_and_the_pool_secret_route_give_one_scope_the_same_key(ns: str) -> None:
    # What the node plugin writes for a pod of `ns` (kvfabric.csi.publish.key_file_text) is what a
    # consumer holding the pool secret derives for that scope.
    from kvfabric.csi.publish import key_file_text

    text = key_file_text(consumer_root(POOL_SECRET), ns, shared=False)
    assert text == encode_key(scope_key(consumer_root(POOL_SECRET), ns)) + "\n"
    with _key_file(text) as path:
        from_file = ConnectorSettings(payload_key_file=path, key_scope=ns, chunk_tokens=CHUNK)
        assert from_file.key.usable
        assert from_file.mac_key == scoped(ns).mac_key
        assert spec_of(from_file) == spec_of(scoped(ns))


def test_a_pod_configured_before_key_scopes_keeps_its_key() -> None:
    # A pool secret without a scope (an old pod, a hand-written config): the old derivation, so
    # nothing cached by it becomes a miss and nothing that works breaks.
    old = ConnectorSettings(payload_key=POOL_SECRET)
    assert old.mac_key == hashlib.sha256(b"kvfabric payload mac\0" + POOL_SECRET.encode()).digest()
    assert old.key.scope == ""
    assert ConnectorSettings().mac_key == layout.PUBLIC_KEY  # no key at all: public, as before


def test_the_namespace_names_the_scope() -> None:
    a, b = (
        keyed_spec(Engine.namespace_spec(TINY, scoped("team-b"), 16), scoped("team-b")),
        keyed_spec(Engine.namespace_spec(TINY, scoped("team-c"), 16), scoped("team-c")),
    )
    assert (a.key_scope, b.key_scope) == ("team-b", "team-c")
    assert a.document()["key_scope"] == "team-b"
    # The scope alone changes the namespace too (the key id already does).
    assert dataclasses.replace(a, key_scope="team-c").digest() != a.digest()
    # The fingerprint is keyed: it gives nothing of the key away, and the scope's name with the
    # pool's public facts does not compute it.
    assert a.payload_key_id not in (scoped("team-b").mac_key.hex(), "")
    assert a.payload_key_id != hashlib.sha256(b"team-b").hexdigest()[:16]


def test_a_scope_keys_the_chunk_key_chain_and_an_unscoped_consumer_keeps_its_keys() -> None:
    tokens = prompt(100, 1)
    spec = Engine.namespace_spec(TINY, ConnectorSettings(chunk_tokens=CHUNK), 16)
    scheduler_b = SchedulerHalf(scoped("team-b"), spec)
    plain_ns = keyed_spec(spec, scoped("team-b")).digest()
    # Keyed: the namespace digest alone (shown in the pool's status) does not give the chunk keys.
    assert scheduler_b.key_chain != scheduler_b.namespace == plain_ns
    keys_b = scheduler_b.chunk_keys(RequestInfo("r", tuple(tokens)))
    assert keys_b == keys.chunk_keys(keys.chain_namespace(plain_ns, scoped("team-b").mac_key), tokens, CHUNK)
    assert keys_b != keys.chunk_keys(plain_ns, tokens, CHUNK)
    # The old unscoped key and no key: the chain and the digest are exactly what they were before
    # key scopes (no `key_scope` member), so their cached chunks stay hits across the upgrade.
    for secret in (POOL_SECRET, None):
        half = SchedulerHalf(ConnectorSettings(payload_key=secret, chunk_tokens=CHUNK), spec)
        assert half.key_chain == half.namespace
        assert "key_scope" not in half.spec.document()


@pytest.mark.parametrize("scope", ["Team-B", "a b", "-x", "x" * 64, "**", "team.b"])
def test_a_scope_that_is_not_a_namespace_is_refused_naming_the_field(scope: str) -> None:
    with pytest.raises(ValueError, match="key_scope"):
        ConnectorSettings(payload_key=POOL_SECRET, key_scope=scope)


def test_the_webhooks_key_variables_are_the_connectors_settings() -> None:
    same = key_env("llm", "llm", shared=False)
    assert same == {ConsumerVar.KEY_SCOPE.value: "llm"}
    other = key_env("team-b", "llm", shared=False)
    assert other == {ConsumerVar.KEY_SCOPE.value: "team-b", ConsumerVar.PAYLOAD_KEY_FILE.value: KEY_FILE_PATH}
    assert key_env("team-b", "llm", shared=True)[ConsumerVar.KEY_SCOPE.value] == SHARED_SCOPE
    assert KEY_FILE_PATH == "/var/run/kvfabric/key/payload.key"
    for var in (ConsumerVar.KEY_SCOPE, ConsumerVar.PAYLOAD_KEY_FILE):
        assert var.field in ConnectorSettings.model_fields


class _Recording:
    """A transport that counts every call: an unusable key must never reach the cache."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def _called(self) -> None:
        with self.lock:
            self.calls += 1

    def lookup(self, namespace: str, keys: Sequence[str], *, timeout: float) -> LookupResult:
        self._called()
        return LookupResult(len(keys), ["dram"] * len(keys))

    def load_into(
        self, namespace: str, keys: Sequence[str], buffers: Sequence[memoryview], *, timeout: float
    ) -> int:
        self._called()
        return 0

    def store(
        self,
        namespace: str,
        keys: Sequence[str],
        payloads: Sequence[bytes | bytearray | memoryview],
        *,
        timeout: float,
    ) -> StoreResult:
        self._called()
        return StoreResult(len(keys), 0)

    def close(self) -> None:
        pass


BAD_KEY_FILES: dict[str, bytes | None] = {
    "missing": None,
    "empty": b"",
    "short": b"ab" * 31 + b"\n",
    "upper-case": b"AB" * 32 + b"\n",
    "two keys": b"ab" * 32 + b"\n" + b"cd" * 32 + b"\n",
    "not text": b"\xff" * 64,
    "huge": b"0" * 100_000,
}


@pytest.mark.parametrize("case", sorted(BAD_KEY_FILES))
def test_a_key_file_that_cannot_be_used_turns_the_cache_off_never_the_public_key(
    case: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / f"{case.replace(' ', '-')}.key"
    content = BAD_KEY_FILES[case]
    if content is not None:
        path.write_bytes(content)
    s = ConnectorSettings(
        payload_key_file=str(path), key_scope="team-b", socket="/run/kvfabric/x/cache.sock", chunk_tokens=32
    )
    with caplog.at_level(logging.ERROR, logger="kvfabric.connector.payloadkey"):
        assert not s.key.usable
        assert str(path) in str(s.key.error)
        # Never the public key (shared by every keyless consumer), nor any pool-derived key.
        assert s.mac_key != layout.PUBLIC_KEY
        assert s.mac_key != scoped("team-b").mac_key
        assert not s.configured
        assert build_cache(s) is None
        # Even handed a cache explicitly, the connector never asks it anything: every request
        # recomputes, and the metrics count why.
        transport = _Recording()
        cache = ResilientCache([Endpoint("srv", lambda: transport, CircuitBreaker(3, 60.0))])
        model = RefModel(TINY)
        engine = Engine(TINY, num_blocks=64, settings=s, cache=cache, model=model)
        tokens = prompt(100, 3)
        baseline = Engine(TINY, num_blocks=64, model=model).generate(tokens, 1).first_logits
        for _ in range(2):
            r = engine.generate(tokens, 1)
            assert r.hit_tokens == 0
            assert (r.first_logits - baseline).abs().max().item() <= 1e-5
        assert engine.worker_conn is not None
        assert engine.worker_conn.wait_for_stores(10)
        assert transport.calls == 0
        assert engine.worker_conn.counters.get("payload_key_unusable") >= 1
        engine.close()
    # One clear error naming the file, however many halves and settings objects read it.
    ConnectorSettings(payload_key_file=str(path)).key  # noqa: B018 - resolving is the point
    named = [r for r in caplog.records if str(path) in r.getMessage()]
    assert len(named) == 1, [r.getMessage() for r in caplog.records]
    assert "cache off" in named[0].getMessage()


@pytest.mark.parametrize("secret", [None, ""])
def test_a_scope_whose_pool_secret_did_not_arrive_turns_the_cache_off_never_the_public_key(
    secret: str | None,
) -> None:
    # The webhook names every consumer's scope; the pool's Secret is an optional reference (the pod
    # must start without it), so a pod that started before the Secret existed has a scope and no key.
    # With the public key its namespace and chunk keys would be computable, and its chunks forgeable,
    # by any pod on the node.
    s = ConnectorSettings(
        payload_key=secret, key_scope="team-a", socket="/run/kvfabric/x/cache.sock", chunk_tokens=32
    )
    assert not s.key.usable
    assert "key_scope" in str(s.key.error)
    assert s.mac_key != layout.PUBLIC_KEY
    assert not s.configured
    assert build_cache(s) is None
    # A hand-written config with neither a key nor a scope keeps the public key (as before).
    assert ConnectorSettings(socket="/run/kvfabric/x/cache.sock", chunk_tokens=32).configured


def test_the_key_file_is_read_once(tmp_path: Path) -> None:
    path = tmp_path / "payload.key"
    key = scope_key(consumer_root(POOL_SECRET), "team-b")
    path.write_text(encode_key(key) + "\n")
    s = ConnectorSettings(payload_key_file=str(path), key_scope="team-b")
    assert s.mac_key == key
    path.write_text(encode_key(bytes(range(32))) + "\n")
    assert s.mac_key == key  # the process keeps the key it started with
    # The file wins over a pool secret given too: it is what the plugin published for this pod.
    both = ConnectorSettings(payload_key="another secret", payload_key_file=str(path), key_scope="team-b")
    assert both.mac_key == bytes(range(32))


class _key_file:  # noqa: N801 - a context manager used like a function
    def __init__(self, text: str) -> None:
        import tempfile

        self._dir = tempfile.TemporaryDirectory()
        self.path = str(Path(self._dir.name) / "payload.key")
        Path(self.path).write_text(text)

    def __enter__(self) -> str:
        return self.path

    def __exit__(self, *exc: object) -> None:
        self._dir.cleanup()
