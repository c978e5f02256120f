"""The published index table's layout: a model-based test of writer and reader, and a concurrent reader.

The invariant (``kvfabric.rpc.indextable``): a reader finds every key present at the time of its
read (no false negatives), reports no key that is absent (no false positives, fingerprints being
distinct here), and returns either a consistent snapshot or ``Inconsistent``.
"""

from __future__ import annotations

import threading

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfabric.rpc import indextable as it


def _table(capacity: int) -> memoryview:
    return memoryview(bytearray(it.table_bytes(capacity))).cast("Q")


def _fresh(capacity: int) -> tuple[memoryview, it.TableWriter]:
    words = _table(capacity)
    it.init_table(words, capacity, epoch=7, now_ns=1)
    return words, it.TableWriter(words)


# Fingerprints crowded onto a few home slots of a small table, so probe runs wrap around the end of
# the table and deletions have to shift members back: the cases linear probing gets wrong.
_HOMES = [0, 1, 14, 15]
POOL = [((i * 0x9E3779B97F4A7C15) & ~0x3F & 0xFFFFFFFFFFFFFFFF) | (_HOMES[i % 4] << 2) for i in range(24)]


class TableMachine(RuleBasedStateMachine):
    """Writer operations against a dict model; the reader must agree with the model after each."""

    def __init__(self) -> None:
        super().__init__()
        self.words, self.writer = _fresh(16)
        self.model: dict[int, int] = {}

    def _grow(self) -> None:
        old = self.writer
        words, writer = _fresh(old.capacity * 2)
        writer.load(old.items())
        old.retire()
        assert it.header(self.words)["state"] == it.RETIRED
        self.words, self.writer = words, writer

    @rule(fp=st.sampled_from(POOL), tier=st.sampled_from([1, 2, 3]))
    def put(self, fp: int, tier: int) -> None:
        if fp not in self.model and self.writer.needs_growth():
            self._grow()
        self.writer.set(fp, tier)
        self.model[fp] = tier

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        fp = data.draw(st.sampled_from(sorted(self.model)))
        self.writer.set(fp, 0)
        del self.model[fp]

    @rule(fp=st.sampled_from(POOL))
    def remove_absent_is_a_no_op(self, fp: int) -> None:
        if fp not in self.model:
            self.writer.set(fp, 0)

    @invariant()
    def reader_agrees_with_model(self) -> None:
        assert self.writer.count == len(self.model)
        assert it.header(self.words)["seq"] % 2 == 0
        for fp in POOL:
            got = it.lookup_prefix(self.words, [fp])
            assert got == ([self.model[fp]] if fp in self.model else []), hex(fp)
            assert self.writer.get(fp) == self.model.get(fp, 0)
        # A prefix stops at the first absent key (when every key of the pool is present, there is
        # none to stop at: the probe is the present keys once).
        present = [fp for fp in POOL if fp in self.model]
        absent = [fp for fp in POOL if fp not in self.model]
        probe = present + absent[:1] + present if absent else present
        assert it.lookup_prefix(self.words, probe) == [self.model[fp] for fp in present]
        assert it.MAX_FILL * self.writer.count <= self.writer.capacity


TestTableMachine = TableMachine.TestCase
TestTableMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_fingerprints_of_keys_match_the_writers_form() -> None:
    keys = [f"{i:02x}" * 32 for i in range(0, 256, 17)]
    assert it.fingerprints(keys) == [it.fingerprint(k) for k in keys]
    assert it.fingerprints([]) == []


def test_a_reader_during_writes_never_misses_a_resident_key_nor_invents_one() -> None:
    """Permanent keys are always found, never-written keys never, while a writer churns others."""
    words, writer = _fresh(2048)
    permanent = [(i * 0x9E3779B97F4A7C15 + 12345) & 0xFFFFFFFFFFFFFFFC for i in range(64)]
    churn = [(i * 0xC2B2AE3D27D4EB4F + 99) & 0xFFFFFFFFFFFFFFFC for i in range(200)]
    never = [(i * 0x165667B19E3779F9 + 7) & 0xFFFFFFFFFFFFFFFC for i in range(64)]
    for fp in permanent:
        writer.set(fp, 1)
    stop = threading.Event()

    def write() -> None:
        n = 0
        while not stop.is_set():
            fp = churn[n % len(churn)]
            writer.set(fp, 0 if writer.get(fp) else 1 + n % 3)
            n += 1

    th = threading.Thread(target=write)
    th.start()
    answers = retries = 0
    try:
        while answers < 3000:
            try:
                assert it.lookup_prefix(words, permanent) == [1] * len(permanent)
                assert it.lookup_prefix(words, never[answers % 64 : answers % 64 + 1]) == []
                answers += 1
            except it.Inconsistent:
                retries += 1
    finally:
        stop.set()
        th.join()
    assert answers == 3000


def test_init_rejects_bad_capacity() -> None:
    import pytest

    with pytest.raises(ValueError, match="power of two"):
        it.init_table(_table(12), 12, epoch=0, now_ns=0)
    words = _table(8)
    it.init_table(words, 8, epoch=0, now_ns=0)
    w = it.TableWriter(words)
    w.set(4, 1)
    w.set(8, 1)
    with pytest.raises(OverflowError, match="quarter full"):
        w.set(12, 1)
