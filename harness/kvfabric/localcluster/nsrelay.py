"""A TCP relay from a network namespace's loopback to the host's loopback.

Each real node of the local cluster lives in its own network namespace, while the control plane
listens on the host's 127.0.0.1 only. This process opens its listening socket *inside* the node's
namespace (``setns`` for the moment of ``bind``; a socket keeps the namespace it was made in), then
returns to the host namespace and connects every accepted connection to the target there. So the
kubelet reaches ``https://127.0.0.1:<port>`` in its namespace, and nothing listens on a host address
other than loopback.

Run: ``python -m kvfabric.localcluster.nsrelay NETNS_PATH LISTEN_PORT TARGET_PORT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import sys

CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def listen_in(netns_path: str, port: int) -> socket.socket:
    """A listening socket on 127.0.0.1:``port`` inside the namespace at ``netns_path``."""
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(netns_path, os.O_RDONLY)
    try:
        _setns(target)
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen(128)
        finally:
            _setns(home)
    finally:
        os.close(home)
        os.close(target)
    sock.setblocking(False)
    return sock


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def serve(listener: socket.socket, target_port: int) -> None:
    """Relay every connection to 127.0.0.1:``target_port`` of the host namespace until cancelled."""

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            cw.close()
            return
        await asyncio.gather(_pipe(cr, uw), _pipe(ur, cw))

    server = await asyncio.start_server(handle, sock=listener)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    listener = listen_in(args[0], int(args[1]))
    asyncio.run(serve(listener, int(args[2])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
