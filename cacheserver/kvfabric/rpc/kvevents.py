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

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
    "encode_event",
    "msgpack_decode",
    "msgpack_encode",
    "msgpack_unpack_from",
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


def encode_event(event: Event) -> bytes:
    """One event's msgpack bytes, as vLLM's msgspec class encodes it."""
    return msgpack_encode(_as_map(event))


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
        extra_keys=None if extra is None else tuple(None if k is None else _tuples(k) for k in extra),
        group_idx=values["group_idx"],
        kv_cache_spec_kind=values["kv_cache_spec_kind"],
        kv_cache_spec_sliding_window=values["kv_cache_spec_sliding_window"],
        locality=values["locality"],
        ownership=values["ownership"],
        session_id=values["session_id"],
    )


def _tuples(items: list[Any]) -> tuple[Any, ...]:
    """Arrays inside ``extra_keys`` back to the tuples vLLM built them from."""
    return tuple(_tuples(i) if isinstance(i, list) else i for i in items)


# ------------------------------------------------------------------------------- msgpack, as msgspec


def msgpack_encode(obj: Any) -> bytes:
    """Msgpack as msgspec writes it: smallest int form, float64 floats, str8 for short strings."""
    out = bytearray()
    _pack(obj, out)
    return bytes(out)


def _pack(obj: Any, out: bytearray) -> None:
    if obj is None:
        out.append(0xC0)
    elif obj is True:
        out.append(0xC3)
    elif obj is False:
        out.append(0xC2)
    elif isinstance(obj, int):
        _pack_int(obj, out)
    elif isinstance(obj, float):
        out += b"\xcb" + struct.pack(">d", obj)
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        _pack_len(len(raw), out, fix=(0xA0, 32), forms=((0xD9, "B"), (0xDA, ">H"), (0xDB, ">I")))
        out += raw
    elif isinstance(obj, bytes | bytearray | memoryview):
        raw = bytes(obj)
        _pack_len(len(raw), out, fix=None, forms=((0xC4, "B"), (0xC5, ">H"), (0xC6, ">I")))
        out += raw
    elif isinstance(obj, list | tuple):
        _pack_len(len(obj), out, fix=(0x90, 16), forms=((0xDC, ">H"), (0xDD, ">I")))
        for item in obj:
            # Token ids dominate what is encoded: small non-negative ints take a short path.
            if type(item) is int and 0 <= item < 0x100000000:
                if item < 0x80:
                    out.append(item)
                elif item < 0x100:
                    out += b"\xcc" + _U8[item]
                elif item < 0x10000:
                    out += b"\xcd" + _U16(item)
                else:
                    out += b"\xce" + _U32(item)
            else:
                _pack(item, out)
    elif isinstance(obj, dict):
        _pack_len(len(obj), out, fix=(0x80, 16), forms=((0xDE, ">H"), (0xDF, ">I")))
        for key, value in obj.items():
            _pack(key, out)
            _pack(value, out)
    else:
        raise TypeError(f"cannot encode {type(obj).__name__} as msgpack")


_LIMITS = {"B": 1 << 8, ">H": 1 << 16, ">I": 1 << 32}
_U8 = [bytes([i]) for i in range(256)]
_U16 = struct.Struct(">H").pack
_U32 = struct.Struct(">I").pack


def _pack_len(
    n: int, out: bytearray, *, fix: tuple[int, int] | None, forms: tuple[tuple[int, str], ...]
) -> None:
    if fix is not None and n < fix[1]:
        out.append(fix[0] | n)
        return
    for marker, fmt in forms:
        if n < _LIMITS[fmt]:
            out.append(marker)
            out += struct.pack(fmt, n)
            return
    raise ValueError(f"msgpack cannot hold a length of {n}")


def _pack_int(n: int, out: bytearray) -> None:
    if 0 <= n < 128 or -32 <= n < 0:
        out += struct.pack(">b" if n < 0 else "B", n)
    elif n >= 0:
        for marker, fmt, limit in (
            (0xCC, "B", 1 << 8),
            (0xCD, ">H", 1 << 16),
            (0xCE, ">I", 1 << 32),
            (0xCF, ">Q", 1 << 64),
        ):
            if n < limit:
                out.append(marker)
                out += struct.pack(fmt, n)
                return
        raise ValueError(f"integer {n} does not fit msgpack's 64 bits")
    else:
        for marker, fmt, limit in (
            (0xD0, ">b", 1 << 7),
            (0xD1, ">h", 1 << 15),
            (0xD2, ">i", 1 << 31),
            (0xD3, ">q", 1 << 63),
        ):
            if n >= -limit:
                out.append(marker)
                out += struct.pack(fmt, n)
                return
        raise ValueError(f"integer {n} does not fit msgpack's 64 bits")


def msgpack_decode(data: bytes) -> Any:
    """Decode one msgpack object (maps to dicts, arrays to lists, bin to bytes); the whole input."""
    view = memoryview(data)
    try:
        obj, end = _unpack(view, 0)
    except (IndexError, struct.error) as exc:
        raise DecodeError("truncated msgpack") from exc
    if end != len(view):
        raise DecodeError(f"{len(view) - end} bytes after the msgpack object")
    return obj


_FIXED: dict[int, tuple[str, int]] = {
    0xCA: (">f", 4),
    0xCB: (">d", 8),
    0xCC: ("B", 1),
    0xCD: (">H", 2),
    0xCE: (">I", 4),
    0xCF: (">Q", 8),
    0xD0: (">b", 1),
    0xD1: (">h", 2),
    0xD2: (">i", 4),
    0xD3: (">q", 8),
}
_SIZED: dict[int, tuple[str, str, int]] = {  # marker -> (kind, length format, length size)
    0xC4: ("bin", "B", 1),
    0xC5: ("bin", ">H", 2),
    0xC6: ("bin", ">I", 4),
    0xD9: ("str", "B", 1),
    0xDA: ("str", ">H", 2),
    0xDB: ("str", ">I", 4),
    0xDC: ("array", ">H", 2),
    0xDD: ("array", ">I", 4),
    0xDE: ("map", ">H", 2),
    0xDF: ("map", ">I", 4),
}
_CONSTANTS = {0xC0: None, 0xC2: False, 0xC3: True}


def msgpack_unpack_from(buf: memoryview, pos: int) -> tuple[Any, int]:
    """One msgpack object at ``pos`` of ``buf``, and the position after it (DecodeError if malformed)."""
    try:
        return _unpack(buf, pos)
    except (IndexError, struct.error) as exc:
        raise DecodeError("truncated msgpack") from exc


def _unpack(buf: memoryview, pos: int) -> tuple[Any, int]:
    b = buf[pos]
    pos += 1
    if b < 0x80:
        return b, pos
    if b >= 0xE0:
        return b - 0x100, pos
    if b in _CONSTANTS:
        return _CONSTANTS[b], pos
    if b in _FIXED:
        fmt, size = _FIXED[b]
        return struct.unpack_from(fmt, buf, pos)[0], pos + size
    if 0x80 <= b <= 0x8F:
        return _collection("map", b & 0x0F, buf, pos)
    if 0x90 <= b <= 0x9F:
        return _collection("array", b & 0x0F, buf, pos)
    if 0xA0 <= b <= 0xBF:
        return _blob("str", b & 0x1F, buf, pos)
    if b in _SIZED:
        kind, fmt, size = _SIZED[b]
        n = struct.unpack_from(fmt, buf, pos)[0]
        pos += size
        return _collection(kind, n, buf, pos) if kind in ("array", "map") else _blob(kind, n, buf, pos)
    raise DecodeError(f"unsupported msgpack marker 0x{b:02x}")


def _blob(kind: str, n: int, buf: memoryview, pos: int) -> tuple[Any, int]:
    if pos + n > len(buf):
        raise DecodeError("truncated msgpack")
    raw = bytes(buf[pos : pos + n])
    return (raw.decode("utf-8") if kind == "str" else raw), pos + n


def _collection(kind: str, n: int, buf: memoryview, pos: int) -> tuple[Any, int]:
    if kind == "array":
        items: list[Any] = []
        append = items.append
        for _ in range(n):
            b = buf[pos]
            # Token ids dominate what is decoded: small non-negative ints take a short path.
            if b < 0x80:
                append(b)
                pos += 1
            elif b == 0xCD:
                append((buf[pos + 1] << 8) | buf[pos + 2])
                pos += 3
            elif b == 0xCE:
                append(int.from_bytes(buf[pos + 1 : pos + 5], "big"))
                pos += 5
            else:
                item, pos = _unpack(buf, pos)
                append(item)
        return items, pos
    mapping = {}
    for _ in range(n):
        key, pos = _unpack(buf, pos)
        value, pos = _unpack(buf, pos)
        mapping[key if not isinstance(key, list) else tuple(key)] = value
    return mapping, pos
