"""Receiving descriptors over a Unix socket, close-on-exec from the moment they arrive.

The standard library's ``socket.recv_fds`` drops its ``flags`` argument: in Python 3.11 (which
this project's tests run) and 3.12 (which its images run) it never reaches ``recvmsg``. So
``MSG_CMSG_CLOEXEC`` passed to it is silently ignored and every received descriptor is
inheritable: a process the engine starts (a compiler, a tokenizer server) would inherit the
cache's blocks. Setting ``FD_CLOEXEC`` afterwards is not enough either, since another thread may
fork in between.
"""

from __future__ import annotations

import array
import socket

__all__ = ["recv_fds"]


def recv_fds(sock: socket.socket, bufsize: int, maxfds: int) -> tuple[bytes, list[int], int]:
    """``(message, descriptors, msg_flags)`` of one ``recvmsg``; every descriptor is close-on-exec.

    The caller owns the descriptors, and checks ``msg_flags & socket.MSG_CTRUNC`` (some were
    dropped by the kernel: this process is out of descriptors).
    """
    fds = array.array("i")
    msg, ancdata, flags, _addr = sock.recvmsg(
        bufsize, socket.CMSG_LEN(maxfds * fds.itemsize), socket.MSG_CMSG_CLOEXEC
    )
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    return msg, list(fds), flags
