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
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "BAD_REQUEST",
    "FOUND",
    "GONE",
    "MAX_MESSAGE",
    "MAX_NAMES",
    "block_socket_for",
    "encode_request",
    "parse_request",
]

REQUEST_PREFIX = b"KVBK1"
MAX_NAMES = 64
"""Names per request (the kernel passes at most 253 descriptors per message)."""
FOUND = 0
GONE = 1
BAD_REQUEST = 0xFF
_NAME = re.compile(rb"[ds]_[0-9a-f]{32}")
MAX_MESSAGE = len(REQUEST_PREFIX) + MAX_NAMES * 35


def block_socket_for(unix_socket: str | os.PathLike[str]) -> Path:
    """Where the block socket of the server listening on ``unix_socket`` is (beside it)."""
    p = Path(unix_socket)
    return p.with_name(p.name + ".blocks")


def encode_request(names: Sequence[str]) -> bytes:
    """One request message for ``names`` (at most :data:`MAX_NAMES`)."""
    if not 0 < len(names) <= MAX_NAMES:
        raise ValueError(f"a block request names 1 to {MAX_NAMES} handles, not {len(names)}")
    return REQUEST_PREFIX + b"".join(b" " + n.encode("ascii") for n in names)


def parse_request(data: bytes) -> list[str] | None:
    """The names of a request message, or None if it is malformed."""
    if not data.startswith(REQUEST_PREFIX):
        return None
    parts = data[len(REQUEST_PREFIX) :].split(b" ")
    if parts[0] != b"" or not 0 < len(parts) - 1 <= MAX_NAMES:
        return None
    names = parts[1:]
    if not all(_NAME.fullmatch(n) for n in names):
        return None
    return [n.decode("ascii") for n in names]
