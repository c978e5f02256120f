"""Residency changes to KV events: every (endpoint, tier, hash) stored once and removed once.

A hypothesis state machine plays a cache server's residency (stores of chunks and tail blocks,
write-back to the lower tiers, promotions, evictions, TTL expiry, deletes, restarts that lose DRAM)
into an :class:`~kvfabric.rpc.kvledger.EventLedger`, sends every batch through the wire encoder and
decodes it into the reference-counting models of llm-d's and Dynamo's indexes
(:mod:`kvfabric.testing.routerindex`). At every step both indexes equal the residency, and no
event is one kvfabric promises never to send.
"""

from __future__ import annotations

import time
from collections.abc import Hashable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvfabric.rpc.kvevents import (
    BlockRemoved,
    BlockStored,
    encode_batch,
    msgpack_decode,
    msgpack_encode,
    scope_of_tier,
)
from kvfabric.rpc.kvledger import MAX_GROUPS, ChunkMeta, EventLedger, GroupTag
from kvfabric.rpc.residency import decode_meta, encode_meta, meta_head
from kvfabric.testing.routerindex import RouterIndexModel

BLOCK = 2  # tokens per engine block
CHUNK = 2  # blocks per chunk
PROMPTS = 3
BLOCKS = 6  # per prompt; the first chunk is shared by every prompt
TIERS = ("dram", "local_disk", "shared", "object")
LLMD = {"CPU": "cpu", "STORAGE": "storage"}
DYNAMO = {"CPU": "host", "STORAGE": "disk"}


def _owner(prompt: int, block: int) -> int:
    return 0 if block < CHUNK else prompt


def _hash(prompt: int, block: int) -> bytes | int:
    owner = _owner(prompt, block)
    return f"{owner}:{block}".encode() if owner % 2 == 0 else owner * 1000 + block  # both hash forms


def _tokens(prompt: int, first: int, end: int) -> tuple[int, ...]:
    return tuple(_owner(prompt, b) * 100 + b * BLOCK + i for b in range(first, end) for i in range(BLOCK))


def chunk(prompt: int, index: int) -> tuple[Hashable, ChunkMeta]:
    """The key and metadata of chunk ``index`` of ``prompt``."""
    first = index * CHUNK
    return ("c", _owner(prompt, first), index), _meta(prompt, first, first + CHUNK)


def tail(prompt: int, block: int) -> tuple[Hashable, ChunkMeta]:
    """The key and metadata of the tail block ``block`` of ``prompt``."""
    return ("t", _owner(prompt, block), block), _meta(prompt, block, block + 1)


def _meta(prompt: int, first: int, end: int) -> ChunkMeta:
    salt = ("salt",) if first == 0 else None
    return ChunkMeta(
        block_hashes=tuple(_hash(prompt, b) for b in range(first, end)),
        parent_block_hash=_hash(prompt, first - 1) if first else None,
        token_ids=_tokens(prompt, first, end),
        block_size=BLOCK,
        extra_keys=tuple(salt if b == 0 else None for b in range(first, end)),
    )


class Residency(RuleBasedStateMachine):
    """A cache server's residency, the ledger it feeds, and two routers' indexes of the wire."""

    max_keys = 10_000

    def __init__(self) -> None:
        super().__init__()
        self.resident: dict[Hashable, set[str]] = {}
        self.meta: dict[Hashable, ChunkMeta] = {}
        self.ever: set[Hashable] = set()
        self.ledger = EventLedger(max_keys=self.max_keys)
        self.llmd = RouterIndexModel("llm-d")
        self.dynamo = RouterIndexModel("dynamo")

    def _store(self, key: Hashable, meta: ChunkMeta, tier: str = "dram") -> None:
        self.meta[key] = meta
        self.ever.add(key)
        tiers = self.resident.setdefault(key, set())
        if tier not in tiers:
            tiers.add(tier)
            self.ledger.stored(key, tier, meta)

    def _leave(self, key: Hashable, tier: str) -> None:
        tiers = self.resident.get(key, set())
        if tier in tiers:
            tiers.discard(tier)
            self.ledger.removed(key, tier)
            if not tiers:
                del self.resident[key]

    def _pick(self, n: int) -> Hashable | None:
        keys = sorted(self.resident, key=repr)
        return keys[n % len(keys)] if keys else None

    # An engine stores a prefix in order: a chunk after the chunk before it, a tail block after the
    # block before it (so every parent was announced on this endpoint before its child).
    @rule(prompt=st.integers(0, PROMPTS - 1), index=st.integers(0, BLOCKS // CHUNK - 1))
    def store_chunk(self, prompt: int, index: int) -> None:
        if index and chunk(prompt, index - 1)[0] not in self.ever:
            return
        self._store(*chunk(prompt, index))

    @rule(prompt=st.integers(0, PROMPTS - 1), block=st.integers(0, BLOCKS - 1))
    def store_tail(self, prompt: int, block: int) -> None:
        start = block - block % CHUNK
        if start and chunk(prompt, start // CHUNK - 1)[0] not in self.ever:
            return
        if block > start and tail(prompt, block - 1)[0] not in self.ever:
            return
        self._store(*tail(prompt, block))

    @rule(n=st.integers(0, 1000), tier=st.sampled_from(TIERS[1:]))
    def write_back(self, n: int, tier: str) -> None:
        key = self._pick(n)
        if key is not None and "dram" in self.resident[key]:
            self._store(key, self.meta[key], tier)

    @rule(n=st.integers(0, 1000))
    def promote(self, n: int) -> None:
        key = self._pick(n)
        if key is not None:
            self._store(key, self.meta[key], "dram")

    @rule(n=st.integers(0, 1000), tier=st.sampled_from(TIERS))
    def evict(self, n: int, tier: str) -> None:
        key = self._pick(n)
        if key is not None:
            self._leave(key, tier)

    @rule(n=st.integers(0, 1000))
    def expire_everywhere(self, n: int) -> None:
        """TTL expiry: the key leaves each tier, one change per tier."""
        key = self._pick(n)
        if key is not None:
            for tier in sorted(self.resident[key]):
                self._leave(key, tier)

    @rule(n=st.integers(0, 1000))
    def delete(self, n: int) -> None:
        """A delete: gone from every tier at once."""
        key = self._pick(n)
        if key is not None:
            del self.resident[key]
            self.ledger.forget(key)

    @rule()
    def restart(self) -> None:
        """The cache server restarts: DRAM is lost, the disk tiers survive."""
        for key in list(self.resident):
            self.resident[key].discard("dram")
            if not self.resident[key]:
                del self.resident[key]
        self.ledger.cleared("dram")

    @rule()
    def publish(self) -> None:
        events = self.ledger.take()
        if events:
            payload = encode_batch(time.time(), events)
            self.llmd.apply_bytes("engine-a", payload)
            self.dynamo.apply_bytes("engine-a", payload)

    def expected(
        self, names: dict[str, str], tracked: set[tuple[Hashable, str]] | None = None
    ) -> set[tuple[str, bytes | int]]:
        out = set()
        for key, tiers in self.resident.items():
            for tier in tiers:
                if tracked is not None and (key, tier) not in tracked:
                    continue
                scope = scope_of_tier(tier)
                if scope is not None:
                    out |= {(names[scope.medium], h) for h in self.meta[key].block_hashes}
        return out

    @invariant()
    def routers_index_the_residency(self) -> None:
        self.publish()
        assert self.llmd.violations.total() == 0, self.llmd.violations
        assert self.dynamo.violations.total() == 0, self.dynamo.violations
        tracked = {(k, tier) for tier in TIERS for k in self.ledger.keys_in(tier)}
        if self.max_keys >= 10_000:
            assert self.llmd.entries("engine-a") == self.expected(LLMD)
            assert self.dynamo.entries("engine-a") == self.expected(DYNAMO)
        else:  # what the bounded ledger forgot is withdrawn, never left credited
            assert self.expected(LLMD, tracked) <= self.llmd.entries("engine-a") <= self.expected(LLMD)
            assert self.expected(DYNAMO, tracked) <= self.dynamo.entries("engine-a") <= self.expected(DYNAMO)
            assert len(self.ledger) <= self.max_keys
        # announced() is one lookup; it must agree with what is credited in any medium and group.
        credited = {h for _, h in self.ledger.credited()}
        for meta in self.meta.values():
            for h in meta.block_hashes:
                assert self.ledger.announced(h) == (h in credited)


class BoundedResidency(Residency):
    """The same with a ledger that can track only a few keys."""

    max_keys = 3


TestResidency = Residency.TestCase
TestResidency.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBoundedResidency = BoundedResidency.TestCase
TestBoundedResidency.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_a_chunk_over_announced_tail_blocks_announces_only_its_new_blocks() -> None:
    ledger = EventLedger()
    t_key, t_meta = tail(1, 2)
    c_key, c_meta = chunk(1, 1)
    ledger.stored(t_key, "dram", t_meta)
    ledger.stored(c_key, "dram", c_meta)
    first, second = ledger.take()
    assert isinstance(first, BlockStored)
    assert isinstance(second, BlockStored)
    assert first.block_hashes == (_hash(1, 2),)
    assert second.block_hashes == (_hash(1, 3),)
    assert second.parent_block_hash == _hash(1, 2)
    assert second.token_ids == _tokens(1, 3, 4)
    ledger.removed(t_key, "dram")
    assert ledger.take() == []  # the chunk still holds the block
    ledger.removed(c_key, "dram")
    assert ledger.take() == [BlockRemoved((_hash(1, 2), _hash(1, 3)), "CPU")]


def test_local_disk_is_storage_local_and_the_shared_tiers_are_not_announced() -> None:
    ledger = EventLedger()
    key, meta = chunk(0, 0)
    for tier in TIERS:
        ledger.stored(key, tier, meta)
    events = ledger.take()
    assert [(e.medium, e.locality) for e in events if isinstance(e, BlockStored)] == [
        ("CPU", None),
        ("STORAGE", "LOCAL"),
    ]
    assert isinstance(events[0], BlockStored)
    assert events[0].extra_keys == (("salt",), None)


def test_metadata_that_does_not_cover_its_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="token_ids"):
        ChunkMeta(block_hashes=(1, 2), parent_block_hash=None, token_ids=(1, 2, 3), block_size=2)
    with pytest.raises(ValueError, match="extra_keys"):
        ChunkMeta(block_hashes=(1,), parent_block_hash=None, token_ids=(1, 2), block_size=2, extra_keys=())


# ----------------------------------------------------------------------- hybrid models: one per group

FULL = GroupTag(1, "full_attention", None)
SWA = GroupTag(0, "sliding_window", 200)
SWA_B = GroupTag(2, "sliding_window", 200)  # a second group of the same kind (Gemma 3 27B has five)


def _grouped(first: int, end: int, *groups: GroupTag) -> ChunkMeta:
    return ChunkMeta(
        block_hashes=tuple(_hash(1, b) for b in range(first, end)),
        parent_block_hash=_hash(1, first - 1) if first else None,
        token_ids=_tokens(1, first, end),
        block_size=BLOCK,
        groups=groups,
    )


def test_a_hybrid_object_is_announced_once_per_group_with_vllms_group_fields() -> None:
    """vLLM announces each group's copy of a block on its own, with the group's kind and window."""
    ledger = EventLedger()
    ledger.stored("full", "dram", _grouped(0, 4, FULL))
    ledger.stored("window", "dram", _grouped(2, 4, SWA, SWA_B))  # only the blocks it holds
    taken = ledger.take()
    events = [e for e in taken if isinstance(e, BlockStored)]
    assert len(events) == len(taken)
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in events] == [
        (1, "full_attention", None),
        (0, "sliding_window", 200),
        (2, "sliding_window", 200),
    ]
    window = events[1]
    assert window.block_hashes == (_hash(1, 2), _hash(1, 3))
    assert window.parent_block_hash == _hash(1, 1)
    assert window.token_ids == _tokens(1, 2, 4)
    assert ledger.credited_groups() == {
        *((scope_of_tier("dram"), 1, _hash(1, b)) for b in range(4)),
        *((scope_of_tier("dram"), g, _hash(1, b)) for g in (0, 2) for b in (2, 3)),
    }
    # The window object leaves: each of its groups is withdrawn on its own, the full group stays.
    ledger.removed("window", "dram")
    assert ledger.take() == [
        BlockRemoved((_hash(1, 2), _hash(1, 3)), "CPU", group_idx=0),
        BlockRemoved((_hash(1, 2), _hash(1, 3)), "CPU", group_idx=2),
    ]
    ledger.cleared("dram")
    assert ledger.take() == [BlockRemoved(tuple(_hash(1, b) for b in range(4)), "CPU", group_idx=1)]
    assert ledger.credited_groups() == set()


def test_the_same_blocks_in_one_group_are_counted_across_keys() -> None:
    """A tail object then its chunk's object, both of the window group: one store, one removal."""
    ledger = EventLedger()
    ledger.stored("tail", "dram", _grouped(3, 4, SWA))
    ledger.stored("chunk", "dram", _grouped(2, 4, SWA))
    first, second = ledger.take()
    assert isinstance(first, BlockStored)
    assert isinstance(second, BlockStored)
    assert (first.block_hashes, second.block_hashes) == ((_hash(1, 3),), (_hash(1, 2),))
    assert second.group_idx == 0
    ledger.forget("tail")
    assert ledger.take() == []
    ledger.forget("chunk")
    assert ledger.take() == [BlockRemoved((_hash(1, 2), _hash(1, 3)), "CPU", group_idx=0)]


def test_group_tags_are_validated_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"groups\.group_idx"):
        GroupTag(-1)
    with pytest.raises(ValueError, match=r"groups\.group_idx"):
        GroupTag(True)  # a bool is an int to Python, not a group index
    with pytest.raises(ValueError, match=r"groups\.group_idx"):
        GroupTag(MAX_GROUPS)
    with pytest.raises(ValueError, match=r"groups\.kind"):
        GroupTag(0, "x" * 65)
    with pytest.raises(ValueError, match=r"groups\.kind"):
        GroupTag(0, "Full Attention")
    for window in (0, -1, True, 1 << 31):
        with pytest.raises(ValueError, match=r"groups\.sliding_window"):
            GroupTag(0, "sliding_window", window)
    with pytest.raises(ValueError, match=r"groups\.sliding_window"):
        GroupTag(0, "sliding_window", "200")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="groups: each KV cache group at most once"):
        _grouped(0, 1, SWA, SWA)


def test_the_residency_wire_carries_groups_and_keeps_the_seven_field_form_without() -> None:
    """The feed relays a hybrid object's groups to sibling engines; a plain chunk's bytes are unchanged."""
    plain = _grouped(0, 2)
    assert len(msgpack_decode(encode_meta(plain))) == 7  # what every server release reads
    hybrid = _grouped(2, 4, SWA, SWA_B)
    raw = encode_meta(hybrid)
    assert msgpack_decode(raw)[7] == [[0, "sliding_window", 200], [2, "sliding_window", 200]]
    assert decode_meta(raw) == hybrid
    assert decode_meta(encode_meta(plain)) == plain
    assert meta_head(raw) == (hybrid.block_hashes, hybrid.parent_block_hash)
    bad = msgpack_decode(raw)
    bad[7] = [[0, "sliding_window"]]
    with pytest.raises(ValueError, match=r"meta\.groups"):
        decode_meta(msgpack_encode(bad))
    bad[7] = [[-3, None, None]]
    with pytest.raises(ValueError, match=r"groups\.group_idx"):
        decode_meta(msgpack_encode(bad))


def _wire_groups(groups: list[list[object]]) -> bytes:
    """A one-block chunk's metadata carrying ``groups`` as sent (unvalidated)."""
    return msgpack_encode([[1], None, bytes(8), 2, None, None, None, groups])


def test_the_residency_wire_refuses_groups_no_vllm_model_has_naming_meta_groups() -> None:
    """One forged message naming thousands of groups would be relayed by every engine on the node,
    one event per group: the decoder (the server's and every connector's) refuses it."""
    assert (
        len(decode_meta(_wire_groups([[g, "full_attention", None] for g in range(MAX_GROUPS)])).groups) == 64
    )
    bad: dict[str, list[list[object]]] = {
        "too many": [[g, "full_attention", None] for g in range(8000)],
        "empty": [],
        "bool index": [[True, "full_attention", None]],
        "huge index": [[1 << 40, None, None]],
        "long kind": [[0, "k" * 4096, None]],
        "kind type": [[0, 7, None]],
        "window": [[0, "sliding_window", 0]],
        "window bool": [[0, "sliding_window", True]],
        "duplicate": [[0, None, None], [0, None, None]],
        "entry shape": [[0, None]],
    }
    for what, groups in bad.items():
        with pytest.raises(ValueError, match=r"^meta\.groups") as err:
            decode_meta(_wire_groups(groups))
        assert len(str(err.value)) < 200, what  # the error never echoes a huge value
