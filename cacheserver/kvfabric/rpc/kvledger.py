"""From residency changes to KV events: every (tier, block hash) announced once and withdrawn once.

llm-d's KV-event pool and Dynamo's ``RefcountDedup`` count every ``BlockStored`` of a hash per
(endpoint, tier) and drop the entry only when as many ``BlockRemoved`` have arrived. A chunk and
the tail blocks stored before it was whole share block hashes, so announcing each key's blocks as
they come would count a hash twice and leave it in the router's index forever after its one
withdrawal. The ledger therefore counts, per announced medium (:class:`~kvfabric.rpc.kvevents.Scope`),
how many resident keys hold each hash, announces a hash when the count leaves 0 and withdraws it
when the count returns to 0. What reaches the wire is then a set, not a multiset: one store, one
later removal.

A chunk whose blocks are partly announced already is announced as the runs of its new blocks, each
with the hash of the block before it as its parent (announced earlier, by this ledger or by vLLM's
own GPU events), so parents always precede children. The ledger never sends ``AllBlocksCleared``:
an engine's identity also carries its GPU entries, which a clear would wipe.

Bounded: past ``max_keys`` tracked keys the oldest is withdrawn (its blocks are removed from every
medium no other key holds them in), so forgetting never leaves credit behind.

Hybrid models (several KV cache groups): a key's metadata names the groups its blocks belong to
(:class:`GroupTag`, one per vLLM KV cache group of the stored object), and every count, store and
removal is per (medium, group, hash), one event per group with the group fields vLLM's own KV cache
manager fills (``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``), as vLLM
announces each group's copy of a block. Metadata without groups (one full-attention group) leaves
the fields unset, as before.

Pure bookkeeping: no I/O, no clock, no vLLM.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from kvfabric.rpc.kvevents import BlockHash, BlockRemoved, BlockStored, Event, Scope, scope_of_tier

__all__ = ["MAX_GROUPS", "MAX_SLIDING_WINDOW", "ChunkMeta", "EventLedger", "GroupTag"]

DEFAULT_MAX_KEYS = 200_000
MAX_GROUPS = 64
"""The most KV cache groups one chunk's metadata names, and the bound on a group index: vLLM models
have a handful (one per attention kind, a few more for hybrid layer patterns). Every group is one
event per announcement, so metadata naming thousands would multiply every engine's events."""
MAX_SLIDING_WINDOW = (1 << 31) - 1  # tokens: vLLM's windows are int32
_KIND = re.compile(r"[a-z][a-z0-9_]{0,63}")  # vLLM's KVCacheSpecKind values: short lower-case names


@dataclass(frozen=True, slots=True)
class GroupTag:
    """One vLLM KV cache group a stored object's blocks belong to, as vLLM's events name it.

    ``kind`` is vLLM's ``get_kv_cache_spec_kind(spec).value`` (``full_attention``,
    ``sliding_window``, ...), ``sliding_window`` its ``get_kv_cache_spec_sliding_window(spec)``.
    """

    group_idx: int
    kind: str | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        """Refuse a tag a router could not file, or one no vLLM KV cache group could have.

        ``group_idx`` a plain integer below :data:`MAX_GROUPS` (not a bool), ``kind`` a short
        lower-case name (vLLM's ``KVCacheSpecKind`` values are), ``sliding_window`` a positive
        integer up to :data:`MAX_SLIDING_WINDOW`.
        """
        idx = self.group_idx
        if type(idx) is not int or not 0 <= idx < MAX_GROUPS:
            raise ValueError(f"groups.group_idx: an integer from 0 to {MAX_GROUPS - 1}, got {idx!r:.40}")
        if self.kind is not None and (type(self.kind) is not str or not _KIND.fullmatch(self.kind)):
            raise ValueError(
                f"groups.kind: a lower-case name of at most 64 characters or None, got {self.kind!r:.40}"
            )
        window = self.sliding_window
        if window is not None and (type(window) is not int or not 0 < window <= MAX_SLIDING_WINDOW):
            raise ValueError(
                f"groups.sliding_window: an integer from 1 to {MAX_SLIDING_WINDOW} or None, "
                f"got {window!r:.40}"
            )


_NO_GROUP: tuple[GroupTag | None, ...] = (None,)
_Group = int | None  # a vLLM KV cache group index; None: events without group fields


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """What a router needs to name one cached key's blocks (a chunk, or a single tail block).

    ``block_hashes`` are the engine's hashes of the key's blocks in prefix order, ``parent_block_hash``
    the hash of the block before the first (None at the start of a prompt), ``token_ids`` the
    blocks' tokens, ``extra_keys`` one entry per block as vLLM publishes them (or None).
    ``groups``: the KV cache groups whose copy of these blocks the key holds (a hybrid model's
    object of one kind); empty for a model with one full-attention group.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    lora_name: str | None = None
    lora_id: int | None = None
    groups: tuple[GroupTag, ...] = ()

    def __post_init__(self) -> None:
        """Refuse metadata a router would drop or misfile: tokens must cover the blocks exactly."""
        if len(self.token_ids) != len(self.block_hashes) * self.block_size:
            raise ValueError(
                f"token_ids: {len(self.token_ids)} tokens for {len(self.block_hashes)} blocks "
                f"of {self.block_size}"
            )
        if self.extra_keys is not None and len(self.extra_keys) != len(self.block_hashes):
            raise ValueError(
                f"extra_keys: {len(self.extra_keys)} entries for {len(self.block_hashes)} blocks"
            )
        if len(self.groups) > MAX_GROUPS:
            raise ValueError(f"groups: at most {MAX_GROUPS} KV cache groups, got {len(self.groups)}")
        if len({g.group_idx for g in self.groups}) != len(self.groups):
            raise ValueError("groups: each KV cache group at most once")

    def tags(self) -> tuple[GroupTag | None, ...]:
        """The groups to announce the blocks in (``(None,)``: no group fields)."""
        return self.groups or _NO_GROUP


class EventLedger:
    """One endpoint's announced blocks, per medium, and the events since :meth:`take`."""

    def __init__(self, *, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        """Track at most ``max_keys`` keys (the oldest is withdrawn past that)."""
        self.max_keys = max_keys
        # Per key only its block hashes and groups (what a withdrawal needs): tokens are not kept.
        self._meta: OrderedDict[Hashable, tuple[tuple[BlockHash, ...], tuple[int | None, ...]]] = (
            OrderedDict()
        )
        self._scopes: dict[Hashable, set[Scope]] = {}
        self._held: dict[tuple[Scope, int | None, BlockHash], int] = {}
        self._events: list[Event] = []
        # Per hash, how many (medium, group) pairs credit it: announced() is one lookup, whatever
        # the number of groups or media.
        self._credits: dict[BlockHash, int] = {}

    def __len__(self) -> int:
        """Keys credited in at least one medium."""
        return len(self._meta)

    def stored(self, key: Hashable, tier: str, meta: ChunkMeta) -> None:
        """``key`` (named by ``meta``) is now resident in ``tier``: announce its blocks new there."""
        scope = scope_of_tier(tier)
        if scope is None:
            return
        scopes = self._scopes.setdefault(key, set())
        if scope in scopes:
            return
        tags = meta.tags()
        self._meta[key] = (meta.block_hashes, tuple(t.group_idx if t else None for t in tags))
        self._meta.move_to_end(key)
        scopes.add(scope)
        for tag in tags:  # vLLM announces each group's copy of a block on its own
            group = tag.group_idx if tag else None
            fresh = [self._hold(scope, group, h) for h in meta.block_hashes]
            start = 0
            while start < len(fresh):  # one event per run of blocks the medium did not hold yet
                if not fresh[start]:
                    start += 1
                    continue
                end = start
                while end < len(fresh) and fresh[end]:
                    end += 1
                self._events.append(_stored(meta, start, end, scope, tag))
                start = end
        while len(self._meta) > self.max_keys:
            self.forget(next(iter(self._meta)))

    def removed(self, key: Hashable, tier: str) -> None:
        """``key`` left ``tier``: withdraw its blocks no other key holds there."""
        scope = scope_of_tier(tier)
        if scope is not None:
            self._withdraw(key, [scope])

    def forget(self, key: Hashable) -> None:
        """``key`` is gone from every tier (or no longer tracked): withdraw it everywhere."""
        self._withdraw(key, sorted(self._scopes.get(key, ()), key=_scope_order))

    def cleared(self, tier: str) -> None:
        """Every key left ``tier`` (a restart lost it): withdraw them all, as ``BlockRemoved``."""
        scope = scope_of_tier(tier)
        if scope is None:
            return
        gone: dict[int | None, list[BlockHash]] = {}
        for key in [k for k, s in self._scopes.items() if scope in s]:
            for group, hashes in self._release(key, scope).items():
                gone.setdefault(group, []).extend(hashes)
        self._removed(scope, gone)

    def holds(self, key: Hashable, tier: str) -> bool:
        """Whether ``key`` is credited in ``tier``'s medium (False for a tier that is not announced)."""
        scope = scope_of_tier(tier)
        return scope is not None and scope in self._scopes.get(key, ())

    def announced(self, h: BlockHash) -> bool:
        """Whether block ``h`` is credited in any medium and group (a router knows it as a parent)."""
        return h in self._credits

    def credited(self) -> set[tuple[Scope, BlockHash]]:
        """The (medium, hash) pairs a router that saw every event holds now (any group)."""
        return {(scope, h) for scope, _, h in self._held}

    def credited_groups(self) -> set[tuple[Scope, int | None, BlockHash]]:
        """The (medium, group, hash) triples credited now (group None: events without group fields)."""
        return set(self._held)

    def keys_in(self, tier: str) -> list[Hashable]:
        """Keys credited in ``tier``'s medium, oldest first."""
        scope = scope_of_tier(tier)
        return [k for k in self._meta if scope is not None and scope in self._scopes.get(k, ())]

    def take(self) -> list[Event]:
        """Return (and forget) the events since the last call, in order."""
        events, self._events = self._events, []
        return events

    def _hold(self, scope: Scope, group: int | None, h: BlockHash) -> bool:
        n = self._held.get((scope, group, h), 0)
        self._held[(scope, group, h)] = n + 1
        if n == 0:
            self._credits[h] = self._credits.get(h, 0) + 1
        return n == 0

    def _withdraw(self, key: Hashable, scopes: Iterable[Scope]) -> None:
        for scope in list(scopes):
            self._removed(scope, self._release(key, scope))

    def _removed(self, scope: Scope, gone: dict[int | None, list[BlockHash]]) -> None:
        """One ``BlockRemoved`` per group (vLLM's removals name one group each)."""
        for group, hashes in gone.items():
            if hashes:
                self._events.append(
                    BlockRemoved(tuple(hashes), scope.medium, group_idx=group, locality=scope.locality)
                )

    def _release(self, key: Hashable, scope: Scope) -> dict[int | None, list[BlockHash]]:
        scopes = self._scopes.get(key)
        if not scopes or scope not in scopes:
            return {}
        scopes.discard(scope)
        hashes, groups = self._meta[key]
        if not scopes:
            del self._scopes[key]
            del self._meta[key]
        gone: dict[int | None, list[BlockHash]] = {}
        for group in groups:
            for h in hashes:
                n = self._held[(scope, group, h)] - 1
                if n:
                    self._held[(scope, group, h)] = n
                else:
                    del self._held[(scope, group, h)]
                    self._uncredit(h)
                    gone.setdefault(group, []).append(h)
        return gone

    def _uncredit(self, h: BlockHash) -> None:
        n = self._credits[h] - 1
        if n:
            self._credits[h] = n
        else:
            del self._credits[h]


def _scope_order(scope: Scope) -> tuple[str, str]:
    return scope.medium, scope.locality or ""


def _stored(meta: ChunkMeta, start: int, end: int, scope: Scope, tag: GroupTag | None) -> BlockStored:
    """The ``BlockStored`` of blocks ``start:end`` of ``meta``, filed under ``scope`` (and ``tag``)."""
    bs = meta.block_size
    parent = meta.block_hashes[start - 1] if start > 0 else meta.parent_block_hash
    return BlockStored(
        block_hashes=meta.block_hashes[start:end],
        parent_block_hash=parent,
        token_ids=meta.token_ids[start * bs : end * bs],
        block_size=bs,
        lora_id=meta.lora_id,
        medium=scope.medium,
        lora_name=meta.lora_name,
        extra_keys=None if meta.extra_keys is None else meta.extra_keys[start:end],
        group_idx=tag.group_idx if tag else None,
        kv_cache_spec_kind=tag.kind if tag else None,
        kv_cache_spec_sliding_window=tag.sliding_window if tag else None,
        locality=scope.locality,
    )
