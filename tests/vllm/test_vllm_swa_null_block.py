"""A model whose every layer uses a sliding window (Mistral-style): one sliding-window KV cache group.

vLLM keeps such a model's ``SlidingWindowSpec`` even with its hybrid manager off, so kvfabric sees a
single group whose block tables point every out-of-window position at block 0, vLLM's shared null
block. Two promises, in real vLLM on a tiny random Mistral (window 128):

- **block 0 is never written**: the connector under test is the product's class with a recorder
  (:mod:`tests.vllm.spyconnector`) that snapshots block 0 of every layer at ``register_kv_caches``
  and records every step in which it changed;
- **saves under block reuse are right**: the storing run has a KV cache of 24 blocks, 128-token
  steps and three concurrent prompts, so the blocks that leave a request's window go back to the
  pool and are handed to the others (and to itself) while its chunks are still being completed;
  after a vLLM restart the hits give exactly the reference tokens and the predicted cached counts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tests.vllm.spyconnector import read_records, spy_environ, spy_transfer_config

from kvfabric.testing import hybridmodels
from kvfabric.testing.hybridhits import Kind, predicted_hit, stored_units
from kvfabric.testing.serverproc import cache_server
from kvfabric.testing.vllmenv import OfflineRun, VllmEnv, connector_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

MODEL = hybridmodels.MODELS["mistral-swa"]
CHUNK, BLOCK, MAX_TOKENS = 256, 128, 12
PROMPTS = {f"swa-{i}": hybridmodels.prompt_tokens(9000 + i, n) for i, n in enumerate((1000, 1100, 1300))}
CONNECTOR = {
    "chunk_tokens": CHUNK,
    "lookup_deadline_ms": 5000,
    "load_deadline_ms": 20000,
    "cost_model": False,
}
# A small KV cache and 128-token steps: blocks that leave the window are reused at once.
REUSE = {
    "num_gpu_blocks_override": 24,
    "max_num_batched_tokens": 128,
    "max_num_seqs": 4,
    "max_model_len": 2048,
}


@dataclass
class Runs:
    reference: dict[str, Any]
    stored: dict[str, Any]
    restarted: dict[str, Any]
    spy_dir: Path


def _requests(ids: list[str]) -> list[dict[str, Any]]:
    return [{"id": i, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS} for i in ids]


@pytest.fixture(scope="module")
def runs(vllm_env: VllmEnv, vllm_workdir: Path) -> Iterator[Runs]:
    """Reference (no cache) and storing run at once; then the restarted run on the same cache server."""
    model = hybridmodels.build(vllm_env, MODEL)
    work = vllm_workdir / "swa-null-block"
    spy_dir = work / "spy"
    spy_env = spy_environ(vllm_env, spy_dir)
    with cache_server(server_id="swa") as srv:
        kv = spy_transfer_config(connector_config(srv.config.listen.unix_socket, **CONNECTOR))
        reference = OfflineRun(
            vllm_env,
            {
                "model": str(model),
                "kv_transfer": None,
                "llm": {"enable_prefix_caching": False, "max_model_len": 2048},
                "requests": _requests(list(PROMPTS)),
            },
            work,
            name="reference",
        ).start()
        storing = OfflineRun(
            vllm_env,
            {"model": str(model), "kv_transfer": kv, "llm": REUSE, "batches": [_requests(list(PROMPTS))]},
            work,
            name="stored",
            extra_env=spy_env,
        ).start()
        stored = storing.result()
        # The restarted vLLM: one prompt alone, then the other two together (loads beside a prefill).
        restarted = OfflineRun(
            vllm_env,
            {
                "model": str(model),
                "kv_transfer": kv,
                "llm": REUSE,
                "requests": _requests(["swa-0"]),
                "batches": [_requests(["swa-1", "swa-2"])],
            },
            work,
            name="restarted",
            extra_env=spy_env,
        ).start()
        yield Runs(reference.result(), stored, restarted.result(), spy_dir)


def test_the_model_is_one_sliding_window_group(runs: Runs) -> None:
    inits = [r for r in read_records(runs.spy_dir) if r["what"] == "init"]
    assert inits, "the recording connector never started"
    for rec in inits:
        assert [(g["type"], g["block_size"], g["sliding_window"]) for g in rec["groups"]] == [
            ("SlidingWindowSpec", BLOCK, MODEL.window)
        ]


def test_block_zero_is_never_written(runs: Runs) -> None:
    """No step of either kvfabric run changed the null block of any layer (loads included)."""
    records = read_records(runs.spy_dir)
    assert any(r["what"] == "registered" for r in records)
    writes = [r for r in records if r["what"] == "block0"]
    assert writes == []


def test_saves_under_block_reuse_give_reference_outputs_after_restart(runs: Runs) -> None:
    """Chunks saved while window blocks were being reused are exact: hits after restart match."""
    for rid in PROMPTS:
        assert runs.stored["outputs"][rid] == runs.reference["outputs"][rid], rid
        assert runs.stored["cached"][rid] == 0, rid
    kind = Kind("sliding_window", BLOCK, 4, 0, window=MODEL.window)
    for rid, prompt in PROMPTS.items():
        units = stored_units(len(prompt) + MAX_TOKENS - 1, CHUNK, BLOCK)
        assert runs.restarted["outputs"][rid] == runs.reference["outputs"][rid], rid
        assert runs.restarted["cached"][rid] == predicted_hit(len(prompt), units, [kind]), rid
