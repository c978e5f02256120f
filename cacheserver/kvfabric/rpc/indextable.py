"""The published lookup index: one shared-memory table per namespace, read by same-node engines.

The cache server writes it; the engines on its node read it without any call. This module is the
layout and nothing else (pure functions over a memoryview, no I/O), so the writer
(:mod:`kvfabric.cacheserver.transport.indexpub`) and the reader (:mod:`kvfabric.client.localindex`) cannot
disagree about it. The server hands the table to a client as a sealed, read-only memfd over a Unix
socket (``SCM_RIGHTS``); see ``docs/performance.md``.

Layout (host byte order: writer and readers share one machine), all fields 64-bit::

    word 0  magic (32 bits) | version (16 bits) << 32
    word 1  seq          seqlock: odd while the writer changes slots; readers retry when it moved
    word 2  capacity     slots, a power of two; fixed for the life of a table
    word 3  count        occupied slots
    word 4  state        LIVE, or RETIRED (the server replaced this table, e.g. grew it: fetch again)
    word 5  heartbeat    CLOCK_MONOTONIC nanoseconds of the server's last heartbeat
    word 6  epoch        random per server process
    word 7  reserved
    word 8.. slots       0 = empty; else (first 8 bytes of the key as u64, low 2 bits cleared) | tier

Open addressing with linear probing, at most a quarter full (:data:`MAX_FILL`: the writer grows
into a new table before that), backward-shift deletion (no tombstones). A slot is the key's 62-bit
fingerprint plus its fastest tier. Keys are already cryptographic digests, so their first bytes are
uniform; one table per namespace means a client can only ever see the fingerprints of namespaces it
was given.

What a reader's answer means (the invariant the property tests check):

* **no false negatives**: a key whose store was acknowledged (and not deleted or evicted since) is
  found — the server updates the table before it acknowledges;
* **false positives only** for a 62-bit fingerprint collision within one namespace, or a block that
  went away after the answer (as with an RPC lookup); either becomes a load miss, which the
  connector already handles (the engine recomputes those tokens);
* an answer is a consistent snapshot (seqlock), or no answer (the caller asks over RPC instead).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "EVICTED",
    "HEADER_WORDS",
    "LIVE",
    "MAGIC",
    "MAX_FILL",
    "MAX_REPORT_LINE",
    "REPORTS_ACCEPTED",
    "REPORT_PREFIX",
    "REQUEST_PREFIX",
    "RETIRED",
    "TIER_CODES",
    "TIER_NAMES",
    "VERSION",
    "W_EPOCH",
    "W_HEARTBEAT",
    "W_SEQ",
    "W_STATE",
    "Inconsistent",
    "TableWriter",
    "encode_report",
    "fingerprint",
    "fingerprints",
    "fingerprints_raw",
    "header",
    "index_socket_for",
    "init_table",
    "lookup_prefix",
    "parse_report",
    "table_bytes",
]

MAGIC = 0x5849564B  # "KVIX"
VERSION = 1
HEADER_WORDS = 8
W_MAGIC, W_SEQ, W_CAPACITY, W_COUNT, W_STATE, W_HEARTBEAT, W_EPOCH = range(7)
LIVE, RETIRED = 0, 1
TIER_CODES = {"dram": 1, "local_disk": 2, "shared": 3}
TIER_NAMES = {v: k for k, v in TIER_CODES.items()}
_FP_MASK = ~3 & 0xFFFFFFFFFFFFFFFF
MAX_FILL = 4
"""A table holds at most ``capacity / MAX_FILL`` keys. At a quarter full about one key in eight
(one in four at half full) is not in its home slot and costs a reader a walk along the run in
Python (:mod:`kvfabric.client.indexprobe`); the price: a table of 8-byte slots is 32-64 bytes per
block once past its initial size (32 just before it grows, 64 just after)."""


class Inconsistent(Exception):  # noqa: N818 - a retry signal, not an error
    """The table changed while it was read (or is mid-write): read again."""


REQUEST_PREFIX = b"KVIX1 "
"""A client asks the index socket for a namespace's table with ``KVIX1 <namespace hex>\\n``; the reply
is one status byte (0 = ok, with the table's descriptor attached via ``SCM_RIGHTS``; else an error
byte and a message line)."""

EVICTED = b"\x06evicted\n"
"""Sent on a held connection that the server then closes to make room for another client's (not a
hang-up: the server still serves; the client drops that table and may fetch it again)."""


REPORTS_ACCEPTED = b"\x00r"
"""The ok reply of a server that counts the lookups its clients answer from the table: the status
byte then ``r``. Only to such a server does a client send reports (an older server would take any
byte on a held connection for a hang-up)."""

REPORT_PREFIX = b"r "
"""A client reports lookups it answered from a table on the connection that holds the table, as
``r <lookups> <hit keys> <missed keys>\n`` (decimal), in batches: the server adds them to the
lookup counters an RPC lookup feeds, so its metrics and the pool's hit rate see same-node lookups."""

MAX_REPORT_LINE = 64
_MAX_REPORTED = 1 << 48  # per number and line: beyond any honest batch, small enough to sum safely


def encode_report(lookups: int, hits: int, misses: int) -> bytes:
    """One report line (see :data:`REPORT_PREFIX`)."""
    return b"%s%d %d %d\n" % (REPORT_PREFIX, lookups, hits, misses)


def parse_report(line: bytes) -> tuple[int, int, int] | None:
    """``(lookups, hits, misses)`` of one report line without its newline; None if malformed."""
    if not line.startswith(REPORT_PREFIX) or len(line) >= MAX_REPORT_LINE:
        return None
    parts = line[len(REPORT_PREFIX) :].split(b" ")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    lookups, hits, misses = (int(p) for p in parts)
    if max(lookups, hits, misses) >= _MAX_REPORTED:
        return None
    return lookups, hits, misses


REPORT_LOOKUPS_PER_SECOND = 20_000
"""The most lookups one held connection's reports may claim per second: about what one client
process answers with RPC lookups over the Unix socket (tens of microseconds each), far above what an
engine's scheduler asks (one lookup per waiting request and step)."""
REPORT_KEYS_PER_SECOND = 4_000_000
"""The most keys (hits and misses) one held connection's reports may claim per second."""
REPORT_BURST_SECONDS = 2.0
"""How much unused budget a connection keeps: a report delayed by a full socket buffer still counts."""
REPORT_INITIAL_LOOKUPS = 16
"""Lookups a connection may report at once after the hand-out (a client that looks up a few times
and hangs up is counted): each table handed out is worth at most this many lookups more."""


class ReportBudget:
    """What one held connection's lookup reports may still claim: a bucket of lookups and keys.

    A report claims lookups its client answered from the table without the server seeing them, so
    the server cannot check them one by one; it bounds them instead to what the client could have
    done with RPC lookups: each line at most ``max_keys_per_lookup`` keys per lookup (the RPC's
    ``limits.max_keys_per_request``), and all lines of the connection at most
    :data:`REPORT_LOOKUPS_PER_SECOND` lookups and :data:`REPORT_KEYS_PER_SECOND` keys per second
    since the table was handed out (unused budget kept for :data:`REPORT_BURST_SECONDS`), plus
    :data:`REPORT_INITIAL_LOOKUPS`. Pure: the caller passes the clock.
    """

    def __init__(
        self,
        max_keys_per_lookup: int,
        now: float,
        *,
        lookups_per_second: float = REPORT_LOOKUPS_PER_SECOND,
        keys_per_second: float = REPORT_KEYS_PER_SECOND,
        burst_seconds: float = REPORT_BURST_SECONDS,
    ) -> None:
        """A bucket at ``now`` (monotonic seconds) with the hand-out's allowance; it fills from then on."""
        self.max_keys_per_lookup = max_keys_per_lookup
        self._rates = (lookups_per_second, keys_per_second)
        self._caps = (lookups_per_second * burst_seconds, keys_per_second * burst_seconds)
        self._lookups = float(REPORT_INITIAL_LOOKUPS)
        self._keys = float(REPORT_INITIAL_LOOKUPS * max_keys_per_lookup)
        self._at = now

    def admit(self, lookups: int, hits: int, misses: int, now: float) -> str | None:
        """Take one report line's claim from the budget; the reason it is refused, or None.

        ``implausible``: more keys than its lookups could have asked for; ``rate``: more than the
        connection's budget holds now. A refused line takes nothing.
        """
        keys = hits + misses
        if keys > lookups * self.max_keys_per_lookup:
            return "implausible"
        elapsed = max(0.0, now - self._at)
        self._at = max(self._at, now)
        self._lookups = min(self._caps[0], self._lookups + elapsed * self._rates[0])
        self._keys = min(self._caps[1], self._keys + elapsed * self._rates[1])
        if lookups > self._lookups or keys > self._keys:
            return "rate"
        self._lookups -= lookups
        self._keys -= keys
        return None


def index_socket_for(unix_socket: str | os.PathLike[str]) -> Path:
    """Where the index socket of the server listening on ``unix_socket`` is (beside it)."""
    p = Path(unix_socket)
    return p.with_name(p.name + ".index")


def table_bytes(capacity: int) -> int:
    """Size of a table of ``capacity`` slots (header included)."""
    return 8 * (HEADER_WORDS + capacity)


def fingerprint(key: str) -> int:
    """The u64 of a key's first 8 bytes, as :func:`fingerprints` computes it (the writer's form)."""
    return int.from_bytes(bytes.fromhex(key[:16]), sys.byteorder)


def fingerprints(keys: Sequence[str]) -> list[int]:
    """Fingerprints of validated 64-hex-character keys."""
    return fingerprints_raw(bytes.fromhex("".join(keys)))


def fingerprints_raw(raw: bytes) -> list[int]:
    """Fingerprints of keys given as their 32-byte digests, concatenated (the reader's hot path)."""
    if len(raw) % 32:
        raise ValueError("raw keys must be 32 bytes each")
    if not raw:
        return []
    # Every 4th u64 is the first 8 bytes of a 32-byte key: one C-level slice, no per-key Python.
    return memoryview(raw).cast("Q")[::4].tolist()


def init_table(words: memoryview, capacity: int, epoch: int, now_ns: int) -> None:
    """Format an all-zero buffer (cast to "Q") as an empty live table."""
    if capacity < 2 or capacity & (capacity - 1):
        raise ValueError(f"capacity must be a power of two >= 2, got {capacity}")
    if len(words) < HEADER_WORDS + capacity:
        raise ValueError("buffer too small for the table")
    words[W_CAPACITY] = capacity
    words[W_COUNT] = 0
    words[W_STATE] = LIVE
    words[W_HEARTBEAT] = now_ns
    words[W_EPOCH] = epoch & 0xFFFFFFFFFFFFFFFF
    words[W_SEQ] = 0
    words[W_MAGIC] = MAGIC | VERSION << 32


def lookup_prefix(words: memoryview, fps: Sequence[int]) -> list[int]:
    """Tier codes of the leading present fingerprints; stops at the first absent one.

    Raises :class:`Inconsistent` if the writer was active during the read (the caller retries) and
    ``ValueError`` if ``words`` is not a table of this version.
    """
    seq = words[W_SEQ]
    if seq & 1:
        raise Inconsistent
    if words[W_MAGIC] != MAGIC | VERSION << 32:
        raise ValueError("not a kvfabric index table of this version")
    cap = words[W_CAPACITY]
    mask = cap - 1
    base = HEADER_WORDS
    out: list[int] = []
    append = out.append
    for fp in fps:
        i = (fp >> 2) & mask
        v = words[base + i]
        if v == 0:
            break
        if v | 3 != fp | 3:  # not in its home slot (the common case is: at load <= 1/2)
            want, probes = fp | 3, 0
            while True:
                i = (i + 1) & mask
                v = words[base + i]
                if v == 0 or v | 3 == want:
                    break
                probes += 1
                if probes > cap:
                    # Never with a consistent table (at most a quarter full): a torn read, which
                    # the seqlock check would reject anyway.
                    raise Inconsistent
            if v == 0:
                break
        append(v & 3)
    if words[W_SEQ] != seq:
        raise Inconsistent
    return out


class TableWriter:
    """The single writer of one table (the caller serializes calls, e.g. under one lock)."""

    def __init__(self, words: memoryview) -> None:
        self.words = words
        self.capacity = words[W_CAPACITY]
        self._mask = self.capacity - 1

    @property
    def count(self) -> int:
        """Occupied slots."""
        return int(self.words[W_COUNT])

    def needs_growth(self, extra: int = 1) -> bool:
        """Whether adding ``extra`` keys would take the table past a quarter full (:data:`MAX_FILL`)."""
        return MAX_FILL * (self.count + extra) > self.capacity

    def _find(self, fp: int) -> tuple[int, int]:
        """(slot index, value) of ``fp``'s slot, or (first empty slot, 0)."""
        w, mask, want = self.words, self._mask, fp | 3
        i = (fp >> 2) & mask
        while True:
            v = w[HEADER_WORDS + i]
            if v == 0 or v | 3 == want:
                return i, v
            i = (i + 1) & mask

    def get(self, fp: int) -> int:
        """The tier code stored for ``fp`` (0 = absent)."""
        _, v = self._find(fp)
        return v & 3

    def set(self, fp: int, tier: int) -> None:
        """Publish ``fp`` with tier code ``tier`` (1..3), or remove it (``tier`` 0)."""
        i, v = self._find(fp)
        new = (fp & _FP_MASK) | tier if tier else 0
        if v == new:
            return
        if tier and v == 0 and self.needs_growth():
            raise OverflowError("table is a quarter full: grow it before inserting")
        w = self.words
        w[W_SEQ] += 1  # odd: readers retry
        try:
            if tier:
                w[HEADER_WORDS + i] = new
                if v == 0:
                    w[W_COUNT] += 1
            else:
                self._remove_at(i)
                w[W_COUNT] -= 1
        finally:
            w[W_SEQ] += 1  # even again

    def _remove_at(self, i: int) -> None:
        # Backward-shift deletion: pull later members of the probe run into the hole, so every key
        # stays reachable from its home slot without tombstones.
        w, mask = self.words, self._mask
        j = i
        while True:
            j = (j + 1) & mask
            v = w[HEADER_WORDS + j]
            if v == 0:
                break
            home = (v >> 2) & mask
            # Move v into the hole at i unless its home lies cyclically in (i, j].
            if (i < j and (home <= i or home > j)) or (i > j and home <= i and home > j):
                w[HEADER_WORDS + i] = v
                i = j
        w[HEADER_WORDS + i] = 0

    def items(self) -> list[int]:
        """Every occupied slot's value (fingerprint | tier), e.g. to copy into a larger table."""
        base = HEADER_WORDS
        return [v for v in self.words[base : base + self.capacity].tolist() if v]

    def load(self, values: Sequence[int]) -> None:
        """Insert slot values from :meth:`items` of another table (a fresh table, before publishing)."""
        for v in values:
            self.set(v & _FP_MASK, v & 3)

    def beat(self, now_ns: int) -> None:
        """Record a heartbeat (readers treat a table whose heartbeat stops as its server gone)."""
        self.words[W_HEARTBEAT] = now_ns

    def retire(self) -> None:
        """Mark the table replaced: readers stop using it and fetch the namespace's table again."""
        w = self.words
        w[W_SEQ] += 1
        w[W_STATE] = RETIRED
        w[W_SEQ] += 1


def header(words: memoryview) -> dict[str, int]:
    """The header fields (for readers' checks, tests and debugging)."""
    return {
        "magic": words[W_MAGIC] & 0xFFFFFFFF,
        "version": words[W_MAGIC] >> 32,
        "seq": words[W_SEQ],
        "capacity": words[W_CAPACITY],
        "count": words[W_COUNT],
        "state": words[W_STATE],
        "heartbeat_ns": words[W_HEARTBEAT],
        "epoch": words[W_EPOCH],
    }
