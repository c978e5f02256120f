"""Dynamo's own KV indexer, run as a process: an independent router index that kvfabric did not write.

>>> with DynamoIndexer.start() as idx:                          # doctest: +SKIP
...     idx.register(1, "tcp://127.0.0.1:5556", model="m", block_size=16)
...     idx.entries()[1]["host"]                                 # vLLM block hashes credited in DRAM

NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer``, PyPI ``ai-dynamo-runtime``,
its Rust ``dynamo-kv-router`` compiled into the wheel) dials each registered engine's ZMQ
publisher, decodes vLLM's frames with Dynamo's ``zmq_wire`` parser, files every block in its radix
trees per storage tier (``device``, ``host_pinned``, ``disk``; non-local ``STORAGE`` and unknown
media are dropped) and answers ``GET /dump`` (every stored block, per worker and tier) and
``POST /query`` (matched tokens of a prompt, per worker and tier). The wheel pins pydantic below
the version the project locks, so it lives in its own virtual environment under
``~/.cache/kvfabric/dynamo-indexer-<digest of the pins>/``; ``python -m kvfabric.testing.dynamoindexer
build`` makes it (``scripts/bootstrap.sh`` calls it) and tests skip, saying so, without it.

Dynamo's parser reads block hashes as integers only: vLLM's default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the hash's low 64 bits) works; an engine that publishes
the raw hash bytes (``=0``) has every batch dropped ("data did not match any variant of untagged enum
BlockHashValue" in the indexer's log).

The indexer binds its HTTP port on every interface (it has no option for loopback only); tests
send it requests on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kvfabric.localcluster.versions import cache_root, pins_digest
from kvfabric.testing.serverproc import free_port

__all__ = [
    "PINS",
    "DynamoIndexer",
    "DynamoIndexerError",
    "ensure_env",
    "env_dir",
    "find_python",
    "skip_reason",
]

# ai-dynamo-runtime 1.6.1 requires pydantic <= 2.13.5 (the project locks a newer one): its own venv.
PINS: Final[dict[str, str]] = {"ai-dynamo-runtime": "1.6.1", "pydantic": "2.13.5", "uvloop": "0.23.0"}
TIERS: Final = ("device", "host_pinned", "disk")
"""Dynamo's storage tiers: GPU, host memory (``CPU``), local disk (``STORAGE`` + ``LOCAL``)."""


class DynamoIndexerError(RuntimeError):
    """The indexer's environment could not be built, or the process did not answer."""


def env_dir() -> Path:
    """Where the pinned environment lives (it may not be built yet)."""
    return cache_root() / f"dynamo-indexer-{pins_digest(PINS)}"


def find_python() -> Path | None:
    """The environment's interpreter, or None when it is not built."""
    python = env_dir() / "venv" / "bin" / "python"
    return python if (env_dir() / "ok").is_file() and python.is_file() else None


def skip_reason() -> str:
    """Why a test that needs the indexer skips."""
    return (
        f"Dynamo's KV indexer ({env_dir()}) is not built: run "
        "`uv run --frozen python -m kvfabric.testing.dynamoindexer build` (scripts/bootstrap.sh does)"
    )


def ensure_env(*, quiet: bool = False) -> Path:
    """The environment's interpreter, building the environment first when needed (a 75 MB wheel)."""
    found = find_python()
    if found is not None:
        return found
    uv = shutil.which("uv")
    if uv is None:
        raise DynamoIndexerError("uv is needed to build Dynamo's indexer environment (scripts/bootstrap.sh)")
    out = env_dir()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final place and renamed: a concurrent or interrupted build leaves no half env.
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    quietly: dict[str, Any] = {"capture_output": True, "text": True} if quiet else {}
    try:
        for cmd in (
            [uv, "venv", "--quiet", "--python", sys.executable, str(tmp / "venv")],
            [
                uv,
                "pip",
                "install",
                "--quiet",
                "--python",
                str(tmp / "venv" / "bin" / "python"),
                *(f"{name}=={version}" for name, version in PINS.items()),
            ],
        ):
            proc = subprocess.run(cmd, check=False, **quietly)
            if proc.returncode != 0:
                raise DynamoIndexerError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr or ''}")
        (tmp / "ok").write_text(json.dumps(PINS) + "\n")
        try:
            tmp.rename(out)
        except OSError:
            if find_python() is None:  # not another build that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    python = find_python()
    if python is None:
        raise DynamoIndexerError(f"building {out} left no interpreter")
    return python


_U64: Final = (1 << 64) - 1  # vLLM's integer hashes are unsigned 64-bit; read any sign the same way
Entries = dict[int, dict[str, set[int]]]
"""worker id -> Dynamo tier -> the block hashes (vLLM's, as the engine published them) it holds."""


@dataclass
class DynamoIndexer:
    """A running ``python -m dynamo.indexer`` on a loopback port (use :meth:`start`)."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    workers: dict[int, str] = field(default_factory=dict)

    @classmethod
    @contextmanager
    def start(cls, log: Path | None = None, *, timeout: float = 60.0) -> Iterator[DynamoIndexer]:
        """Start the indexer (one indexing thread: events are applied in order) and stop it after."""
        python = find_python()
        if python is None:
            raise DynamoIndexerError(skip_reason())
        port = free_port()
        if log is None:
            log = Path(tempfile.mkdtemp(prefix="dynamo-indexer-")) / "indexer.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [str(python), "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "NO_COLOR": "1", "RUST_LOG": os.environ.get("RUST_LOG", "info")},
            )
        idx = cls(proc, port, log)
        try:
            idx._wait_healthy(timeout)
            yield idx
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    @property
    def url(self) -> str:
        """The HTTP API's base URL (loopback)."""
        return f"http://127.0.0.1:{self.port}"

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DynamoIndexerError(f"the indexer exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:  # noqa: S310 - loopback
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise DynamoIndexerError(f"the indexer did not answer /health in {timeout} s: {self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the indexer's log (for assertion messages)."""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _call(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        req = urllib.request.Request(self.url + path, data=data, headers=headers)  # noqa: S310 - loopback
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - loopback URL we built
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise DynamoIndexerError(f"{path}: {e.code} {e.read().decode(errors='replace')}") from None

    def register(
        self, worker: int, endpoint: str, *, model: str, block_size: int, replay_endpoint: str | None = None
    ) -> None:
        """Follow an engine's ZMQ publisher (``endpoint``, e.g. ``tcp://127.0.0.1:5556``) as ``worker``."""
        body: dict[str, Any] = {
            "instance_id": worker,
            "endpoint": endpoint,
            "model_name": model,
            "block_size": block_size,
        }
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        self._call("/register", body)
        self.workers[worker] = model

    def unregister(self, worker: int) -> None:
        """Stop following ``worker`` (its entries leave the index)."""
        self._call("/unregister", {"instance_id": worker, "model_name": self.workers.pop(worker)})

    def dump(self) -> Any:
        """``GET /dump``: every indexer's tree as Dynamo's router events."""
        return self._call("/dump")

    def entries(self) -> Entries:
        """What the index holds: worker -> tier -> block hashes (every registered worker listed)."""
        out: Entries = {w: {t: set() for t in TIERS} for w in self.workers}
        for indexer in self.dump().values():
            if "error" in indexer:
                raise DynamoIndexerError(f"/dump: {indexer['error']}")
            for ev in indexer["events"]:
                stored = ev["event"]["data"].get("stored")
                if stored is None:
                    continue
                tiers = out.setdefault(int(ev["worker_id"]), {t: set() for t in TIERS})
                tiers.setdefault(ev["storage_tier"], set()).update(
                    int(b["block_hash"]) & _U64 for b in stored["blocks"]
                )
        return out

    def query(self, token_ids: list[int], *, model: str, lora_name: str | None = None) -> Any:
        """``POST /query``: matched tokens of a prompt per worker (and per tier under ``instances``)."""
        return self._call("/query", {"token_ids": token_ids, "model_name": model, "lora_name": lora_name})


def main(argv: list[str] | None = None) -> int:
    """``python -m kvfabric.testing.dynamoindexer build|path``: build the environment or print where."""
    ap = argparse.ArgumentParser(
        prog="python -m kvfabric.testing.dynamoindexer", description=__doc__.splitlines()[0]
    )
    ap.add_argument("action", choices=["build", "path"], help="build the environment, or print its directory")
    ns = ap.parse_args(argv)
    print(ensure_env() if ns.action == "build" else env_dir())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
