"""Pieces of the client: validation, channel options, error mapping, stream assembly, shared memory."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import grpc

from kvfabric.client import errors
from kvfabric.client.blocks import BlockChannel, BlockRef, close_all, write_all
from kvfabric.client.localindex import LocalIndex
from kvfabric.client.results import FlushResult, LookupResult
from kvfabric.rpc import CLIENT_ID_HEADER
from kvfabric.rpc.blockproto import MAX_NAMES, block_socket_for
from kvfabric.rpc.indextable import index_socket_for
from kvfabric.rpc.v1 import cache_pb2 as pb

Payload: TypeAlias = bytes | bytearray | memoryview

_HEX64 = re.compile(r"[0-9a-f]{64}")
RECONNECT_BACKOFF_MAX_MS = 1000
"""Longest wait between two reconnect attempts of a channel to a server that went away."""

CLIENT_IDLE_NEVER_MS = 2**31 - 1
"""The largest idle timeout gRPC takes: about 25 days, never in practice."""

CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    # Larger than any payload we accept; the server enforces its own limit.
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    # gRPC's default reconnect backoff starts at 1 s and grows to 120 s: after a cache-server
    # restart a channel could stay in TRANSIENT_FAILURE (every call failing at once) for minutes
    # while the server was serving again. The server is on the same node or the same cluster, so
    # retrying every 100 ms to 1 s costs nothing and brings hits back within about a second.
    # (Not grpc.min_reconnect_backoff_ms: gRPC core uses it as the minimum *connect timeout*, and
    # lowering it fails connections to a slow-to-answer server.)
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS),
    # Never let the channel go idle (gRPC's default drops its connection after 30 minutes without a
    # call): an engine that loads and stores over the block socket and looks up from the published
    # index makes few calls, and its next one would connect as a newcomer, which the server refuses
    # while its listener's connections are all taken.
    ("grpc.client_idle_timeout_ms", CLIENT_IDLE_NEVER_MS),
]
STREAM_PIECE_BYTES = 1 << 20  # 1-2 MiB messages measured fastest through grpcio


def tier_name(tier: int) -> str:
    """A wire tier's name as the server spells it (``TIER_LOCAL_DISK`` -> ``"local_disk"``).

    The server's ``TierName`` values are the proto names without ``TIER_``, lower case (a server-side
    test checks that), so the client derives them from the proto and names every tier it knows.
    """
    return pb.Tier.Name(tier).removeprefix("TIER_").lower()


TIER_NAMES: dict[int, str] = {v: tier_name(v) for v in pb.Tier.values() if v != pb.TIER_UNSPECIFIED}
"""Every tier the proto names (``TIER_UNSPECIFIED`` aside); a newer server's unknown tier is ``"unknown"``."""


@dataclass(frozen=True, slots=True)
class Target:
    """A parsed client target."""

    address: str
    """What grpc dials: ``unix:///abs/path`` or ``host:port``."""
    is_unix: bool


def parse_target(target: str) -> Target:
    """Accept ``unix:///abs/path.sock`` (same node) or ``host:port`` (remote)."""
    if target.startswith("unix://"):
        path = target[len("unix://") :]
        if not path.startswith("/"):
            raise errors.InvalidRequest(f"unix target must be absolute (unix:///path): {target!r}")
        return Target(target, True)
    if target.startswith("unix:"):
        raise errors.InvalidRequest(f"use unix:///absolute/path, not {target!r}")
    if ":" not in target:
        raise errors.InvalidRequest(f"target must be 'unix:///path' or 'host:port': {target!r}")
    return Target(target, False)


def local_index_for(target: Target) -> LocalIndex | None:
    """The published-index reader of a Unix target's server (None for TCP: nothing is published remotely)."""
    if not target.is_unix:
        return None
    return LocalIndex(index_socket_for(target.address[len("unix://") :]))


def check_ids(namespace: str, keys: Sequence[str]) -> bytes:
    """Raise :class:`InvalidRequest` unless namespace and keys are 64-char lower-case hex digests.

    Returns the keys' digests, concatenated (what the published index is probed with).
    """
    if not isinstance(namespace, str) or not _HEX64.fullmatch(namespace):
        raise errors.InvalidRequest(f"namespace must be 64 lower-case hex characters: {namespace!r:.80}")
    # A few C-speed passes over all keys, about 5 us for 128 (a regex per key costs ~0.4 us each,
    # more than the whole local lookup). The keys joined by spaces: bytes.fromhex skips the spaces
    # and rejects anything else that is not hex; 32 bytes per key out of 65 characters per key
    # (less the last space) leaves no room for anything but hex digits and the separators; the
    # separators every 65 characters make each key 64 long; no A-F makes them lower case. The slow
    # loop only runs to name the bad key.
    n = len(keys)
    if not n:
        return b""
    try:
        joined = " ".join(keys)
        raw = bytes.fromhex(joined)
        if (
            len(raw) == 32 * n
            and len(joined) == 65 * n - 1
            and joined[64::65] == " " * (n - 1)
            and not ("A" in joined or "B" in joined or "C" in joined)
            and not ("D" in joined or "E" in joined or "F" in joined)
        ):
            return raw
    except (TypeError, ValueError):
        pass
    for key in keys:
        if not isinstance(key, str) or not _HEX64.fullmatch(key):
            raise errors.InvalidRequest(f"key must be 64 lower-case hex characters: {key!r:.80}")
    raise errors.InvalidRequest("keys must be 64 lower-case hex characters")


def check_raw_ids(namespace: str, keys: Sequence[str], raw: bytes) -> bytes:
    """Check the namespace, and that ``raw`` is 32 bytes per key and begins and ends as ``keys`` do.

    For a caller that holds the keys' digests (the connector hashes them): the whole of ``keys``
    is not decoded again, only the first and the last key are compared with ``raw``, which catches
    a list and digests that went out of step. Returns ``raw``. The keys are validated in full
    before they are sent to a server (:func:`check_ids`).
    """
    if not isinstance(namespace, str) or not _HEX64.fullmatch(namespace):
        raise errors.InvalidRequest(f"namespace must be 64 lower-case hex characters: {namespace!r:.80}")
    n = len(keys)
    if not isinstance(raw, bytes) or len(raw) != 32 * n:
        raise errors.InvalidRequest("raw keys must be the keys' 32-byte digests, one per key")
    if n and (raw[:32].hex() != keys[0] or raw[-32:].hex() != keys[-1]):
        raise errors.InvalidRequest("raw keys are not the digests of the keys")
    return raw


CREDENTIAL_CHECK_SECONDS = 1.0
"""How often a client looks at its credential files for a rotation."""
RETIRED_CHANNEL_GRACE_SECONDS = 60.0
"""How long a channel replaced by a credential rotation stays open for the calls still on it."""


def file_stamps(paths: Sequence[Path]) -> tuple[tuple[int, int, int] | None, ...]:
    """What identifies each file's current content: inode, size and modification time (None: missing).

    The kubelet updates a Secret volume by swapping a symlink to a new directory, so every changed
    file has a new inode.
    """
    out: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            out.append(None)
        else:
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def read_token(path: Path) -> str | None:
    """The bearer token in ``path`` (surrounding whitespace stripped), or None if missing or empty."""
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        return None
    return token or None


def new_client_id() -> str:
    """A name for one client object, which the server's per-client slot cap counts on the Unix socket."""
    return f"{os.getpid():x}-{secrets.token_hex(6)}"


def metadata(token: str | None, client_id: str | None = None) -> tuple[tuple[str, str], ...] | None:
    """Per-call metadata: the bearer token, if any, and the client's id, if any."""
    md = []
    if token:
        md.append(("authorization", f"Bearer {token}"))
    if client_id:
        md.append((CLIENT_ID_HEADER, client_id))
    return tuple(md) or None


def credentials(
    tls_ca: str | os.PathLike[str] | None,
    tls_cert: str | os.PathLike[str] | None = None,
    tls_key: str | os.PathLike[str] | None = None,
) -> grpc.ChannelCredentials | None:
    """TLS channel credentials trusting ``tls_ca`` (a PEM file), or None for plaintext.

    ``tls_cert`` and ``tls_key`` (PEM files, both or neither) are the client certificate presented
    to a listener that requires mutual TLS.
    """
    if (tls_cert is None) != (tls_key is None):
        raise errors.InvalidRequest("tls_cert and tls_key must be given together")
    if tls_ca is None:
        if tls_cert is not None:
            raise errors.InvalidRequest("a client certificate needs tls_ca (the server's CA)")
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=Path(tls_ca).read_bytes(),
        private_key=Path(tls_key).read_bytes() if tls_key is not None else None,
        certificate_chain=Path(tls_cert).read_bytes() if tls_cert is not None else None,
    )


def server_name_option(name: str | None) -> list[tuple[str, Any]]:
    """Channel option checking the server certificate against ``name`` rather than the target host."""
    return [("grpc.ssl_target_name_override", name)] if name else []


def map_rpc_error(exc: grpc.RpcError) -> errors.CacheError:
    """Translate a gRPC error into the client's typed errors (the caller chains the cause)."""
    # Every RpcError raised by a channel is also a grpc.Call; the stubs cannot express that.
    code_fn = getattr(exc, "code", None)
    details_fn = getattr(exc, "details", None)
    code: grpc.StatusCode | None = code_fn() if callable(code_fn) else None
    detail = (details_fn() if callable(details_fn) else None) or str(exc)
    msg = f"{code.name if code else 'UNKNOWN'}: {detail}"
    match code:
        case grpc.StatusCode.DEADLINE_EXCEEDED:
            return errors.CacheTimeout(msg)
        case grpc.StatusCode.INVALID_ARGUMENT | grpc.StatusCode.OUT_OF_RANGE:
            return errors.InvalidRequest(msg)
        case grpc.StatusCode.NOT_FOUND:
            return errors.NotFound(msg)
        case grpc.StatusCode.DATA_LOSS:
            return errors.CacheCorrupt(msg)
        case grpc.StatusCode.UNAUTHENTICATED | grpc.StatusCode.PERMISSION_DENIED:
            return errors.PermissionDenied(msg)
        case grpc.StatusCode.RESOURCE_EXHAUSTED:
            return errors.CacheOverloaded(msg)
        case _:
            return errors.CacheUnavailable(msg)


def lookup_result(resp: pb.LookupResponse) -> LookupResult:
    """Convert a LookupResponse."""
    return LookupResult(matched=resp.matched, tiers=[TIER_NAMES.get(t, "unknown") for t in resp.tiers])


def flush_result(resp: pb.FlushResponse) -> FlushResult:
    """Convert a FlushResponse."""
    tiers = [[TIER_NAMES.get(t, "unknown") for t in held.tiers] for held in resp.keys]
    return FlushResult(tiers=tiers, complete=resp.complete)


def check_timeout(timeout: float) -> None:
    """Every call needs a positive deadline: a cache that hangs must never stall inference."""
    if not timeout > 0:
        raise errors.InvalidRequest(f"timeout must be > 0 seconds, got {timeout!r}")


def store_chunks(namespace: str, keys: Sequence[str], payloads: Sequence[Payload]) -> Iterator[pb.StoreChunk]:
    """Split payloads into StoreChunk messages of at most :data:`STREAM_PIECE_BYTES` data each."""
    for i, (key, payload) in enumerate(zip(keys, payloads, strict=True)):
        view = memoryview(payload).cast("B")
        n = len(view)
        first = pb.StoreChunk(key=key, total_length=n, data=bytes(view[:STREAM_PIECE_BYTES]))
        if i == 0:
            first.namespace = namespace
        yield first
        for off in range(STREAM_PIECE_BYTES, n, STREAM_PIECE_BYTES):
            yield pb.StoreChunk(data=bytes(view[off : off + STREAM_PIECE_BYTES]))


def check_payloads(keys: Sequence[str], payloads: Sequence[Payload]) -> None:
    """Keys and payloads must pair up one to one."""
    if len(keys) != len(payloads):
        raise errors.InvalidRequest(f"{len(keys)} keys but {len(payloads)} payloads")


def as_bytes_view(buf: memoryview) -> memoryview:
    """A flat, writable byte view of a caller's buffer (any format or shape, C-contiguous)."""
    if buf.readonly:
        raise errors.InvalidRequest("load buffers must be writable")
    if buf.format == "B" and buf.ndim == 1:
        return buf
    if not buf.c_contiguous:
        raise errors.InvalidRequest("load buffers must be C-contiguous")
    return buf.cast("B")


class LoadAssembler:
    """Reassembles streamed LoadChunk messages into whole payloads (stops at the first gap)."""

    def __init__(self, buffers: Sequence[memoryview] | None = None) -> None:
        self._buffers = None if buffers is None else [as_bytes_view(b) for b in buffers]
        self.payloads: list[bytes] = []
        self.count = 0
        self._pieces: list[bytes] = []
        self._index = -1
        self._total = 0
        self._filled = 0

    def feed(self, chunk: pb.LoadChunk) -> None:
        """Consume one streamed piece."""
        if chunk.index != self._index:
            self._finish()
            if chunk.index != self.count:
                raise errors.CacheCorrupt(
                    f"load stream skipped to index {chunk.index}, expected {self.count}"
                )
            self._index, self._total, self._filled = chunk.index, chunk.total_length, 0
            if self._buffers is not None:
                if chunk.index >= len(self._buffers):
                    raise errors.CacheCorrupt("server sent more payloads than requested")
                if len(self._buffers[chunk.index]) < self._total:
                    raise errors.InvalidRequest(
                        f"buffer {chunk.index} holds {len(self._buffers[chunk.index])} bytes, "
                        f"payload is {self._total}"
                    )
        if chunk.offset != self._filled or self._filled + len(chunk.data) > self._total:
            raise errors.CacheCorrupt("load stream pieces out of order")
        if self._buffers is not None:
            self._buffers[self._index][self._filled : self._filled + len(chunk.data)] = chunk.data
        else:
            self._pieces.append(chunk.data)
        self._filled += len(chunk.data)

    def _finish(self) -> None:
        if self._index < 0:
            return
        if self._filled != self._total:
            raise errors.CacheCorrupt(f"payload {self._index} truncated: {self._filled}/{self._total}")
        if self._buffers is None:
            data = self._pieces[0] if len(self._pieces) == 1 else b"".join(self._pieces)
            self.payloads.append(data)
            self._pieces = []
        self.count += 1
        self._index = -1

    def done(self) -> None:
        """Call at the end of the stream."""
        self._finish()


# --- shared memory (memfds from the block socket) ------------------------------------------------


def block_channel_for(
    target: Target, mapping_budget: int = 0, client_id: str | None = None
) -> BlockChannel | None:
    """The block-socket channel of a Unix target's server (None for TCP: no shared memory remotely).

    ``client_id``: the client's id (as on the gRPC socket), by which the server budgets its holds.
    """
    if not target.is_unix:
        return None
    path = block_socket_for(target.address[len("unix://") :])
    return BlockChannel(path, mapping_budget=mapping_budget, client_id=client_id)


def shm_slots(messages: Iterable[pb.ShmSlot]) -> Iterator[pb.ShmSlot]:
    """Every slot of a ShmLoad answer, in key order (a message carries the next ones in ``more``)."""
    for msg in messages:
        yield msg
        yield from msg.more


def shm_slot_groups(messages: Iterable[pb.ShmSlot]) -> Iterator[list[pb.ShmSlot]]:
    """The slots of a ShmLoad answer a message at a time, in key order (``more`` after the first).

    The server names the blocks already resident together: a group's blocks are fetched together.
    """
    for msg in messages:
        yield [msg, *msg.more]


def shm_refs(namespace: str, keys: Sequence[str], first: int, group: Sequence[pb.ShmSlot]) -> list[BlockRef]:
    """The blocks of ``group``, named for the keys from ``keys[first]`` on (none past the last key)."""
    return [
        BlockRef(slot.name, slot.length, f"{namespace}/{key}")
        for slot, key in zip(group, keys[first:], strict=False)
    ]


def shm_read_into(
    blocks: BlockChannel, refs: Sequence[BlockRef], buffers: Sequence[memoryview], first: int, deadline: float
) -> int:
    """Copy the leading named blocks into ``buffers`` (one copy each); how many were copied.

    ``buffers[i]`` is ``refs[i]``'s, the load's buffer ``first + i``; each is checked to hold its
    block before anything is fetched.
    """
    targets = []
    for i, (ref, buf) in enumerate(zip(refs, buffers, strict=True)):
        target = as_bytes_view(buf)
        if target.nbytes < ref.length:
            raise errors.InvalidRequest(
                f"buffer {first + i} holds {target.nbytes} bytes, payload is {ref.length}"
            )
        targets.append(target)
    return blocks.copy_blocks(refs, targets, deadline=deadline)


def write_staged(fds: Sequence[int | None], payloads: Sequence[Payload]) -> None:
    """Write each payload into its staging descriptor (None: not staged) and close every descriptor."""
    todo = list(fds)
    try:
        for i, (fd, payload) in enumerate(zip(todo, payloads, strict=True)):
            if fd is None:
                continue
            todo[i] = None  # write_all closes it
            write_all(fd, memoryview(payload).cast("B"))
    finally:
        close_all(todo)


def shm_write(
    blocks: BlockChannel, slots: Sequence[pb.ShmSlot], payloads: Sequence[Payload], deadline: float
) -> None:
    """Write each payload into its staging memfd (skipping slots the server left empty)."""
    todo = [(slot, p) for slot, p in zip(slots, payloads, strict=True) if slot.name]
    # A batch at a time: a store of thousands of keys never holds thousands of descriptors.
    for start in range(0, len(todo), MAX_NAMES):
        batch = todo[start : start + MAX_NAMES]
        fds = blocks.fetch([slot.name for slot, _ in batch], deadline=deadline)
        try:
            if any(fd is None for fd in fds):
                raise errors.NotFound("the store's staging lease expired before it was written")
            for i, ((_, payload), fd) in enumerate(zip(batch, fds, strict=True)):
                assert fd is not None
                fds[i] = None  # write_all closes it
                write_all(fd, memoryview(payload).cast("B"))
        finally:
            close_all(fds)
