"""Read-only bind mounts through mount(2): the node plugin's side effects on the node.

Besides the binds, only the key volumes' files, written in a directory private to the plugin
before they are bound.

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
import tempfile
from typing import Final

MS_RDONLY: Final = 0x1
MS_NOSUID: Final = 0x2
MS_NODEV: Final = 0x4
MS_NOEXEC: Final = 0x8
MS_REMOUNT: Final = 0x20
MS_BIND: Final = 0x1000
# A published socket directory needs none of these: nothing in it is a device or a program.
READ_ONLY_FLAGS: Final = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
READ_ONLY_OPTIONS: Final = frozenset({"ro", "nosuid", "nodev", "noexec"})
MNT_DETACH: Final = 0x2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_OCTAL: Final = re.compile(r"\\([0-7]{3})")


def _mountinfo(text: str) -> list[list[str]]:
    """The fields of every line of a mountinfo text, with the paths (fields 3 and 4) unescaped."""
    out = []
    for line in text.splitlines():
        fields = line.split(" ")
        if len(fields) > 5:
            for i in (3, 4):
                fields[i] = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[i])
            out.append(fields)
    return out


def mount_options(path: str) -> set[str]:
    """The per-mount options of the topmost mount at ``path`` (empty when it is no mount point).

    From mountinfo, not ``os.path.ismount``: a bind mount from the same file system has the same
    st_dev as its parent, which ismount cannot tell from a plain directory.
    """
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        found = [fields for fields in _mountinfo(f.read()) if fields[4] == path]
    return set(found[-1][5].split(",")) if found else set()


def is_mounted(path: str) -> bool:
    """Whether ``path`` is a mount point in this process's mount namespace (every mount has options)."""
    return bool(mount_options(path))


def _mount(source: str | None, target: str, flags: int) -> None:
    src = os.fsencode(source) if source is not None else None
    if _libc.mount(src, os.fsencode(target), None, ctypes.c_ulong(flags), None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def ensure_directory(path: str, mode: int = 0o755) -> None:
    """Create ``path`` if missing; refuse a symlink or anything that is not a directory."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, mode)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, f"{path} is not a directory (a symlink is refused)")


def write_key_directory(directory: str, name: str, text: str) -> None:
    """Make ``directory`` afresh (0755) holding the file ``name`` (0444) with ``text``.

    Readable by everyone: the consumer's uid is not known here, and the directory reaches only the
    pod it is published into (read-only). Its parent is made 0700 (the plugin's own). A stale
    directory of an interrupted publish is replaced; a symlink anywhere on the way is refused.
    """
    ensure_directory(os.path.dirname(directory), 0o700)
    remove_key_directory(directory, name)
    os.mkdir(directory, 0o755)
    os.chmod(directory, 0o755)  # noqa: S103 - whatever the umask; it holds one world-readable key
    fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444)
    try:
        os.write(fd, text.encode())
        os.fchmod(fd, 0o444)
    finally:
        os.close(fd)


def remove_key_directory(directory: str, name: str) -> None:
    """Remove what :func:`write_key_directory` made; a directory already gone is success."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(directory, name))
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(directory)


def bind_read_only(source: str, target: str, staging_root: str) -> None:
    """Bind ``source`` at ``target`` read-only, nosuid, nodev, noexec; never expose a writable bind.

    A bind mount takes its source's flags, and a remount changes only the mount it is made on: under
    a shared target (the kubelet's pods directory, Bidirectional) a plain bind propagates to the node
    at once, writable, and remounting the plugin's copy read-only would leave the node's copy (the
    one containers get) writable. So the bind is made and made read-only in ``staging_root``, a
    private directory of the plugin's own mount namespace, and only that read-only mount is bound at
    the target (a bind of a read-only mount is read-only wherever it propagates).
    """
    stage = tempfile.mkdtemp(prefix="publish-", dir=staging_root)
    try:
        _mount(source, stage, MS_BIND)
        try:
            _mount(None, stage, READ_ONLY_FLAGS)
            ensure_directory(target, 0o750)
            _mount(stage, target, MS_BIND)
        finally:
            _umount(stage, MNT_DETACH)
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(stage)
    if not mount_options(target) >= READ_ONLY_OPTIONS:
        unmount(target, remove=False)
        raise OSError(errno.EPERM, f"{target} did not come out read-only; unmounted")


def _umount(target: str, flags: int = 0) -> None:
    if _libc.umount2(os.fsencode(target), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


def unmount(target: str, *, remove: bool = True) -> None:
    """Unmount everything stacked at ``target`` (retries may have stacked binds), then remove it."""
    while is_mounted(target):
        try:
            _umount(target)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # not a mount point after all (raced): done
                break
            raise
    if remove:
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(target)
