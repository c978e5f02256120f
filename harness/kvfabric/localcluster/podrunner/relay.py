"""Cluster services on the host's loopback, reachable from inside pods' network namespaces.

A pod the runner starts has a network namespace with loopback only. A service the harness runs on
the host's 127.0.0.1 (the S3 server of the object tier) is what a real cluster would offer as a
Service; the runner makes it reachable at the same address inside every pod: for each relayed port
it binds ``127.0.0.1:<port>`` *inside* the pod's namespace (:func:`kvfabric.localcluster.nsrelay.listen_in`)
and pipes each connection to the same port of the host. So an endpoint such as
``http://127.0.0.1:8333`` means the same server to the operator (a host process) and to the cache
servers (pods), and nothing listens beyond loopback.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading

from kvfabric.localcluster.nsrelay import listen_in

log = logging.getLogger("kvfabric.podrunner")


class PortRelay:
    """Relays ``ports`` of one network namespace's loopback to the host's, until :meth:`close`."""

    def __init__(self, netns_path: str, ports: tuple[int, ...]) -> None:
        self._listeners: list[socket.socket] = []
        self._closed = threading.Event()
        for port in ports:
            sock = listen_in(netns_path, port)
            sock.setblocking(True)
            sock.settimeout(0.5)  # the accept loop notices close() within this
            self._listeners.append(sock)
            threading.Thread(
                target=self._accept, args=(sock, port), name=f"relay-{port}", daemon=True
            ).start()

    def _accept(self, listener: socket.socket, port: int) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", port), timeout=10)
            except OSError as exc:
                log.info("relay to 127.0.0.1:%d failed: %s", port, exc)
                conn.close()
                continue
            conn.settimeout(None)
            upstream.settimeout(None)
            for src, dst in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=_pipe, args=(src, dst), daemon=True).start()

    def close(self) -> None:
        """Stop accepting (connections in flight end when either side closes)."""
        self._closed.set()
        for sock in self._listeners:
            with contextlib.suppress(OSError):
                sock.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        # Half-close: the other direction may still carry the response.
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        with contextlib.suppress(OSError):
            src.close()
