"""A real S3 server for tests and benchmarks: SeaweedFS's ``weed`` (master + volume + filer + S3 gateway).

>>> with s3_server() as s3:                                       # doctest: +SKIP
...     s3.endpoint, s3.bucket, s3.access_key, s3.secret_key

The binary is built from the Go module proxy by ``build-seaweedfs.sh`` (pinned below) and cached under
``~/.cache/kvfabric/seaweedfs-<digest of pin + script>/bin/weed``; ``python -m kvfabric.testing.s3server
build`` does that (``scripts/bootstrap.sh`` calls it). The server listens on loopback only, on free
ports, keeps its data in a temporary directory, authenticates every request (SigV4 with a random key
pair) and is stopped (SIGTERM, then SIGKILL) when the context exits. Tests can :meth:`S3Server.pause`
it (SIGSTOP: a hung server that still accepts connections) and :meth:`S3Server.kill` it.

:class:`FaultProxy` sits between a client and the server on another loopback port and can answer every
request with ``503 SlowDown`` (S3's throttling reply) or pass bytes through untouched.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from kvfabric.localcluster.versions import cache_root, pins_digest

__all__ = [
    "PINS",
    "SEAWEEDFS_VERSION",
    "FaultProxy",
    "S3BuildError",
    "S3Server",
    "ensure_weed",
    "s3_server",
    "weed_path",
]

# SeaweedFS tags its releases "4.xx", which are not Go semver tags: pin the module pseudo-version of
# a commit of the main branch (2026-11-09).
SEAWEEDFS_VERSION: Final = "v0.0.0-20261109003541-7506e5f91cd6"
PINS: Final[dict[str, str]] = {"seaweedfs": SEAWEEDFS_VERSION}
_SCRIPT: Final = Path(__file__).with_name("build-seaweedfs.sh")
_PROGRESS: Final = Path(__file__).parents[1] / "localcluster" / "go-progress.sh"  # sourced by it


class S3BuildError(RuntimeError):
    """The S3 server could not be built; the message carries the build log's tail."""


def weed_path() -> Path:
    """Where the pinned ``weed`` binary lives (it may not be built yet)."""
    return cache_root() / f"seaweedfs-{pins_digest(PINS, _SCRIPT, _PROGRESS)}" / "bin" / "weed"


def ensure_weed(*, quiet: bool = False) -> Path:
    """Return the pinned ``weed`` binary, building it first when needed (minutes on a cold Go cache)."""
    path = weed_path()
    if path.is_file():
        return path
    if shutil.which("go") is None:
        raise S3BuildError("the Go toolchain is needed to build SeaweedFS; install Go >= 1.26")
    if not quiet:
        print(f"building SeaweedFS {SEAWEEDFS_VERSION} into {path.parent}", file=sys.stderr)
    proc = subprocess.run(
        ["bash", str(_SCRIPT), str(path.parent)],
        env={**os.environ, "SEAWEEDFS_VERSION": SEAWEEDFS_VERSION},
        stdout=subprocess.DEVNULL if quiet else sys.stderr,
        stderr=subprocess.PIPE if quiet else subprocess.STDOUT,
        text=True,
        check=False,
    )
    if proc.returncode != 0 or not path.is_file():
        raise S3BuildError(
            f"building SeaweedFS failed (exit {proc.returncode}).\n{(proc.stderr or '')[-4000:]}"
        )
    return path


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class S3Server:
    """One running SeaweedFS server with an S3 gateway on loopback."""

    workdir: Path
    bucket: str = "kvfabric"
    access_key: str = field(default_factory=lambda: "AK" + secrets.token_hex(9).upper())
    secret_key: str = field(default_factory=lambda: secrets.token_urlsafe(30))
    proc: subprocess.Popen[bytes] | None = None
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL (path-style, plain HTTP on loopback)."""
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def log_path(self) -> Path:
        """The server's combined stdout/stderr."""
        return self.workdir / "weed.log"

    def start(self, timeout: float = 120.0) -> None:
        """Start ``weed server -filer -s3`` and create the bucket; returns when S3 answers."""
        weed = ensure_weed()
        names = ["master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc"]
        self.ports = dict(zip(names, _free_ports(len(names)), strict=True))
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "s3.json"
        cfg.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "kvfabric",
                            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                        }
                    ]
                }
            )
        )
        cfg.chmod(0o600)
        p = self.ports
        args = [
            str(weed),
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={data}",
            "-filer",
            "-s3",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            "-master.telemetry=false",
            "-master.volumeSizeLimitMB=512",
            "-volume.max=0",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
            f"-s3.config={cfg}",
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self.proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                start_new_session=True,
            )
        finally:
            log.close()
        self._wait_ready(timeout)
        self._create_bucket(weed, timeout)
        self._wait_writable(timeout)

    def _alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"SeaweedFS exited with {self.proc.returncode}:\n{self.logs()[-4000:]}")

    def _wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while True:
            self._alive()
            try:
                # Any HTTP answer (403 for an unsigned request) means the gateway serves.
                urllib.request.urlopen(self.endpoint + "/", timeout=2)  # noqa: S310 - loopback URL we built
                return
            except urllib.error.HTTPError:
                return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"SeaweedFS S3 gateway not up after {timeout}s:\n{self.logs()[-4000:]}")
            time.sleep(0.2)

    def _create_bucket(self, weed: Path, timeout: float) -> None:
        end = time.monotonic() + timeout
        while True:
            self._alive()
            proc = subprocess.run(
                [
                    str(weed),
                    "shell",
                    f"-master=127.0.0.1:{self.ports['master']}.{self.ports['master_grpc']}",
                    f"-filer=127.0.0.1:{self.ports['filer']}.{self.ports['filer_grpc']}",
                ],
                input=f"s3.bucket.create -name {self.bucket}\nexit\n",
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
                cwd=self.workdir,
            )
            out = proc.stdout + proc.stderr
            if proc.returncode == 0 and ("created bucket" in out.lower() or "already exist" in out.lower()):
                return
            if time.monotonic() > end:
                raise TimeoutError(f"could not create bucket {self.bucket}: {out[-2000:]}")
            time.sleep(0.5)

    def _wait_writable(self, timeout: float) -> None:
        # The gateway learns a new bucket from the filer asynchronously: until then requests get 404.
        import obstore
        from obstore.store import S3Store

        store = S3Store(
            self.bucket,
            endpoint=self.endpoint,
            region="us-east-1",
            access_key_id=self.access_key,
            secret_access_key=self.secret_key,
            client_options={"allow_http": True},
        )
        end = time.monotonic() + timeout
        while True:
            self._alive()
            try:
                obstore.put(store, ".kvfabric-ready", b"ok", use_multipart=False)
                obstore.head(store, ".kvfabric-ready")
                obstore.delete(store, ".kvfabric-ready")
                return
            except Exception as exc:
                if time.monotonic() > end:
                    raise TimeoutError(f"bucket {self.bucket} not writable after {timeout}s: {exc}") from exc
            time.sleep(0.2)

    def logs(self) -> str:
        """What the server printed so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def pause(self) -> None:
        """SIGSTOP every process of the server: connections are accepted by the kernel, never answered."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the server (its data directory stays, so :meth:`start` again would serve it)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGCONT)
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """Graceful stop (SIGTERM), SIGKILL if it hangs."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()


@contextlib.contextmanager
def s3_server(bucket: str = "kvfabric") -> Iterator[S3Server]:
    """Run a SeaweedFS S3 server on loopback for the duration of the block, on a temporary directory."""
    work = Path(tempfile.mkdtemp(prefix="kvf-s3-"))
    srv = S3Server(work, bucket=bucket)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)


_SLOW_DOWN_BODY: Final = (
    b'<?xml version="1.0" encoding="UTF-8"?>'
    b"<Error><Code>SlowDown</Code><Message>Reduce your request rate.</Message></Error>"
)
_SLOW_DOWN: Final = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
    + f"Content-Length: {len(_SLOW_DOWN_BODY)}\r\n\r\n".encode()
    + _SLOW_DOWN_BODY
)


class FaultProxy:
    """A TCP proxy on loopback in front of an S3 endpoint that can throttle every request.

    ``mode = "pass"`` splices bytes both ways; ``mode = "throttle"`` answers each new connection's first
    request with ``503 SlowDown`` and closes it (switching modes drops the open connections, so pooled
    keep-alive connections cannot bypass it). :attr:`throttled` counts the 503 answers.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.throttled = 0
        self._mode = "pass"
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="s3-fault-proxy", daemon=True)
        self._server: asyncio.Server | None = None

    @property
    def endpoint(self) -> str:
        """The proxy's endpoint URL."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def mode(self) -> str:
        """'pass' or 'throttle'."""
        return self._mode

    def set_mode(self, mode: str) -> None:
        """Switch modes; open connections are closed so that the next request sees the new mode."""
        if mode not in ("pass", "throttle"):
            raise ValueError(mode)

        def switch() -> None:
            self._mode = mode
            for w in list(self._writers):
                w.close()

        self._loop.call_soon_threadsafe(switch)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):
                w.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._server is not None:
                await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            if self._mode == "throttle":
                with contextlib.suppress(OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                    await reader.readuntil(b"\r\n\r\n")
                    self.throttled += 1
                    writer.write(_SLOW_DOWN)
                    await writer.drain()
                return
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            self._writers.add(up_w)
            try:
                await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer))
            finally:
                self._writers.discard(up_w)
                up_w.close()
                with contextlib.suppress(OSError, asyncio.CancelledError):
                    await up_w.wait_closed()
        except OSError:
            pass
        finally:
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await writer.wait_closed()

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(1 << 20):
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            dst.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m kvfabric.testing.s3server build|path|serve``."""
    ap = argparse.ArgumentParser(
        prog="python -m kvfabric.testing.s3server", description=__doc__.split("\n")[0]
    )
    ap.add_argument(
        "action", choices=["build", "path", "serve"], help="build the binary, print its path, or run it"
    )
    ns = ap.parse_args(argv)
    if ns.action == "path":
        print(weed_path())
        return 0
    if ns.action == "build":
        print(ensure_weed())
        return 0
    with s3_server() as srv:
        print(
            json.dumps(
                {
                    "endpoint": srv.endpoint,
                    "bucket": srv.bucket,
                    "access_key": srv.access_key,
                    "secret_key": srv.secret_key,
                }
            ),
            flush=True,
        )
        with contextlib.suppress(KeyboardInterrupt):
            while srv.proc is not None and srv.proc.poll() is None:
                time.sleep(1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
