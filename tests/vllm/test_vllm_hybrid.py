"""Hybrid-attention models inside real vLLM with kvfabric: the hybrid KV cache manager stays on.

Five tiny random fp32 models (:mod:`kvfabric.testing.hybridmodels`): Gemma 3 (window 200 beside
full attention), Gemma 4 (window 300, 256-token sliding-window blocks beside 128-token full ones),
gpt-oss (sinks, MoE, window 128), Mistral with a window (one sliding-window group) and Llama 4
(attention chunk 384 beside one full-attention layer: four groups). Per model, three vLLM
processes, all offline ``LLM`` runs on one cache server:

- the **reference**: no connector, no prefix caching, the prompts one by one;
- the **storing run**: kvfabric (through :mod:`tests.vllm.spyconnector`), a 48-block KV cache,
  128-token steps and the three prompts at once, so blocks that leave a window are reused while
  chunks are still being completed;
- then one object is deleted in the cache server (the window or local object of the unit a hit
  of prompt ``c`` ends with), and the **restarted run** (a new vLLM process) asks every prompt again.

Expectations come from :mod:`kvfabric.testing.hybridhits` (the design's table), never from the
connector's code: cached tokens exactly, bytes stored and loaded per kind exactly. Every process
runs with the connector's recorder, which also checks that block 0 is never written.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from tests.vllm.spyconnector import read_records, spy_environ, spy_transfer_config

from kvfabric.client.sync import CacheClient
from kvfabric.connector import keys as keyslib
from kvfabric.connector.groups import GroupPlan, kind_key
from kvfabric.connector.layout import HEADER_SIZE
from kvfabric.testing import hybridmodels
from kvfabric.testing.hybridhits import Kind, Unit, predicted_hit, read_bytes, stored_bytes, stored_units
from kvfabric.testing.serverproc import ServerProcess, cache_server
from kvfabric.testing.vllmenv import OfflineRun, VllmEnv, connector_config, metric_sum

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

CHUNK, MAX_TOKENS = 256, 12
NAMES = list(hybridmodels.MODELS)
PROMPTS = {
    "a": hybridmodels.prompt_tokens(7001, 1000),
    "b": hybridmodels.prompt_tokens(7002, 1100),
    "c": hybridmodels.prompt_tokens(7003, 1000),
}
CONNECTOR = {
    "chunk_tokens": CHUNK,
    "lookup_deadline_ms": 5000,
    "load_deadline_ms": 20000,
    "cost_model": False,
}
REUSE = {
    "num_gpu_blocks_override": 48,
    "max_num_batched_tokens": 128,
    "max_num_seqs": 4,
    "max_model_len": 2048,
}
# vLLM start-up is CPU-bound: more processes at once than this only slow each other down.
PARALLEL = 3
TURNED_OFF = "Turning off hybrid kv cache manager"


@dataclass
class ModelRuns:
    """What one model's three runs produced."""

    model: hybridmodels.HybridModel
    reference: dict[str, Any]
    stored: dict[str, Any]
    restarted: dict[str, Any]
    logs: str
    store_records: list[dict[str, Any]]
    restart_records: list[dict[str, Any]]
    deleted: tuple[str, Unit] | None

    def kinds(self) -> list[Kind]:
        """The model's kinds of layers, from the groups vLLM made (layers and page bytes)."""
        (init,) = [r for r in self.store_records if r["what"] == "init" and r["role"] == "scheduler"]
        by_kind: dict[str, Kind] = {}
        for g in init["groups"]:
            name = _KIND_OF_SPEC[g["type"]]
            old = by_kind.get(name)
            layers = len(g["layers"]) + (old.layers if old else 0)
            by_kind[name] = Kind(
                name,
                g["block_size"],
                layers,
                g["page_size_bytes"],
                window=g["sliding_window"],
                attention_chunk=g["attention_chunk_size"],
            )
        return list(by_kind.values())

    def step(self) -> int:
        """The scheduler block ``S``: the tail units' size."""
        import math

        return math.lcm(*(k.block for k in self.kinds()))


_KIND_OF_SPEC = {
    "FullAttentionSpec": "full",
    "SlidingWindowSpec": "sliding_window",
    "ChunkedLocalAttentionSpec": "chunked_local",
}


def _requests(ids: list[str]) -> list[dict[str, Any]]:
    return [{"id": i, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS} for i in ids]


def _units(prompt: str, step: int) -> list[Unit]:
    return stored_units(len(PROMPTS[prompt]) + MAX_TOKENS - 1, CHUNK, step)


def _victim(kinds: list[Kind], step: int) -> tuple[str, Unit] | None:
    """The object to delete: the window (or local) object of the last unit prompt ``c``'s hit reads."""
    units = _units("c", step)
    hit = predicted_hit(len(PROMPTS["c"]), units, kinds)
    for kind in kinds:
        if kind.name == "full":
            continue
        for unit in reversed(units):
            if unit[1] <= hit and stored_bytes([unit], kind) > 0 and unit[1] > kind.needed_from(0, hit):
                return kind.name, unit
    return None


class _PlainIsFalse:
    """The one attribute of a group plan :func:`kind_key` reads: a hybrid plan is never plain."""

    plain = False


def object_key(keys_record: dict[str, Any], prompt: list[int], unit: Unit, kind: str) -> str:
    """The cache-server key of ``kind``'s object of ``unit`` of ``prompt`` (as the connector stores it)."""
    chain, step = keys_record["key_chain"], keys_record["block_size"]
    chunks = keyslib.chunk_keys(chain, prompt, CHUNK)
    start, end = unit
    if end - start == CHUNK and start % CHUNK == 0:
        base = chunks[start // CHUNK]
    else:
        c = start // CHUNK
        parent = chunks[c - 1] if c > 0 else None
        tails = keyslib.tail_keys(chain, prompt, CHUNK, step, chunk=c, parent=parent)
        base = tails[(end - c * CHUNK) // step - 1]
    return kind_key(base, keys_record["kinds"].index(kind), cast(GroupPlan, _PlainIsFalse()))


def _run_model(
    env: VllmEnv, srv: ServerProcess, name: str, work: Path, slots: threading.Semaphore
) -> ModelRuns:
    model = hybridmodels.MODELS[name]
    path = hybridmodels.build(env, model)
    work = work / name
    kv = spy_transfer_config(connector_config(srv.config.listen.unix_socket, **CONNECTOR))

    def run(spec: dict[str, Any], run_name: str, spy: Path | None = None) -> dict[str, Any]:
        extra = spy_environ(env, spy) if spy is not None else {}
        with slots:
            return (
                OfflineRun(env, {"model": str(path), **spec}, work, name=run_name, extra_env=extra)
                .start()
                .result()
            )

    with ThreadPoolExecutor(1) as side:
        ref_future = side.submit(
            run,
            {
                "kv_transfer": None,
                "llm": {"enable_prefix_caching": False, "max_model_len": 2048},
                "requests": _requests(list(PROMPTS)),
            },
            "reference",
        )
        stored = run(
            {"kv_transfer": kv, "llm": REUSE, "batches": [_requests(list(PROMPTS))], "metrics": True},
            "stored",
            work / "spy-stored",
        )
        # A worker that disabled itself stores nothing: say why rather than fail on a missing object.
        disabled = [ln for ln in (work / "stored.log").read_text().splitlines() if "worker disabled" in ln]
        assert not disabled, disabled[0]
        store_records = read_records(work / "spy-stored")
        partial = ModelRuns(model, {}, stored, {}, "", store_records, [], None)
        victim = _victim(partial.kinds(), partial.step())
        if victim is not None:
            (keys_record,) = [r for r in store_records if r["what"] == "keys"]
            key = object_key(keys_record, PROMPTS["c"], victim[1], victim[0])
            with CacheClient(srv.unix_target) as client:
                assert client.delete(keys_record["namespace"], [key], timeout=10) == 1, (name, victim)
        restarted = run(
            {"kv_transfer": kv, "llm": REUSE, "requests": _requests(list(PROMPTS)), "metrics": True},
            "restarted",
            work / "spy-restarted",
        )
        reference = ref_future.result()
    logs = "".join((work / f"{n}.log").read_text(errors="replace") for n in ("stored", "restarted"))
    return ModelRuns(
        model,
        reference,
        stored,
        restarted,
        logs,
        store_records,
        read_records(work / "spy-restarted"),
        victim,
    )


class Hybrid:
    """Every model's runs, by name; a model whose runs failed fails only its own tests."""

    def __init__(self, futures: dict[str, Future[ModelRuns]]) -> None:
        self._futures = futures

    def __getitem__(self, name: str) -> ModelRuns:
        return self._futures[name].result()


@pytest.fixture(scope="module")
def hybrid(vllm_env: VllmEnv, vllm_workdir: Path) -> Iterator[Hybrid]:
    """Every model's three runs, models side by side (at most :data:`PARALLEL` vLLM processes)."""
    slots = threading.Semaphore(PARALLEL)
    with cache_server(server_id="hybrid", dram_bytes=1 << 30) as srv, ThreadPoolExecutor(len(NAMES)) as pool:
        futures = {
            n: pool.submit(_run_model, vllm_env, srv, n, vllm_workdir / "hybrid", slots) for n in NAMES
        }
        for f in futures.values():  # every run ends before the cache server stops
            f.exception()
        yield Hybrid(futures)


@pytest.mark.parametrize("name", NAMES)
def test_the_hybrid_manager_stays_on(hybrid: Hybrid, name: str) -> None:
    """VLLM keeps its hybrid manager with kvfabric configured; the groups are the model's own."""
    runs = hybrid[name]
    assert runs.stored["hybrid_kv_cache_manager"] is True
    assert runs.restarted["hybrid_kv_cache_manager"] is True
    assert TURNED_OFF.lower() not in runs.logs.lower()
    assert "kvfabric group plan:" in runs.logs
    inits = [r for r in runs.store_records + runs.restart_records if r["what"] == "init"]
    assert len(inits) == 4  # scheduler and worker, two processes
    for rec in inits:
        assert rec["disable_hybrid_kv_cache_manager"] is False
        assert tuple((g["type"], g["block_size"]) for g in rec["groups"]) == runs.model.groups


@pytest.mark.parametrize("name", NAMES)
def test_outputs_equal_the_reference_across_a_restart(hybrid: Hybrid, name: str) -> None:
    """Stored under block reuse, loaded by a new process: every token equals vLLM without a cache."""
    runs = hybrid[name]
    for rid in PROMPTS:
        assert runs.stored["outputs"][rid] == runs.reference["outputs"][rid], rid
        assert runs.stored["cached"][rid] == 0, rid
        assert runs.restarted["outputs"][rid] == runs.reference["outputs"][rid], rid


@pytest.mark.parametrize("name", NAMES)
def test_cached_tokens_are_the_predicted_hit(hybrid: Hybrid, name: str) -> None:
    """After the restart every prompt hits exactly the design's boundary (c: below the deleted object)."""
    runs = hybrid[name]
    kinds, step = runs.kinds(), runs.step()
    for rid in ("a", "b"):
        assert runs.restarted["cached"][rid] == predicted_hit(len(PROMPTS[rid]), _units(rid, step), kinds), (
            rid
        )
    full_hit = predicted_hit(len(PROMPTS["c"]), _units("c", step), kinds)
    missing = [runs.deleted] if runs.deleted is not None else []
    expected = predicted_hit(len(PROMPTS["c"]), _units("c", step), kinds, missing=missing)
    assert runs.restarted["cached"]["c"] == expected
    if runs.deleted is not None:
        assert expected < full_hit  # the deletion mattered: the hit dropped to an earlier boundary


@pytest.mark.parametrize("name", NAMES)
def test_bytes_per_kind_equal_the_formula(hybrid: Hybrid, name: str) -> None:
    """Stored and loaded bytes per kind, from the counters: window and local kinds move only what is seen.

    Window objects hold only the blocks a later boundary can see, local objects only the open
    attention chunk; a hit reads only the objects its boundary's window or attention chunk reaches.
    The loaded bytes are those of the hit vLLM reported, so they are exact only together with
    :func:`test_cached_tokens_are_the_predicted_hit`.
    """
    runs = hybrid[name]
    kinds, step = runs.kinds(), runs.step()
    for kind in kinds:
        want_stored = sum(stored_bytes(_units(rid, step), kind, HEADER_SIZE) for rid in PROMPTS)
        got_stored = metric_sum(runs.stored["metrics"], "vllm:kvfabric_stored_bytes", kind=kind.name)
        assert got_stored == want_stored, kind
        # Objects are read whole (each carries its own MAC): the bytes moved are the objects' payloads.
        want_read = sum(
            read_bytes(_units(rid, step), 0, runs.restarted["cached"][rid], kind, HEADER_SIZE)
            for rid in PROMPTS
        )
        got_read = metric_sum(runs.restarted["metrics"], "vllm:kvfabric_loaded_bytes", kind=kind.name)
        assert got_read == want_read, kind
    assert metric_sum(runs.restarted["metrics"], "vllm:kvfabric_null_block_writes_refused") == 0


@pytest.mark.parametrize("name", NAMES)
def test_block_zero_is_never_written(hybrid: Hybrid, name: str) -> None:
    """No store or load touched the null block that every group's out-of-window positions share."""
    runs = hybrid[name]
    records = runs.store_records + runs.restart_records
    assert len([r for r in records if r["what"] == "registered"]) == 2
    assert [r for r in records if r["what"] == "block0"] == []
