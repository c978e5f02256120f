"""KV events in vLLM's format for the chunks kvfabric stores and finds gone.

Routers that consume vLLM's KV events (llm-d, Dynamo, AIBrix) learn from ``BlockStored`` /
``BlockRemoved`` which endpoint holds which prefix. vLLM publishes what the connector's
``take_events()`` returns next to its own events, on the publisher ``--kv-events-config``
configures; events are keyed by vLLM's own block hashes, so a router needs no kvfabric knowledge.

The bookkeeping is :class:`kvfabric.rpc.kvledger.EventLedger`: each (medium, block hash) is
announced once while any stored key holds it and withdrawn once when the last one goes, so the
routers' reference counts (llm-d, Dynamo) return to zero; a chunk stored over tail blocks that
were announced before it was whole announces only its new blocks. This module only reads vLLM's
``Request`` (hashes, tokens, LoRA, ``extra_keys`` computed by vLLM's own functions) and turns the
ledger's events into vLLM's event objects (:func:`to_vllm`).

- ``BlockStored`` (medium ``CPU``, the node's DRAM tier where every store lands first): a chunk's
  blocks, or a tail block, were handed to the node's cache server, prompt or generated tokens alike
  (a store can still be dropped under back-pressure; a router that routes on it at worst finds a miss).
- ``BlockRemoved``: a lookup found an announced key gone (evicted, expired or lost with a restart),
  or the bounded bookkeeping forgot it (credit is withdrawn rather than left behind).

Hybrid models (several KV cache groups, :mod:`kvfabric.connector.groups`): each stored object of a
kind is announced once per vLLM KV cache group of the kind, with the fields vLLM's own KV cache
manager gives that group's events (``group_idx``, ``kv_cache_spec_kind``,
``kv_cache_spec_sliding_window``, from vLLM's ``get_kv_cache_spec_kind`` and
``get_kv_cache_spec_sliding_window``), the group's block size, and only the blocks the object
holds (a sliding-window object names the blocks inside its window, named by vLLM's hashes at the
group's block size).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from kvfabric.connector.groups import GroupPlan
from kvfabric.connector.nodefeed import NodeResidency
from kvfabric.connector.steps import SaveSpec
from kvfabric.rpc import kvevents as kv
from kvfabric.rpc.kvledger import DEFAULT_MAX_KEYS, ChunkMeta, EventLedger, GroupTag

try:  # pragma: no cover - depends on the environment
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import (
        generate_block_hash_extra_keys,
        maybe_convert_block_hash,
        to_event_extra_keys,
    )

    _VLLM = True
except ImportError:  # the stand-ins keep the module importable (and testable) without vLLM
    _VLLM = False
    BlockStored = BlockRemoved = AllBlocksCleared = None
    generate_block_hash_extra_keys = to_event_extra_keys = None

    def maybe_convert_block_hash(hash_bytes: Any) -> Any:
        """Stand-in: vLLM's external form of a block hash."""
        return hash_bytes


try:  # pragma: no cover - depends on the environment
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
except ImportError:  # vLLM without the group fields (or none): groups are named by index only
    get_kv_cache_spec_kind = get_kv_cache_spec_sliding_window = None


log = logging.getLogger(__name__)

MEDIUM_DRAM = kv.MEDIUM_CPU
_MAX_ANNOUNCED = DEFAULT_MAX_KEYS


def to_vllm(event: kv.Event) -> Any:
    """VLLM's own event object for ``event`` (its publisher then writes the same bytes)."""
    if isinstance(event, kv.BlockStored):
        return BlockStored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=None if event.extra_keys is None else list(event.extra_keys),
            group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
            locality=event.locality,
        )
    if isinstance(event, kv.BlockRemoved):
        return BlockRemoved(
            block_hashes=list(event.block_hashes),
            medium=event.medium,
            group_idx=event.group_idx,
            locality=event.locality,
        )
    raise ValueError(f"kvfabric never sends {type(event).__name__} on an engine's behalf")


def group_tags(kv_cache_config: Any) -> tuple[GroupTag, ...]:
    """Per vLLM KV cache group, the fields vLLM's own events carry for it.

    vLLM's KV cache manager annotates its ``BlockStored`` with ``get_kv_cache_spec_kind(spec).value``
    and ``get_kv_cache_spec_sliding_window(spec)`` of the event's group (``kv_cache_event_metadata``);
    the same functions name kvfabric's. Without them (no vLLM) only the index is known.
    """
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    tags = []
    for gid, group in enumerate(groups):
        spec = getattr(group, "kv_cache_spec", None)
        kind = window = None
        if get_kv_cache_spec_kind is not None and get_kv_cache_spec_sliding_window is not None:
            kind = str(get_kv_cache_spec_kind(spec).value)
            window = get_kv_cache_spec_sliding_window(spec)
        tags.append(GroupTag(gid, kind, window))
    return tuple(tags)


def hash_block_size_of(kv_cache_config: Any, default: int) -> int:
    """Tokens per entry of vLLM's ``Request.block_hashes``.

    ``kv_cache_config.hash_block_size`` where vLLM set it, else the greatest common divisor of the
    groups' block sizes (vLLM's rule for several groups), else ``default``.
    """
    value = getattr(kv_cache_config, "hash_block_size", None)
    if isinstance(value, int) and value > 0:
        return value
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    sizes = [int(getattr(getattr(g, "kv_cache_spec", None), "block_size", 0) or 0) for g in groups]
    sizes = [b for b in sizes if b > 0]
    return math.gcd(*sizes) if len(sizes) > 1 else default


def block_extra_keys(request: Any, first: int, end: int, block_size: int) -> tuple[Any, ...] | None:
    """VLLM's published ``extra_keys`` of blocks ``first:end`` of ``request`` (None when all empty)."""
    if generate_block_hash_extra_keys is None or to_event_extra_keys is None:
        return None
    per_block = [
        generate_block_hash_extra_keys(request, b * block_size, (b + 1) * block_size, 0)[0]
        for b in range(first, end)
    ]
    if all(k is None for k in per_block):
        return None
    return tuple(to_event_extra_keys(per_block) or ())


def _h(hashes: Sequence[Any], i: int) -> Any:
    """VLLM's external form of hash ``i``."""
    return maybe_convert_block_hash(hashes[i])


class KVEventLog:
    """The events of one scheduler between two ``take_events()`` calls, and what was announced."""

    def __init__(
        self,
        block_size: int,
        enabled: bool,
        *,
        max_keys: int | None = None,
        follow: Callable[[EventLedger], NodeResidency | None] | None = None,
        plan: GroupPlan | None = None,
        tags: tuple[GroupTag, ...] = (),
        hash_block_size: int | None = None,
    ) -> None:
        """Track events of keys that span whole blocks of vLLM's ``block_size`` tokens.

        ``follow(ledger)``: the node cache server's residency feed to follow (:mod:`.nodefeed`);
        while it is followed, the feed decides what is announced and withdrawn, and this log only
        names the chunks this engine stores. Without one (or while the feed is down) stores are
        announced as they are handed over and withdrawn when a lookup finds them gone.

        A hybrid model's ``plan`` (saves of per-kind objects), ``tags`` (:func:`group_tags`, per vLLM
        group) and ``hash_block_size`` (tokens per entry of the request's ``block_hashes``,
        :func:`hash_block_size_of`; ``block_size`` by default).
        """
        self.enabled = enabled and _VLLM
        self.block_size = block_size
        self.plan = plan if plan is not None and not plan.plain else None
        self.tags = tags
        self.hash_block_size = hash_block_size or block_size
        self.ledger = EventLedger(max_keys=_MAX_ANNOUNCED if max_keys is None else max_keys)
        self.node = follow(self.ledger) if self.enabled and follow is not None else None
        self.failures = 0
        """Failures of the events path (the feed, naming a chunk) survived by falling back."""

    def stored(self, request: Any, save: SaveSpec) -> None:
        """Announce what ``save`` stores of ``request``: its whole chunks and its tail blocks.

        Each key's blocks are named by vLLM's hashes of those blocks, with the hash of the block
        before as the parent; blocks another announced key already holds are not announced again.
        """
        if not self.enabled:
            return
        for i, (key, first, blocks) in enumerate(
            zip(save.keys, save.first_blocks, save.block_ids, strict=False)
        ):
            try:
                if save.objects is not None:
                    meta = self._object_meta(request, save, i)
                else:
                    meta = self.meta(request, first, first + len(blocks)) if blocks else None
            except Exception:  # the cache never breaks inference: this chunk goes unannounced
                self._failed("naming a stored chunk for KV events failed; it is not announced")
                continue
            if meta is None:  # vLLM hashed no such blocks (no prefix caching)
                continue
            if self.node is not None:
                try:
                    self.node.describe(key, meta)  # announced now, confirmed (or withdrawn) by the feed
                    continue
                except Exception:  # the cache never breaks inference: stop following, as take() does
                    self._failed("following the node's residency feed failed; KV events fall back to stores")
                    self._drop_node()
            self.ledger.stored(key, "dram", meta)

    def _failed(self, what: str) -> None:
        """Count a failure of the events path; log the first with its traceback, the rest quietly."""
        self.failures += 1
        if self.failures == 1:
            log.exception(what)
        else:
            log.debug(what, exc_info=True)

    def _drop_node(self) -> None:
        if self.node is not None:
            with contextlib.suppress(Exception):
                self.node.close()
            self.node = None

    def _object_meta(self, request: Any, save: SaveSpec, i: int) -> ChunkMeta | None:
        """What names object ``i`` of a hybrid ``save``: the blocks it holds, in its kind's groups."""
        assert save.objects is not None
        if self.plan is None:
            return None  # per-kind objects without the plan: nothing to name them by
        kind = self.plan.kinds[save.objects.kinds[i]]
        end = save.first_blocks[i] * self.block_size + save.objects.tokens[i]
        b = kind.block_size
        start = end - save.objects.stored[i] * b
        groups = tuple(self.tags[g] if g < len(self.tags) else GroupTag(g) for g in kind.groups)
        return self.meta(request, start // b, end // b, block_size=b, groups=groups)

    def meta(
        self,
        request: Any,
        first: int,
        end: int,
        *,
        block_size: int | None = None,
        groups: tuple[GroupTag, ...] = (),
    ) -> ChunkMeta | None:
        """What a router needs to name blocks ``first:end`` of ``request``, or None if unhashed.

        Blocks of ``block_size`` tokens (the log's by default), named as vLLM names a group's blocks
        of that size: by the hash of the request's last ``hash_block_size`` block inside each.
        """
        hashes = list(getattr(request, "block_hashes", None) or ())
        bs = block_size or self.block_size
        scale = bs // self.hash_block_size
        if scale <= 0 or bs % self.hash_block_size or len(hashes) < end * scale:
            return None
        tokens = getattr(request, "all_token_ids", None) or getattr(request, "prompt_token_ids", None) or ()
        lora = getattr(request, "lora_request", None)
        if len(tokens) < end * bs:
            return None  # vLLM hashes whole blocks only; never let a stand-in request raise here
        return ChunkMeta(
            block_hashes=tuple(
                maybe_convert_block_hash(hashes[(b + 1) * scale - 1]) for b in range(first, end)
            ),
            parent_block_hash=_h(hashes, first * scale - 1) if first > 0 else None,
            token_ids=tuple(tokens[first * bs : end * bs]),
            block_size=bs,
            extra_keys=block_extra_keys(request, first, end, bs),
            lora_name=getattr(lora, "name", None),
            lora_id=getattr(lora, "adapter_id", None),
            groups=groups,
        )

    def found_missing(self, keys: Sequence[str]) -> None:
        """A lookup found ``keys`` absent: withdraw the blocks no other announced key still holds."""
        if not self.enabled or (self.node is not None and self.node.connected):
            return  # the feed withdraws what the server lost, in the order it lost it
        for key in keys:
            self.ledger.forget(key)

    def take(self) -> list[Any]:
        """Return (and forget) the events since the last call, as vLLM's event objects."""
        if self.node is not None:
            try:
                self.node.poll()
            except Exception:  # the cache never breaks inference: stop following, announce as before
                self._failed("following the node's residency feed failed; KV events fall back to stores")
                self._drop_node()
        return [to_vllm(e) for e in self.ledger.take()]
