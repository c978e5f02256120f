"""An in-memory "object store" tier: proof that a new tier is one module plus configuration.

Configure it below the built-in tiers::

    tiers:
      extra:
        - kind: kvfabric.testing.objecttier:build
          capacity_bytes: 67108864
          options: {bucket: my-bucket}   # stores naming the same bucket in one process share it

It implements :class:`~kvfabric.cacheserver.engine.base.BackingTier` and nothing else: the tiered
store promotes from it, writes back to it, deletes from it and ticks it exactly as it does the disk
tiers. Objects are kept in a process-wide dict per bucket name, so two stores in one test process
naming one bucket see each other's objects, as servers sharing an object store would.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from kvfabric.cacheserver.config import ExtraTierConfig
from kvfabric.cacheserver.engine.base import MissReason, ReadResult, TierName, TierUsage
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.ordering import Generations
from kvfabric.cacheserver.engine.tiers import TierContext

__all__ = ["ObjectTier", "buckets", "build"]


@dataclass(frozen=True, slots=True)
class _Object:
    gen: int
    data: bytes


class _Bucket:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: OrderedDict[BlockId, _Object] = OrderedDict()


_BUCKETS: dict[str, _Bucket] = {}
_BUCKETS_LOCK = threading.Lock()


def buckets() -> dict[str, _Bucket]:
    """Every bucket of this process (tests inspect or clear them)."""
    return _BUCKETS


def _bucket(name: str) -> _Bucket:
    with _BUCKETS_LOCK:
        return _BUCKETS.setdefault(name, _Bucket())


class ObjectTier:
    """Objects in memory with a byte budget; LRU eviction; never expires by itself."""

    durable = True

    def __init__(
        self, bucket: str, capacity_bytes: int, generations: Generations, *, high: float, low: float
    ) -> None:
        self._b = _bucket(bucket)
        self.capacity = capacity_bytes
        self.high = high
        self.low = low
        self.generations = generations

    @property
    def name(self) -> TierName:
        """``object``."""
        return TierName.OBJECT

    def start(self) -> None:
        """Learn the generations already in the bucket."""
        with self._b.lock:
            for obj in self._b.objects.values():
                self.generations.observe(obj.gen)

    def close(self) -> None:
        """Nothing to release."""

    def tick(self) -> None:
        """Evict above the high watermark."""
        u = self.usage()
        if u.used_bytes > u.high_bytes:
            self.evict(int(self.capacity * self.low))

    def has(self, bid: BlockId) -> bool:
        """Whether the bucket holds ``bid``."""
        return bid in self._b.objects

    contains = has

    def generation(self, bid: BlockId) -> int | None:
        """Generation of the stored object."""
        obj = self._b.objects.get(bid)
        return None if obj is None else obj.gen

    def length(self, bid: BlockId) -> int | None:
        """Length of the stored object."""
        obj = self._b.objects.get(bid)
        return None if obj is None else len(obj.data)

    def get(self, bid: BlockId) -> bytes | None:
        """The object's bytes, or None."""
        obj = self._b.objects.get(bid)
        return None if obj is None or not self.generations.admits(bid, obj.gen) else obj.data

    def read_into(self, bid: BlockId, dest: memoryview) -> ReadResult:
        """Copy the object into ``dest``."""
        obj = self._b.objects.get(bid)
        if obj is None:
            return ReadResult.missed(MissReason.ABSENT)
        if not self.generations.admits(bid, obj.gen):
            return ReadResult.missed(MissReason.STALE)
        dest[: len(obj.data)] = obj.data
        return ReadResult(len(obj.data), obj.gen)

    def put(self, bid: BlockId, payload: bytes | bytearray | memoryview, *, bucket: int) -> bool:
        """Store an object with a fresh generation."""
        data = bytes(payload)
        return self.write(
            bid, memoryview(data), gen=self.generations.next(), bucket=bucket, created_at=0, checksum=b""
        )

    def write(
        self,
        bid: BlockId,
        payload: memoryview,
        *,
        gen: int,
        bucket: int,
        created_at: float,
        checksum: bytes,
    ) -> bool:
        """Store an object unless a newer one or a newer delete is known."""
        data = bytes(payload)
        if len(data) > int(self.capacity * self.high):
            return False
        with self._b.lock:
            cur = self._b.objects.get(bid)
            if (cur is not None and cur.gen >= gen) or not self.generations.admits(bid, gen):
                return False
            self._b.objects[bid] = _Object(gen, data)
        self.tick()
        return True

    def delete(self, bid: BlockId, gen: int | None = None) -> bool:
        """Remove the object if it is older than ``gen`` (any if None)."""
        with self._b.lock:
            cur = self._b.objects.get(bid)
            if cur is None or (gen is not None and cur.gen >= gen):
                return False
            del self._b.objects[bid]
            return True

    def purge(self, bid: BlockId, gen: int) -> bool:
        """A delete learned elsewhere."""
        return self.delete(bid, gen)

    def usage(self) -> TierUsage:
        """Bytes held in the bucket."""
        with self._b.lock:
            used = sum(len(o.data) for o in self._b.objects.values())
            n = len(self._b.objects)
        return TierUsage(self.name, used, self.capacity, n, self.high, self.low)

    def evict(self, target_bytes: int) -> list[BlockId]:
        """Drop least recently written objects until usage is at most ``target_bytes``."""
        gone: list[BlockId] = []
        with self._b.lock:
            used = sum(len(o.data) for o in self._b.objects.values())
            while self._b.objects and used > target_bytes:
                bid, obj = self._b.objects.popitem(last=False)
                used -= len(obj.data)
                gone.append(bid)
        return gone

    def wants_refresh(self, bid: BlockId, bucket: int) -> bool:
        """Objects have no TTL buckets here."""
        return False

    def refresh(self, bid: BlockId, bucket: int) -> bool:
        """Nothing to move."""
        return False


def build(ctx: TierContext, cfg: ExtraTierConfig) -> ObjectTier:
    """The factory ``tiers.extra[].kind`` names."""
    return ObjectTier(
        str(cfg.options.get("bucket", "default")),
        cfg.capacity_bytes,
        ctx.generations,
        high=cfg.high_watermark,
        low=cfg.low_watermark,
    )
