"""Per-server journals on the shared volume: how servers learn each other's blocks without probing.

Each server appends one line per event to ``journals/<server_id>.log`` and tails every other file:

    P <bucket> <namespace> <key> <length> [<gen>]   a block is stored (or refreshed into <bucket>)
    D <namespace> <key>                             a block was evicted (no longer on the volume)
    T <namespace> <key> <gen>                       a delete: no copy older than <gen> may be served
    X <bucket>                                      a whole bucket expired

``T`` is the one record that is more than a hint: every server applies it to all its tiers (DRAM and
local disk included), and the shared tier also leaves it on the volume as a tombstone file, so a
server that was down when it was written still honours it at start-up. Servers of an older release
skip the records they do not parse (a 6-field ``P``, a ``T``): a miss, never wrong bytes.

Lines are tiny single ``write`` calls on an O_APPEND file that only its owner writes, so a reader
sees whole lines or a partial last line (kept until its newline arrives). The journal is a hint, not
the truth: a stale "present" entry costs one failed open (then a miss and an index fix), a lost one a
miss — never wrong bytes, because every read verifies the block's checksums. That is what lets the
journal start over when it grows: on start-up and past :data:`MAX_JOURNAL_BYTES` its owner renames a
new, empty file over it; a tailer that sees a new inode (or a file shrink) starts it over.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kvfabric.cacheserver.engine.ids import BlockId, InvalidId

__all__ = ["Event", "JournalReader", "JournalWriter", "parse_lines"]

MAX_JOURNAL_BYTES = 64 << 20
SUFFIX = ".log"


@dataclass(frozen=True, slots=True)
class Event:
    """One journal entry."""

    op: str
    bid: BlockId | None = None
    bucket: int = 0
    length: int = 0
    gen: int = 0


def format_event(ev: Event) -> bytes:
    """Encode one event as a journal line."""
    if ev.op == "P" and ev.bid is not None:
        return f"P {ev.bucket} {ev.bid.namespace} {ev.bid.key} {ev.length} {ev.gen}\n".encode()
    if ev.op == "T" and ev.bid is not None:
        return f"T {ev.bid.namespace} {ev.bid.key} {ev.gen}\n".encode()
    if ev.op == "D" and ev.bid is not None:
        return f"D {ev.bid.namespace} {ev.bid.key}\n".encode()
    if ev.op == "X":
        return f"X {ev.bucket}\n".encode()
    raise ValueError(f"cannot encode {ev}")


def parse_lines(data: bytes) -> Iterator[Event]:
    """Decode complete lines; malformed ones (e.g. a torn write after a crash) are skipped."""
    for raw in data.split(b"\n"):
        parts = raw.decode("ascii", "replace").split()
        try:
            if len(parts) in (5, 6) and parts[0] == "P":
                gen = int(parts[5]) if len(parts) == 6 else 0
                yield Event("P", BlockId.parse(parts[2], parts[3]), int(parts[1]), int(parts[4]), gen)
            elif len(parts) == 4 and parts[0] == "T":
                yield Event("T", BlockId.parse(parts[1], parts[2]), gen=int(parts[3]))
            elif len(parts) == 3 and parts[0] == "D":
                yield Event("D", BlockId.parse(parts[1], parts[2]))
            elif len(parts) == 2 and parts[0] == "X":
                yield Event("X", bucket=int(parts[1]))
        except (InvalidId, ValueError):
            continue


class JournalWriter:
    """Appends this server's events to its own journal."""

    def __init__(self, journal_dir: Path, server_id: str) -> None:
        journal_dir.mkdir(parents=True, exist_ok=True)
        self.path = journal_dir / f"{server_id}{SUFFIX}"
        self._lock = threading.Lock()
        # Start empty: every server rebuilds its index from block headers at start-up, so nothing
        # this server wrote before its restart is still needed by anyone.
        self._size = 0
        self._fd = self._fresh_file()

    def _fresh_file(self) -> int:
        # A new file renamed over the old one, not a truncation: it has a new inode, so a tailer
        # knows to start it over even when it has already grown past the tailer's old position
        # (with truncation in place it would skip the new file's first records).
        tmp = self.path.with_name(f".{self.path.name}.{os.urandom(4).hex()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
        # The first line names this file's epoch: inode numbers are reused, epochs are not.
        head = f"E {os.urandom(8).hex()}\n".encode()
        os.write(fd, head)
        os.rename(tmp, self.path)
        self._size = len(head)
        return fd

    def append(self, events: list[Event]) -> None:
        """Append events in one write (best effort: a failed append costs other servers a miss)."""
        if not events:
            return
        data = b"".join(format_event(e) for e in events)
        with self._lock:
            if self._fd < 0:
                return
            try:
                if self._size + len(data) > MAX_JOURNAL_BYTES:
                    fd = self._fresh_file()
                    os.close(self._fd)
                    self._fd = fd
                os.write(self._fd, data)
                self._size += len(data)
            except OSError:
                return

    def reopen_if_removed(self) -> bool:
        """Start a fresh file if ours is no longer the one at our path; True if it did.

        A live server removed this server's files after it looked departed (paused for longer than
        the margin, engine/departed.py): appends to the unlinked file would reach nobody.
        """
        with self._lock:
            if self._fd < 0:
                return False
            try:
                if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                    return False
            except FileNotFoundError:
                pass
            except OSError:
                return False
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = self._fresh_file()
            except OSError:
                return False
            os.close(self._fd)
            self._fd = fd
            return True

    def close(self) -> None:
        """Close the journal file."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class JournalReader:
    """Tails every other server's journal from where it last stopped."""

    def __init__(self, journal_dir: Path, server_id: str) -> None:
        self.dir = journal_dir
        self.own = f"{server_id}{SUFFIX}"
        # name -> (epoch line, offset, stat signature when last read)
        self._pos: dict[str, tuple[bytes, int, tuple[int, int, int]]] = {}
        self._partial: dict[str, bytes] = {}

    def skip_to_end(self) -> None:
        """Start tailing from the current ends (called before the start-up scan, which covers the past)."""
        for name, size, sig in self._files():
            with contextlib.suppress(OSError), open(self.dir / name, "rb") as f:
                self._pos[name] = (_epoch(f), size, sig)

    def _files(self) -> list[tuple[str, int, tuple[int, int, int]]]:
        out = []
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.dir):
                if e.name.endswith(SUFFIX) and e.name != self.own and not e.name.startswith("."):
                    with contextlib.suppress(FileNotFoundError):
                        st = e.stat()
                        out.append((e.name, st.st_size, (st.st_ino, st.st_size, st.st_mtime_ns)))
        return out

    def poll(self) -> list[Event]:
        """Events appended since the last poll, across all other journals."""
        events: list[Event] = []
        files = self._files()
        for gone in set(self._pos) - {name for name, _, _ in files}:
            # Removed (a departed server's, engine/departed.py): its state would grow for ever.
            del self._pos[gone]
            self._partial.pop(gone, None)
        for name, size, sig in files:
            seen, pos, seen_sig = self._pos.get(name, (b"", 0, (-1, -1, -1)))
            if sig == seen_sig:
                continue  # same file, same size, same mtime: nothing new
            try:
                with open(self.dir / name, "rb") as f:
                    epoch = _epoch(f)
                    if epoch != seen or size < pos:
                        # A new file (its owner restarted or rotated it), even one that regrew to our
                        # old offset: start over. Replaying records is harmless: they are idempotent,
                        # and generations order them.
                        pos = 0
                        self._partial.pop(name, None)
                    f.seek(pos)
                    data = f.read(max(0, size - pos))
            except FileNotFoundError:
                continue
            self._pos[name] = (epoch, pos + len(data), sig if len(data) == size - pos else (-1, -1, -1))
            data = self._partial.pop(name, b"") + data
            cut = data.rfind(b"\n") + 1
            if cut < len(data):
                self._partial[name] = data[cut:]
            events.extend(parse_lines(data[:cut]))
        return events


def _epoch(f: BinaryIO) -> bytes:
    """The first line of an open journal (its epoch), or b"" when it has none yet."""
    line = os.pread(f.fileno(), 64, 0)
    return line[: line.find(b"\n") + 1] if b"\n" in line else b""
