"""Version skew: this release's client with the previous release's cache server, and the reverse.

The previous release is its git tag's code (:mod:`kvfabric.testing.release`), run from a temporary
directory: its cache server as a process, its client in a subprocess. Both paths engines use are
covered: gRPC over TCP (another node) and the same-node path (Unix socket, shared memory, the block and
index sockets). A rolling update from the previous release's server to this one hands the node's
DRAM over. docs/operations.md states the promise these tests hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfabric.client import CacheClient
from kvfabric.connector.keys import NamespaceSpec
from kvfabric.testing.release import ReleaseTree, previous_release, release_tree
from kvfabric.testing.serverproc import MiB, cache_server, digest, payload_for

pytestmark = [pytest.mark.process, pytest.mark.slow]

SPEC = NamespaceSpec("meta-llama/Llama-3.1-8B", "0e9e39f", "bfloat16", 32, 8, 128, 16, 256)
SIZES = (1, 4096, 100_000, 1 * MiB)

# Runs under either release's code: it may use only what both releases' client has, and computes keys
# and payloads as kvfabric.testing.serverproc does (the harness is not part of a release).
CLIENT = """
import hashlib, json, sys
import kvfabric.client
from kvfabric.client import CacheClient

target, shm, ns, spec, tag = sys.argv[1], sys.argv[2] == "1", sys.argv[3], sys.argv[4], sys.argv[5]
sizes = [int(n) for n in sys.argv[6].split(",")]

def digest(*parts):
    return hashlib.sha256(repr(parts).encode()).hexdigest()

def payload(key, size):
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * -(-size // len(seed)))[:size]

keys = [digest(tag, i) for i in range(len(sizes) + 1)]  # the last one is never stored
payloads = [payload(k, n) for k, n in zip(keys, sizes)]
with CacheClient(target, shared_memory=shm) as c:
    c.describe(ns, spec, timeout=5)
    accepted = c.store(ns, keys[:-1], payloads, timeout=10).accepted
    matched = c.lookup(ns, keys, timeout=5).matched
    loaded = c.load(ns, keys, timeout=10)
    deleted = c.delete(ns, keys[:1], timeout=5)
    after = c.lookup(ns, keys, timeout=5).matched
    out = {
        "client": kvfabric.client.__file__,
        "uses_shm": c.uses_shm,
        "accepted": accepted,
        "matched": matched,
        "loaded_exact": loaded == payloads,
        "deleted": deleted,
        "matched_after_delete": after,
        "healthy": c.health(timeout=5),
    }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def previous() -> Iterator[ReleaseTree]:
    tag = previous_release()
    if tag is None:
        pytest.skip("no previous release: tag one (git tag -a v<version> <commit>)")
    with release_tree(tag) as tree:
        yield tree


def _code_of(module: str, env: dict[str, str]) -> Path:
    """Where ``module`` is imported from under ``env``."""
    out = subprocess.run(
        [sys.executable, "-c", f"import {module}; print({module}.__file__)"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def _run_client(target: str, *, shm: bool, env: dict[str, str], tag: str) -> dict[str, Any]:
    result = subprocess.run(
        [
            sys.executable, "-c", CLIENT, target, "1" if shm else "0", SPEC.digest(),
            SPEC.canonical().decode(), tag, ",".join(str(n) for n in SIZES),
        ],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return out


def test_the_previous_release_runs_its_own_code(previous: ReleaseTree) -> None:
    env = {"PYTHONPATH": previous.pythonpath}
    for module in ("kvfabric.cacheserver", "kvfabric.client", "kvfabric.rpc.v1.cache_pb2"):
        assert _code_of(module, env).is_relative_to(previous.root), module
        assert not _code_of(module, {}).is_relative_to(previous.root), module


@pytest.mark.parametrize("path", ["grpc", "same-node"])
@pytest.mark.parametrize("server", ["previous", "this"])
def test_a_client_and_a_server_one_release_apart_work_together(
    previous: ReleaseTree, server: str, path: str
) -> None:
    old = {"PYTHONPATH": previous.pythonpath}
    server_env, client_env = (old, {}) if server == "previous" else ({}, old)
    with cache_server(dram_bytes=64 * MiB, env=server_env) as srv:
        same_node = path == "same-node"
        got = _run_client(
            srv.unix_target if same_node else srv.tcp_target,
            shm=same_node,
            env=client_env,
            tag=f"{server}-{path}",
        )
    assert Path(got.pop("client")).is_relative_to(previous.root) == (server == "this")
    n = len(SIZES)
    assert got == {
        "uses_shm": same_node,
        "accepted": n,
        "matched": n,
        "loaded_exact": True,
        "deleted": 1,
        "matched_after_delete": 0,
        "healthy": True,
    }


def test_a_rolling_update_from_the_previous_release_hands_the_node_over(previous: ReleaseTree) -> None:
    ns = SPEC.digest()
    keys = [digest("rolling", i) for i in range(8)]
    payloads = [payload_for(k, 256 * 1024) for k in keys]
    # No disk tier: after the update, a block can only come from the DRAM the new server took over.
    with cache_server(
        dram_bytes=64 * MiB, local_disk_bytes=None, env={"PYTHONPATH": previous.pythonpath}
    ) as old:
        with CacheClient(old.unix_target, shared_memory=True) as c:
            c.describe(ns, SPEC.canonical().decode(), timeout=5)
            assert c.store(ns, keys, payloads, timeout=10).accepted == len(keys)
        new = old.successor()
        new.env = {}  # this release's code
        try:
            new.start_beside()
            # Every block is served by this release's server, from the DRAM it took over (the
            # previous one idles, handed over).
            with CacheClient(new.unix_target, shared_memory=True) as c:
                assert c.lookup(ns, keys, timeout=5).matched == len(keys)
                assert c.load(ns, keys, timeout=10) == payloads
            with urllib.request.urlopen(new.metrics_url + "/metrics", timeout=10) as resp:
                families = text_string_to_metric_families(resp.read().decode())
            adopted = [
                (sample.labels["tier"], sample.value)
                for family in families
                for sample in family.samples
                if sample.name == "kvfabric_handover_adopted_blocks_total"
            ]
            assert adopted == [("dram", len(keys))]
            assert any(
                r.get("message") == "handed over to the successor; idle until terminated"
                for r in old.log_records()
            )
        finally:
            new.stop()
