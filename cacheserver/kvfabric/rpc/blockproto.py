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
    "block_socket_for",
    "encode_hold_request",
    "encode_request",
    "parse_request",
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
MAX_MESSAGE = len(REQUEST_PREFIX) + 66 + MAX_NAMES * 35 + MAX_NAMES * 36


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
