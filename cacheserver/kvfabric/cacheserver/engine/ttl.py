"""TTL buckets, the shared-volume clock, liveness leases and bucket ownership.

Time for expiry never comes from this machine's clock. Every server touches a clock file on the
shared volume (``os.utime(path, None)``: the *filesystem* stamps the time — the NFS server's clock
on NFS, the kernel's on a local filesystem) and reads its mtime back; the offset to the local
monotonic clock gives "volume time" between touches. A server whose wall clock is hours off therefore
expires nothing early. If the clock file cannot be touched, the clock is unknown and nothing expires.

Ownership: each live server (lease file touched within ``lease_seconds`` of volume time) gets the
buckets for which its rendezvous hash is highest, so exactly one live server expires a given bucket;
the expiry itself is claimed by an atomic rename of the bucket directory, so even two servers that
briefly disagree about who is alive cannot both expire it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import xxhash

__all__ = [
    "SharedClock",
    "bucket_of",
    "expired_buckets",
    "live_servers",
    "owner_of",
    "touch_lease",
    "wallclock",
]

SKEW_ENV = "KVFABRIC_TEST_CLOCK_SKEW_SECONDS"


def wallclock() -> float:
    """Return this machine's wall clock (``time.time()``), skewed by $KVFABRIC_TEST_CLOCK_SKEW_SECONDS.

    The skew exists for tests that prove expiry ignores the local clock: only log lines and fallback
    clocks (no shared volume) use this.
    """
    return time.time() + float(os.environ.get(SKEW_ENV, "0") or 0)


def bucket_of(t: float, bucket_seconds: int) -> int:
    """Return the bucket containing time ``t``."""
    return int(t // bucket_seconds)


def expired_buckets(
    buckets: Iterable[int], now: float, *, ttl_seconds: int, bucket_seconds: int
) -> list[int]:
    """Buckets whose every block is older than the TTL: the bucket *ended* more than ttl ago."""
    return sorted(b for b in buckets if (b + 1) * bucket_seconds + ttl_seconds <= now)


def owner_of(bucket: int, servers: Iterable[str]) -> str | None:
    """Rendezvous (highest-random-weight) owner of ``bucket`` among ``servers``."""
    best: tuple[int, str] | None = None
    for sid in servers:
        w = xxhash.xxh3_64_intdigest(f"{sid}\0{bucket}".encode())
        if best is None or (w, sid) > best:
            best = (w, sid)
    return None if best is None else best[1]


def touch_lease(lease_dir: Path, server_id: str) -> None:
    """Renew this server's liveness lease (its mtime is volume time)."""
    path = lease_dir / server_id
    try:
        os.utime(path, None)
    except FileNotFoundError:
        lease_dir.mkdir(parents=True, exist_ok=True)
        path.touch()


def drop_lease(lease_dir: Path, server_id: str) -> None:
    """Give up the lease at a clean shutdown so the others take over its buckets at once."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lease_dir / server_id)


def live_servers(lease_dir: Path, now: float, lease_seconds: float) -> list[str]:
    """Servers whose lease was renewed within ``lease_seconds`` of volume time ``now``."""
    out = []
    try:
        entries = list(os.scandir(lease_dir))
    except FileNotFoundError:
        return []
    for e in entries:
        try:
            if now - e.stat().st_mtime <= lease_seconds:
                out.append(e.name)
        except FileNotFoundError:
            continue
    return sorted(out)


class SharedClock:
    """Volume time: the mtime of a clock file on the shared volume, extrapolated with a monotonic clock.

    Without a shared volume (``path`` None) the local wall clock is used: a single server has nobody to
    disagree with, and its own clock only moves its own buckets.
    """

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._offset: float | None = None
        if path is None:
            self._offset = 0.0
        else:
            self.sync()

    def sync(self) -> bool:
        """Touch the clock file and re-read volume time; False (clock unknown) on failure."""
        if self._path is None:
            return True
        try:
            try:
                os.utime(self._path, None)
            except FileNotFoundError:
                self._path.parent.mkdir(parents=True, exist_ok=True)
                self._path.touch()
            mono = time.monotonic()
            mtime = os.stat(self._path).st_mtime
        except OSError:
            with self._lock:
                self._offset = None
            return False
        with self._lock:
            self._offset = mtime - mono
        return True

    def now(self) -> float | None:
        """Volume time in seconds since the epoch, or None when unknown (then nothing expires)."""
        with self._lock:
            if self._offset is None:
                return None
            if self._path is None:
                return wallclock()
            return self._offset + time.monotonic()

    def now_or_local(self) -> float:
        """Volume time, or the local clock when unknown (for stamping, never for expiry)."""
        t = self.now()
        return wallclock() if t is None else t
