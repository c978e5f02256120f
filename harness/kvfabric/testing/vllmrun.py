"""Run a workload through vLLM's offline ``LLM`` in the vLLM environment (a child process).

    python -m kvfabric.testing.vllmrun SPEC.json OUT.json

``SPEC`` is ``{"model": dir, "kv_transfer": {...} | null, "llm": {...extra LLM kwargs},
"requests": [{"id", "prompt": [ids], "max_tokens"}], "conversations": [{"id", "turns": [[ids]...],
"max_tokens"}]}``. Requests run one at a time, in order, each greedy (``ignore_eos``); a
conversation's round r prompt is :func:`next_prompt` of round r-1. ``OUT`` gets ``{"outputs": {id:
[ids]}, "cached": {id: n}, "conversations": {id: [[ids] per round]}, "version": ...}``.

vLLM on CPU starts its engine core with ``spawn``, hence the ``__main__`` guard: without it the
engine core re-imports this module and fails ("Engine core initialization failed").
"""

from __future__ import annotations

import json
import sys
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
    llm = LLM(**kwargs)

    def generate(prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)

    result: dict[str, Any] = {"outputs": {}, "cached": {}, "conversations": {}, "version": vllm.__version__}
    for req in spec.get("requests", []):
        tokens, cached = generate(list(req["prompt"]), int(req["max_tokens"]))
        result["outputs"][req["id"]] = tokens
        result["cached"][req["id"]] = cached
    for conv in spec.get("conversations", []):
        outs: list[list[int]] = []
        prompt: list[int] = []
        for r, turn in enumerate(conv["turns"]):
            prompt = list(turn) if r == 0 else next_prompt(prompt, outs[-1], turn)
            tokens, cached = generate(prompt, int(conv["max_tokens"]))
            outs.append(tokens)
            result["cached"][f"{conv['id']}/{r}"] = cached
        result["conversations"][conv["id"]] = outs
    return result


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - runs inside vLLM
    """Run SPEC and write OUT."""
    spec_path, out_path = (argv if argv is not None else sys.argv[1:])[:2]
    spec = json.loads(Path(spec_path).read_text())
    Path(out_path).write_text(json.dumps(_run(spec)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
