"""The residency feed's wire: what a node's cache server tells same-node connectors about its tiers.

The cache server is the authority on which chunk is in which of its tiers. Over a Unix stream
socket beside its gRPC socket (:func:`residency_socket_for`) it streams, per namespace, ordered
changes: a chunk *stored* in a tier, *removed* from one (eviction, TTL expiry, a delete, a move
between tiers is a store in one and a removal from the other). A connector attaches to each chunk
what a router needs to name it (:class:`~kvfabric.rpc.kvledger.ChunkMeta`: the engine's block hashes,
parent hash, tokens, ``extra_keys``, LoRA name), which the server keeps with the chunk while any
tier holds it and hands to every subscriber, so sibling engines on the node can announce chunks
another engine stored.

Frames are a 4-byte big-endian length and one msgpack array (:mod:`kvfabric.rpc.kvevents`'s codec):

* client -> server: ``["sub", namespace]`` (once per connection, first), then any number of
  ``["meta", key, meta]``, ``meta`` being the msgpack bytes of :func:`meta_to_wire`'s array (a bin:
  the server validates it once and passes the bytes on as they are);
* server -> client: ``["hello", epoch, namespace]`` first, then the snapshot of the namespace's
  residency as ``stored`` records, ``["synced"]``, then live records
  ``["stored", key, tier, meta or nil]`` and ``["removed", key, tier]``, in the order the server
  applied them. ``epoch`` is random per server process: a new one (after a reconnect) means the
  server restarted, and its snapshot replaces everything the client believed.

Pure: framing and message shapes only; no sockets.
"""

from __future__ import annotations

import os
import struct
import sys
from array import array
from pathlib import Path
from typing import Any

from kvfabric.rpc.kvevents import (
    DecodeError,
    extra_key_tuples,
    msgpack_decode,
    msgpack_encode,
    msgpack_prefix_decoder,
)
from kvfabric.rpc.kvledger import MAX_GROUPS, ChunkMeta, GroupTag

__all__ = [
    "MAX_CLIENT_FRAME",
    "MAX_FRAME",
    "MAX_META_BYTES",
    "Change",
    "FrameReader",
    "decode_meta",
    "encode_meta",
    "frame",
    "meta_from_wire",
    "meta_head",
    "meta_to_wire",
    "residency_socket_for",
]

MAX_FRAME = 4 << 20  # a chunk's metadata is a few KiB (its tokens); anything far larger is refused
MAX_META_BYTES = 64 << 10
"""The most one chunk's encoded metadata may take: 16,384 tokens (4 bytes each, a chunk holds a few
hundred to a few thousand) plus their block hashes and extra keys. Larger is refused (the feed closes
the connection with an error naming ``meta``)."""
MAX_CLIENT_FRAME = MAX_META_BYTES + 256  # what a server reads from a client: a meta message and its key
_LEN = struct.Struct(">I")


def residency_socket_for(unix_socket: str | os.PathLike[str]) -> Path:
    """Where the residency feed of the server listening on ``unix_socket`` is (beside it)."""
    p = Path(unix_socket)
    return p.with_name(p.name + ".residency")


def frame(message: list[Any]) -> bytes:
    """One message, length-prefixed."""
    body = msgpack_encode(message)
    if len(body) > MAX_FRAME:
        raise ValueError(f"a residency frame holds at most {MAX_FRAME} bytes, this one {len(body)}")
    return _LEN.pack(len(body)) + body


class FrameReader:
    """Reassembles frames from a byte stream, however it is cut."""

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        """An empty buffer; a frame announced longer than ``max_frame`` is a DecodeError."""
        self._buf = bytearray()
        self._max = max_frame

    def feed(self, data: bytes) -> list[list[Any]]:
        """Add ``data``; return the messages now complete (DecodeError for a malformed one)."""
        self._buf += data
        out = []
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if n > self._max:
                raise DecodeError(f"a residency frame of {n} bytes (at most {self._max})")
            if len(self._buf) < _LEN.size + n:
                break
            message = msgpack_decode(bytes(self._buf[_LEN.size : _LEN.size + n]))
            del self._buf[: _LEN.size + n]
            if not isinstance(message, list) or not message or not isinstance(message[0], str):
                raise DecodeError("a residency message is an array starting with its kind")
            out.append(message)
        return out


def meta_to_wire(meta: ChunkMeta) -> list[Any]:
    """``meta`` as a msgpack array (positional, in field order; the tokens packed as uint32 LE).

    Seven fields; a hybrid model's object adds an eighth, its KV cache groups as
    ``[group_idx, kind, sliding_window]`` arrays (metadata without groups keeps the seven-field
    form every server release reads).
    """
    tokens = array("I", meta.token_ids)
    if sys.byteorder == "big":
        tokens.byteswap()
    groups = [[g.group_idx, g.kind, g.sliding_window] for g in meta.groups]
    return [
        list(meta.block_hashes),
        meta.parent_block_hash,
        tokens.tobytes(),
        meta.block_size,
        None if meta.extra_keys is None else list(meta.extra_keys),
        meta.lora_name,
        meta.lora_id,
        *([groups] if groups else []),
    ]


def meta_from_wire(raw: Any) -> ChunkMeta:
    """Inverse of :func:`meta_to_wire`; ValueError naming the field that is wrong."""
    if not isinstance(raw, list) or len(raw) not in (7, 8):
        raise ValueError("meta: an array of 7 fields (8 with KV cache groups)")
    hashes, parent, packed, block_size, extra, lora_name, lora_id = raw[:7]
    if not isinstance(hashes, list) or not hashes or not all(isinstance(h, bytes | int) for h in hashes):
        raise ValueError("meta.block_hashes: a non-empty array of bytes or integers")
    if parent is not None and not isinstance(parent, bytes | int):
        raise ValueError("meta.parent_block_hash: bytes, an integer or nil")
    if not isinstance(packed, bytes) or len(packed) % 4:
        raise ValueError("meta.token_ids: bytes of little-endian uint32 token ids")
    tokens = array("I")
    tokens.frombytes(packed)
    if sys.byteorder == "big":
        tokens.byteswap()
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError("meta.block_size: a positive integer")
    if extra is not None and not isinstance(extra, list):
        raise ValueError("meta.extra_keys: an array or nil")
    if lora_name is not None and not isinstance(lora_name, str):
        raise ValueError("meta.lora_name: a string or nil")
    if lora_id is not None and not isinstance(lora_id, int):
        raise ValueError("meta.lora_id: an integer or nil")
    groups = _groups_from_wire(raw[7]) if len(raw) == 8 else ()
    try:
        return ChunkMeta(
            block_hashes=tuple(hashes),
            parent_block_hash=parent,
            token_ids=tuple(tokens),
            block_size=block_size,
            extra_keys=None
            if extra is None
            else tuple(None if k is None else extra_key_tuples(k, "meta.extra_keys") for k in extra),
            lora_name=lora_name,
            lora_id=lora_id,
            groups=groups,
        )
    except ValueError as err:  # ChunkMeta names its field ("token_ids: ..."): the wire's prefix is meta.
        raise ValueError(str(err) if str(err).startswith("meta") else f"meta.{err}") from None


def _groups_from_wire(raw: Any) -> tuple[GroupTag, ...]:
    if not isinstance(raw, list) or not raw or len(raw) > MAX_GROUPS:
        raise ValueError(
            f"meta.groups: an array of 1 to {MAX_GROUPS} [group_idx, kind, sliding_window] arrays"
        )
    tags = []
    for g in raw:
        if not isinstance(g, list) or len(g) != 3:
            raise ValueError("meta.groups: each entry an array [group_idx, kind, sliding_window]")
        try:
            tags.append(GroupTag(*g))
        except ValueError as err:  # names the field ("groups.kind: ..."): the wire's prefix is meta.
            raise ValueError(f"meta.{err}") from None
    return tuple(tags)


_meta_heads = (msgpack_prefix_decoder(7), msgpack_prefix_decoder(8))


def meta_head(raw: bytes) -> tuple[tuple[Any, ...], Any]:
    """The block hashes and parent hash of encoded metadata, without decoding the rest."""
    try:
        hashes, parent, *_ = _meta_heads[0](raw)
    except DecodeError:
        hashes, parent, *_ = _meta_heads[1](raw)
    if not isinstance(hashes, list):
        raise DecodeError("meta.block_hashes: an array")
    return tuple(hashes), parent


def encode_meta(meta: ChunkMeta) -> bytes:
    """``meta``'s msgpack bytes (how it travels: encoded once, passed on as is)."""
    return msgpack_encode(meta_to_wire(meta))


def decode_meta(raw: Any) -> ChunkMeta:
    """Inverse of :func:`encode_meta`; ValueError naming the field that is wrong."""
    if not isinstance(raw, bytes):
        raise ValueError("meta: msgpack bytes (a bin) of the chunk's 7 (or 8) fields")
    return meta_from_wire(msgpack_decode(raw))


class Change:
    """One residency change as a subscriber reads it.

    The metadata travels as bytes and is decoded only when :attr:`meta` is read (a connector that
    knows the chunk already never pays for it).
    """

    __slots__ = ("_bin", "_meta", "key", "op", "tier")

    def __init__(
        self, op: str, key: str, tier: str, meta: ChunkMeta | None = None, *, meta_bin: bytes | None = None
    ) -> None:
        """``op`` is ``stored`` or ``removed``; metadata given decoded, encoded, or not at all."""
        self.op = op
        self.key = key
        self.tier = tier
        self._meta = meta
        self._bin = meta_bin

    @property
    def has_meta(self) -> bool:
        """Whether the change names the chunk's blocks."""
        return self._meta is not None or self._bin is not None

    @property
    def meta(self) -> ChunkMeta | None:
        """The chunk's metadata (decoded on first use; ValueError if malformed)."""
        if self._meta is None and self._bin is not None:
            self._meta = decode_meta(self._bin)
        return self._meta

    @property
    def meta_bin(self) -> bytes | None:
        """The chunk's metadata as sent (encoded on first use)."""
        if self._bin is None and self._meta is not None:
            self._bin = encode_meta(self._meta)
        return self._bin

    def __eq__(self, other: object) -> bool:
        """Equal changes: same operation, key, tier and metadata."""
        if not isinstance(other, Change):
            return NotImplemented
        return (self.op, self.key, self.tier, self.meta) == (other.op, other.key, other.tier, other.meta)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        """For test failures."""
        return f"Change({self.op!r}, {self.key[:12]!r}, {self.tier!r}, meta={self.has_meta})"

    def to_wire(self) -> list[Any]:
        """The change's message."""
        if self.op == "stored":
            return ["stored", self.key, self.tier, self.meta_bin]
        return ["removed", self.key, self.tier]

    @classmethod
    def from_wire(cls, message: list[Any]) -> Change:
        """Parse a ``stored``/``removed`` message (ValueError if it is not one)."""
        if (
            message[0] == "stored"
            and len(message) == 4
            and (message[3] is None or isinstance(message[3], bytes))
        ):
            return cls("stored", str(message[1]), str(message[2]), meta_bin=message[3])
        if message[0] == "removed" and len(message) == 3:
            return cls("removed", str(message[1]), str(message[2]))
        raise ValueError(f"not a residency change: {message[:1]!r}")
