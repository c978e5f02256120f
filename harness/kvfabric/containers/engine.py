"""A private Docker engine for building and smoke-testing kvfabric's images.

The harness starts Debian's ``dockerd`` itself (no systemd): its own Unix socket and exec root under
the run directory, its data root in the kvfabric cache (so images survive between runs), no bridge
and no iptables rules (builds use ``--network=host``), and a runc wrapper as the default runtime that
drops CAP_SYS_RESOURCE, which the machines this runs on lack (see ``runc-wrapper``). The daemon lives
as long as the :class:`DockerEngine` context that started it; a second context on the same data root
reuses the running daemon instead of starting another.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kvfabric.localcluster.versions import cache_root

RUNC_WRAPPER = Path(__file__).with_name("runc-wrapper")
RUNTIME_NAME = "kvfabric-runc"


class EngineError(RuntimeError):
    """dockerd is missing, or did not come up; the message says which and where its log is."""


def run_dir() -> Path:
    """Short paths for sockets (containerd's socket paths must stay under 108 bytes)."""
    env = os.environ.get("KVFABRIC_RUN_DIR")
    if env:
        return Path(env)
    base = Path("/run") if os.access("/run", os.W_OK) else Path("/tmp")
    return base / f"kvfabric-{os.getuid()}"


@dataclass(frozen=True)
class EnginePaths:
    """Where one private engine keeps its state."""

    data_root: Path
    exec_root: Path
    socket: Path
    pidfile: Path
    log: Path
    lock: Path

    @classmethod
    def default(cls) -> EnginePaths:
        """Data in ``<cache>/docker``; socket, exec root and log under :func:`run_dir`."""
        run = run_dir() / "docker"
        return cls(
            data_root=cache_root() / "docker",
            exec_root=run / "exec",
            socket=run / "docker.sock",
            pidfile=run / "docker.pid",
            log=run / "dockerd.log",
            lock=run / "dockerd.lock",
        )

    @property
    def host(self) -> str:
        """The value for ``DOCKER_HOST`` / ``docker -H``."""
        return f"unix://{self.socket}"


def dockerd_argv(paths: EnginePaths, dockerd: str = "dockerd") -> list[str]:
    """Dockerd's command line: private paths, no networking of its own, the runc wrapper."""
    return [
        dockerd,
        f"--host={paths.host}",
        f"--data-root={paths.data_root}",
        f"--exec-root={paths.exec_root}",
        f"--pidfile={paths.pidfile}",
        # No bridge, no NAT: nothing of ours is reachable from outside, and builds use the host network.
        "--bridge=none",
        "--iptables=false",
        "--ip6tables=false",
        "--ip-masq=false",
        f"--add-runtime={RUNTIME_NAME}={RUNC_WRAPPER}",
        f"--default-runtime={RUNTIME_NAME}",
        "--log-level=warn",
    ]


def docker_cli() -> str:
    """Debian's docker client (the daemon's own version) when installed, else any on PATH."""
    for candidate in ("/usr/bin/docker", shutil.which("docker")):
        if candidate and Path(candidate).is_file():
            return candidate
    raise EngineError("no docker client: run scripts/bootstrap.sh (installs Debian's docker.io)")


def ping(sock: Path, timeout: float = 2.0) -> bool:
    """True when a Docker engine answers ``GET /_ping`` on the Unix socket."""
    if not sock.exists():
        return False
    conn = _UnixHTTPConnection(str(sock), timeout)
    try:
        conn.request("GET", "/_ping")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


class DockerEngine(contextlib.AbstractContextManager["DockerEngine"]):
    """Start (or join) the private dockerd; stop it on exit if this context started it."""

    def __init__(self, paths: EnginePaths | None = None, *, start_timeout: float = 120.0) -> None:
        self.paths = paths or EnginePaths.default()
        self.start_timeout = start_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock: IO[str] | None = None

    @property
    def env(self) -> dict[str, str]:
        """The environment for docker CLI calls against this engine (legacy builder: it prints steps)."""
        return {**os.environ, "DOCKER_HOST": self.paths.host, "DOCKER_BUILDKIT": "0"}

    @property
    def docker_path(self) -> str:
        """The docker client binary (see :func:`docker_cli`)."""
        return docker_cli()

    def docker(
        self, *args: str, check: bool = True, capture: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run the docker client against this engine."""
        return subprocess.run(
            [docker_cli(), *args], env=self.env, check=check, text=True, capture_output=capture
        )

    def __enter__(self) -> DockerEngine:
        p = self.paths
        p.socket.parent.mkdir(parents=True, exist_ok=True)
        p.data_root.mkdir(parents=True, exist_ok=True)
        lock = p.lock.open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            # Another process owns the daemon: use it while it runs.
            self._wait_ready(owner=None)
            return self
        self._lock = lock
        if ping(p.socket):  # left over by a process that died without stopping it: adopt it
            return self
        dockerd = shutil.which("dockerd") or "/usr/sbin/dockerd"
        if not Path(dockerd).is_file():
            raise EngineError("dockerd not found: run scripts/bootstrap.sh (installs Debian's docker.io)")
        self._stop_stale()
        log = p.log.open("ab")
        self._proc = subprocess.Popen(
            dockerd_argv(p, dockerd),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self._wait_ready(owner=self._proc)
        return self

    def _stop_stale(self) -> None:
        """A dockerd whose pidfile survives but whose socket does not answer is killed."""
        with contextlib.suppress(OSError, ValueError):
            pid = int(self.paths.pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"dockerd" in cmdline and str(self.paths.data_root).encode() in cmdline:
                os.kill(pid, signal.SIGTERM)
                time.sleep(2)

    def _wait_ready(self, owner: subprocess.Popen[bytes] | None) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if ping(self.paths.socket):
                return
            if owner is not None and owner.poll() is not None:
                tail = self.paths.log.read_text(errors="replace")[-3000:]
                raise EngineError(f"dockerd exited with {owner.returncode}; log {self.paths.log}:\n{tail}")
            time.sleep(0.3)
        raise EngineError(f"dockerd did not answer on {self.paths.socket}; log {self.paths.log}")

    def __exit__(self, *exc: object) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._lock is not None:
            self._lock.close()
            self._lock = None


@contextlib.contextmanager
def engine(*, quiet: bool = False) -> Iterator[DockerEngine]:
    """The private engine, announced on stderr."""
    with DockerEngine() as eng:
        if not quiet:
            print(f"[images] docker engine at {eng.paths.host} (data {eng.paths.data_root})", file=sys.stderr)
        yield eng
