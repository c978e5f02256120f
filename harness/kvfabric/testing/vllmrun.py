"""Run a workload through vLLM's offline ``LLM`` in the vLLM environment (a child process).

    python -m kvfabric.testing.vllmrun SPEC.json OUT.json

``SPEC`` is ``{"model": dir, "kv_transfer": {...} | null, "llm": {...extra LLM kwargs},
"requests": [{"id", "prompt": [ids], "max_tokens"}], "conversations": [{"id", "turns": [[ids]...],
"max_tokens"}], "batches": [[{"id", "prompt", "max_tokens"}, ...], ...], "metrics": bool}``.
Requests run one at a time, in order, each greedy (``ignore_eos``); then each batch's requests are
submitted together in one ``generate`` call (they run concurrently, sharing steps and blocks); a
conversation's round r prompt is :func:`next_prompt` of round r-1. ``OUT`` gets ``{"outputs": {id:
[ids]}, "cached": {id: n}, "conversations": {id: [[ids] per round]}, "version": ...,
"hybrid_kv_cache_manager": bool, "kv_cache_blocks": n}``; with ``"metrics": true`` (statistics on)
also ``"metrics"``: the Prometheus exposition of vLLM's metrics, kvfabric's ``vllm:kvfabric_*``
included, read once they stopped changing.

vLLM on CPU starts its engine core with ``spawn``, hence the ``__main__`` guard: without it the
engine core re-imports this module and fails ("Engine core initialization failed").
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def next_prompt(prompt: Sequence[int], output: Sequence[int], turn: Sequence[int]) -> list[int]:
    """The next round of a chat: everything so far, the model's answer, then the user's new turn."""
    return [*prompt, *output, *turn]


def conversation_prompts(turns: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> list[list[int]]:
    """Every round's prompt given the answers of the rounds before it (``len(outputs) >= len(turns)-1``)."""
    prompts = [list(turns[0])]
    for r in range(1, len(turns)):
        prompts.append(next_prompt(prompts[-1], outputs[r - 1], turns[r]))
    return prompts


def _run(spec: dict[str, Any]) -> dict[str, Any]:  # pragma: no cover - runs inside vLLM
    import vllm
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "dtype": "float32",
        "enforce_eager": True,
        "seed": 0,
        "max_model_len": 4096,
        **spec.get("llm", {}),
    }
    if spec.get("kv_transfer"):
        kwargs["kv_transfer_config"] = spec["kv_transfer"]
    if spec.get("kv_events"):  # LLM() takes no dict for it
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**spec["kv_events"])
    if spec.get("metrics"):
        kwargs["disable_log_stats"] = False
    llm = LLM(**kwargs)

    def generate(prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)

    config = llm.llm_engine.vllm_config
    result: dict[str, Any] = {
        "outputs": {},
        "cached": {},
        "conversations": {},
        "version": vllm.__version__,
        "hybrid_kv_cache_manager": not config.scheduler_config.disable_hybrid_kv_cache_manager,
        "kv_cache_blocks": int(config.cache_config.num_gpu_blocks or 0),
    }
    for req in spec.get("requests", []):
        tokens, cached = generate(list(req["prompt"]), int(req["max_tokens"]))
        result["outputs"][req["id"]] = tokens
        result["cached"][req["id"]] = cached
    for batch in spec.get("batches", []):
        params_list = [
            SamplingParams(max_tokens=int(r["max_tokens"]), temperature=0.0, ignore_eos=True) for r in batch
        ]
        batch_outs = llm.generate(
            [{"prompt_token_ids": list(r["prompt"])} for r in batch], params_list, use_tqdm=False
        )
        for r, out in zip(batch, batch_outs, strict=True):
            result["outputs"][r["id"]] = list(out.outputs[0].token_ids)
            result["cached"][r["id"]] = int(out.num_cached_tokens or 0)
    for conv in spec.get("conversations", []):
        outs: list[list[int]] = []
        prompt: list[int] = []
        for r, turn in enumerate(conv["turns"]):
            prompt = list(turn) if r == 0 else next_prompt(prompt, outs[-1], turn)
            tokens, cached = generate(prompt, int(conv["max_tokens"]))
            outs.append(tokens)
            result["cached"][f"{conv['id']}/{r}"] = cached
        result["conversations"][conv["id"]] = outs
    if spec.get("metrics"):
        result["metrics"] = _settled_metrics(lambda: generate([3, 4, 5, 6], 1))
    return result


def _settled_metrics(poke: Any, quiet_rounds: int = 3, timeout: float = 60.0) -> str:  # pragma: no cover
    """VLLM's Prometheus text once kvfabric's counters stopped changing.

    Stores finish in the connector's background and their counters travel with later steps'
    statistics, so tiny requests (too short to store anything) keep steps coming until the
    ``vllm:kvfabric_*`` samples have been the same ``quiet_rounds`` times in a row.
    """
    from prometheus_client import REGISTRY, generate_latest

    def kvfabric_lines() -> list[str]:
        text = generate_latest(REGISTRY).decode()
        return [line for line in text.splitlines() if line.startswith("vllm:kvfabric")]

    last: list[str] | None = None
    same = 0
    end = time.monotonic() + timeout
    while same < quiet_rounds and time.monotonic() < end:
        time.sleep(0.5)
        poke()
        now = kvfabric_lines()
        same = same + 1 if now == last else 0
        last = now
    return str(generate_latest(REGISTRY).decode())


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - runs inside vLLM
    """Run SPEC and write OUT."""
    spec_path, out_path = (argv if argv is not None else sys.argv[1:])[:2]
    spec = json.loads(Path(spec_path).read_text())
    Path(out_path).write_text(json.dumps(_run(spec)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
