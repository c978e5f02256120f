"""The published index's table registry against a model: who gets a table, what is evicted, what is reclaimed.

Hypothesis drives requests (of described and made-up namespaces), blocks arriving and going, clients
holding and releasing tables, and time; the model is the plain truth of which namespaces hold blocks,
which are described and who holds what. Invariants after every step:

* never more tables than the capacity;
* a namespace that neither holds a block nor was described when it asked never has a table;
* a request for a namespace that holds blocks or was described always gets a table; when all places
  are taken, the table evicted for it is the one asked for least recently, blocks or not (storing
  blocks under made-up names keeps no engine from its table);
* a block arriving evicts only an empty table nobody holds, and is refused a table only when every
  place is taken by a table that lists blocks or is held;
* a table says it lists blocks exactly when its namespace holds blocks;
* after a reclaim, no empty table that nobody holds has been idle for ``idle_seconds``.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfabric.cacheserver.transport.indexregistry import Admit, Decision, TableRegistry

NAMESPACES = [f"ns{i}" for i in range(8)]
CAPACITY = 3
IDLE = 10.0


class RegistryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.reg = TableRegistry(CAPACITY, IDLE)
        self.now = 0.0
        self.blocks: set[str] = set()  # namespaces holding a block (the store's truth, table or not)
        self.described: set[str] = set()
        self.holds: list[str] = []  # one entry per open connection holding that namespace's table
        self.entitled: set[str] = set()  # had blocks, or was described, when it got its table
        self.last_used: dict[str, float] = {}
        self.requested: dict[str, float] = {}  # last request (or making) of each namespace's table

    @initialize()
    def start(self) -> None:
        assert len(self.reg) == 0

    def _drop_evicted(self, evicted: tuple[str, ...]) -> None:
        for ns in evicted:
            # Its holders keep a retired table; their releases no longer count against anything.
            self.holds = [h for h in self.holds if h != ns]

    @rule(ns=st.sampled_from(NAMESPACES))
    def describe(self, ns: str) -> None:
        self.described.add(ns)

    @rule(ns=st.sampled_from(NAMESPACES))
    def forget_description(self, ns: str) -> None:
        self.described.discard(ns)

    @rule(ns=st.sampled_from(NAMESPACES), hold=st.booleans())
    def request(self, ns: str, hold: bool) -> None:
        had = ns in self.reg
        before = {n: self.requested[n] for n in self.reg.namespaces()}
        d = self.reg.request(ns, known=ns in self.described, populated=ns in self.blocks, now=self.now)
        if had:
            assert d.admit is Admit.SERVE
            assert d.evicted == ()
        elif ns not in self.described and ns not in self.blocks:
            assert d.admit is Admit.UNKNOWN
        else:
            assert d.admit is Admit.CREATE, "a described namespace, or one with blocks, always gets a table"
            if len(before) == CAPACITY:
                assert len(d.evicted) == 1
                assert before[d.evicted[0]] == min(before.values()), "not the least recently asked for"
            else:
                assert d.evicted == ()
        self._drop_evicted(d.evicted)
        for gone in d.evicted:
            assert self.reg.holders(gone) == 0
        if d.admit is Admit.CREATE:
            self.entitled.add(ns)
        if d.admit in (Admit.SERVE, Admit.CREATE):
            assert ns in self.reg
            self.last_used[ns] = self.now
            self.requested[ns] = self.now
            if hold:
                self.reg.hold(ns)
                self.holds.append(ns)

    @rule(ns=st.sampled_from(NAMESPACES))
    def block_arrives(self, ns: str) -> None:
        had = ns in self.reg
        unused_empty = [
            n for n in self.reg.namespaces() if not self.reg.populated(n) and not self.reg.holders(n)
        ]
        d = self.reg.block_added(ns, now=self.now)
        self.blocks.add(ns)
        for gone in d.evicted:
            assert gone in unused_empty, f"a block arriving evicted {gone}, which is held or lists blocks"
        self._drop_evicted(d.evicted)
        if d.admit is Admit.FULL:
            assert not had
            assert len(self.reg) == CAPACITY
            assert not unused_empty, "room could have been made in an unused empty table"
        else:
            if d.admit is Admit.CREATE:
                self.entitled.add(ns)
                self.last_used[ns] = self.now
                self.requested[ns] = self.now
            assert self.reg.populated(ns)

    @precondition(lambda self: bool(self.blocks))
    @rule(data=st.data())
    def blocks_gone(self, data: st.DataObject) -> None:
        ns = data.draw(st.sampled_from(sorted(self.blocks)))
        self.blocks.discard(ns)
        self.reg.emptied(ns, now=self.now)
        self.last_used[ns] = self.now

    @precondition(lambda self: bool(self.holds))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.holds) - 1))
        ns = self.holds.pop(i)
        self.reg.release(ns, now=self.now)
        self.last_used[ns] = self.now

    @rule(dt=st.sampled_from([0.5, 3.0, IDLE, 2 * IDLE]))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    @rule()
    def reclaim(self) -> None:
        gone = self.reg.reclaim(self.now)
        for ns in gone:
            assert ns not in self.blocks
            assert ns not in self.holds
            assert self.now - self.last_used[ns] >= IDLE
        for ns in self.reg.namespaces():
            reclaimable = (
                ns not in self.blocks and ns not in self.holds and self.now - self.last_used[ns] >= IDLE
            )
            assert not reclaimable, f"{ns} is empty, unheld and idle, and was kept"

    @invariant()
    def bounded(self) -> None:
        assert len(self.reg) <= CAPACITY

    @invariant()
    def only_known_namespaces_have_tables(self) -> None:
        for ns in self.reg.namespaces():
            assert ns in self.entitled

    @invariant()
    def populated_means_blocks(self) -> None:
        for ns in self.reg.namespaces():
            assert self.reg.populated(ns) == (ns in self.blocks)
            assert self.reg.requested(ns) == self.requested[ns]

    @invariant()
    def holders_match(self) -> None:
        for ns in NAMESPACES:
            assert self.reg.holders(ns) == self.holds.count(ns)


TestRegistry = RegistryMachine.TestCase
TestRegistry.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


def test_reclaim_drops_exactly_the_empty_unheld_idle_tables() -> None:
    reg = TableRegistry(4, IDLE)
    for ns in ("a", "b", "c"):
        assert reg.request(ns, known=True, now=0.0).admit is Admit.CREATE
    assert reg.block_added("d", now=0.0).admit is Admit.CREATE
    reg.hold("b")
    assert reg.reclaim(IDLE - 0.1) == []
    reg.request("c", known=True, now=5.0)  # used again: idle from now on
    assert reg.reclaim(IDLE) == ["a"]
    assert reg.reclaim(5.0 + IDLE) == ["c"]
    reg.release("b", now=20.0)
    assert reg.reclaim(20.0 + IDLE) == ["b"]
    assert reg.namespaces() == ["d"]  # it lists blocks: never reclaimed
    assert reg.reclaim(1e9) == []


def test_tables_listing_blocks_nobody_asks_for_give_way_to_an_asked_for_namespace() -> None:
    reg = TableRegistry(3, IDLE)
    for i, ns in enumerate(("x", "y", "z")):  # blocks stored under made-up names: every place taken
        assert reg.block_added(ns, now=float(i)).admit is Admit.CREATE
    assert reg.block_added("w", now=5.0).admit is Admit.FULL  # a store evicts nothing that lists blocks
    assert reg.request("y", known=False, now=6.0).admit is Admit.SERVE  # asked for: ranks as used
    d = reg.request("engine", known=True, now=7.0)
    assert d == Decision(Admit.CREATE, ("x",))  # the least recently asked for, though it lists blocks
    d = reg.request("w", known=False, populated=True, now=8.0)  # blocks but no table: made again
    assert d == Decision(Admit.CREATE, ("z",))
    assert reg.populated("w")
    assert reg.namespaces() == ["engine", "w", "y"]
