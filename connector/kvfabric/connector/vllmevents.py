"""KV events in vLLM's format for the chunks kvfabric stores and finds gone.

Routers that consume vLLM's KV events (llm-d, Dynamo, AIBrix) learn from ``BlockStored`` /
``BlockRemoved`` which node holds which prefix. vLLM publishes what the connector's
``take_events()`` returns next to its own events, on the publisher ``--kv-events-config``
configures; events are keyed by vLLM's own block hashes, so a router needs no kvfabric knowledge.
The medium names the tier: ``CPU`` (the node's DRAM tier, where every store lands first).

- ``BlockStored``: a chunk's blocks were handed to the node's cache server (a store can still be
  dropped under back-pressure; a router that routes on it at worst finds a miss).
- ``BlockRemoved``: a lookup found an announced chunk gone (evicted, expired or lost with a
  restart); the cache server itself announces nothing.

Pure bookkeeping: the caller passes vLLM's ``Request`` objects; nothing here does I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

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

    def __init__(self, chunk_tokens: int, block_size: int, enabled: bool) -> None:
        """Track events for chunks of ``chunk_tokens`` (a multiple of vLLM's ``block_size``)."""
        self.enabled = enabled and BlockStored is not None
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self._events: list[Any] = []
        # chunk key -> the external block hashes announced for it (bounded, oldest forgotten).
        self._announced: OrderedDict[str, list[Any]] = OrderedDict()

    def stored(self, request: Any, keys: Sequence[str], chunk_index: dict[str, int]) -> None:
        """Announce the chunks ``keys`` of ``request`` (their index in the prompt: ``chunk_index``)."""
        if not self.enabled:
            return
        hashes = list(getattr(request, "block_hashes", None) or ())
        tokens = getattr(request, "all_token_ids", None) or getattr(request, "prompt_token_ids", None) or ()
        tokens = list(tokens)
        bpc = self.chunk_tokens // self.block_size
        lora = getattr(request, "lora_request", None)
        for key in keys:
            c = chunk_index.get(key)
            if c is None or key in self._announced or len(hashes) < (c + 1) * bpc:
                continue  # unknown chunk, already announced, or vLLM hashed no blocks (no prefix caching)
            own = [maybe_convert_block_hash(h) for h in hashes[c * bpc : (c + 1) * bpc]]
            parent = maybe_convert_block_hash(hashes[c * bpc - 1]) if c > 0 else None
            self._events.append(
                BlockStored(
                    block_hashes=own,
                    parent_block_hash=parent,
                    token_ids=tokens[c * self.chunk_tokens : (c + 1) * self.chunk_tokens],
                    block_size=self.block_size,
                    lora_id=getattr(lora, "adapter_id", None),
                    medium=MEDIUM_DRAM,
                    lora_name=getattr(lora, "name", None),
                )
            )
            self._announced[key] = own
            if len(self._announced) > _MAX_ANNOUNCED:
                self._announced.popitem(last=False)

    def found_missing(self, keys: Sequence[str]) -> None:
        """A lookup found the chunks ``keys`` absent: withdraw those that were announced."""
        if not self.enabled:
            return
        gone = [h for key in keys for h in (self._announced.pop(key, None) or ())]
        if gone:
            self._events.append(BlockRemoved(block_hashes=gone, medium=MEDIUM_DRAM))

    def take(self) -> list[Any]:
        """Return (and forget) the events since the last call."""
        events, self._events = self._events, []
        return events
