"""Injected I/O faults for tests: a slow disk, an NFS that answers ESTALE. Configured, never patched.

A tier configured with ``faults`` (``tiers.local_disk.faults`` / ``tiers.shared.faults``) delays each
block commit and fails each read as told, so a test drives the real server code through the race or
the failure it needs — the code under test is the code that ships.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass

__all__ = ["IoFaults"]


@dataclass(frozen=True, slots=True)
class IoFaults:
    """What to inject into one tier's I/O."""

    write_delay_seconds: float = 0.0
    """Sleep before each block write commits (its rename): a slow disk."""
    read_error: str | None = None
    """Errno name (``ESTALE``, ``EIO``, ...) every block read raises."""
    rename_delay_seconds: float = 0.0
    """Sleep inside each block write's commit, after its rename (a slow rename: deletes wait for it)."""
    read_delay_seconds: float = 0.0
    """Sleep before each block read (a hung network filesystem)."""

    def before_commit(self) -> None:
        """Run before a block write commits."""
        if self.write_delay_seconds > 0:
            time.sleep(self.write_delay_seconds)

    def during_commit(self) -> None:
        """Run inside a block write's commit, between its rename and its index update."""
        if self.rename_delay_seconds > 0:
            time.sleep(self.rename_delay_seconds)

    def before_read(self) -> None:
        """Run before a block read; sleeps and raises as configured."""
        if self.read_delay_seconds > 0:
            time.sleep(self.read_delay_seconds)
        if self.read_error is not None:
            code = getattr(errno, self.read_error)
            raise OSError(code, os.strerror(code))
