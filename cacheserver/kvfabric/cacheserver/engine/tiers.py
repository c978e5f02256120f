"""Building the tiers below DRAM from configuration: the built-in ones, then ``tiers.extra``.

Built in, fastest first: local disk, the shared volume, the object store (S3 API).

The order of the returned list is the order the tiered store searches and promotes from (fastest
first). A tier from ``tiers.extra`` is built by a factory named ``package.module:callable`` that
receives a :class:`TierContext` (what the store shares with its tiers) and its own configuration.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, cast

from kvfabric.cacheserver.config import DiskTierConfig, ExtraTierConfig, ObjectStoreTierConfig, ServerConfig
from kvfabric.cacheserver.engine.base import BackingTier, TierName
from kvfabric.cacheserver.engine.disk import DiskTier, Expiry
from kvfabric.cacheserver.engine.faults import IoFaults
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.objectstore import ObjectStoreTier
from kvfabric.cacheserver.engine.ordering import Generations
from kvfabric.cacheserver.engine.shared import SharedTier
from kvfabric.cacheserver.engine.stats import Counters
from kvfabric.cacheserver.engine.ttl import SharedClock

__all__ = ["TierContext", "TierFactory", "build_backing_tiers"]


@dataclass(frozen=True, slots=True)
class TierContext:
    """What the tiered store shares with the tiers it composes."""

    config: ServerConfig
    server_id: str
    counters: Counters
    generations: Generations
    """Issues generations and holds the tombstones every tier honours."""
    clock: SharedClock
    """The one clock every expiry decision uses."""
    on_delete: Callable[[BlockId, int], None]
    """A tier that learns of a delete made elsewhere reports it here; the store applies it to all tiers."""

    @property
    def expiry(self) -> Expiry:
        """TTL expiry on the store's clock."""
        return Expiry(self.clock, self.config.ttl_seconds, self.config.bucket_seconds)


TierFactory = Callable[[TierContext, ExtraTierConfig], BackingTier]


def _faults(cfg: DiskTierConfig) -> IoFaults | None:
    f = cfg.faults
    return (
        None
        if f is None
        else IoFaults(f.write_delay_seconds, f.read_error, f.rename_delay_seconds, f.read_delay_seconds)
    )


def _disk_tier(
    name: TierName,
    ctx: TierContext,
    cfg: DiskTierConfig,
    *,
    policy: Literal["lru", "oldest_bucket"],
    expiry: Expiry | None = None,
    on_evicted: Callable[[list[BlockId]], None] | None = None,
) -> DiskTier:
    """A block-file tier on ``cfg.path``: what the local disk and the shared volume have in common."""
    return DiskTier(
        name,
        cfg.path,
        cfg.capacity_bytes,
        server_id=ctx.server_id,
        high_watermark=cfg.high_watermark,
        low_watermark=cfg.low_watermark,
        min_free_fraction=cfg.min_free_fraction,
        policy=policy,
        counters=ctx.counters,
        generations=ctx.generations,
        expiry=expiry,
        on_evicted=on_evicted,
        faults=_faults(cfg),
    )


def _local_disk(ctx: TierContext, cfg: DiskTierConfig) -> DiskTier:
    # LRU, expiring its own buckets on the store's clock.
    return _disk_tier(TierName.LOCAL_DISK, ctx, cfg, policy="lru", expiry=ctx.expiry)


def _shared(ctx: TierContext, cfg: DiskTierConfig) -> SharedTier:
    # Oldest bucket first; the SharedTier wrapper owns expiry (volume time) and learns of evictions.
    def disk(on_evicted: Callable[[list[BlockId]], None]) -> DiskTier:
        return _disk_tier(TierName.SHARED, ctx, cfg, policy="oldest_bucket", on_evicted=on_evicted)

    return SharedTier(
        disk,
        server_id=ctx.server_id,
        expiry=ctx.expiry,
        generations=ctx.generations,
        counters=ctx.counters,
        lease_seconds=ctx.config.lease_seconds,
        journal_poll_seconds=ctx.config.journal_poll_seconds,
        on_delete=ctx.on_delete,
    )


def _object_store(ctx: TierContext, cfg: ObjectStoreTierConfig) -> ObjectStoreTier:
    return ObjectStoreTier(
        cfg,
        server_id=ctx.server_id,
        bucket_seconds=ctx.config.bucket_seconds,
        ttl_seconds=ctx.config.ttl_seconds,
        janitor_seconds=ctx.config.janitor_interval_seconds,
        counters=ctx.counters,
        generations=ctx.generations,
        on_delete=ctx.on_delete,
    )


def load_factory(kind: str) -> TierFactory:
    """Import the factory named ``package.module:callable``."""
    module, _, attr = kind.partition(":")
    factory = getattr(importlib.import_module(module), attr)
    if not callable(factory):
        raise TypeError(f"tier factory {kind} is not callable")
    return cast(TierFactory, factory)


def build_backing_tiers(ctx: TierContext) -> list[BackingTier]:
    """The tiers below DRAM, fastest first: local disk, the shared volume, then ``tiers.extra``."""
    t = ctx.config.tiers
    out: list[BackingTier] = []
    if t.local_disk is not None:
        out.append(_local_disk(ctx, t.local_disk))
    if t.shared is not None:
        out.append(_shared(ctx, t.shared))
    if t.object_store is not None:
        out.append(_object_store(ctx, t.object_store))
    for extra in t.extra:
        out.append(load_factory(extra.kind)(ctx, extra))
    return out
