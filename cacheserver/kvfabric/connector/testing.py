"""Test helpers: an in-memory transport with the client's interface and injectable faults.

Integration tests use real cache-server processes; this fake is for fast unit tests of the
connector's logic and of the resilience layer (it can hang, refuse or corrupt on demand).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

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
    """A real cache-server process (``python -m kvfabric.cacheserver``) on temporary directories.

    Used by the connector's integration tests and by ``kvfabric bench ttft``. ``shared`` may be the
    same directory for several instances (the shared-volume tier). The process can be stopped
    gracefully, killed, frozen (SIGSTOP) and thawed.
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
        write_back: str = "all",
    ) -> None:
        self.root = root / name
        self.root.mkdir(parents=True, exist_ok=True)
        self.socket = self.root / "cache.sock"
        self.shm_dir = self.root / "shm"
        if isinstance(local_disk, Path):
            self.local_disk: Path | None = local_disk
        else:
            self.local_disk = self.root / "disk" if local_disk else None
        self.shared = shared
        tiers: dict[str, object] = {"dram": {"capacity_bytes": dram_bytes}, "write_back": write_back}
        if self.local_disk is not None:
            tiers["local_disk"] = {
                "path": str(self.local_disk),
                "capacity_bytes": 8 << 30,
                "min_free_fraction": 0.0,
            }
        if shared is not None:
            tiers["shared"] = {"path": str(shared), "capacity_bytes": 8 << 30, "min_free_fraction": 0.0}
        self.config = {
            "server_id": name,
            "listen": {
                "unix_socket": str(self.socket),
                "tcp_host": "127.0.0.1",
                "tcp_port": 0 if tcp else None,
            },
            "shm": {"dir": str(self.shm_dir)},
            "metrics": {"port": None},
            "tiers": tiers,
            "journal_poll_seconds": 0.1,
        }
        self.config_path = self.root / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.proc: subprocess.Popen[bytes] | None = None
        self.tcp_port: int | None = None
        self._log = self.root / "server.log"

    @property
    def unix_target(self) -> str:
        """Client target of the Unix socket."""
        return f"unix://{self.socket}"

    @property
    def tcp_target(self) -> str:
        """Client target of the TCP listener."""
        assert self.tcp_port is not None
        return f"127.0.0.1:{self.tcp_port}"

    def start(self, timeout: float = 60.0) -> CacheServerProcess:
        """Start the process and wait until it serves (its "serving" log record)."""
        with contextlib.suppress(FileNotFoundError):
            self._log.unlink()
        log_file = self._log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvfabric.cacheserver", "--config", str(self.config_path)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        log_file.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cache server exited with {self.proc.returncode}:\n{self.log_text()}")
            for line in self.log_text().splitlines():
                if '"serving"' in line or "serving" in line.split('"message":')[-1][:12]:
                    with contextlib.suppress(ValueError):
                        rec = json.loads(line)
                        self.tcp_port = rec.get("tcp_port")
                        return self
            time.sleep(0.05)
        raise TimeoutError(f"cache server did not start:\n{self.log_text()}")

    def log_text(self) -> str:
        """The process's combined output so far."""
        try:
            return self._log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def settings_env(self) -> dict[str, str]:
        """The ``KVFABRIC_*`` variables an engine on this "node" gets (as the operator injects them)."""
        env = {"KVFABRIC_SOCKET": str(self.socket), "KVFABRIC_SHM_DIR": str(self.shm_dir)}
        return env

    def freeze(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a hung server)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL and reap (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        """SIGTERM (after SIGCONT, in case it is frozen) and wait; SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> CacheServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
