"""The block socket's wire format: same-node clients trade handle names for memfd descriptors.

The cache server keeps DRAM blocks and store staging in memfds only it holds (see
:mod:`kvfabric.cacheserver.engine.dram`). A ``ShmLoad`` or ``ShmStoreBegin`` call on the gRPC socket
answers with handle names (128-bit random tokens); the client then sends those names on the block
socket, a ``SOCK_SEQPACKET`` Unix socket beside the gRPC one (:func:`block_socket_for`), and receives
one descriptor per name that still exists (``SCM_RIGHTS``): a sealed, read-only block for a load, a
writable staging memfd for a store.

A request is one message: ``KVBK1`` followed by up to :data:`MAX_NAMES` names, each preceded by a
space. The answer is one message of one status byte per name (:data:`FOUND` or :data:`GONE`) with
the descriptors of the found names attached in request order. A malformed request is answered
:data:`BAD_REQUEST` followed by a reason, and the connection is closed. Both halves import this
module, so they cannot disagree about the format.

A client that keeps its mappings of loaded blocks across loads (``kvfabric.client.mappings``) asks
with ``KVBH1`` instead: each found block is also *held* for this connection — the server keeps its
memory charged to the DRAM budget after an eviction or delete until the hold is released, so kept
mappings never make the server use memory it does not account — and answered :data:`FOUND`, or
:data:`LENT` when its client's hold budget (bytes or blocks) or the server's share is spent (the
client copies and unmaps as with ``KVBK1``). Names preceded by ``-`` release earlier holds first; a
request of releases only is answered with the single byte :data:`RELEASED`. Closing the connection
releases all of its holds.

A client names itself with ``@<id>`` right after the prefix (kvfabric's client sends the id it sends
on the gRPC socket as ``kvfabric-client`` metadata, one per client object): the server budgets holds
and counts connections per client, so a second connection buys a client nothing. A connection is
one client for its life: a later request naming another is malformed. A server that takes no more
connections, in all or from this client, answers :data:`REFUSED` followed by a reason and closes.

**Stores.** A same-node client stores on this socket too, in two exchanges instead of two gRPC calls
and a name trade. ``KVSB1 [@<id>] <namespace> <key>:<length> ...`` (up to :data:`MAX_NAMES` keys)
begins a store: the answer is :data:`STORE_BEGUN`, the lease id (32 hex characters), one byte saying
whether the server lacks the namespace's description (``0``/``1``), then one status byte per key
(:data:`STAGED`, :data:`PRESENT` or :data:`DROPPED`) with the writable staging memfd of each staged
key attached in key order. ``KVSC1 [@<id>] <lease>`` commits that lease and ``KVSA1 [@<id>] <lease>``
aborts it; the answer is :data:`STORE_DONE` followed by ``<accepted> <dropped>``. The server checks
a store's request exactly as it checks ``ShmStoreBegin``/``ShmStoreCommit`` (one implementation); a
request it refuses is answered :data:`STORE_ERROR`, one letter (:data:`INVALID`,
:data:`UNKNOWN_LEASE`, :data:`UNAVAILABLE` or :data:`BUSY`) and a reason, and the connection stays
open. A server
that serves no stores here answers :data:`BAD_REQUEST` (then the client uses gRPC).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "BAD_REQUEST",
    "FOUND",
    "GONE",
    "LENT",
    "MAX_MESSAGE",
    "MAX_NAMES",
    "REFUSED",
    "RELEASED",
    "Request",
    "StoreBegin",
    "StoreEnd",
    "block_socket_for",
    "encode_hold_request",
    "encode_request",
    "encode_store_begin",
    "encode_store_begun",
    "encode_store_done",
    "encode_store_end",
    "encode_store_error",
    "is_store_request",
    "parse_request",
    "parse_store_begun",
    "parse_store_done",
    "parse_store_request",
    "store_error",
]

REQUEST_PREFIX = b"KVBK1"
HOLD_PREFIX = b"KVBH1"
MAX_NAMES = 64
"""Names per request, and releases per request (the kernel passes at most 253 descriptors per message)."""
FOUND = 0
GONE = 1
LENT = 2
"""Found, sent, but not held (the client's hold budget, or the server's share, is spent)."""
RELEASED = 3
"""The answer to a request of releases only."""
REFUSED = 0xFE
"""No more connections are served (in all, or of this client): a reason follows, then it closes."""
BAD_REQUEST = 0xFF
CLIENT_ID = re.compile(r"[A-Za-z0-9-]{1,64}")
"""What a client id looks like (as the gRPC socket's ``kvfabric-client`` metadata)."""
_CLIENT = re.compile(rb"@[A-Za-z0-9-]{1,64}")
_NAME = re.compile(rb"[ds]_[0-9a-f]{32}")
_BLOCK_NAME = re.compile(rb"d_[0-9a-f]{32}")
STORE_BEGIN_PREFIX = b"KVSB1"
STORE_COMMIT_PREFIX = b"KVSC1"
STORE_ABORT_PREFIX = b"KVSA1"
STORE_BEGUN = 0x10
"""A store's begin was served: the lease, the describe flag and one status byte per key follow."""
STORE_DONE = 0x11
"""A store's commit (or abort) was served: ``<accepted> <dropped>`` follows."""
STORE_ERROR = 0xFD
"""A store request was refused: one of the letters below and a reason follow; the connection stays."""
INVALID = b"i"
"""The request's arguments are refused (as gRPC's INVALID_ARGUMENT)."""
UNKNOWN_LEASE = b"n"
"""The lease is unknown or expired (as gRPC's NOT_FOUND)."""
UNAVAILABLE = b"u"
"""The server could not serve the store now (as gRPC's UNAVAILABLE)."""
BUSY = b"b"
"""Too many store requests queued: this one is dropped at once, as a store without a slot is (the
client counts its keys dropped; not a failure of the server)."""
STAGED = 0
"""A staged key: its writable staging memfd is attached."""
PRESENT = 1
"""A key already stored: nothing to write."""
DROPPED = 2
"""A key the server cannot take now: nothing to write."""
_HEX64 = re.compile(rb"[0-9a-f]{64}")
_LEASE = re.compile(rb"[0-9a-f]{32}")
_KEY_LENGTH = re.compile(rb"([0-9a-f]{64}):(0|[1-9][0-9]{0,18})")
MAX_MESSAGE = len(STORE_BEGIN_PREFIX) + 66 + 65 + MAX_NAMES * 86
"""The longest request (a store's begin of :data:`MAX_NAMES` keys; a block request is shorter)."""


@dataclass(frozen=True, slots=True)
class Request:
    """A parsed request: the names to send descriptors of, whether to hold them, holds to release."""

    names: list[str]
    hold: bool = False
    release: list[str] = field(default_factory=list)
    client: str | None = None
    """The id the client named itself by (``@<id>``), or None."""


def block_socket_for(unix_socket: str | os.PathLike[str]) -> Path:
    """Where the block socket of the server listening on ``unix_socket`` is (beside it)."""
    p = Path(unix_socket)
    return p.with_name(p.name + ".blocks")


def _client_part(client: str | None) -> bytes:
    if client is None:
        return b""
    if not CLIENT_ID.fullmatch(client):
        raise ValueError(f"a client id is 1 to 64 letters, digits and dashes, not {client!r}")
    return b" @" + client.encode("ascii")


def encode_request(names: Sequence[str], client: str | None = None) -> bytes:
    """One request message for ``names`` (at most :data:`MAX_NAMES`), from ``client`` if named."""
    if not 0 < len(names) <= MAX_NAMES:
        raise ValueError(f"a block request names 1 to {MAX_NAMES} handles, not {len(names)}")
    return REQUEST_PREFIX + _client_part(client) + b"".join(b" " + n.encode("ascii") for n in names)


def encode_hold_request(
    names: Sequence[str], release: Sequence[str] = (), client: str | None = None
) -> bytes:
    """One ``KVBH1`` message: send and hold ``names`` (blocks only), after releasing ``release``."""
    if not len(names) <= MAX_NAMES or not len(release) <= MAX_NAMES or not (names or release):
        raise ValueError(f"a hold request names 0 to {MAX_NAMES} blocks and releases 0 to {MAX_NAMES}")
    return (
        HOLD_PREFIX
        + _client_part(client)
        + b"".join(b" -" + n.encode("ascii") for n in release)
        + b"".join(b" " + n.encode("ascii") for n in names)
    )


def parse_request(data: bytes) -> Request | None:
    """A request message's parts, or None if it is malformed."""
    hold = data.startswith(HOLD_PREFIX)
    if not hold and not data.startswith(REQUEST_PREFIX):
        return None
    parts = data[len(REQUEST_PREFIX) :].split(b" ")
    if parts[0] != b"":
        return None
    client = None
    if len(parts) > 1 and parts[1].startswith(b"@"):
        if not _CLIENT.fullmatch(parts[1]):
            return None
        client = parts[1][1:].decode("ascii")
        del parts[1]
    release = [p[1:] for p in parts[1:] if p.startswith(b"-")] if hold else []
    names = [p for p in parts[1:] if not p.startswith(b"-")] if hold else parts[1:]
    if len(names) > MAX_NAMES or len(release) > MAX_NAMES or not (names or release):
        return None
    # Only loaded blocks are held (a staging memfd is the client's to write, and short-lived).
    if not all((_BLOCK_NAME if hold else _NAME).fullmatch(n) for n in names):
        return None
    if not all(_BLOCK_NAME.fullmatch(n) for n in release):
        return None
    return Request([n.decode("ascii") for n in names], hold, [n.decode("ascii") for n in release], client)


@dataclass(frozen=True, slots=True)
class StoreBegin:
    """A parsed store begin: the namespace, and each key with its payload's length (not validated yet)."""

    namespace: str
    keys: list[str]
    lengths: list[int]
    client: str | None = None


@dataclass(frozen=True, slots=True)
class StoreEnd:
    """A parsed store commit (``abort`` False) or abort of ``lease``."""

    lease: str
    abort: bool
    client: str | None = None


def is_store_request(data: bytes) -> bool:
    """Whether ``data`` is a store request (it may still be malformed)."""
    return data[:5] in (STORE_BEGIN_PREFIX, STORE_COMMIT_PREFIX, STORE_ABORT_PREFIX)


def encode_store_begin(
    namespace: str, keys: Sequence[str], lengths: Sequence[int], client: str | None = None
) -> bytes:
    """One ``KVSB1`` message: begin storing ``keys`` (at most :data:`MAX_NAMES`) of ``lengths`` bytes."""
    if not 0 < len(keys) <= MAX_NAMES or len(lengths) != len(keys):
        raise ValueError(f"a store begins 1 to {MAX_NAMES} keys, each with a length")
    return (
        STORE_BEGIN_PREFIX
        + _client_part(client)
        + b" "
        + namespace.encode("ascii")
        + b"".join(b" %s:%d" % (k.encode("ascii"), n) for k, n in zip(keys, lengths, strict=True))
    )


def encode_store_end(lease: str, *, abort: bool = False, client: str | None = None) -> bytes:
    """One ``KVSC1`` (commit) or ``KVSA1`` (abort) message for ``lease``."""
    prefix = STORE_ABORT_PREFIX if abort else STORE_COMMIT_PREFIX
    return prefix + _client_part(client) + b" " + lease.encode("ascii")


def parse_store_request(data: bytes) -> StoreBegin | StoreEnd | None:
    """A store request's parts, or None if it is malformed.

    Only the shape is checked here (hex digests, decimal lengths, the key count); what the server
    accepts (the key limit, payload sizes) is checked where ``ShmStoreBegin`` checks it.
    """
    prefix = data[:5]
    parts = data[5:].split(b" ")
    if parts[0] != b"":
        return None
    client = None
    if len(parts) > 1 and parts[1].startswith(b"@"):
        if not _CLIENT.fullmatch(parts[1]):
            return None
        client = parts[1][1:].decode("ascii")
        del parts[1]
    if prefix in (STORE_COMMIT_PREFIX, STORE_ABORT_PREFIX):
        if len(parts) != 2 or not _LEASE.fullmatch(parts[1]):
            return None
        return StoreEnd(parts[1].decode("ascii"), prefix == STORE_ABORT_PREFIX, client)
    if prefix != STORE_BEGIN_PREFIX or not 3 <= len(parts) <= MAX_NAMES + 2:
        return None
    if not _HEX64.fullmatch(parts[1]):
        return None
    keys: list[str] = []
    lengths: list[int] = []
    for part in parts[2:]:
        m = _KEY_LENGTH.fullmatch(part)
        if m is None:
            return None
        keys.append(m.group(1).decode("ascii"))
        lengths.append(int(m.group(2)))
    return StoreBegin(parts[1].decode("ascii"), keys, lengths, client)


def encode_store_begun(lease: str, describe: bool, statuses: Sequence[int]) -> bytes:
    """The answer to a served begin (the staged keys' descriptors go with it, in key order)."""
    return bytes([STORE_BEGUN]) + lease.encode("ascii") + (b"1" if describe else b"0") + bytes(statuses)


def encode_store_done(accepted: int, dropped: int) -> bytes:
    """The answer to a served commit or abort."""
    return bytes([STORE_DONE]) + b"%d %d" % (accepted, dropped)


def encode_store_error(kind: bytes, reason: str) -> bytes:
    """The answer to a refused store request: ``kind`` (:data:`INVALID`...) and why (cut to 200 bytes)."""
    return bytes([STORE_ERROR]) + kind + reason.encode("utf-8", "replace")[:200]


def store_error(msg: bytes) -> tuple[bytes, str] | None:
    """``(kind, reason)`` of a refused store request's answer, or None if ``msg`` is not a refusal."""
    if msg[:1] == bytes([STORE_ERROR]) and len(msg) >= 2:
        return msg[1:2], msg[2:].decode("utf-8", "replace")
    return None


def parse_store_begun(msg: bytes, nkeys: int) -> tuple[str, bool, list[int]] | None:
    """``(lease, describe, statuses)`` of a served begin of ``nkeys`` keys, or None if malformed."""
    if msg[:1] != bytes([STORE_BEGUN]) or len(msg) != 34 + nkeys:
        return None
    lease, flag, statuses = msg[1:33], msg[33:34], list(msg[34:])
    if not _LEASE.fullmatch(lease) or flag not in (b"0", b"1"):
        return None
    if not all(b in (STAGED, PRESENT, DROPPED) for b in statuses):
        return None
    return lease.decode("ascii"), flag == b"1", statuses


def parse_store_done(msg: bytes) -> tuple[int, int] | None:
    """``(accepted, dropped)`` of a served commit or abort, or None if malformed."""
    if msg[:1] != bytes([STORE_DONE]):
        return None
    counts = msg[1:].split(b" ")
    if len(counts) != 2 or not all(c.isdigit() and len(c) <= 20 for c in counts):
        return None
    return int(counts[0]), int(counts[1])
