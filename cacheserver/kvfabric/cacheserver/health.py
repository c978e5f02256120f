"""Readiness from the data path: each same-node listener proves, from inside the process, that it serves.

A flag set once at start says nothing about a listener whose accept loop died later (a thread that
could not be started, a descriptor limit, a socket file someone removed). So a background thread
probes every listener the way a client reaches it, through its published path, at a fixed interval
and with a short deadline each:

* ``grpc``: a gRPC health check on the Unix socket (``SERVING``);
* ``blocks``: a block-socket request for a name that does not exist (answered ``GONE``);
* ``index``: a request for the table of :data:`PROBE_NAMESPACE`, a namespace the server knows for
  this purpose only, taking the path an engine's request takes (peer bounds, table places): answered
  with a live table whose heartbeat is fresh, or the listener is down. So ``/readyz`` cannot say
  ready while the index socket refuses engines.

A listener is *up* while its last probe got that answer in time. ``/readyz`` fails (503) when any is
down, or when the probes themselves stalled, and its body names each listener and why
(``docs/cacheserver.md``, "Health"); the same is exported as ``kvfabric_listener_up{listener}``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvfabric.rpc import blockproto as bp
from kvfabric.rpc import indextable as it

__all__ = ["PROBE_NAMESPACE", "ListenerProbes", "ListenerState", "probe_blocks", "probe_grpc", "probe_index"]

log = logging.getLogger(__name__)

PROBE_INTERVAL_SECONDS = 1.0
PROBE_DEADLINE_SECONDS = 1.0
_ABSENT_BLOCK = "d_" + "0" * 32  # a well-formed name no block ever has (names are random)
PROBE_NAMESPACE = hashlib.sha256(b"kvfabric listener probe").hexdigest()
"""The namespace the index probe asks for; the server counts it as described (an empty table)."""
HEARTBEAT_STALE_SECONDS = 2.0  # the index probe fails on a table whose heartbeat is older

Probe = Callable[[float], None]
"""Probes one listener within a deadline (seconds); raises ``OSError`` or ``ProbeFailedError`` if it does not
serve."""


class ProbeFailedError(Exception):
    """A listener answered, but not what a serving listener answers."""


@dataclass(frozen=True, slots=True)
class ListenerState:
    """The outcome of a listener's last probe."""

    up: bool
    reason: str  # "" when up
    at: float  # monotonic seconds of the probe


def probe_index(path: Path) -> Probe:
    """A probe of the index socket at ``path``."""

    def probe(deadline: float) -> None:
        with _connected(path, deadline, socket.SOCK_STREAM) as s:
            s.sendall(it.REQUEST_PREFIX + PROBE_NAMESPACE.encode() + b"\n")
            reply, fds, _, _ = socket.recv_fds(s, 64, 1)
        try:
            if reply[:1] != b"\x00" or len(fds) != 1:
                if not reply:
                    raise ProbeFailedError("closed without an answer")
                text = reply[1:64].decode(errors="replace").strip()
                raise ProbeFailedError(
                    f"refuses a table: {text}" if reply[:1] != b"\x00" else "no table sent"
                )
            _check_table(fds[0])
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    return probe


def _check_table(fd: int) -> None:
    """The table behind ``fd`` is live and its heartbeat fresh (the publisher beats)."""
    size = os.fstat(fd).st_size
    if size < it.table_bytes(2):
        raise ProbeFailedError(f"table of {size} bytes")
    with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mp:
        words = memoryview(mp).cast("Q")
        try:
            hdr = it.header(words)
        finally:
            words.release()
    if hdr["magic"] != it.MAGIC or hdr["state"] != it.LIVE:
        raise ProbeFailedError("the table sent is not a live table")
    age = (time.monotonic_ns() - hdr["heartbeat_ns"]) / 1e9
    if age > HEARTBEAT_STALE_SECONDS:
        raise ProbeFailedError(f"the table's heartbeat is {age:.1f} s old")


def probe_blocks(path: Path) -> Probe:
    """A probe of the block socket at ``path``."""

    def probe(deadline: float) -> None:
        with _connected(path, deadline, socket.SOCK_SEQPACKET) as s:
            s.sendall(bp.encode_request([_ABSENT_BLOCK]))
            reply, fds, _, _ = socket.recv_fds(s, 64, 4)
            for fd in fds:
                with contextlib.suppress(OSError):
                    socket.close(fd)
        if reply[:1] == b"\xfe":  # REFUSED: it takes no more connections (a reason follows)
            raise ProbeFailedError(f"refuses new connections: {reply[1:64].decode(errors='replace')}")
        if reply[:1] not in (bytes([bp.GONE]), bytes([bp.FOUND])):
            raise ProbeFailedError(
                f"unexpected answer {reply[:16]!r}" if reply else "closed without an answer"
            )

    return probe


def probe_grpc(path: Path) -> Probe:
    """A probe of the gRPC Unix socket at ``path`` (the standard health service)."""

    def probe(deadline: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        if not path.exists():
            raise ProbeFailedError(f"socket file {path} is missing")
        with grpc.insecure_channel(f"unix://{path}") as channel:
            try:
                got = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=deadline
                )
            except grpc.RpcError as exc:
                raise ProbeFailedError(f"health check failed: {exc.code().name}") from None
        if got.status != health_pb2.HealthCheckResponse.SERVING:
            raise ProbeFailedError(
                f"health check says {health_pb2.HealthCheckResponse.ServingStatus.Name(got.status)}"
            )

    return probe


@contextlib.contextmanager
def _connected(path: Path, deadline: float, kind: int) -> Iterator[socket.socket]:
    s = socket.socket(socket.AF_UNIX, kind | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(deadline)
        try:
            s.connect(str(path))
        except FileNotFoundError:
            raise ProbeFailedError(f"socket file {path} is missing") from None
        yield s
    finally:
        s.close()


class ListenerProbes:
    """Probes each listener every ``interval`` on a daemon thread; thread-safe reads of the outcome."""

    def __init__(
        self,
        probes: Mapping[str, Probe],
        *,
        interval: float = PROBE_INTERVAL_SECONDS,
        deadline: float = PROBE_DEADLINE_SECONDS,
    ) -> None:
        self.probes = dict(probes)
        self.interval = interval
        self.deadline = deadline
        self._lock = threading.Lock()
        self._states: dict[str, ListenerState] = {}
        self._round_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> None:
        """Probe every listener once (in turn, each within the deadline) and record the outcomes."""
        for name, probe in self.probes.items():
            start = time.monotonic()
            try:
                probe(self.deadline)
                state = ListenerState(True, "", start)
            except TimeoutError:
                state = ListenerState(False, f"no answer within {self.deadline:g} s", start)
            except (OSError, ProbeFailedError) as exc:
                state = ListenerState(False, _reason(exc), start)
            except Exception as exc:  # a probe's own bug must not end the probing (nor say "up")
                state = ListenerState(False, f"probe error: {type(exc).__name__}: {exc}", start)
            with self._lock:
                before = self._states.get(name)
                self._states[name] = state
            if before is not None and before.up != state.up:
                log.warning(
                    "listener %s",
                    "serves again" if state.up else "does not serve",
                    extra={"listener": name, "reason": state.reason},
                )
        with self._lock:
            self._round_at = time.monotonic()

    def states(self) -> dict[str, ListenerState]:
        """The last outcome per listener (only those probed at least once)."""
        with self._lock:
            return dict(self._states)

    def report(self) -> tuple[bool, list[str]]:
        """Whether every listener serves, and one line per listener (``<name> up`` / ``<name> down: why``)."""
        with self._lock:
            states = dict(self._states)
            round_at = self._round_at
        lines: list[str] = []
        ok = True
        for name in self.probes:
            state = states.get(name)
            if state is None:
                ok = False
                lines.append(f"listener {name} down: not probed yet")
            elif state.up:
                lines.append(f"listener {name} up")
            else:
                ok = False
                lines.append(f"listener {name} down: {state.reason}")
        # A probe thread that hangs or died would leave the last outcomes standing: stale is not ready.
        stale_after = 2 * self.interval + len(self.probes) * self.deadline + 1.0
        age = time.monotonic() - round_at
        if round_at and age > stale_after:
            ok = False
            lines.append(f"probes stalled: last round {age:.1f} s ago")
        return ok, lines

    def start(self) -> None:
        """Probe in the background until :meth:`stop`."""
        self._thread = threading.Thread(target=self._loop, name="listener-probes", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.check()

    def stop(self) -> None:
        """Stop probing."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ProbeFailedError):
        return str(exc)
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing accepts on the socket)"
    return f"{type(exc).__name__}: {exc}"
