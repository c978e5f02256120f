"""Read-only bind mounts through mount(2): the node plugin's only side effect on the node.

ctypes over libc instead of the ``mount`` binary: the operator's image needs no util-linux, and the
flags are exactly the ones written here.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import re
import stat
from typing import Final

MS_RDONLY: Final = 0x1
MS_NOSUID: Final = 0x2
MS_NODEV: Final = 0x4
MS_NOEXEC: Final = 0x8
MS_REMOUNT: Final = 0x20
MS_BIND: Final = 0x1000
# A published socket directory needs none of these: nothing in it is a device or a program.
READ_ONLY_FLAGS: Final = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_OCTAL: Final = re.compile(r"\\([0-7]{3})")


def mount_points(mountinfo: str) -> list[str]:
    """Return the mount points listed in a ``/proc/<pid>/mountinfo`` text, in order, unescaped."""
    points = []
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) > 4:
            points.append(_OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4]))
    return points


def is_mounted(path: str) -> bool:
    """Whether ``path`` is a mount point in this process's mount namespace.

    From mountinfo, not ``os.path.ismount``: a bind mount from the same file system has the same
    st_dev as its parent, which ismount cannot tell from a plain directory.
    """
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return path in mount_points(f.read())


def _mount(source: str | None, target: str, flags: int) -> None:
    src = source.encode() if source is not None else None
    if _libc.mount(src, target.encode(), None, ctypes.c_ulong(flags), None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def ensure_directory(path: str, mode: int = 0o755) -> None:
    """Create ``path`` if missing; refuse a symlink or anything that is not a directory."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, mode)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, f"{path} is not a directory (a symlink is refused)")


def bind_read_only(source: str, target: str) -> None:
    """Bind ``source`` at ``target`` read-only, nosuid, nodev, noexec; never leave a writable bind.

    A bind mount takes the source's flags, so read-only needs a second, remounting call; if that
    fails the first is undone.
    """
    ensure_directory(target, 0o750)
    _mount(source, target, MS_BIND)
    try:
        _mount(None, target, READ_ONLY_FLAGS)
    except OSError:
        unmount(target, remove=False)
        raise


def unmount(target: str, *, remove: bool = True) -> None:
    """Unmount everything stacked at ``target`` (retries may have stacked binds), then remove it."""
    while is_mounted(target):
        if _libc.umount2(target.encode(), 0) != 0:
            err = ctypes.get_errno()
            if err == errno.EINVAL:  # not a mount point after all (raced): done
                break
            raise OSError(err, f"umount {target}: {os.strerror(err)}")
    if remove:
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(target)
