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
thread binding (``VLLM_CPU_NUM_OF_RESERVED_CPU=1``). Not a test: nothing is asserted. The last line
is ``spread`` and ``targets`` (:mod:`kvfabric.bench.report`): per length, ``kvfabric_vs_vllm_warm_<n>``
over the prompts (each prompt's hit over its own vLLM hit), goal <= 1.2.

``--chat``: instead, a multi-round chat workload whose total context exceeds vLLM's KV cache
(``--num-gpu-blocks-override``): ``--sessions`` chats of ``--rounds`` rounds, sent round-robin
(every session's round r, then every session's round r+1), so between two rounds of a chat the
others' rounds pass through and vLLM's own prefix cache has evicted its history. Two arms, each a
fresh vLLM server with the same KV-cache size and CPU binding: vLLM alone (its own prefix cache on)
and vLLM with kvfabric. TTFT p50/p90/p99 per arm for round 1 (nothing to reuse) and rounds 2+
(history to reuse), the ratio of the arms' medians, and whether every output of the kvfabric arm
equals vLLM alone's (greedy, float32). The last line judges the run (one sample: all its requests):
rounds 2+ speed-up at p50 (>= 1), every output identical, round 1's p90 with kvfabric over vLLM
alone's (<= 1.03: round 1 only stores).

``--co-running``: instead, what a load costs the requests decoding beside it, with synchronous and
with asynchronous loads (``load_async``, issue 11.6). A first vLLM server stores ``--repeats``
long prompts (8k tokens); then, per mode, a fresh server on the same cache server streams two long
decodes while those prompts arrive one by one as kvfabric hits. Printed per mode: the decoders'
gaps between streamed tokens while the loads ran (p50/p99/max) against their gaps before, and the
hits' TTFT.

``--model gemma3|gemma4|gptoss|mistral-swa|llama4``: instead, one tiny hybrid-attention model
(:mod:`kvfabric.testing.hybridmodels`; several may be given, comma-separated) and what kvfabric
costs or saves it. Per model, four vLLM servers in turn, all with the same KV memory
(``VLLM_CPU_KVCACHE_SPACE``) and CPU binding:

- **vLLM alone**: its KV cache capacity in tokens (the "KV cache size" vLLM logs);
- **with kvfabric**: its capacity (the goal: equal to vLLM alone's, which vLLM gives only to a
  connector that keeps its hybrid manager on); per prompt the **cold** TTFT (computed, stored)
  and **vLLM's own prefix-cache hit**;
- **with kvfabric, restarted**: the same prompts are **kvfabric hits after a restart**; the bytes
  loaded per hit (``vllm:kvfabric_loaded_bytes``);
- **with kvfabric, hybrid manager off** (``--disable-hybrid-kv-cache-manager``): its capacity, and
  the bytes loaded per hit (prompts stored, then vLLM's prefix cache reset, then asked again), to
  compare: with the manager on, window and local layers move only what they attend to.

``--repeats`` prompts per model (default 3), medians with min and max.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvfabric.bench.report import Target, judge, percentile, spread, summary

SUFFIX = 64


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options."""
    parser.add_argument("--quick", action="store_true", help="2k and 8k only, one prompt each")
    parser.add_argument("--json", action="store_true", help="print every line as JSON")
    parser.add_argument(
        "--lengths", default=None, help="comma-separated prompt lengths (default 2048,8192,16384)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="prompts per length (default 3; --quick 1)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="run the multi-round chat workload (context beyond vLLM's KV cache) instead of the length table",
    )
    parser.add_argument(
        "--co-running",
        action="store_true",
        help="decode latency of co-running requests while hits load, synchronous against asynchronous loads",
    )
    parser.add_argument(
        "--sessions", type=int, default=6, help="--chat: conversations, sent round-robin (default 6)"
    )
    parser.add_argument("--rounds", type=int, default=4, help="--chat: rounds per conversation (default 4)")
    parser.add_argument(
        "--model",
        default=None,
        help="tiny hybrid model(s), comma-separated: gemma3, gemma4, gptoss, mistral-swa, llama4 "
        "(default: the Llama length table)",
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=2048, help="--model: prompt length before the new turn"
    )
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=24,
        help="--chat: vLLM's KV cache in 128-token blocks (default 24: about one and a half chats)",
    )


def _ttft(server: Any, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    stream = server.stream(prompt, 4, timeout=600)
    next(stream)
    ttft = time.perf_counter() - t0
    for _ in stream:
        pass
    return ttft


def _ttft_tokens(server: Any, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Time to the first streamed token, and every generated token id."""
    t0 = time.perf_counter()
    out: list[int] = []
    ttft = 0.0
    for ids in server.stream(prompt, max_tokens, timeout=600):
        if not out:
            ttft = time.perf_counter() - t0
        out.extend(ids)
    return ttft, out


def _vllm_env() -> Any:
    """The pinned vLLM environment, or None after saying why it is missing (the caller exits 2)."""
    from kvfabric.testing.vllmenv import find_env, skip_reason

    env = find_env()
    if env is None:
        print(skip_reason(), file=sys.stderr)
    return env


def _out(args: argparse.Namespace, line: dict[str, Any]) -> None:
    print(json.dumps(line) if args.json else "  ".join(f"{k}={v}" for k, v in line.items()))


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


CHAT_FIRST, CHAT_TURN, CHAT_OUT = 1024, 256, 32


def _chat_turns(sessions: int, rounds: int, vocab: int) -> list[list[list[int]]]:
    """Every session's user turns (the first one long, like a system prompt and a document)."""
    rng = random.Random(1)
    return [
        [[rng.randrange(3, vocab) for _ in range(CHAT_FIRST if r == 0 else CHAT_TURN)] for r in range(rounds)]
        for _ in range(sessions)
    ]


def _chat_arm(server: Any, turns: list[list[list[int]]]) -> tuple[list[float], list[float], list[list[int]]]:
    """Send every session's rounds round-robin; TTFTs of round 1 and of later rounds, and outputs."""
    prompts: list[list[int]] = [[] for _ in turns]
    first: list[float] = []
    later: list[float] = []
    outputs: list[list[int]] = []
    for r in range(len(turns[0])):
        for s, conv in enumerate(turns):
            prompts[s] = [*prompts[s], *conv[r]]
            ttft, out = _ttft_tokens(server, prompts[s], CHAT_OUT)
            (first if r == 0 else later).append(ttft)
            outputs.append(out)
            prompts[s] = [*prompts[s], *out]
    return first, later, outputs


def run_chat(args: argparse.Namespace) -> int:
    """``--chat``: the multi-round workload, vLLM alone against vLLM with kvfabric."""
    from kvfabric.testing.serverproc import cache_server
    from kvfabric.testing.vllmenv import BENCH, VllmServer, connector_config, make_tiny_model
    from kvfabric.testing.vllmenv import metric_sum as msum

    env = _vllm_env()
    if env is None:
        return 2
    turns = _chat_turns(args.sessions, args.rounds, int(BENCH["vocab_size"]))
    context = CHAT_FIRST + (args.rounds - 1) * CHAT_TURN + args.rounds * CHAT_OUT
    vllm_args = ["--num-gpu-blocks-override", str(args.kv_blocks)]
    max_len = min(args.kv_blocks * 128, context + 128)
    _out(
        args,
        {
            "event": "workload",
            "sessions": args.sessions,
            "rounds": args.rounds,
            "context_per_session_tokens": context,
            "total_context_tokens": context * args.sessions,
            "vllm_kv_cache_tokens": args.kv_blocks * 128,
        },
    )
    results: dict[str, tuple[list[float], list[float], list[list[int]]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvf-bench-chat-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(env, work / "model", BENCH)
        arms: list[tuple[str, bool]] = [("vllm_alone", False), ("vllm_kvfabric", True)]
        with cache_server(server_id="bench-chat", dram_bytes=1 << 30, local_disk_bytes=None) as srv:
            kv = connector_config(srv.config.listen.unix_socket, load_deadline_ms=30000)
            for name, with_cache in arms:
                s = VllmServer(
                    env,
                    model,
                    work / f"{name}.log",
                    kv if with_cache else None,
                    vllm_args,
                    max_model_len=max_len,
                )
                t0 = time.monotonic()
                s.start()
                _out(args, {"event": "started", "arm": name, "startup_s": round(time.monotonic() - t0, 1)})
                try:
                    results[name] = _chat_arm(s, turns)
                    if with_cache:
                        loaded = msum(s.metrics(), "vllm:kvfabric_loaded_tokens")
                        _out(args, {"event": "kvfabric", "loaded_tokens": loaded})
                finally:
                    s.stop()
    alone, fabric = results["vllm_alone"], results["vllm_kvfabric"]
    same = sum(a == b for a, b in zip(alone[2], fabric[2], strict=True))
    for label, a, f in (("round_1", alone[0], fabric[0]), ("rounds_2_plus", alone[1], fabric[1])):
        _out(
            args,
            {
                "rounds": label,
                "vllm_alone_ttft_s": summary(a),
                "vllm_kvfabric_ttft_s": summary(f),
                "speedup_p50": round(statistics.median(a) / statistics.median(f), 2),
            },
        )
    _out(args, {"event": "outputs", "identical": same, "of": len(alone[2]), "vllm": env.installed_version()})
    _out(args, chat_verdicts(alone[0], fabric[0], alone[1], fabric[1], identical=same, outputs=len(alone[2])))
    return 0


# Goals of the chat workload: later rounds reuse their history (kvfabric no slower than vLLM alone at
# the median), round 1 (nothing to reuse, only stores) costs at most 3 % at p90, every output equal.
CHAT_ROUND_1_P90_GOAL = 1.03
CHAT_SPEEDUP_GOAL = 1.0


def chat_verdicts(
    first_alone: list[float],
    first_fabric: list[float],
    later_alone: list[float],
    later_fabric: list[float],
    *,
    identical: int,
    outputs: int,
) -> dict[str, Any]:
    """The chat run's summary line: ``spread`` (one sample each: a whole run) and ``targets``."""
    spreads = {
        "chat_round_1_p90_ratio": spread(
            [percentile(sorted(first_fabric), 0.9) / percentile(sorted(first_alone), 0.9)]
        ),
        "chat_outputs_identical_fraction": spread([identical / outputs if outputs else 0.0]),
    }
    if later_alone and later_fabric:
        spreads["chat_rounds_2_plus_speedup_p50"] = spread(
            [statistics.median(later_alone) / statistics.median(later_fabric)]
        )
    targets = [
        Target("chat rounds >= 2: TTFT p50 speed-up, vLLM alone / with kvfabric",
               "chat_rounds_2_plus_speedup_p50", ">=", CHAT_SPEEDUP_GOAL),
        Target("chat: outputs identical to vLLM alone's (fraction)", "chat_outputs_identical_fraction",
               ">=", 1.0, stat="worst"),
        Target("chat round 1 (stores only): TTFT p90, with kvfabric / vLLM alone",
               "chat_round_1_p90_ratio", "<=", CHAT_ROUND_1_P90_GOAL),
    ]  # fmt: skip
    return {
        "bench": "vllm-chat",
        "spread": {k: v.as_dict() for k, v in spreads.items()},
        "targets": judge(targets, spreads),
    }


# A kvfabric hit after a restart may cost at most 1.2x vLLM's own prefix-cache hit of the same prompt.
HIT_OVER_WARM_GOAL = 1.2


def length_verdicts(warm: dict[int, list[float]], hit: dict[int, list[float]]) -> dict[str, Any]:
    """The length table's summary line: per length, the ratio hit / vLLM's own hit of each prompt."""
    spreads = {
        f"kvfabric_vs_vllm_warm_{n}": spread([h / w for h, w in zip(hit[n], warm[n], strict=True)])
        for n in warm
        if warm[n]
    }
    targets = [
        Target(f"real vLLM: kvfabric hit after restart / vLLM's own prefix-cache hit, {n} tokens",
               f"kvfabric_vs_vllm_warm_{n}", "<=", HIT_OVER_WARM_GOAL)
        for n in warm
    ]  # fmt: skip
    return {
        "bench": "vllm",
        "spread": {k: v.as_dict() for k, v in spreads.items()},
        "targets": judge(targets, spreads),
    }


def _gaps(stamps: list[float], start: float, end: float) -> list[float]:
    """Gaps between consecutive stamps whose later stamp lies in ``[start, end]``."""
    return [b - a for a, b in itertools.pairwise(stamps) if start <= b <= end]


def _gaps_ms(gaps: list[float]) -> dict[str, float]:
    return summary(gaps, (0.99,), scale=1000, digits=1, unit="_ms")


def run_co_running(args: argparse.Namespace) -> int:
    """``--co-running``: decoders' token gaps while hits load, synchronous against asynchronous loads."""
    import threading

    from kvfabric.testing.serverproc import cache_server, wait_until
    from kvfabric.testing.vllmenv import BENCH, VllmServer, connector_config, make_tiny_model
    from kvfabric.testing.vllmenv import metric_sum as msum

    env = _vllm_env()
    if env is None:
        return 2
    n_loads = args.repeats or 4
    length, decode_tokens = 8192, 600
    rng = random.Random(2)
    vocab = int(BENCH["vocab_size"])
    hits = [[rng.randrange(3, vocab) for _ in range(length + SUFFIX)] for _ in range(n_loads)]
    decoders = [[rng.randrange(3, vocab) for _ in range(256)] for _ in range(2)]
    per_token = 2 * int(BENCH["num_hidden_layers"]) * int(BENCH["num_key_value_heads"]) * 64 * 4
    dram = max(512 << 20, int(n_loads * (length + SUFFIX) * per_token * 1.5))
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvf-bench-corun-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(env, work / "model", BENCH)
        with cache_server(server_id="bench-corun", dram_bytes=dram, local_disk_bytes=None) as srv:

            def server(name: str, **extra: Any) -> VllmServer:
                kv = connector_config(srv.config.listen.unix_socket, load_deadline_ms=30000, **extra)
                s = VllmServer(env, model, work / f"{name}.log", kv, max_model_len=length + SUFFIX + 64)
                t0 = time.monotonic()
                s.start()
                _out(args, {"event": "started", "server": name, "startup_s": round(time.monotonic() - t0, 1)})
                return s

            store = server("storing")
            try:
                for p in hits:
                    store.complete(p, 1)
            finally:
                store.stop()

            def stored() -> float:
                with urllib.request.urlopen(srv.metrics_url + "/metrics", timeout=10) as r:  # noqa: S310
                    return msum(r.read().decode(), "kvfabric_cache_stores")

            wait_until(lambda: stored() >= n_loads * (length // 256), 120, what="the stores to land")
            for mode, load_async in (("sync", False), ("async", True)):
                s = server(mode, load_async=load_async)
                try:
                    stamps: list[list[float]] = [[] for _ in decoders]
                    started = threading.Barrier(len(decoders) + 1)

                    def decode(
                        i: int,
                        s: VllmServer = s,
                        stamps: list[list[float]] = stamps,
                        started: threading.Barrier = started,
                    ) -> None:
                        first = True
                        for _ids in s.stream(decoders[i], decode_tokens, timeout=600):
                            stamps[i].append(time.perf_counter())
                            if first:
                                first = False
                                started.wait(60)

                    threads = [threading.Thread(target=decode, args=(i,)) for i in range(len(decoders))]
                    for t in threads:
                        t.start()
                    started.wait(120)
                    time.sleep(1.0)  # steady decoding first: the "before" gaps
                    window_start = time.perf_counter()
                    ttfts = [_ttft(s, p) for p in hits]
                    window_end = time.perf_counter()
                    for t in threads:
                        t.join()
                    during = [g for st in stamps for g in _gaps(st, window_start, window_end)]
                    before = [g for st in stamps for g in _gaps(st, st[0], window_start)]
                    loaded = msum(s.metrics(), "vllm:kvfabric_loaded_tokens")
                    out[mode] = {
                        "decoder_gaps_before": _gaps_ms(before),
                        "decoder_gaps_while_loading": summary(
                            during, (0.99,), scale=1000, digits=1, unit="_ms"
                        ),
                        "hit_ttft_s": _summary(ttfts),
                        "loaded_tokens": loaded,
                    }
                    _out(args, {"mode": mode, **out[mode]})
                finally:
                    s.stop()
    sync_max = out["sync"]["decoder_gaps_while_loading"].get("max_ms")
    async_max = out["async"]["decoder_gaps_while_loading"].get("max_ms")
    _out(
        args,
        {
            "event": "summary",
            "vllm": env.installed_version(),
            "hit_tokens": length + SUFFIX,
            "decoder_max_gap_sync_ms": sync_max,
            "decoder_max_gap_async_ms": async_max,
            "hit_ttft_p50_sync_s": out["sync"]["hit_ttft_s"]["p50"],
            "hit_ttft_p50_async_s": out["async"]["hit_ttft_s"]["p50"],
        },
    )
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print one line per length (and a header of versions)."""
    if args.chat:
        return run_chat(args)
    if args.co_running:
        return run_co_running(args)
    if args.model:
        return run_hybrid(args)
    from kvfabric.testing.serverproc import cache_server, wait_until
    from kvfabric.testing.vllmenv import BENCH, VllmServer, connector_config, make_tiny_model
    from kvfabric.testing.vllmenv import metric_sum as msum

    env = _vllm_env()
    if env is None:
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
            kv = connector_config(srv.config.listen.unix_socket, load_deadline_ms=30000)
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
    _out(args, length_verdicts(warm, hit))
    return 0


_KV_CACHE_SIZE = re.compile(r"KV cache size: ([\d,]+) tokens")


def kv_cache_tokens(log: str) -> int | None:
    """VLLM's logged KV cache capacity in tokens (the last "KV cache size: N tokens"), or None."""
    found = _KV_CACHE_SIZE.findall(log)
    return int(found[-1].replace(",", "")) if found else None


def _settle(count: Any, floor: float, quiet_s: float = 3.0, patience_s: float = 60.0) -> float:
    """Wait until the cache server's store counter ``count()`` stopped moving; return it.

    A hybrid model stores one object per chunk and kind, so the number of objects is not known in
    advance: stores are over when the counter stayed the same for ``quiet_s`` seconds, once it
    reached ``floor`` (one object per chunk) or, failing that, after ``patience_s`` (a store may be
    dropped: the caller reports the count).
    """
    start = time.monotonic()
    last, since = count(), start
    while True:
        time.sleep(0.5)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
            continue
        quiet = time.monotonic() - since >= quiet_s
        if quiet and (now >= floor or time.monotonic() - start >= patience_s):
            return float(now)


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def _loaded_by_kind(metrics: str) -> dict[str, float]:
    """``vllm:kvfabric_loaded_bytes`` per ``kind`` label (``total``: every sample)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {"total": 0.0}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name in ("vllm:kvfabric_loaded_bytes", "vllm:kvfabric_loaded_bytes_total"):
                kind = sample.labels.get("kind")
                out["total"] += sample.value
                if kind:
                    out[kind] = out.get(kind, 0.0) + sample.value
    return out


# vLLM sizes a sliding-window group for the window plus one step's tokens, and reports its capacity
# as the requests of max_model_len tokens that fit: the models' full context and 512-token steps
# (the probes' settings) let the window layers' saving show.
HYBRID_MAX_MODEL_LEN = 4096
HYBRID_SERVER_ARGS = ["--max-num-batched-tokens", "512"]


def run_hybrid(args: argparse.Namespace) -> int:
    """``--model``: capacity, TTFT and bytes per hit of tiny hybrid models, with and without kvfabric."""
    from kvfabric.testing import hybridmodels

    names = [n.strip() for n in args.model.split(",") if n.strip()]
    unknown = [n for n in names if n not in hybridmodels.MODELS]
    if unknown:
        print(f"--model: unknown {unknown}; known: {', '.join(hybridmodels.MODELS)}", file=sys.stderr)
        return 2
    env = _vllm_env()
    if env is None:
        return 2
    for name in names:
        _out(args, _hybrid_model(args, env, name))
    return 0


def _hybrid_model(args: argparse.Namespace, env: Any, name: str) -> dict[str, Any]:
    """One model's four servers (see the module docstring); the result line."""
    from kvfabric.testing import hybridmodels
    from kvfabric.testing.serverproc import cache_server, wait_until
    from kvfabric.testing.vllmenv import VllmServer, connector_config
    from kvfabric.testing.vllmenv import metric_sum as msum

    repeats = args.repeats or 3
    n = args.prompt_tokens + SUFFIX
    path = hybridmodels.build(env, hybridmodels.MODELS[name])
    prompts = [hybridmodels.prompt_tokens(100 * i + 1, n) for i in range(repeats)]
    off_prompts = [hybridmodels.prompt_tokens(100 * i + 2, n) for i in range(repeats)]
    line: dict[str, Any] = {"model": name, "prompt_tokens": n, "vllm": env.installed_version()}
    cold: list[float] = []
    warm: list[float] = []
    hit: list[float] = []
    with (
        tempfile.TemporaryDirectory(prefix=f"kvf-bench-{name}-") as tmp,
        cache_server(server_id=f"bench-{name}", dram_bytes=1 << 30, local_disk_bytes=None) as srv,
    ):
        work = Path(tmp)
        kv = connector_config(srv.config.listen.unix_socket, load_deadline_ms=30000, cost_model=False)

        def server(
            arm: str, *, with_cache: bool = True, extra: Sequence[str] = (), dev: bool = False
        ) -> VllmServer:
            s = VllmServer(
                env,
                path,
                work / f"{arm}.log",
                kv if with_cache else None,
                [*HYBRID_SERVER_ARGS, *extra],
                extra_env={"VLLM_SERVER_DEV_MODE": "1"} if dev else {},
                max_model_len=HYBRID_MAX_MODEL_LEN,
            )
            t0 = time.monotonic()
            s.start()
            _out(
                args,
                {"event": "started", "model": name, "arm": arm, "startup_s": round(time.monotonic() - t0, 1)},
            )
            return s

        def stored() -> float:
            with urllib.request.urlopen(srv.metrics_url + "/metrics", timeout=10) as r:  # noqa: S310
                return msum(r.read().decode(), "kvfabric_cache_stores")

        alone = server("vllm_alone", with_cache=False)
        alone.stop()
        line["kv_cache_tokens_vllm_alone"] = kv_cache_tokens(alone.logs())

        s1 = server("kvfabric")
        try:
            line["kv_cache_tokens_kvfabric"] = kv_cache_tokens(s1.logs())
            line["hybrid_manager_kept"] = "turning off hybrid kv cache manager" not in s1.logs().lower()
            for p in prompts:
                cold.append(_ttft(s1, p))
                warm.append(_ttft(s1, p))
            # Stores run in the connector's background: let them land before vLLM stops.
            line["objects_stored"] = _settle(stored, repeats * (n // 256))
        finally:
            s1.stop()

        s2 = server("kvfabric_restarted")
        try:
            before = _loaded_by_kind(s2.metrics())
            hit.extend(_ttft(s2, p) for p in prompts)
            try:
                wait_until(
                    lambda: _loaded_by_kind(s2.metrics())["total"] > before["total"],
                    60,
                    what="the loads' counters",
                )
            except TimeoutError:  # nothing was loaded (a miss, or a worker that disabled itself)
                line["warning"] = "no kvfabric loads after the restart: see the server log"
            time.sleep(2.0)  # the last steps' statistics
            moved = _delta(before, _loaded_by_kind(s2.metrics()))
        finally:
            s2.stop()

        moved_off: dict[str, float] = {}
        try:
            s3 = server("kvfabric_hybrid_manager_off", extra=["--disable-hybrid-kv-cache-manager"], dev=True)
        except (RuntimeError, TimeoutError) as exc:  # a model vLLM cannot serve without it
            errors = [ln for ln in str(exc).splitlines() if "Error" in ln] or str(exc).splitlines()[:1]
            line["hybrid_off_error"] = errors[0][-300:]  # the root cause vLLM logs first
        else:
            try:
                line["kv_cache_tokens_kvfabric_hybrid_off"] = kv_cache_tokens(s3.logs())
                stores0 = stored()
                for p in off_prompts:
                    s3.complete(p, 4)
                line["objects_stored_hybrid_off"] = _settle(stored, stores0 + repeats * (n // 256)) - stores0
                # vLLM's own prefix cache forgets the prompts (kvfabric's cache is not reset).
                req = urllib.request.Request(s3.url + "/reset_prefix_cache", method="POST")  # noqa: S310
                urllib.request.urlopen(req, timeout=30).close()  # noqa: S310 - loopback
                before_off = _loaded_by_kind(s3.metrics())
                for p in off_prompts:
                    s3.complete(p, 4)
                time.sleep(2.0)
                moved_off = _delta(before_off, _loaded_by_kind(s3.metrics()))
            finally:
                s3.stop()
    c, w, h = statistics.median(cold), statistics.median(warm), statistics.median(hit)
    alone_tokens, with_tokens = line["kv_cache_tokens_vllm_alone"], line["kv_cache_tokens_kvfabric"]
    per_hit = {k: round(v / repeats) for k, v in moved.items()}
    per_hit.setdefault("total", 0)
    per_hit_off = round(moved_off.get("total", 0.0) / repeats)
    line.update(
        {
            "capacity_ratio": round(with_tokens / alone_tokens, 3) if alone_tokens and with_tokens else None,
            "cold_s": _summary(cold),
            "vllm_prefix_cache_s": _summary(warm),
            "kvfabric_hit_after_restart_s": _summary(hit),
            "kvfabric_vs_vllm_warm": round(h / w, 2),
            "speedup_vs_cold": round(c / h, 1),
            "bytes_per_hit": per_hit,
            "bytes_per_hit_hybrid_off": per_hit_off,
            "bytes_ratio_vs_hybrid_off": round(per_hit["total"] / per_hit_off, 3) if per_hit_off else None,
        }
    )
    return line
