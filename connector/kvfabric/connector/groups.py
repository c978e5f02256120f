"""The group plan: what kvfabric stores and loads of each KV cache group of a hybrid model (pure).

vLLM's hybrid KV cache manager keeps one block table per *KV cache group*: full-attention layers keep
every block, sliding-window layers only the blocks inside their window, chunked-local layers only
the open attention chunk; positions a group does not keep point at block 0, the null block every
request's table shares. Groups whose specs are identical (Gemma 3 27B's five sliding-window groups)
form one *kind*: one stored object per (chunk or tail block, kind), holding every layer of the kind.

For an object covering tokens ``[s, e)`` (a whole chunk, or one tail block of ``S`` tokens) a kind
stores only what a later hit at a boundary ``H >= e`` can need (:meth:`Kind.stored_start`):

- full attention: every block of ``[s, e)``;
- sliding window ``w`` (+ ``extra`` retained tokens, ``W = w - 1 + extra``): the trailing
  ``cdiv(W, B)`` blocks (a hit at ``H`` reads ``[H - W, H)``; those blocks are alive while the
  step that computes ``e`` runs, earlier ones may already belong to another request);
- chunked local ``A``: the blocks of ``[max(s, floor(e/A)*A), e)`` (nothing when ``A`` divides ``e``).

A hit at ``H`` with the engine already holding ``[0, L)`` needs, per kind, the blocks from
:meth:`Kind.needed_start` to ``H``; exactly those are the non-null blocks of vLLM's table there.

The scheduler block ``S`` is the least common multiple of the groups' block sizes: every boundary
kvfabric offers is a multiple of it. Nothing here imports vLLM: the plan is built from duck-typed
``kv_cache_config`` objects by spec class name (:func:`plan_from_kv_cache_config`).
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "GroupPlan",
    "Kind",
    "KindType",
    "UnsupportedGroupsError",
    "cdiv",
    "kind_key",
    "plan_from_kv_cache_config",
]

_KIND_DOMAIN = b"kvfabric.kind.v1"


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(-a // b)


class UnsupportedGroupsError(ValueError):
    """The model's KV cache groups include one kvfabric cannot store exactly (named in the message)."""


class KindType(enum.StrEnum):
    """What a kind's layers attend to, hence which of its blocks a hit needs."""

    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL = "chunked_local"
    STATE = "state"
    """Recurrent state (Mamba, linear attention) in vLLM's ``align`` mode: one block holds the state
    after exactly the tokens up to its end; an object is a checkpoint at a span's end."""


@dataclass(frozen=True)
class Kind:
    """One or more KV cache groups with identical specs: stored as one object per chunk."""

    type: KindType
    block_size: int
    """Tokens per block of these groups."""
    page_bytes: int
    """Bytes of one block of one layer (vLLM's page)."""
    groups: tuple[int, ...]
    """vLLM's group ids of this kind, ascending."""
    layers: tuple[tuple[str, ...], ...]
    """Per group (same order as ``groups``), its layer names."""
    window: int = 0
    """Sliding window ``w`` (sliding-window kinds)."""
    extra: int = 0
    """Tokens retained behind the window (vLLM's ``extra_retained_tokens``)."""
    attention_chunk: int = 0
    """Attention chunk ``A`` (chunked-local kinds)."""
    state_bytes: int = 0
    """Bytes of one layer's state, unpadded (state kinds)."""
    spec: str = ""
    """Canonical description of the groups' spec (class and fields), for the namespace."""

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Every layer of the kind, group by group: the order of a stored object's body."""
        return tuple(name for names in self.layers for name in names)

    def stored_start(self, start: int, end: int) -> int:
        """First token (a block boundary) of what an object covering ``[start, end)`` stores."""
        b = self.block_size
        if self.type is KindType.SLIDING_WINDOW:
            keep = cdiv(self.window - 1 + self.extra, b) * b
            return max(start, end - keep)
        if self.type is KindType.CHUNKED_LOCAL:
            return max(start, (end // self.attention_chunk) * self.attention_chunk // b * b)
        if self.type is KindType.STATE:
            return max(start, end - b)  # the one block holding the state after ``end`` tokens
        return start

    def stored_blocks(self, start: int, end: int) -> int:
        """Blocks per group an object covering ``[start, end)`` stores (0: no object)."""
        return max(0, end - self.stored_start(start, end)) // self.block_size

    def needed_start(self, hit: int, local: int) -> int:
        """First token (a block boundary) whose block a hit at ``hit`` must write, ``local`` held."""
        b = self.block_size
        if self.type is KindType.SLIDING_WINDOW:
            first = max(0, hit - self.window + 1 - self.extra) // b * b
        elif self.type is KindType.CHUNKED_LOCAL:
            first = (hit // self.attention_chunk) * self.attention_chunk // b * b
        elif self.type is KindType.STATE:
            first = hit - b  # block hit/B - 1 receives the state after ``hit`` tokens
        else:
            first = 0
        return max(local, first)

    def document(self) -> dict[str, Any]:
        """The kind's canonical description (part of the namespace)."""
        return {
            "type": self.type.value,
            "block_size": self.block_size,
            "page_bytes": self.page_bytes,
            "window": self.window,
            "extra": self.extra,
            "attention_chunk": self.attention_chunk,
            "state_bytes": self.state_bytes,
            "spec": self.spec,
            "layers": [list(names) for names in self.layers],
        }


@dataclass(frozen=True)
class GroupPlan:
    """Per kind what is stored and loaded; the scheduler block; which group is which kind."""

    kinds: tuple[Kind, ...]
    num_groups: int
    """Groups vLLM made (some may be left out: not prefix-cacheable)."""

    @property
    def scheduler_block(self) -> int:
        """``S``: the least common multiple of the kinds' block sizes."""
        return math.lcm(*(k.block_size for k in self.kinds))

    @property
    def request_level_failures(self) -> bool:
        """Whether a failed load can only be reported per request, not per block.

        vLLM (0.32, 0.33) refuses block-level load failures with several KV cache groups (block
        ids are unique only within a group: it raises); it takes failed *asynchronous* loads per
        request (``failed_recving``) and recomputes them from the start. So such models load in
        the background, always.
        """
        return self.num_groups > 1

    @property
    def has_state(self) -> bool:
        """Whether some kind is recurrent state (loaded before the forward, saved after it)."""
        return any(k.type is KindType.STATE for k in self.kinds)

    @property
    def plain(self) -> bool:
        """One full-attention group: today's layout, namespace and keys, unchanged."""
        return self.num_groups == 1 and len(self.kinds) == 1 and self.kinds[0].type is KindType.FULL

    def layer_places(self) -> dict[str, tuple[int, int, int]]:
        """Layer name -> (kind, position in the kind's body, position of its group in the kind)."""
        places: dict[str, tuple[int, int, int]] = {}
        for k, kind in enumerate(self.kinds):
            pos = 0
            for j, names in enumerate(kind.layers):
                for name in names:
                    places[name] = (k, pos, j)
                    pos += 1
        return places

    def document(self) -> str:
        """Canonical JSON of the plan: per kind its spec, window, block size, page bytes and layers."""
        doc = {"scheduler_block": self.scheduler_block, "kinds": [k.document() for k in self.kinds]}
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    def namespace_field(self) -> str:
        """The namespace's ``groups`` member: empty for a plain plan, else a summary and a digest.

        A short readable summary of the kinds and the SHA-256 of :meth:`document` (a namespace
        description's values are short).
        """
        if self.plain:
            return ""
        summary = ",".join(
            f"{k.type.value}"
            + (f":{k.window}+{k.extra}" if k.type is KindType.SLIDING_WINDOW else "")
            + (f":{k.attention_chunk}" if k.type is KindType.CHUNKED_LOCAL else "")
            + f"/b{k.block_size}x{len(k.layer_names)}"
            for k in self.kinds
        )
        return f"{summary};{hashlib.sha256(self.document().encode()).hexdigest()}"

    def describe(self) -> str:
        """One line for the start-up log: kinds, windows, block sizes, layers."""
        parts = []
        for i, k in enumerate(self.kinds):
            extra = ""
            if k.type is KindType.SLIDING_WINDOW:
                extra = f" window={k.window}" + (f"+{k.extra}" if k.extra else "")
            elif k.type is KindType.CHUNKED_LOCAL:
                extra = f" attention_chunk={k.attention_chunk}"
            parts.append(
                f"kind {i} {k.type.value}{extra} block={k.block_size} groups={list(k.groups)} "
                f"layers={len(k.layer_names)}"
            )
        return f"scheduler_block={self.scheduler_block} groups={self.num_groups}; " + "; ".join(parts)


def kind_key(key: str, kind: int, plan: GroupPlan) -> str:
    """The key of kind ``kind``'s object of the chunk or tail block ``key``.

    A plain plan keeps ``key`` (today's objects); otherwise ``H(domain || key || kind)``, so every
    kind's object has a key of its own and its own MAC.
    """
    if plan.plain:
        return key
    h = hashlib.sha256(_KIND_DOMAIN)
    h.update(bytes.fromhex(key))
    h.update(kind.to_bytes(4, "little"))
    return h.hexdigest()


def _field(obj: Any, name: str, default: Any = None) -> Any:
    return getattr(obj, name, default)


def _spec_doc(spec: Any) -> str:
    """Class name and the fields that shape a spec's bytes, canonically."""
    names = (
        "block_size",
        "num_kv_heads",
        "head_size",
        "head_size_v",
        "dtype",
        "sliding_window",
        "extra_retained_tokens",
        "attention_chunk_size",
        "sink_len",
        "kv_quant_mode",
        "page_size_padded",
        "shapes",
        "dtypes",
        "mamba_cache_mode",
    )
    doc = {n: str(_field(spec, n)) for n in names if _field(spec, n) is not None}
    return type(spec).__name__ + json.dumps(doc, sort_keys=True, separators=(",", ":"))


def _page_bytes(spec: Any) -> int:
    value = _field(spec, "page_size_bytes")
    return int(value) if isinstance(value, int) else 0


def _kind_of_spec(spec: Any, *, allow_state: bool = False) -> tuple[KindType, int, int, int]:
    """(type, window, extra, attention chunk) of a spec, or :class:`UnsupportedGroupsError`."""
    name = type(spec).__name__
    if ("Mamba" in name or _field(spec, "shapes") is not None) and allow_state:
        if _field(spec, "mamba_cache_mode") != "align":
            raise UnsupportedGroupsError(
                f"KV cache group spec {name} keeps recurrent state outside vLLM's 'align' mode "
                "(mamba_cache_mode must be 'align': states exist only at block boundaries there)"
            )
        return KindType.STATE, 0, 0, 0
    if "Mamba" in name or _field(spec, "shapes") is not None:
        raise UnsupportedGroupsError(
            f"KV cache group spec {name} holds recurrent (Mamba / linear-attention) state: kvfabric "
            "stores attention blocks only; serve this model without kvfabric"
        )
    if name in ("SlidingWindowSpec", "SlidingWindowMLASpec"):
        if _field(spec, "bounded_replay"):
            raise UnsupportedGroupsError(f"KV cache group spec {name} with bounded replay is not supported")
        window = int(_field(spec, "sliding_window"))
        return KindType.SLIDING_WINDOW, window, int(_field(spec, "extra_retained_tokens", 0) or 0), 0
    if name == "ChunkedLocalAttentionSpec":
        return KindType.CHUNKED_LOCAL, 0, 0, int(_field(spec, "attention_chunk_size"))
    if name in ("FullAttentionSpec", "MLAAttentionSpec", "SinkFullAttentionSpec", "AttentionSpec"):
        return KindType.FULL, 0, 0, 0
    raise UnsupportedGroupsError(f"KV cache group spec {name} is not one kvfabric knows how to store")


def plan_from_kv_cache_config(
    kv_cache_config: Any, *, fallback_block_size: int = 0, allow_state: bool = False
) -> GroupPlan | None:
    """Build the plan from vLLM's ``KVCacheConfig`` (None when it has no groups: a stand-in config).

    A group not in ``prefix_cacheable_group_ids`` (when vLLM names them: per-request rings such as
    ``CircularBufferSpec``, host-resident HiSparse groups, bounded-replay windows, groups without KV
    transfer) is refused: a hit would restore every other group and leave that one as the request's
    fresh blocks hold it, which recompute would not. Raises
    :class:`UnsupportedGroupsError`, naming the reason, for what the plan cannot serve: recurrent-state
    groups, packed or host-resident groups, EAGLE draft groups beside others, unknown specs.
    ``allow_state`` plans recurrent-state groups in ``align`` mode as state checkpoints instead: the
    path is unit-tested on vLLM-shaped objects only, so the connector never asks for it until a
    real model proves it.
    """
    groups: Sequence[Any] = _field(kv_cache_config, "kv_cache_groups", None) or ()
    if not groups:
        return None
    cacheable = _field(kv_cache_config, "prefix_cacheable_group_ids", None)
    try:
        keep = set(int(g) for g in cacheable) if cacheable is not None else set(range(len(groups)))
    except TypeError:
        keep = set(range(len(groups)))
    by_spec: dict[tuple[Any, ...], list[int]] = {}
    facts: dict[tuple[Any, ...], tuple[KindType, int, int, int, int, int, str, int]] = {}
    for gid, group in enumerate(groups):
        spec = _field(group, "kv_cache_spec")
        if gid not in keep:
            raise UnsupportedGroupsError(
                f"KV cache group {gid} ({type(spec).__name__}) is not prefix-cacheable in vLLM "
                "(per-request state a hit cannot restore): not supported"
            )
        if _field(group, "host_resident", False):
            raise UnsupportedGroupsError(f"KV cache group {gid} is host-resident (HiSparse): not supported")
        if _field(group, "is_eagle_group", False) and len(groups) > 1:
            raise UnsupportedGroupsError(f"KV cache group {gid} holds EAGLE/MTP draft layers: not supported")
        ktype, window, extra, chunk = _kind_of_spec(spec, allow_state=allow_state)
        block = int(_field(spec, "block_size", 0) or fallback_block_size)
        if block <= 0:
            raise UnsupportedGroupsError(f"KV cache group {gid} has no block size")
        if ktype is KindType.CHUNKED_LOCAL and chunk % block:
            raise UnsupportedGroupsError(
                f"KV cache group {gid}: attention_chunk_size {chunk} is not a multiple of "
                f"its block size {block}"
            )
        doc = _spec_doc(spec)
        ident = (doc, ktype, window, extra, chunk, block)
        by_spec.setdefault(ident, []).append(gid)
        state = int(_field(spec, "real_page_size_bytes", 0) or 0) if ktype is KindType.STATE else 0
        facts[ident] = (ktype, window, extra, chunk, block, _page_bytes(spec), doc, state)
    if not by_spec:
        raise UnsupportedGroupsError("no KV cache group is prefix-cacheable")
    kinds = []
    for ident, gids in by_spec.items():
        ktype, window, extra, chunk, block, page, doc, state = facts[ident]
        kinds.append(
            Kind(
                type=ktype,
                block_size=block,
                page_bytes=page,
                groups=tuple(gids),
                layers=tuple(tuple(str(n) for n in _field(groups[g], "layer_names", ())) for g in gids),
                window=window,
                extra=extra,
                attention_chunk=chunk,
                state_bytes=state,
                spec=doc,
            )
        )
    # Canonical order: by the first group id (full attention first when it is group 0).
    kinds.sort(key=lambda k: k.groups[0])
    plan = GroupPlan(tuple(kinds), len(groups))
    if not plan.plain and _block_outermost(kv_cache_config):
        raise UnsupportedGroupsError(
            "the KV cache is packed block-outermost (each block holds every layer's page): kvfabric's "
            "per-kind objects are not proven on it; serve this model with a layer-outermost layout"
        )
    return plan


def _block_outermost(kv_cache_config: Any) -> bool:
    """Whether some ``KVCacheTensor`` packs several layers' pages inside each block."""
    for tensor in _field(kv_cache_config, "kv_cache_tensors", None) or ():
        layers = _field(tensor, "layers", None) or ()
        layer_stride = _field(tensor, "layer_stride", None)
        block_stride = _field(tensor, "block_stride", None)
        if not isinstance(layer_stride, int) or not isinstance(block_stride, int):
            continue
        if len(layers) > 1 and 0 < layer_stride < block_stride:
            return True
    return False
