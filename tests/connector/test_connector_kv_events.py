"""The connector's KV events, read by a model of the routers' reference-counted indexes.

llm-d and Dynamo count every ``BlockStored`` of a (endpoint, tier, hash) and drop the entry only
after as many ``BlockRemoved`` (:mod:`kvfabric.testing.routerindex`). These tests drive the
connector's event log the way the scheduler does and check, through the wire bytes, that what the
router indexes is exactly what kvfabric still holds.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvfabric.connector import vllmevents
from kvfabric.connector.steps import SaveSpec
from kvfabric.rpc import kvevents as kv
from kvfabric.testing.routerindex import RouterIndexModel

BLOCK = 2


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> vllmevents.KVEventLog:
    """An enabled event log whose events are kvfabric's wire records (no vLLM in this environment)."""
    monkeypatch.setattr(vllmevents, "_VLLM", True, raising=False)
    monkeypatch.setattr(vllmevents, "BlockStored", kv.BlockStored)
    monkeypatch.setattr(vllmevents, "BlockRemoved", kv.BlockRemoved)
    return vllmevents.KVEventLog(BLOCK, enabled=True)


def _publish(log: vllmevents.KVEventLog, router: RouterIndexModel) -> None:
    events = log.take()
    if events:
        router.apply_bytes("engine", kv.encode_batch(0.0, events))


def _request(n_blocks: int, tag: str = "h") -> SimpleNamespace:
    return SimpleNamespace(
        block_hashes=[f"{tag}{i}".encode() for i in range(n_blocks)],
        all_token_ids=list(range(n_blocks * BLOCK)),
        lora_request=None,
    )


def test_a_tail_block_then_its_chunk_leave_no_credit_once_both_are_gone(log: vllmevents.KVEventLog) -> None:
    """The tail block's hash was announced twice (alone, then inside its chunk) and withdrawn once."""
    router = RouterIndexModel("llm-d")
    req = _request(4)
    log.stored(req, SaveSpec("r", ["k0"], [[10, 11]], first_blocks=[0]))
    log.stored(req, SaveSpec("r", ["t2"], [[12]], tail=1, first_blocks=[2]))  # chunk 1 not whole yet
    _publish(log, router)
    log.stored(req, SaveSpec("r", ["k1"], [[12, 13]], first_blocks=[2]))  # now it is
    _publish(log, router)
    assert router.entries("engine") == {("cpu", f"h{i}".encode()) for i in range(4)}
    log.found_missing(["k0", "t2", "k1"])
    _publish(log, router)
    assert router.violations.double_stores == 0
    assert router.entries("engine") == set()


def test_keys_the_bounded_bookkeeping_forgets_are_withdrawn(
    log: vllmevents.KVEventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past its bound the log forgets the oldest keys; a router must not keep crediting them forever."""
    monkeypatch.setattr(vllmevents, "_MAX_ANNOUNCED", 2)
    log = vllmevents.KVEventLog(BLOCK, enabled=True)
    router = RouterIndexModel("dynamo")
    for n in range(5):
        log.stored(_request(1, tag=f"p{n}-"), SaveSpec(f"r{n}", [f"k{n}"], [[n]], first_blocks=[0]))
    _publish(log, router)
    # The three oldest are no longer tracked: a later miss could never withdraw them, so they are
    # withdrawn now. What stays credited is what the log can still withdraw.
    assert router.entries("engine") == {("host", b"p3-0"), ("host", b"p4-0")}
    log.found_missing(["k3", "k4"])
    _publish(log, router)
    assert router.entries("engine") == set()
    assert router.violations.total() == 0
