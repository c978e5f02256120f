"""KV events in vLLM's format for the chunks kvfabric stores and finds gone.

Routers that consume vLLM's KV events (llm-d, Dynamo, AIBrix) learn from ``BlockStored`` /
``BlockRemoved`` which node holds which prefix. vLLM publishes what the connector's
``take_events()`` returns next to its own events, on the publisher ``--kv-events-config``
configures; events are keyed by vLLM's own block hashes, so a router needs no kvfabric knowledge.
The medium names the tier: ``CPU`` (the node's DRAM tier, where every store lands first).

- ``BlockStored``: a chunk's blocks, or a tail block (one block of a partial chunk), were handed to
  the node's cache server, prompt or generated tokens alike (a store can still be dropped under
  back-pressure; a router that routes on it at worst finds a miss).
- ``BlockRemoved``: a lookup found an announced chunk or tail block gone (evicted, expired or lost
  with a restart); the cache server itself announces nothing.

Pure bookkeeping: the caller passes vLLM's ``Request`` objects; nothing here does I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvfabric.connector.steps import SaveSpec

try:  # pragma: no cover - depends on the environment
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
except ImportError:  # the stand-ins keep the module importable (and testable) without vLLM
    BlockStored = BlockRemoved = None

    def maybe_convert_block_hash(hash_bytes: Any) -> Any:
        """Stand-in: vLLM's external form of a block hash."""
        return hash_bytes


MEDIUM_DRAM = "CPU"
_MAX_ANNOUNCED = 200_000


class KVEventLog:
    """The events of one scheduler between two ``take_events()`` calls, and what was announced."""

    def __init__(self, block_size: int, enabled: bool) -> None:
        """Track events of keys that span whole blocks of vLLM's ``block_size`` tokens."""
        self.enabled = enabled and BlockStored is not None
        self.block_size = block_size
        self._events: list[Any] = []
        # key -> the external block hashes announced for it (bounded, oldest forgotten), and per
        # hash how many announced keys hold it (a chunk and a tail block can share a block).
        self._announced: OrderedDict[str, list[Any]] = OrderedDict()
        self._held: dict[Any, int] = {}

    def stored(self, request: Any, save: SaveSpec) -> None:
        """Announce what ``save`` stores of ``request``: its whole chunks and its tail blocks.

        Each key is one event covering its blocks (a chunk's, or the single block of a tail block,
        generated tokens' included), keyed by vLLM's hashes of those blocks, with the hash of the
        block before as the parent. A tail block announced before its chunk was whole is announced
        again inside the chunk's event: ``BlockStored`` of a known hash is a no-op for a router.
        """
        if not self.enabled:
            return
        hashes = list(getattr(request, "block_hashes", None) or ())
        tokens = getattr(request, "all_token_ids", None) or getattr(request, "prompt_token_ids", None) or ()
        tokens = list(tokens)
        lora = getattr(request, "lora_request", None)
        for key, first, blocks in zip(save.keys, save.first_blocks, save.block_ids, strict=False):
            end = first + len(blocks)
            if key in self._announced or not blocks or len(hashes) < end:
                continue  # already announced, or vLLM hashed no such blocks (no prefix caching)
            own = [maybe_convert_block_hash(h) for h in hashes[first:end]]
            parent = maybe_convert_block_hash(hashes[first - 1]) if first > 0 else None
            self._events.append(
                BlockStored(
                    block_hashes=own,
                    parent_block_hash=parent,
                    token_ids=tokens[first * self.block_size : end * self.block_size],
                    block_size=self.block_size,
                    lora_id=getattr(lora, "adapter_id", None),
                    medium=MEDIUM_DRAM,
                    lora_name=getattr(lora, "name", None),
                )
            )
            self._announced[key] = own
            for h in own:
                self._held[h] = self._held.get(h, 0) + 1
            if len(self._announced) > _MAX_ANNOUNCED:
                self._release(self._announced.popitem(last=False)[1])  # forgotten, not known gone

    def _release(self, hashes: list[Any]) -> list[Any]:
        """Drop one hold on each of ``hashes``; return those no announced key holds any more."""
        free = []
        for h in hashes:
            n = self._held.get(h, 0) - 1
            if n > 0:
                self._held[h] = n
            else:
                self._held.pop(h, None)
                free.append(h)
        return free

    def found_missing(self, keys: Sequence[str]) -> None:
        """A lookup found ``keys`` absent: withdraw the blocks no other announced key still holds."""
        if not self.enabled:
            return
        gone: list[Any] = []
        for key in keys:
            own = self._announced.pop(key, None)
            if own:
                gone += [h for h in self._release(own) if h not in gone]
        if gone:
            self._events.append(BlockRemoved(block_hashes=gone, medium=MEDIUM_DRAM))

    def take(self) -> list[Any]:
        """Return (and forget) the events since the last call."""
        events, self._events = self._events, []
        return events
