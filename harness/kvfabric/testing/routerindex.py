"""A MODEL of how llm-d's and Dynamo's routers index KV events (written from their documented code).

Not their code: a Python model of the semantics kvfabric's events must satisfy, written from
llm-d-router's ``pkg/kvevents`` (``pool.go``, ``event_dedup_filter.go``, ``engineadapter``) and
Dynamo's ``zmq_wire`` parser and ``RefcountDedup`` as described in their sources:

* an entry is (endpoint, tier, block hash); every ``BlockStored`` adds one reference, duplicates
  included, and a ``BlockRemoved`` drops the entry only when its count returns to 0;
* ``BlockRemoved`` touches the named tier only; ``AllBlocksCleared`` clears every tier of the endpoint;
* tiers: llm-d files the lower-cased medium (empty means ``gpu``); Dynamo maps ``GPU``/absent to
  device, ``CPU`` to host, ``STORAGE`` with locality ``LOCAL`` to disk, and drops anything else
  (non-local storage, unknown media);
* tokenless stores are useless to both (Dynamo hashes tokens itself; llm-d needs them after any
  restart); llm-d drops a store whose parent it has never seen (engine key -> request key map).

The model counts what a real router would silently tolerate but kvfabric promises never to send:
a second store of a counted entry, a removal of an entry not held, a tokenless store, an orphan
parent, an ``AllBlocksCleared``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvfabric.rpc.kvevents import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event, decode_batch

__all__ = ["RouterIndexModel", "Violations", "dynamo_tier", "llmd_tier"]


def llmd_tier(medium: str | None, locality: str | None) -> str | None:
    """llm-d's tier name for an event's medium (locality is not read)."""
    del locality
    return (medium or "gpu").lower()


def dynamo_tier(medium: str | None, locality: str | None) -> str | None:
    """Dynamo's tier for an event's medium, or None where Dynamo drops the event."""
    if medium in (None, "GPU"):
        return "device"
    if medium in ("CPU", "CPU_PINNED", "CPU_TIER1"):
        return "host"
    if medium == "STORAGE" and locality == "LOCAL":
        return "disk"
    return None


@dataclass
class Violations:
    """What kvfabric promises never to send (each a count)."""

    double_stores: int = 0
    removals_of_unheld: int = 0
    tokenless: int = 0
    orphan_parents: int = 0
    clears: int = 0
    bad_token_counts: int = 0

    def total(self) -> int:
        """Every violation, summed."""
        return sum(vars(self).values())


@dataclass
class RouterIndexModel:
    """One router's reference-counted index over any number of endpoints."""

    tier_of: str = "llm-d"
    counts: Counter[tuple[str, str, BlockHash]] = field(default_factory=Counter)
    seen: set[tuple[str, BlockHash]] = field(default_factory=set)
    violations: Violations = field(default_factory=Violations)

    def _tier(self, medium: str | None, locality: str | None) -> str | None:
        return (llmd_tier if self.tier_of == "llm-d" else dynamo_tier)(medium, locality)

    def apply_bytes(self, endpoint: str, payload: bytes) -> None:
        """Apply one batch's msgpack bytes (the publisher's third frame)."""
        _, events, _ = decode_batch(payload)
        self.apply(endpoint, events)

    def apply(self, endpoint: str, events: Iterable[Event]) -> None:
        """Apply decoded events of ``endpoint`` in order."""
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.violations.clears += 1
                for entry in [e for e in self.counts if e[0] == endpoint]:
                    del self.counts[entry]
            elif isinstance(event, BlockStored):
                self._stored(endpoint, event)
            elif isinstance(event, BlockRemoved):
                tier = self._tier(event.medium, event.locality)
                for h in event.block_hashes:
                    entry = (endpoint, tier or "", h)
                    if tier is None or self.counts[entry] == 0:
                        self.violations.removals_of_unheld += tier is not None
                        self.counts.pop(entry, None)
                        continue
                    self.counts[entry] -= 1
                    if self.counts[entry] == 0:
                        del self.counts[entry]

    def _stored(self, endpoint: str, event: BlockStored) -> None:
        if not event.token_ids:
            self.violations.tokenless += 1
            return
        if len(event.token_ids) != len(event.block_hashes) * event.block_size:
            self.violations.bad_token_counts += 1
        if event.parent_block_hash is not None and (endpoint, event.parent_block_hash) not in self.seen:
            self.violations.orphan_parents += 1  # llm-d drops the whole event
            return
        tier = self._tier(event.medium, event.locality)
        for h in event.block_hashes:
            self.seen.add((endpoint, h))
            if tier is None:
                continue
            if self.counts[(endpoint, tier, h)]:
                self.violations.double_stores += 1
            self.counts[(endpoint, tier, h)] += 1

    def entries(self, endpoint: str) -> set[tuple[str, BlockHash]]:
        """The (tier, hash) entries credited to ``endpoint``."""
        return {(t, h) for (e, t, h) in self.counts if e == endpoint}
