"""Smoke checks of the built images: each runs its default command in a container.

- operator, engine: ``--help`` of the image's command, as the image's entrypoint runs it;
- engine: ``kvfabric engine serve`` answering requests, its connector on the cache-server image's
  socket, until a repeated prompt is a hit (:func:`engine_with_cache`);
- cache server: the image's default entrypoint serving a real configuration, as the DaemonSet runs
  it (uid 65532, read-only root file system, every capability dropped, no network), until the host
  stores and loads a chunk through the Unix socket and the server's sealed memfds on bind mounts;
- connector: the payload copied by the image's default command into a directory, then imported by
  the Python image the way an inference pod imports it (``PYTHONPATH``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypedDict

import yaml

from kvfabric.containers.base import PYTHON_IMAGE
from kvfabric.containers.build import Image
from kvfabric.containers.engine import DockerEngine

NONROOT = "65532:65532"
# The restrictions the operator's DaemonSet puts on the cache server (a test asserts they hold).
LOCKED_DOWN = (
    "--network=none",
    "--read-only",
    "--cap-drop=ALL",
    "--security-opt=no-new-privileges",
    f"--user={NONROOT}",
)


class SmokeError(AssertionError):
    """An image did not do what its default command promises; the message has its output."""


def help_of(eng: DockerEngine, image: Image, *command: str) -> str:
    """``docker run IMAGE COMMAND --help``; returns the help text."""
    out = eng.docker("run", "--rm", *LOCKED_DOWN, image.ref, *command, "--help", check=False)
    if out.returncode != 0 or "usage:" not in out.stdout:
        raise SmokeError(
            f"{image.ref} {' '.join(command)} --help exited {out.returncode}:\n{out.stdout}{out.stderr}"
        )
    return out.stdout


@contextlib.contextmanager
def _shared_dir() -> Iterator[Path]:
    """A directory that uid 65532 can write (bind-mounted into the container)."""
    with tempfile.TemporaryDirectory(prefix="kvf-smoke-") as run:
        os.chmod(run, 0o777)  # noqa: S103 - a throw-away directory shared with the container's uid
        yield Path(run)


@contextlib.contextmanager
def _cache_server(eng: DockerEngine, image: Image, run: Path, timeout: float) -> Iterator[str]:
    """Run the cache-server image locked down, its socket in ``run``; yields the container's name."""
    from kvfabric.client.sync import CacheClient

    config = {
        "server_id": "smoke",
        "listen": {"unix_socket": "/run/kvfabric/cache.sock", "tcp_host": "127.0.0.1", "tcp_port": 7070},
        "shm": {"arena_bytes": 64 * 2**20},
        "metrics": {"host": "127.0.0.1", "port": 9090},
        "tiers": {"dram": {"capacity_bytes": 64 * 2**20}, "local_disk": None, "shared": None},
        "limits": {"max_payload_bytes": 16 * 2**20},
        "log_level": "INFO",
    }
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    name = f"kvfabric-smoke-{secrets.token_hex(4)}"
    started = eng.docker(
        "run",
        "-d",
        f"--name={name}",
        *LOCKED_DOWN,
        "-v",
        f"{run}:/run/kvfabric",
        image.ref,
        "cacheserver",
        "--config",
        "/run/kvfabric/config.yaml",
        check=False,
    )
    if started.returncode != 0:
        raise SmokeError(f"docker run {image.ref} failed:\n{started.stderr}")
    try:
        sock = run / "cache.sock"
        client = CacheClient(f"unix://{sock}", shared_memory=True)
        deadline = time.monotonic() + timeout
        while not (sock.exists() and client.health(timeout=1.0)):
            state = eng.docker("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
            if state != "running" or time.monotonic() > deadline:
                logs = eng.docker("logs", name, check=False)
                raise SmokeError(f"cache server never became healthy ({state}):\n{logs.stdout}{logs.stderr}")
            time.sleep(0.5)
        client.close()
        yield name
    finally:
        eng.docker("rm", "-f", name, check=False)


def cacheserver_round_trip(eng: DockerEngine, image: Image, timeout: float = 120.0) -> ProcessFacts:
    """Start the cache-server image locked down, store and load one chunk from the host.

    Returns what the kernel says about the server's process, for the caller to assert on.
    """
    from kvfabric.client.sync import CacheClient

    with _shared_dir() as run, _cache_server(eng, image, run, timeout) as name:
        sock = run / "cache.sock"
        client = CacheClient(f"unix://{sock}", shared_memory=True)
        payload = secrets.token_bytes(4096)
        ns, key = hashlib.sha256(b"smoke").hexdigest(), hashlib.sha256(payload).hexdigest()
        stored = client.store(ns, [key], [payload], timeout=10.0)
        loaded = client.load(ns, [key], timeout=10.0)
        client.close()
        if stored.accepted != 1 or loaded != [payload]:
            raise SmokeError(f"round trip through {sock} lost the chunk: {stored}, {len(loaded)} loaded")
        pid = int(eng.docker("inspect", "--format", "{{.State.Pid}}", name).stdout.strip())
        return process_facts(pid)


# Run inside the engine's container (it has no network but its own loopback): wait for the server,
# send the same prompt until the whole prefix is a hit (the connector stores in the background), and
# print every answer as one JSON line.
_ENGINE_CLIENT = """
import json, sys, time, urllib.error, urllib.request
url = "http://127.0.0.1:8000"
deadline = time.monotonic() + float(sys.argv[1])
while True:
    try:
        urllib.request.urlopen(url + "/healthz", timeout=5).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.5)
body = json.dumps({"prompt_token_ids": json.loads(sys.argv[2]), "max_tokens": 3}).encode()
want = int(sys.argv[3])
for _ in range(60):
    req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        sys.exit(f"/generate answered {exc.code}: {exc.read().decode()}")
    print(json.dumps(answer), flush=True)
    if answer["hit_tokens"] == want:
        break
    time.sleep(0.25)
"""
ENGINE_CHUNK_TOKENS = 32


def engine_with_cache(
    eng: DockerEngine,
    engine: Image,
    cacheserver: Image,
    prompt: list[int],
    *,
    want_hit_tokens: int,
    timeout: float = 300.0,
) -> list[dict[str, Any]]:
    """Serve a prompt from the engine image, its connector on the cache-server image's socket.

    Both containers run locked down (no network, read-only root, no capabilities, uid 65532) and
    share only the socket directory, as an injected pod and the node's cache server do. The engine
    gets the variables the operator injects; the same prompt is sent until ``want_hit_tokens`` of it
    are a hit (at most 60 times). Returns every answer, first to last.
    """
    with _shared_dir() as run, _cache_server(eng, cacheserver, run, timeout):
        name = f"kvfabric-smoke-engine-{secrets.token_hex(4)}"
        started = eng.docker(
            "run",
            "-d",
            f"--name={name}",
            *LOCKED_DOWN,
            "--tmpfs=/tmp",
            "-v",
            f"{run}:/run/kvfabric",
            "-e",
            "KVFABRIC_SOCKET=/run/kvfabric/cache.sock",
            "-e",
            f"KVFABRIC_CHUNK_TOKENS={ENGINE_CHUNK_TOKENS}",
            engine.ref,
            "engine",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "8000",
            "--max-model-len",
            "2048",
            check=False,
        )
        if started.returncode != 0:
            raise SmokeError(f"docker run {engine.ref} failed:\n{started.stderr}")
        try:
            out = eng.docker(
                "exec",
                name,
                "python",
                "-c",
                _ENGINE_CLIENT,
                str(timeout),
                json.dumps(prompt),
                str(want_hit_tokens),
                check=False,
            )
            if out.returncode != 0:
                logs = eng.docker("logs", name, check=False)
                raise SmokeError(
                    f"the engine image served no request:\n{out.stderr}\n--- engine log ---\n"
                    f"{logs.stdout}{logs.stderr}"
                )
            return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
        finally:
            eng.docker("rm", "-f", name, check=False)


class ProcessFacts(TypedDict):
    """What the kernel says about a container's process (see :func:`process_facts`)."""

    uids: list[int]
    gids: list[int]
    cap_eff: int
    cap_bnd: int
    no_new_privs: bool
    root_read_only: bool


def process_facts(pid: int) -> ProcessFacts:
    """What the kernel says about a running process: its uids, capabilities and root mount.

    ``uids`` are (real, effective, saved, filesystem); ``cap_eff``/``cap_bnd`` are bit masks;
    ``root_read_only`` is whether ``/`` is mounted ``ro`` in the process's mount namespace.
    """
    status = dict(
        line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line
    )
    root_opts = next(
        line.split()[3].split(",")
        for line in Path(f"/proc/{pid}/mounts").read_text().splitlines()
        if line.split()[1] == "/"
    )
    return {
        "uids": [int(u) for u in status["Uid"].split()],
        "gids": [int(g) for g in status["Gid"].split()],
        "cap_eff": int(status["CapEff"], 16),
        "cap_bnd": int(status["CapBnd"], 16),
        "no_new_privs": status.get("NoNewPrivs", "0").strip() == "1",
        "root_read_only": "ro" in root_opts,
    }


def connector_payload(eng: DockerEngine, image: Image) -> list[str]:
    """Copy the payload with the image's default command; import it from the Python image."""
    with _shared_dir() as dest:
        out = eng.docker("run", "--rm", *LOCKED_DOWN, "-v", f"{dest}:/opt/kvfabric", image.ref, check=False)
        if out.returncode != 0:
            raise SmokeError(f"{image.ref} default command failed:\n{out.stdout}{out.stderr}")
        site = dest / "site-packages"
        if not (site / "kvfabric" / "connector").is_dir():
            raise SmokeError(f"the payload did not land in {site}: {sorted(os.listdir(dest))}")
        probe = (
            "import kvfabric.connector.settings, kvfabric.connector.resilient, kvfabric.client.sync, sys; "
            "print(sys.version.split()[0])"
        )
        imported = eng.docker(
            "run",
            "--rm",
            *LOCKED_DOWN,
            "-e",
            "PYTHONPATH=/opt/kvfabric/site-packages",
            "-v",
            f"{dest}:/opt/kvfabric:ro",
            PYTHON_IMAGE,
            "python",
            "-c",
            probe,
            check=False,
        )
        if imported.returncode != 0:
            raise SmokeError(f"the payload does not import in {PYTHON_IMAGE}:\n{imported.stderr}")
        return sorted(p.name for p in site.iterdir())
