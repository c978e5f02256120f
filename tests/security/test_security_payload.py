"""Payload authenticity: a chunk that was not sealed with the pool's key never reaches the KV cache.

The MAC is checked by the connector, end to end: the cache server and whoever can reach it are not
trusted with the bytes' integrity.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.client import CacheClient
from kvfabric.connector import keys, layout
from kvfabric.connector.resilient import CircuitBreaker, Endpoint, ResilientCache, transport_factory
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.refengine.engine import Engine
from kvfabric.refengine.model import RefModel
from kvfabric.refengine.testing import TINY, prompt
from kvfabric.testing.serverproc import MiB, cache_server, wait_until

NS, KEY = "1" * 64, "2" * 64
POOL_KEY = ConnectorSettings(payload_key="pool-secret-from-the-operator").mac_key


def sealed(body: bytes, mac_key: bytes = POOL_KEY) -> bytearray:
    payload = bytearray(layout.HEADER_SIZE) + bytearray(body)
    layout.seal(payload, namespace=NS, key=KEY, num_tokens=16, num_layers=2, mac_key=mac_key)
    return payload


def verifies(payload: bytearray, mac_key: bytes = POOL_KEY) -> bool:
    try:
        layout.verify(payload, namespace=NS, key=KEY, num_tokens=16, num_layers=2, mac_key=mac_key)
    except layout.PayloadError:
        return False
    return True


@settings(max_examples=200, deadline=None)
@given(body=st.binary(min_size=1, max_size=4096), data=st.data())
def test_any_change_to_a_sealed_payload_fails(body: bytes, data: st.DataObject) -> None:
    payload = sealed(body)
    assert verifies(payload)
    at = data.draw(st.integers(0, len(payload) - 1))
    flip = data.draw(st.integers(1, 255))
    payload[at] ^= flip
    assert not verifies(payload)


@settings(max_examples=100, deadline=None)
@given(body=st.binary(max_size=4096), other=st.binary(min_size=32, max_size=32))
def test_a_payload_sealed_without_the_pool_key_never_verifies(body: bytes, other: bytes) -> None:
    # The attacker knows the format, the namespace and the key; not the pool's MAC key.
    for forger_key in (layout.PUBLIC_KEY, other):
        if forger_key != POOL_KEY:
            assert not verifies(sealed(body, forger_key))
    # A genuine payload moved to another key or namespace does not verify there either.
    genuine = sealed(body)
    with pytest.raises(layout.PayloadError):
        layout.verify(genuine, namespace=NS, key="3" * 64, num_tokens=16, num_layers=2, mac_key=POOL_KEY)


def test_the_key_is_part_of_the_namespace() -> None:
    # A rotated key starts a fresh key space: old chunks are never looked up (they would shadow new
    # stores, since the server skips a store whose key it already holds).
    assert layout.key_id(layout.PUBLIC_KEY) == ""
    a = layout.key_id(POOL_KEY)
    b = layout.key_id(ConnectorSettings(payload_key="rotated").mac_key)
    assert len({a, b}) == 2
    assert "pool-secret" not in a


@pytest.mark.process
def test_forged_chunks_stored_through_a_real_server_are_recomputed_not_loaded() -> None:
    model = RefModel(TINY)
    pool = ConnectorSettings(
        chunk_tokens=32, lookup_deadline_ms=2000, load_deadline_ms=5000, payload_key="the-pool-key"
    )
    tokens = prompt(100, 7)
    with cache_server(dram_bytes=64 * MiB, tcp=False) as srv:

        def engine(s: ConnectorSettings) -> Engine:
            factory = transport_factory(srv.unix_target, shared_memory=True)
            cache = ResilientCache([Endpoint("srv", factory, CircuitBreaker(3, 60.0))])
            return Engine(TINY, num_blocks=64, settings=s, cache=cache, model=model)

        baseline = Engine(TINY, num_blocks=64, model=model).generate(tokens, 1).first_logits
        warm = engine(pool)
        assert warm.generate(tokens, 1).hit_tokens == 0
        assert warm.worker_conn is not None
        assert warm.worker_conn.wait_for_stores(60)
        ns = warm.worker_conn.namespace
        warm.close()
        chunk_keys = keys.chunk_keys(ns, tokens, 32)
        assert len(chunk_keys) == 3
        # An attacker who can reach the server, knows the prompt (so the keys) and the payload format
        # but not the key replaces every chunk with its own bytes, sealed as well as it can.
        with CacheClient(srv.unix_target) as attacker:
            genuine = attacker.load(ns, chunk_keys, timeout=10)
            assert len(genuine) == 3
            attacker.delete(ns, chunk_keys, timeout=10)
            forged = []
            for key, payload in zip(chunk_keys, genuine, strict=True):
                buf = bytearray(payload)
                buf[layout.HEADER_SIZE :] = os.urandom(len(buf) - layout.HEADER_SIZE)
                layout.seal(buf, namespace=ns, key=key, num_tokens=32, num_layers=TINY.num_layers)
                forged.append(bytes(buf))
            # A deleted key takes no store for the delete margin (engine/ordering.py): wait it out.
            wait_until(
                lambda: attacker.store(ns, chunk_keys, forged, timeout=10).accepted == 3,
                timeout=60,
                what="the forged store after the delete margin",
            )
        victim = engine(pool)
        r = victim.generate(tokens, 1)
        # The lookup finds the keys; every load fails verification and the engine recomputes.
        assert r.fallback_reason == "corrupt"
        assert r.recomputed_after_load_error
        assert (r.first_logits - baseline).abs().max().item() <= 1e-5
        victim.close()
