"""TTL buckets, the shared-volume clock, liveness leases and bucket ownership.

One clock for every expiry decision (buckets, leases, temp-file reaping), correct whoever stamps
the shared volume's timestamps:

* **Volume time.** Every server touches its own clock file on the shared volume
  (``clocks/<server_id>``, ``os.utime(path, None)``) and reads its mtime back; the offset to the
  local monotonic clock gives volume time between touches. On NFS the NFS server stamps it, so every
  server reads the same clock. The file is per server because on a client-stamped volume a peer
  touching a shared one between this server's touch and its read would hand this server the peer's
  clock (a peer days ahead made a correct server expire everything early).
* **Client-stamped filesystems** (CephFS, Lustre, FUSE) stamp the *client's* clock, so each server's
  "volume time" is just its own wall clock. Therefore no decision compares a file's mtime with this
  server's clock alone: liveness is decided by *watching* leases change (a lease that has not
  changed for ``lease_seconds`` of this server's monotonic clock is dead, whatever its mtime says),
  each live server's clock is estimated from its own lease stamps (:class:`PeerClocks`), a temp file
  is aged against the clock of the server that wrote it, and a bucket expires only when it is older
  than the TTL by the *earliest* live server's clock — a server days ahead expires nothing early
  (expiring late is safe). The start-up check says when the volume's stamps follow this server's
  clock (log and the ``kvfabric_volume_stamps_local_clock`` metric).

Ownership: each live server gets the buckets for which its rendezvous hash is highest, so exactly
one live server expires a given bucket; the expiry itself is claimed by an atomic rename of the
bucket directory, so even two servers that briefly disagree about who is alive cannot both expire it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import xxhash

__all__ = [
    "LocalClock",
    "PeerClocks",
    "SharedClock",
    "bucket_of",
    "clock_path",
    "expired_buckets",
    "live_servers",
    "owner_of",
    "touch_lease",
    "wallclock",
]

log = logging.getLogger(__name__)
SKEW_ENV = "KVFABRIC_TEST_CLOCK_SKEW_SECONDS"
# Stamps within this of the local clock "follow the local clock" (client-stamped, or clocks in sync).
LOCAL_STAMP_TOLERANCE_S = 0.05


def wallclock() -> float:
    """Return this machine's wall clock (``time.time()``), skewed by $KVFABRIC_TEST_CLOCK_SKEW_SECONDS.

    The skew exists for tests that prove expiry ignores the local clock (see :class:`LocalClock`).
    """
    return LocalClock().now()


def clock_path(shared_root: Path, server_id: str) -> Path:
    """The clock file only ``server_id`` touches (see the module docstring for why it is its own)."""
    return shared_root / "clocks" / server_id


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


def touch_lease(lease_dir: Path, server_id: str, local: LocalClock | None = None) -> None:
    """Renew this server's liveness lease (its mtime is stamped like every volume timestamp)."""
    path = lease_dir / server_id
    stamp = local.stamp if local is not None else _stamp
    try:
        stamp(path)
    except FileNotFoundError:
        lease_dir.mkdir(parents=True, exist_ok=True)
        path.touch()
        stamp(path)


def drop_lease(lease_dir: Path, server_id: str) -> None:
    """Give up the lease at a clean shutdown so the others take over its buckets at once."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lease_dir / server_id)


def live_servers(lease_dir: Path, now: float, lease_seconds: float) -> list[str]:
    """Servers whose lease mtime is within ``lease_seconds`` of ``now`` (only right on NFS-like volumes).

    Kept for tools; the server itself decides liveness with :class:`PeerClocks`.
    """
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


def _stamp(path: Path) -> None:
    os.utime(path, None)


class LocalClock:
    """This machine's wall clock, and how this server stamps times on the shared volume.

    ``skew_seconds`` is a test hook emulating a machine whose clock is that far off *on a
    client-stamped filesystem*: the clock reads ahead, and every timestamp the server stamps on the
    volume (clock file, lease) carries the same skew — the fault is real for the code under test.
    """

    def __init__(self, skew_seconds: float = 0.0) -> None:
        self.skew = skew_seconds

    def now(self) -> float:
        """Wall-clock seconds since the epoch, plus the emulated skew and the test environment's."""
        return time.time() + self.skew + float(os.environ.get(SKEW_ENV, "0") or 0)

    def stamp(self, path: Path) -> None:
        """Set ``path``'s mtime to "now" as the volume stamps it."""
        if self.skew:
            t = time.time() + self.skew
            os.utime(path, (t, t))
        else:
            os.utime(path, None)


@dataclass(slots=True)
class _Seen:
    mtime: float
    changed_mono: float


class PeerClocks:
    """Other servers' liveness and clocks, learned by watching their lease files change.

    A lease whose mtime changed at our monotonic time ``m`` tells that its owner's stamping clock
    read ``mtime`` at about ``m``: its clock now is about ``mtime + (monotonic() - m)`` (an
    underestimate by at most one janitor interval: safe, it only delays expiry). A lease unchanged
    for ``lease_seconds`` of *our* monotonic clock is dead — no comparison of its mtime with our clock.
    """

    def __init__(self, lease_dir: Path, own: str, lease_seconds: float) -> None:
        self.lease_dir = lease_dir
        self.own = own
        self.lease_seconds = lease_seconds
        self._lock = threading.Lock()
        self._seen: dict[str, _Seen] = {}

    def observe(self) -> None:
        """Look at every lease once (each janitor tick)."""
        mono = time.monotonic()
        current: dict[str, float] = {}
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.lease_dir):
                if e.name != self.own and not e.name.startswith("."):
                    with contextlib.suppress(FileNotFoundError):
                        current[e.name] = e.stat().st_mtime
        with self._lock:
            for name in list(self._seen):
                if name not in current:
                    del self._seen[name]  # dropped at a clean shutdown
            for name, mtime in current.items():
                seen = self._seen.get(name)
                if seen is None or seen.mtime != mtime:
                    self._seen[name] = _Seen(mtime, mono)

    def live(self) -> list[str]:
        """Other servers whose lease changed within ``lease_seconds`` of our monotonic clock."""
        mono = time.monotonic()
        with self._lock:
            return sorted(n for n, s in self._seen.items() if mono - s.changed_mono <= self.lease_seconds)

    def clock_of(self, name: str) -> float | None:
        """Estimated stamping clock of a live server now, or None if it is not live."""
        mono = time.monotonic()
        with self._lock:
            s = self._seen.get(name)
            if s is None or mono - s.changed_mono > self.lease_seconds:
                return None
            return s.mtime + (mono - s.changed_mono)

    def clocks(self) -> list[float]:
        """Estimated clocks of every live server."""
        return [c for n in self.live() if (c := self.clock_of(n)) is not None]


class SharedClock:
    """Volume time (see the module docstring), extrapolated with a monotonic clock.

    Without a shared volume (``path`` None) the local wall clock is used: a single server has nobody to
    disagree with, and its own clock only moves its own buckets. With one, :meth:`expiry_now` is the
    earliest of this server's volume time and every live peer's clock (:class:`PeerClocks`).
    """

    def __init__(self, path: Path | None, local: LocalClock | None = None) -> None:
        self._path = path
        self.local = local or LocalClock()
        self.peers: PeerClocks | None = None
        self._lock = threading.Lock()
        self._offset: float | None = None
        self.stamps_local_clock: bool | None = None
        """Whether the volume's timestamps follow this server's clock (None: not known yet)."""
        if path is None:
            self._offset = 0.0
        else:
            self.sync()
            self._check_stamping()

    def _check_stamping(self) -> None:
        now = self.now()
        if now is None:
            return
        follows = abs(now - self.local.now()) <= LOCAL_STAMP_TOLERANCE_S
        self.stamps_local_clock = follows
        if follows:
            log.warning(
                "the shared volume's timestamps follow this server's clock: a client-stamped filesystem "
                "(CephFS, Lustre, FUSE) or clocks in sync; expiry uses the earliest live server's clock",
                extra={"clock_file": str(self._path)},
            )
        else:
            log.info(
                "the shared volume stamps its own clock",
                extra={"clock_file": str(self._path), "offset_seconds": round(now - self.local.now(), 3)},
            )

    def sync(self) -> bool:
        """Touch the clock file and re-read volume time; False (clock unknown) on failure."""
        if self._path is None:
            return True
        try:
            try:
                self.local.stamp(self._path)
            except FileNotFoundError:
                self._path.parent.mkdir(parents=True, exist_ok=True)
                self._path.touch()
                self.local.stamp(self._path)
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
                return self.local.now()
            return self._offset + time.monotonic()

    def now_or_local(self) -> float:
        """Volume time, or the local clock when unknown (for stamping, never for expiry)."""
        t = self.now()
        return self.local.now() if t is None else t

    def attach_peers(self, peers: PeerClocks) -> None:
        """Let expiry also follow the other servers' clocks (the shared tier watches their leases)."""
        self.peers = peers

    def expiry_now(self) -> float | None:
        """The time every expiry decision uses: the earliest live clock; None when unknown."""
        t = self.now()
        if t is None or self.peers is None:
            return t
        return min([t, *self.peers.clocks()])

    def spread(self) -> float:
        """Seconds between the latest and the earliest live clock (0 when alone or unknown)."""
        t = self.now()
        if t is None or self.peers is None:
            return 0.0
        clocks = [t, *self.peers.clocks()]
        return max(clocks) - min(clocks)
