"""Test helpers: run a real cache-server process on temporary directories and free ports.

>>> with cache_server() as srv:                                  # doctest: +SKIP
...     c = CacheClient(srv.unix_target, shared_memory=True)
...     c.store(ns, keys, payloads, timeout=5)

The process is ``python -m kvfabric.cacheserver --config <file>``, exactly what the DaemonSet runs;
:class:`ServerProcess` can SIGKILL and restart it on the same directories. Used by this package's
tests, the connector's tests and the end-to-end tests.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from kvfabric.cacheserver.config import ServerConfig, apply_overrides

__all__ = [
    "ServerProcess",
    "cache_server",
    "digest",
    "free_port",
    "nofile_site",
    "open_descriptors",
    "payload_for",
    "site_env",
    "wait_until",
]

MiB = 1 << 20


def digest(*parts: object) -> str:
    """A 64-char lower-case hex digest of ``parts`` (the shape of every namespace and key)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def payload_for(key: str, size: int, salt: bytes = b"") -> bytes:
    """Deterministic bytes derived from ``key``: a loaded block can be checked without keeping a copy."""
    seed = hashlib.sha256(key.encode() + salt).digest()
    return (seed * -(-size // len(seed)))[:size]


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def site_env(site: Path, code: str) -> dict[str, str]:
    """The environment under which a Python process runs ``code`` first (a ``sitecustomize`` in ``site``).

    How a test puts a real limit or fault into a server process before it starts anything.
    """
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def nofile_site(limit: int) -> str:
    """``sitecustomize`` code that sets the process's descriptor limit, soft and hard, to ``limit``."""
    return f"import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))\n"


def open_descriptors(pid: int | str = "self") -> dict[str, str]:
    """A process's open descriptors and what each is open on (``readlink`` of ``/proc/<pid>/fd/<n>``).

    For leak checks: the descriptors in a later snapshot that are not in an earlier one, by number
    *and* target, were opened meanwhile and are still open. A count would also move when another
    thread closes one of its own meanwhile (a store's background work), which is no leak.
    """
    out: dict[str, str] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # (the listing's own, closed by now)
            out[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
    return out


def wait_until(pred: Any, timeout: float = 30.0, interval: float = 0.05, what: str = "condition") -> Any:
    """Poll ``pred()`` until it returns something truthy; raise TimeoutError after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_http_ok(
    url: str, proc: subprocess.Popen[bytes] | None, logs: Any, timeout: float, what: str
) -> None:
    """Poll ``url`` until it answers 200; raise (with ``logs()``'s tail) if ``proc`` exits first."""
    import urllib.request

    def ok() -> bool:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{logs()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:  # noqa: S310
                return bool(r.status == 200)
        except OSError:
            return False

    wait_until(ok, timeout, what=f"{what} to answer {url}")


class ServerProcess:
    """A cache-server subprocess and everything needed to talk to it."""

    def __init__(
        self,
        config: ServerConfig,
        workdir: Path,
        env: Mapping[str, str] | None = None,
        *,
        name: str | None = None,
    ) -> None:
        self.config = config
        self.workdir = workdir
        self.env = dict(env or {})
        name = name or config.resolved_server_id()
        self.config_path = workdir / f"{name}.yaml"
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def unix_target(self) -> str:
        """Client target of the Unix socket."""
        return f"unix://{self.config.listen.unix_socket}"

    @property
    def tcp_target(self) -> str:
        """Client target of the TCP listener."""
        return f"127.0.0.1:{self.config.listen.tcp_port}"

    @property
    def metrics_url(self) -> str:
        """Base URL of the metrics/probe endpoint."""
        return f"http://127.0.0.1:{self.config.metrics.port}"

    def start(self, timeout: float = 60.0) -> None:
        """Start the process and wait until its gRPC health check says SERVING."""
        self.start_process()
        self.wait_ready(timeout)

    def start_process(self) -> None:
        """Start the process; do not wait."""
        self.config_path.write_text(self.config.to_yaml())
        env = {**os.environ, **self.env}
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvfabric.cacheserver", "--config", str(self.config_path)],
                stdout=log,
                stderr=log,
                env=env,
            )
        finally:
            log.close()
        self.starts += 1

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the server answers its health check (raises if the process died)."""
        from kvfabric.client import CacheClient

        client = CacheClient(self.unix_target)
        try:

            def ready() -> bool:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(
                        f"cache server exited with {self.proc.returncode}:\n{self.logs()[-4000:]}"
                    )
                return self.config.listen.unix_socket.exists() and client.health(timeout=1.0)

            wait_until(ready, timeout, what="cache server to serve")
        finally:
            client.close()

    def logs(self) -> str:
        """Everything the server logged so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_records(self) -> list[dict[str, Any]]:
        """The JSON log records."""
        out = []
        for line in self.logs().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL) and reap the process."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=60)

    def stop(self) -> None:
        """Graceful stop (SIGTERM), then SIGKILL if it hangs."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()

    def successor(self, name: str = "successor") -> ServerProcess:
        """A second server on the same socket and disk directories, as a rolling update's new pod.

        It runs beside this one with its own TCP and metrics ports (a pod has its own network namespace).
        """
        data = self.config.model_dump(mode="json")
        if data["listen"]["tcp_port"] is not None:
            data["listen"]["tcp_port"] = free_port()
        data["metrics"]["port"] = free_port()
        return ServerProcess(ServerConfig.model_validate(data), self.workdir, self.env, name=name)

    def start_beside(self, timeout: float = 60.0) -> None:
        """Start while another server still serves the socket; wait until *this* one says it is ready."""
        self.start_process()
        self.wait_own_ready(timeout)

    def wait_own_ready(self, timeout: float = 60.0) -> None:
        """Block until this server's own readiness probe says ready (raises if the process died)."""
        wait_http_ok(f"{self.metrics_url}/readyz", self.proc, self.logs, timeout, "cache server")

    def restart(self, timeout: float = 60.0) -> None:
        """Stop (if running) and start again on the same directories and ports."""
        self.stop()
        self.start(timeout)


def make_config(
    workdir: Path,
    *,
    server_id: str = "srv",
    shared_dir: Path | None = None,
    dram_bytes: int = 256 * MiB,
    local_disk_bytes: int | None = 512 * MiB,
    shared_bytes: int = 512 * MiB,
    tcp: bool = True,
    metrics: bool = True,
    overrides: Mapping[str, Any] | None = None,
) -> ServerConfig:
    """A server configuration rooted in ``workdir`` (its sockets and disk tiers)."""
    data: dict[str, Any] = {
        "server_id": server_id,
        "listen": {
            "unix_socket": str(workdir / f"{server_id}.sock"),
            "tcp_host": "127.0.0.1",
            "tcp_port": free_port() if tcp else None,
        },
        "shm": {"arena_bytes": max(dram_bytes, 64 * MiB)},
        "metrics": {"host": "127.0.0.1", "port": free_port() if metrics else None},
        "tiers": {
            "dram": {"capacity_bytes": dram_bytes},
            "local_disk": None
            if local_disk_bytes is None
            else {"path": str(workdir / f"{server_id}-local"), "capacity_bytes": local_disk_bytes},
            "shared": None
            if shared_dir is None
            else {"path": str(shared_dir), "capacity_bytes": shared_bytes},
        },
        # As the operator renders it: the hand-over socket apart from the directory consumers reach.
        "handover": {"socket_dir": str(workdir / f"{server_id}-handover")},
        "journal_poll_seconds": 0.1,
        "janitor_interval_seconds": 0.5,
        "limits": {"max_payload_bytes": min(dram_bytes, 128 * MiB)},
        "log_level": "INFO",
    }
    return ServerConfig.model_validate(apply_overrides(data, dict(overrides or {})))


@contextlib.contextmanager
def temp_dir() -> Iterator[Path]:
    """A short-named work directory (Unix socket paths are limited to 107 bytes)."""
    work = Path(tempfile.mkdtemp(prefix="kvf-"))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def cache_server(
    *,
    server_id: str = "srv",
    shared_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
    start: bool = True,
    **config_kwargs: Any,
) -> Iterator[ServerProcess]:
    """Run one cache-server process on fresh temporary directories; stopped and cleaned up on exit.

    Keyword arguments go to :func:`make_config` (``dram_bytes``, ``local_disk_bytes``, ``shared_bytes``,
    ``tcp``, ``metrics``, ``overrides={"dotted.path": value}``).
    """
    with temp_dir() as work:
        config = make_config(work, server_id=server_id, shared_dir=shared_dir, **config_kwargs)
        srv = ServerProcess(config, work, env)
        try:
            if start:
                srv.start()
            yield srv
        finally:
            srv.stop()
