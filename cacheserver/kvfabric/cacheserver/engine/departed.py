"""Departed servers' files on the shared volume: noticed by watching, removed by a live server.

Every server leaves ``leases/<id>``, ``clocks/<id>``, ``journals/<id>.log`` and ``tmp/<id>/`` on the
shared volume, and server ids are node names: with an autoscaled node pool, every node that ever ran
adds four entries that every server scans (the journals every ``journal_poll_seconds``). Nothing
removed them. :class:`DepartedServers` does, safely:

* **Departed** is decided the way liveness is (``ttl.PeerClocks``): by *watching*, on this server's
  monotonic clock, never by comparing a file's mtime with a clock — on a client-stamped volume a live
  server whose clock is days behind stamps days-old mtimes. A server whose files (lease, clock file,
  journal) have not changed at all for ``departed_after_s`` of our watching has departed; a live
  one changes its lease and clock file every janitor tick. The margin is generous (ten leases, at
  least ten minutes by default): it only delays the cleanup. A server that starts watching starts
  every id's clock afresh, so it removes nothing before it has watched for the whole margin.
* **Removal** is claimed like a bucket expiry: the lease is renamed to a private name first; if the
  claimed lease turns out to have changed since we last saw it, its owner came back and the claim is
  undone. Each other file is removed only if it is still exactly what we watched (same inode, size
  and mtime).
* **A server that comes back anyway** (paused for longer than the margin) recreates what it finds
  missing at its next janitor tick: its lease and clock file (``touch_lease``, ``SharedClock.sync``),
  its journal (:meth:`~kvfabric.cacheserver.engine.journal.JournalWriter.reopen_if_removed`) and its
  temp directory. What it appended meanwhile is lost to the others, which a journal tolerates (a
  hint: misses, never wrong bytes; deletes also leave tombstone files).

The files are not charged to the tier's ``capacity_bytes`` (a budget for blocks, which eviction can
free): leases and clock files are empty, a live journal starts over past 64 MiB, and a departed
server's go after the margin.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEPARTED_AFTER_MIN_S", "DepartedServers", "departed_after"]

log = logging.getLogger(__name__)

DEPARTED_AFTER_MIN_S = 600.0
LEASES, CLOCKS, JOURNALS, TMP = "leases", "clocks", "journals", "tmp"
JOURNAL_SUFFIX = ".log"

Signature = tuple[tuple[int, int, int] | None, ...]
"""Per file of a server (lease, clock, journal): ``(inode, size, mtime_ns)``, or None when absent."""


def departed_after(lease_seconds: float) -> float:
    """The default margin: ten leases, and never under ten minutes."""
    return max(10 * lease_seconds, DEPARTED_AFTER_MIN_S)


@dataclass(slots=True)
class _Watched:
    sig: Signature
    changed_mono: float


def _stat(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class DepartedServers:
    """Watches every server id with files on the shared volume; removes the departed ones' files."""

    def __init__(self, root: Path, own: str, departed_after_s: float) -> None:
        self.root = root
        self.own = own
        self.departed_after_s = departed_after_s
        self._watched: dict[str, _Watched] = {}
        self.removed = 0
        """Server ids whose files this server removed (lifetime)."""

    def _paths(self, sid: str) -> tuple[Path, Path, Path]:
        return (
            self.root / LEASES / sid,
            self.root / CLOCKS / sid,
            self.root / JOURNALS / f"{sid}{JOURNAL_SUFFIX}",
        )

    def _signature(self, sid: str) -> Signature:
        return tuple(_stat(p) for p in self._paths(sid))

    def server_ids(self) -> set[str]:
        """Every server id with a lease, a clock file, a journal or a temp directory (not ours)."""
        ids: set[str] = set()
        for sub, suffix in ((LEASES, ""), (CLOCKS, ""), (JOURNALS, JOURNAL_SUFFIX), (TMP, "")):
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                for e in os.scandir(self.root / sub):
                    if e.name.startswith(".") or not e.name.endswith(suffix):
                        continue
                    ids.add(e.name.removesuffix(suffix) if suffix else e.name)
        ids.discard(self.own)
        return ids

    def observe(self) -> list[str]:
        """Look at every server's files once; return the ids departed for the whole margin."""
        mono = time.monotonic()
        ids = self.server_ids()
        for gone in set(self._watched) - ids:
            del self._watched[gone]
        departed = []
        for sid in ids:
            sig = self._signature(sid)
            seen = self._watched.get(sid)
            if seen is None or seen.sig != sig:
                self._watched[sid] = _Watched(sig, mono)
            elif mono - seen.changed_mono > self.departed_after_s:
                departed.append(sid)
        return sorted(departed)

    def reap(self) -> list[str]:
        """Observe, then remove the files of every departed server; returns the ids removed."""
        removed = [sid for sid in self.observe() if self._remove(sid)]
        if removed:
            self.removed += len(removed)
            log.info(
                "removed departed servers' files",
                extra={"servers": len(removed), "first": removed[0], "server_id": self.own},
            )
        return removed

    def _remove(self, sid: str) -> bool:
        seen = self._watched[sid]
        lease, clock, journal = self._paths(sid)
        claimed: Path | None = None
        if seen.sig[0] is not None:
            claimed = lease.with_name(f".reap-{sid}-{os.urandom(4).hex()}")
            try:
                os.rename(lease, claimed)
            except FileNotFoundError:
                return False  # changed under us: look again next time
            if _stat(claimed) != seen.sig[0]:
                self._undo(claimed, lease)  # it was renewed between our look and the claim
                del self._watched[sid]
                return False
        if (_stat(clock), _stat(journal)) != seen.sig[1:]:
            # It is starting (a new journal, a synced clock) or came back: leave it everything.
            if claimed is not None:
                self._undo(claimed, lease)
            del self._watched[sid]
            return False
        for path in (clock, journal):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        shutil.rmtree(self.root / TMP / sid, ignore_errors=True)
        if claimed is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(claimed)
        del self._watched[sid]
        return True

    @staticmethod
    def _undo(claimed: Path, lease: Path) -> None:
        # Put the lease back unless its owner already made a new one (then ours is older: drop it).
        try:
            os.link(claimed, lease)
        except FileExistsError:
            pass
        except OSError:
            with contextlib.suppress(OSError):
                os.rename(claimed, lease)
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(claimed)
