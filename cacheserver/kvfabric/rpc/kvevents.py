"""vLLM's KV events on the wire: the one encoder (and a decoder) for every transport, no vLLM needed.

Routers (llm-d's precise prefix producer, Dynamo's KV router, AIBrix) learn which endpoint holds
which prefix from the msgpack batches vLLM's ``ZmqEventPublisher`` sends. This module writes those
bytes exactly as vLLM 0.32's msgspec classes (``vllm.distributed.kv_events``) encode them, checked
byte for byte against vectors vLLM itself produced (``tests/rpc/kvevents_golden.json``, made by
``scripts/kvevents-golden.py`` in the real-vLLM environment):

* a batch is a 3-element array ``[ts (float64), events, data_parallel_rank (nil or int)]``;
* an event is a **map** tagged ``{"type": <class name>, ...}`` (vLLM's ``KVCacheEvent`` is
  ``tag=True`` without ``array_like``): required fields always present (``None`` as nil), fields
  with a default left out while they equal it, keys in field order. Consumers accept both this and
  the older positional form; :func:`decode_batch` reads both;
* block hashes are ``bytes`` (vLLM's default) or 64-bit ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``),
  passed through as given; ``extra_keys`` entries are tuples, sent as arrays.

Pure functions and frozen records only: no I/O, no clock. The connector hands vLLM its own event
objects built from these records (:mod:`kvfabric.connector.vllmevents`), so vLLM's publisher writes
the same bytes; tests and node-side publishers use :func:`encode_batch` directly.

Media (which tier an event names), per ``docs/routing.md``:

* DRAM -> ``CPU`` (llm-d tier ``cpu``, Dynamo host tier);
* local NVMe -> ``STORAGE`` with locality ``LOCAL`` (llm-d tier ``storage``, Dynamo disk tier);
* the shared volume and the object store are **not announced**: their credit would be nearly the
  same for every endpoint (no ranking value), Dynamo drops non-local ``STORAGE`` anyway, llm-d
  weighs an unconfigured tier at 1.0 (as much as the GPU), and relaying a fleet-wide tier through
  every engine multiplies index entries by the number of engines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = [
    "LOCALITY_LOCAL",
    "LOCALITY_REMOTE",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "Event",
    "Scope",
    "decode_batch",
    "encode_batch",
    "extra_key_tuples",
    "msgpack_decode",
    "msgpack_encode",
    "msgpack_prefix_decoder",
    "scope_of_tier",
]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCALITY_LOCAL = "LOCAL"
LOCALITY_REMOTE = "REMOTE"

BlockHash = bytes | int


@dataclass(frozen=True, slots=True)
class Scope:
    """Where a router files an entry: the event's ``medium`` and ``locality``."""

    medium: str
    locality: str | None = None


_TIER_SCOPES: dict[str, Scope | None] = {
    "dram": Scope(MEDIUM_CPU),
    "local_disk": Scope(MEDIUM_STORAGE, LOCALITY_LOCAL),
    "shared": None,
    "object": None,
}


def scope_of_tier(tier: str) -> Scope | None:
    """The medium a kvfabric tier is announced under, or None for a tier that is not announced."""
    try:
        return _TIER_SCOPES[tier]
    except KeyError:
        raise ValueError(f"tier must be one of {sorted(_TIER_SCOPES)}, got {tier!r}") from None


@dataclass(frozen=True, slots=True)
class BlockStored:
    """vLLM's ``BlockStored``: the blocks ``block_hashes`` (a run of one prefix) are held in ``medium``.

    Field names, order and defaults are vLLM 0.32's; ``parent_block_hash`` is the hash of the block
    before the first one (None at the start of a prompt), ``token_ids`` the run's tokens
    (``len(block_hashes) * block_size`` of them), ``extra_keys`` one untagged entry per block
    (vLLM's ``to_event_extra_keys``: LoRA name, ``(mm id, offset)`` pairs, cache salt, prompt
    embedding digests) or None.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """vLLM's ``BlockRemoved``: the blocks ``block_hashes`` left ``medium``."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """vLLM's ``AllBlocksCleared``: every tier of the publishing endpoint is empty.

    kvfabric never sends it on an engine's behalf (a router would drop the engine's GPU entries too).
    """


Event = BlockStored | BlockRemoved | AllBlocksCleared

# (field, has a default) in vLLM's declaration order.
_FIELDS: dict[type, tuple[tuple[str, bool], ...]] = {
    BlockStored: (
        ("block_hashes", False),
        ("parent_block_hash", False),
        ("token_ids", False),
        ("block_size", False),
        ("lora_id", False),
        ("medium", False),
        ("lora_name", False),
        ("extra_keys", True),
        ("group_idx", True),
        ("kv_cache_spec_kind", True),
        ("kv_cache_spec_sliding_window", True),
        ("locality", True),
        ("ownership", True),
        ("session_id", True),
    ),
    BlockRemoved: (
        ("block_hashes", False),
        ("medium", False),
        ("group_idx", True),
        ("locality", True),
        ("ownership", True),
    ),
    AllBlocksCleared: (),
}
_BY_TAG: dict[str, type] = {cls.__name__: cls for cls in _FIELDS}


def _as_map(event: Event) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(event).__name__}
    for name, has_default in _FIELDS[type(event)]:
        value = getattr(event, name)
        if has_default and value is None:
            continue  # omit_defaults: every default is None
        out[name] = value
    return out


def encode_batch(ts: float, events: Sequence[Event], data_parallel_rank: int | None = None) -> bytes:
    """A ``KVEventBatch``'s msgpack bytes (the third frame of a publisher message)."""
    return msgpack_encode([float(ts), [_as_map(e) for e in events], data_parallel_rank])


class DecodeError(ValueError):
    """Bytes that are not a KV-event batch."""


def decode_batch(data: bytes) -> tuple[float, list[Event], int | None]:
    """Read a batch in either form consumers accept (tagged maps, or positional arrays)."""
    obj = msgpack_decode(data)
    if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[1], list):
        raise DecodeError("a batch is an array [ts, events, data_parallel_rank]")
    rank = obj[2] if len(obj) > 2 else None
    return float(obj[0]), [_event(e) for e in obj[1]], rank


def _event(raw: Any) -> Event:
    if isinstance(raw, dict):
        cls = _BY_TAG.get(raw.get("type", ""))
        if cls is None:
            raise DecodeError(f"unknown event type {raw.get('type')!r}")
        values = {n: raw.get(n) for n, _ in _FIELDS[cls]}
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        cls = _BY_TAG.get(raw[0])
        if cls is None:
            raise DecodeError(f"unknown event type {raw[0]!r}")
        names = [n for n, _ in _FIELDS[cls]]
        values = dict(zip(names, raw[1:], strict=False))  # trailing fields may be left out
        values.update({n: None for n in names[len(raw) - 1 :]})
    else:
        raise DecodeError("an event is a tagged map or a tagged array")
    return _build(cls, values)


def _build(cls: type, values: dict[str, Any]) -> Event:
    if cls is AllBlocksCleared:
        return AllBlocksCleared()
    hashes = tuple(values["block_hashes"] or ())
    if cls is BlockRemoved:
        return BlockRemoved(
            hashes, values["medium"], values["group_idx"], values["locality"], values["ownership"]
        )
    extra = values["extra_keys"]
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=values["parent_block_hash"],
        token_ids=tuple(values["token_ids"] or ()),
        block_size=values["block_size"] or 0,
        lora_id=values["lora_id"],
        medium=values["medium"],
        lora_name=values["lora_name"],
        extra_keys=None
        if extra is None
        else tuple(None if k is None else extra_key_tuples(k) for k in extra),
        group_idx=values["group_idx"],
        kv_cache_spec_kind=values["kv_cache_spec_kind"],
        kv_cache_spec_sliding_window=values["kv_cache_spec_sliding_window"],
        locality=values["locality"],
        ownership=values["ownership"],
        session_id=values["session_id"],
    )


def extra_key_tuples(items: Any, field: str = "extra_keys") -> tuple[Any, ...]:
    """One block's ``extra_keys`` entry as msgpack decodes it (arrays) back to the tuples vLLM built.

    :class:`DecodeError` naming ``field`` for an entry that is not an array.
    """
    if not isinstance(items, list):
        raise DecodeError(f"{field}: each entry an array or nil")
    return tuple(extra_key_tuples(i, field) if isinstance(i, list) else i for i in items)


# ------------------------------------------------------------------------------------------- msgpack

# msgspec is what vLLM encodes its events with, so its plain encoder writes the same bytes for the
# same values (smallest int forms, float64, str8 for short strings, maps in insertion order).
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder()


def msgpack_encode(obj: Any) -> bytes:
    """Msgpack bytes of ``obj`` (lists and tuples as arrays, bytes as bin, dicts as maps)."""
    try:
        return _ENCODER.encode(obj)
    except (TypeError, msgspec.EncodeError) as exc:
        raise TypeError(f"cannot encode as msgpack: {exc}") from exc


def msgpack_decode(data: bytes | memoryview) -> Any:
    """Decode one msgpack object (maps to dicts, arrays to lists, bin to bytes); the whole input.

    DecodeError for anything malformed, truncated or followed by extra bytes.
    """
    try:
        return _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"not msgpack: {exc}") from exc


def msgpack_prefix_decoder(n: int) -> Callable[[bytes | memoryview], tuple[Any, ...]]:
    """A decoder of an array of ``n`` fields that decodes the first two and leaves the rest raw.

    (For the residency feed's chunk metadata: the router names of a chunk are read for every record,
    its tokens only when a connector announces it.) DecodeError if the input is not such an array.
    """
    decoder = msgspec.msgpack.Decoder(tuple[(Any, Any, *([msgspec.Raw] * (n - 2)))])  # type: ignore[misc]

    def decode(data: bytes | memoryview) -> tuple[Any, ...]:
        try:
            return tuple(decoder.decode(data))
        except msgspec.DecodeError as exc:
            raise DecodeError(f"not an array of {n} fields: {exc}") from exc

    return decode
