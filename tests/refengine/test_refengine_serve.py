"""``kvfabric engine serve``: the HTTP "inference pod", as a real process with a real cache server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfabric.refengine.testing import prompt
from kvfabric.testing.memtransport import CacheServerProcess

pytestmark = pytest.mark.process  # real processes (test level, see kvfabric.testing.levels)


def post(url: str, doc: Any) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url, data=json.dumps(doc).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[CacheServerProcess]:
    with CacheServerProcess(tmp_path, name="node") as srv:
        yield srv


@pytest.fixture
def pod(cache: CacheServerProcess) -> Iterator[str]:
    env = {
        **os.environ,
        **cache.settings_env(),
        "KVFABRIC_CHUNK_TOKENS": "32",
        # Generous: a deadline that expires on a loaded machine is a (correct) recompute that these
        # exact-outcome assertions would read as a failure. A killed server fails fast regardless.
        "KVFABRIC_LOOKUP_DEADLINE_MS": "3000",
        "KVFABRIC_LOAD_DEADLINE_MS": "10000",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvfabric.cli.main",
            "engine",
            "serve",
            "--port",
            "0",
            "--max-model-len",
            "2048",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        yield json.loads(line)["listening"]
    finally:
        proc.terminate()
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()


def test_generate_hits_after_first_request_and_survives_cache_death(
    pod: str, cache: CacheServerProcess
) -> None:
    with urllib.request.urlopen(pod + "/healthz", timeout=30) as resp:
        assert resp.status == 200
    tokens = prompt(150, 21)
    status, first = post(pod + "/generate", {"prompt_token_ids": tokens, "max_tokens": 3})
    assert status == 200
    assert (first["hit_tokens"], first["tier"], first["fallback_reason"]) == (0, None, "not-found")
    assert len(first["output_token_ids"]) == 3
    assert first["ttft_ms"] > 0
    # The store is asynchronous (chunk by chunk); an identical request hits all four chunks and the
    # tail's one whole block (150 = 4 x 32 + 22: 144 tokens) once every one has landed (an earlier
    # one may see a partial prefix, which is correct too).
    for _ in range(200):
        status, second = post(pod + "/generate", {"prompt_token_ids": tokens, "max_tokens": 3})
        assert second["output_token_ids"] == first["output_token_ids"]
        if second["hit_tokens"] == 144:
            break
    assert (status, second["hit_tokens"], second["tier"]) == (200, 144, "dram")
    assert second["output_token_ids"] == first["output_token_ids"]
    cache.kill()
    status, third = post(pod + "/generate", {"prompt_token_ids": tokens, "max_tokens": 3})
    assert (status, third["hit_tokens"], third["fallback_reason"]) == (200, 0, "unavailable")
    assert third["output_token_ids"] == first["output_token_ids"]
    with urllib.request.urlopen(pod + "/stats", timeout=30) as resp:
        stats = json.loads(resp.read())
    assert stats["counters"]["miss.unavailable"] >= 1


BAD_BODIES: list[Any] = [
    {},
    [1, 2],
    {"prompt_token_ids": []},
    {"prompt_token_ids": [1, "x"]},
    {"prompt_token_ids": [1], "max_tokens": 0},
    {"prompt_token_ids": [10**9]},
]


def test_bad_requests_are_400_and_the_pod_stays_up(pod: str) -> None:
    for body in BAD_BODIES:
        status, doc = post(pod + "/generate", body)
        assert status == 400, body
        assert doc["error"]
    status, doc = post(pod + "/generate", {"prompt_token_ids": [1, 2, 3]})
    assert status == 200
    assert len(doc["output_token_ids"]) == 1
