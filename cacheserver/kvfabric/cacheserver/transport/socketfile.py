"""A listening Unix socket's file: bound under a fresh name, published in one rename, removed only if ours.

Two servers take turns on one socket path during a hand-over (transport/handover.py), and a killed
server leaves its file behind. Binding the path itself would need an ``unlink`` first (a moment with
no file: a client connecting then gets ``ENOENT``), and a listener that removes "its" path when it
stops (gRPC does) would remove whichever socket has that name by then: the successor's. So each
listener binds a fresh name beside the path, :meth:`SocketFile.publish` renames it onto the path
(replacing the old file in one step), and :meth:`SocketFile.remove` unlinks the path only while it
is still the file this process published.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

__all__ = ["SocketFile"]


class SocketFile:
    """The file of one listening socket at ``path`` (bind to :attr:`bound` first)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.bound = path.with_name(f"{path.name}.{secrets.token_hex(4)}")
        """The fresh name to bind to; it becomes :attr:`path` at :meth:`publish`."""
        self._ident: tuple[int, int] | None = None

    @property
    def published(self) -> bool:
        """Whether :meth:`publish` ran."""
        return self._ident is not None

    def publish(self) -> None:
        """Rename the bound socket onto the path (replacing whatever socket file is there)."""
        os.rename(self.bound, self.path)
        st = os.stat(self.path)
        self._ident = (st.st_dev, st.st_ino)

    def remove(self) -> None:
        """Remove the socket file if it is still this one (never a successor's); drop the bound name."""
        with contextlib.suppress(FileNotFoundError):
            self.bound.unlink()
        if self._ident is None:
            return
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._ident:
                os.unlink(self.path)
