"""Test helpers: an in-memory transport with the client's interface and injectable faults.

Integration tests use real cache-server processes; this fake is for fast unit tests of the
connector's logic and of the resilience layer (it can hang, refuse or corrupt on demand).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from pathlib import Path

from kvfabric.client.errors import CacheUnavailable
from kvfabric.client.results import LookupResult, StoreResult


class MemoryTransport:
    """A dict-backed stand-in for ``kvfabric.client.CacheClient``."""

    def __init__(self, tier: str = "dram") -> None:
        self.blocks: dict[tuple[str, str], bytes] = {}
        self.tier = tier
        self.calls: list[str] = []
        self.hang = threading.Event()  # set: calls block until released (like a SIGSTOPped server)
        self.release = threading.Event()
        self.down = False  # True: calls raise CacheUnavailable
        self.corrupt_keys: set[str] = set()  # loads of these keys return a flipped byte
        self._lock = threading.Lock()

    def _enter(self, name: str, timeout: float) -> None:
        with self._lock:
            self.calls.append(name)
        if self.down:
            raise CacheUnavailable("fake server is down")
        if self.hang.is_set():
            # Ignore ``timeout`` on purpose: the resilience layer must not rely on the transport.
            self.release.wait()

    def lookup(self, namespace: str, keys: Sequence[str], *, timeout: float) -> LookupResult:
        """Count leading stored keys."""
        self._enter("lookup", timeout)
        n = 0
        for k in keys:
            if (namespace, k) not in self.blocks:
                break
            n += 1
        return LookupResult(n, [self.tier] * n)

    def load_into(
        self, namespace: str, keys: Sequence[str], buffers: Sequence[memoryview], *, timeout: float
    ) -> int:
        """Copy leading payloads into buffers."""
        self._enter("load_into", timeout)
        n = 0
        for k, buf in zip(keys, buffers, strict=True):
            data = self.blocks.get((namespace, k))
            if data is None or len(data) != len(buf):
                break
            buf[:] = data
            if k in self.corrupt_keys:
                buf[len(buf) // 2] ^= 0xFF
            n += 1
        return n

    def store(
        self,
        namespace: str,
        keys: Sequence[str],
        payloads: Sequence[bytes | bytearray | memoryview],
        *,
        timeout: float,
    ) -> StoreResult:
        """Store payloads."""
        self._enter("store", timeout)
        for k, p in zip(keys, payloads, strict=True):
            self.blocks[(namespace, k)] = bytes(p)
        return StoreResult(len(keys), 0)

    def close(self) -> None:
        """Nothing to release."""


def block_files(tier_dir: Path) -> list[Path]:
    """Return the block files of a disk tier directory (written completely: renamed into place)."""
    return sorted(tier_dir.glob("buckets/*/*.blk"))


class CacheServerProcess:
    """A real cache-server process on temporary directories, for the connector's tests and benchmark.

    A thin layer over :class:`kvfabric.testing.serverproc.ServerProcess` (the cache server's own
    test helper) that adds what the connector's fault tests need: a chosen local-disk directory (to
    restart a "node" with its disk but empty DRAM), a shared volume used by several servers, and
    SIGSTOP/SIGCONT. Same-node payloads travel as the server's sealed memfds.
    """

    def __init__(
        self,
        root: Path,
        *,
        name: str = "server",
        shared: Path | None = None,
        local_disk: Path | bool = True,
        dram_bytes: int = 1 << 30,
        tcp: bool = True,
    ) -> None:
        from kvfabric.testing.serverproc import ServerProcess, make_config

        root.mkdir(parents=True, exist_ok=True)
        overrides: dict[str, object] = {}
        if isinstance(local_disk, Path):
            overrides["tiers.local_disk.path"] = str(local_disk)
        config = make_config(
            root,
            server_id=name,
            shared_dir=shared,
            dram_bytes=dram_bytes,
            local_disk_bytes=(4 << 30) if local_disk else None,
            shared_bytes=4 << 30,
            tcp=tcp,
            metrics=False,
            overrides=overrides,
        )
        self.process = ServerProcess(config, root)
        self.socket = config.listen.unix_socket
        self.local_disk = config.tiers.local_disk.path if config.tiers.local_disk else None
        self.shared = shared

    @property
    def unix_target(self) -> str:
        """Client target of the Unix socket."""
        return self.process.unix_target

    @property
    def tcp_target(self) -> str:
        """Client target of the TCP listener."""
        return self.process.tcp_target

    def start(self, timeout: float = 60.0) -> CacheServerProcess:
        """Start the process and wait until it serves."""
        self.process.start(timeout)
        return self

    def log_text(self) -> str:
        """The process's output so far."""
        return self.process.logs()

    def settings_env(self) -> dict[str, str]:
        """The ``KVFABRIC_*`` variables an engine on this "node" gets (as the operator injects them)."""
        return {"KVFABRIC_SOCKET": str(self.socket)}

    def freeze(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a hung server)."""
        assert self.process.proc is not None
        self.process.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT."""
        if self.process.proc is not None and self.process.proc.poll() is None:
            self.process.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL and reap (a crash)."""
        self.process.kill()

    def stop(self) -> None:
        """Graceful stop (thawed first, in case it is frozen)."""
        self.thaw()
        self.process.stop()

    def close(self) -> None:
        """Stop the process."""
        self.stop()

    def __enter__(self) -> CacheServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
