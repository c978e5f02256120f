"""The published index's table registry against a model: who gets a table, what is evicted, what is reclaimed.

Hypothesis drives requests (of described and made-up namespaces), blocks arriving and going, clients
holding and releasing tables, and time; the model is the plain truth of which namespaces hold blocks,
which are described and who holds what. Invariants after every step:

* never more tables than the capacity;
* a namespace that neither holds a block nor was described when it asked never has a table;
* a table that lists blocks is never evicted, and a namespace whose blocks arrive gets a table
  whenever fewer than ``capacity`` tables list blocks;
* after a reclaim, no empty table that nobody holds has been idle for ``idle_seconds``.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfabric.cacheserver.transport.indexregistry import Admit, TableRegistry

NAMESPACES = [f"ns{i}" for i in range(8)]
CAPACITY = 3
IDLE = 10.0


class RegistryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.reg = TableRegistry(CAPACITY, IDLE)
        self.now = 0.0
        self.blocks: set[str] = set()  # namespaces whose table lists a block (the store's truth)
        self.described: set[str] = set()
        self.holds: list[str] = []  # one entry per open connection holding that namespace's table
        self.entitled: set[str] = set()  # had blocks, or was described, when it got its table
        self.last_used: dict[str, float] = {}

    @initialize()
    def start(self) -> None:
        assert len(self.reg) == 0

    def _drop_evicted(self, evicted: tuple[str, ...]) -> None:
        for ns in evicted:
            assert ns not in self.blocks, f"{ns} lists blocks and was evicted"
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
        d = self.reg.request(ns, known=ns in self.described, now=self.now)
        if had:
            assert d.admit is Admit.SERVE
        elif ns not in self.described:
            assert d.admit is Admit.UNKNOWN
        else:
            assert d.admit in (Admit.CREATE, Admit.FULL)
            unheld_empty = [
                n for n in self.reg.namespaces() if not self.reg.populated(n) and not self.reg.holders(n)
            ]
            if d.admit is Admit.FULL:
                assert len(self.reg) == CAPACITY
                assert not unheld_empty
        self._drop_evicted(d.evicted)
        for gone in d.evicted:
            assert self.reg.holders(gone) == 0
        if d.admit is Admit.CREATE:
            self.entitled.add(ns)
        if d.admit in (Admit.SERVE, Admit.CREATE):
            assert ns in self.reg
            self.last_used[ns] = self.now
            if hold:
                self.reg.hold(ns)
                self.holds.append(ns)

    @rule(ns=st.sampled_from(NAMESPACES))
    def block_arrives(self, ns: str) -> None:
        populated_before = sum(self.reg.populated(n) for n in self.reg.namespaces())
        d = self.reg.block_added(ns, now=self.now)
        self._drop_evicted(d.evicted)
        if d.admit is Admit.FULL:
            assert populated_before == CAPACITY, "room could have been made for a namespace with blocks"
        else:
            self.blocks.add(ns)
            self.entitled.add(ns)
            self.last_used[ns] = self.now
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
    def blocks_keep_their_tables(self) -> None:
        for ns in self.blocks:
            assert ns in self.reg
            assert self.reg.populated(ns)

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
