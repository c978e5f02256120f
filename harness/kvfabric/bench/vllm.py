"""``kvfabric bench vllm``: time to first token inside real vLLM (CPU), cold vs warm vs a kvfabric hit.

What runs: the pinned vLLM environment (``scripts/vllm-env.sh``), a random-weight Llama generated
locally (``kvfabric.testing.vllmenv.BENCH``: 4 layers, hidden 512, 8 KiB of fp32 KV per token), one
real cache server, and vLLM's OpenAI server with kvfabric's connector:

- server 1, per prompt length (2k, 8k, 16k tokens plus a 64-token new turn; ``--quick``: 2k and
  8k): a new prompt is **cold** (vLLM computes it; kvfabric stores it), the same prompt again is
  **vLLM's own prefix-cache hit** (the best case: KV already in vLLM's memory);
- server 1 stops, server 2 starts on the same cache server: the same prompts are **kvfabric hits
  after a restart** (vLLM's memory is empty; the KV comes from the cache server's DRAM).

Medians over ``--repeats`` prompts per length, with min and max, and the ratios measured in this run:
``kvfabric_vs_vllm_warm`` (goal <= 1.2) and ``speedup_vs_cold``. Both servers run with the same CPU
thread binding (``VLLM_CPU_NUM_OF_RESERVED_CPU=1``). Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

SUFFIX = 64


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options."""
    parser.add_argument("--quick", action="store_true", help="2k and 8k only, one prompt each")
    parser.add_argument("--json", action="store_true", help="print every line as JSON")
    parser.add_argument(
        "--lengths", default=None, help="comma-separated prompt lengths (default 2048,8192,16384)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="prompts per length (default 3; --quick 1)")


def _ttft(server: Any, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    stream = server.stream(prompt, 4, timeout=600)
    next(stream)
    ttft = time.perf_counter() - t0
    for _ in stream:
        pass
    return ttft


def _out(args: argparse.Namespace, line: dict[str, Any]) -> None:
    print(json.dumps(line) if args.json else "  ".join(f"{k}={v}" for k, v in line.items()))


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print one line per length (and a header of versions)."""
    from kvfabric.testing.serverproc import cache_server, wait_until
    from kvfabric.testing.vllmenv import (
        BENCH,
        VllmServer,
        connector_config,
        find_env,
        make_tiny_model,
        skip_reason,
    )
    from kvfabric.testing.vllmenv import metric_sum as msum

    env = find_env()
    if env is None:
        print(skip_reason(), file=sys.stderr)
        return 2
    lengths = [
        int(x) for x in (args.lengths or ("2048,8192" if args.quick else "2048,8192,16384")).split(",")
    ]
    repeats = args.repeats or (1 if args.quick else 3)
    rng = random.Random(0)
    prompts = {
        n: [[rng.randrange(3, int(BENCH["vocab_size"])) for _ in range(n + SUFFIX)] for _ in range(repeats)]
        for n in lengths
    }
    per_token = 2 * int(BENCH["num_hidden_layers"]) * int(BENCH["num_key_value_heads"]) * 64 * 4
    need = sum(n + SUFFIX for n in lengths) * repeats * per_token
    with tempfile.TemporaryDirectory(prefix="kvf-bench-vllm-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(env, work / "model", BENCH)
        mib = 1 << 20
        dram = max(256 * mib, int(need * 1.5))
        with cache_server(server_id="bench", dram_bytes=dram, local_disk_bytes=2 * dram) as srv:
            kv = connector_config(srv.config.listen.unix_socket, srv.shm_dir, load_deadline_ms=30000)
            max_len = max(lengths) + SUFFIX + 64

            def server(name: str) -> VllmServer:
                s = VllmServer(env, model, work / f"{name}.log", kv, max_model_len=max_len)
                t0 = time.monotonic()
                s.start()
                _out(args, {"event": "started", "server": name, "startup_s": round(time.monotonic() - t0, 1)})
                return s

            cold: dict[int, list[float]] = {n: [] for n in lengths}
            warm: dict[int, list[float]] = {n: [] for n in lengths}
            hit: dict[int, list[float]] = {n: [] for n in lengths}
            s1 = server("server-1")
            try:
                for n in lengths:
                    for p in prompts[n]:
                        cold[n].append(_ttft(s1, p))
                        warm[n].append(_ttft(s1, p))
            finally:
                s1.stop()

            def stored() -> float:
                with urllib.request.urlopen(srv.metrics_url + "/metrics", timeout=10) as r:  # noqa: S310
                    return msum(r.read().decode(), "kvfabric_cache_stores")

            chunks = sum((n + SUFFIX) // 256 for n in lengths) * repeats
            wait_until(lambda: stored() >= chunks, 120, what="the stores to land")
            s2 = server("server-2")
            try:
                loaded0 = msum(s2.metrics(), "vllm:kvfabric_loaded_tokens")
                for n in lengths:
                    for p in prompts[n]:
                        hit[n].append(_ttft(s2, p))
                loaded = msum(s2.metrics(), "vllm:kvfabric_loaded_tokens") - loaded0
            finally:
                s2.stop()
    versions = {
        "vllm": env.installed_version(),
        "model": "random Llama, 4x512, fp32",
        "loaded_tokens": loaded,
    }
    _out(args, {"event": "versions", **versions})
    for n in lengths:
        c, w, h = statistics.median(cold[n]), statistics.median(warm[n]), statistics.median(hit[n])
        _out(
            args,
            {
                "prompt_tokens": n + SUFFIX,
                "cold_s": _summary(cold[n]),
                "vllm_prefix_cache_s": _summary(warm[n]),
                "kvfabric_hit_after_restart_s": _summary(hit[n]),
                "kvfabric_vs_vllm_warm": round(h / w, 2),
                "speedup_vs_cold": round(c / h, 1),
            },
        )
    return 0
