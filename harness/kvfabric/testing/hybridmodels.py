"""Tiny random-weight hybrid-attention models for real-vLLM tests and benchmarks (built locally, no hub).

Each :class:`HybridModel` names a transformers architecture and its config: Gemma 3 (sliding window
beside full attention), Gemma 4 (the same, with a larger head on the global layers, so vLLM gives
its two KV cache groups different block sizes), gpt-oss (attention sinks, mixture of experts,
sliding window), Mistral with ``sliding_window`` (every layer windowed: one sliding-window group)
and Llama 4 (chunked local attention beside one full-attention layer). All are float32, four
layers, hidden 128, a 1,024-word WordLevel tokenizer (token ``i >= 3`` is the word ``w<i>``), and
deterministic: the same config and seed give the same bytes.

:func:`build` writes a model once per config digest under ``~/.cache/kvfabric/models/`` (the
digest covers the build script, the config and the seed, so editing either gives a new directory)
and returns the cached directory afterwards. The windows are chosen against kvfabric's 256-token
chunks and the CPU backend's 128-token blocks: windows that divide the chunk (128) and do not (200,
300), attention chunks that divide it (256) and do not (384).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfabric.testing.vllmenv import VllmEnv

__all__ = ["MODELS", "VOCAB", "HybridModel", "build", "model_cache_dir", "prompt_tokens"]

VOCAB = 1024

_BUILD_SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
import transformers as T
from tokenizers import Tokenizer, models, pre_tokenizers

out, spec = Path(sys.argv[1]), json.loads(sys.argv[2])
torch.manual_seed(spec["seed"])
cfg = getattr(T, spec["config_class"])(**spec["config"])
cfg.architectures = [spec["architecture"]]
cfg.torch_dtype = "float32"
model = getattr(T, spec["architecture"])(cfg).to(torch.float32)
model.save_pretrained(out, safe_serialization=True)
vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
vocab.update({f"w{i}": i for i in range(3, spec["config"]["vocab_size"])})
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
fast = T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                 eos_token="</s>", pad_token="<unk>", clean_up_tokenization_spaces=False)
fast.save_pretrained(out)
"""

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    # As for the tiny Llama: with transformers' 0.02 a random model soon repeats one token whatever
    # its context, which would make "identical outputs" a weak check of the KV it attended to.
    "initializer_range": 0.1,
}
_SWA_FULL = ["sliding_attention", "full_attention"] * 2


@dataclass(frozen=True)
class HybridModel:
    """One tiny model: its architecture, config and what vLLM is expected to make of it.

    ``groups`` are the KV cache groups vLLM 0.32 forms with its hybrid manager on, as (spec class
    name, block size) in group order; ``window`` is the sliding window (``None`` if none) and
    ``attention_chunk`` Llama 4's local attention chunk (``None`` if none).
    """

    name: str
    architecture: str
    config_class: str
    config: Mapping[str, Any]
    groups: tuple[tuple[str, int], ...]
    window: int | None = None
    attention_chunk: int | None = None
    seed: int = 0
    notes: str = field(default="", compare=False)

    def spec(self) -> dict[str, Any]:
        """What the build script reads (and what the cache digest covers)."""
        return {
            "architecture": self.architecture,
            "config_class": self.config_class,
            "config": dict(self.config),
            "seed": self.seed,
        }

    def digest(self) -> str:
        """Digest of the build script, the config and the seed (the cache directory's suffix)."""
        text = _BUILD_SCRIPT + json.dumps(self.spec(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def _gemma4_config(window: int) -> dict[str, Any]:
    return {
        **_COMMON,
        "intermediate_size": 256,
        # The global layers (1 and 3) get head 128: their KV page is twice the local layers', and
        # vLLM equalises pages by giving the sliding-window group 256-token blocks.
        "per_layer_config": {"01": {"head_dim": 128}, "03": {"head_dim": 128}},
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 16,
        "sliding_window": window,
        "layer_types": _SWA_FULL,
    }


MODELS: dict[str, HybridModel] = {
    m.name: m
    for m in (
        HybridModel(
            "gemma3",
            "Gemma3ForCausalLM",
            "Gemma3TextConfig",
            {
                **_COMMON,
                "intermediate_size": 256,
                "sliding_window": 200,
                "layer_types": _SWA_FULL,
                "query_pre_attn_scalar": 64,
            },
            groups=(("SlidingWindowSpec", 128), ("FullAttentionSpec", 128)),
            window=200,
            notes="window 200 does not divide the 256-token chunk: a hit needs 2 blocks of its window",
        ),
        HybridModel(
            "gemma4",
            "Gemma4ForCausalLM",
            "Gemma4TextConfig",
            _gemma4_config(300),
            groups=(("SlidingWindowSpec", 256), ("FullAttentionSpec", 128)),
            window=300,
            notes="per-group block sizes (256 local, 128 global); window 300 spans two chunks",
        ),
        HybridModel(
            "gptoss",
            "GptOssForCausalLM",
            "GptOssConfig",
            {
                **_COMMON,
                "intermediate_size": 128,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "sliding_window": 128,
                "layer_types": _SWA_FULL,
            },
            groups=(("SlidingWindowSpec", 128), ("FullAttentionSpec", 128)),
            window=128,
            notes="attention sinks and MoE; window 128 divides the chunk",
        ),
        HybridModel(
            "mistral-swa",
            "MistralForCausalLM",
            "MistralConfig",
            {**_COMMON, "intermediate_size": 256, "sliding_window": 128},
            groups=(("SlidingWindowSpec", 128),),
            window=128,
            notes="every layer windowed: one sliding-window group, with or without the hybrid manager",
        ),
        HybridModel(
            "llama4",
            "Llama4ForCausalLM",
            "Llama4TextConfig",
            {
                **_COMMON,
                "intermediate_size": 128,
                "intermediate_size_mlp": 256,
                "num_local_experts": 2,
                "num_experts_per_tok": 1,
                "interleave_moe_layer_step": 2,
                "attention_chunk_size": 384,
                # 1 = RoPE layer (chunked local attention), 0 = NoPE layer (full attention).
                "no_rope_layers": [1, 1, 1, 0],
            },
            groups=(
                ("ChunkedLocalAttentionSpec", 128),
                ("ChunkedLocalAttentionSpec", 128),
                ("ChunkedLocalAttentionSpec", 128),
                ("FullAttentionSpec", 128),
            ),
            attention_chunk=384,
            notes="attention chunk 384 does not divide the 256-token chunk (768 is a common end)",
        ),
    )
}
"""Every tiny hybrid model, by name (the names ``kvfabric bench vllm --model`` accepts)."""


def prompt_tokens(seed: int, n: int) -> list[int]:
    """``n`` deterministic word token ids of these models' vocabulary (``3..VOCAB-1``)."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def model_cache_dir() -> Path:
    """Where built models are kept: ``$KVFABRIC_CACHE/models`` (default ``~/.cache/kvfabric/models``)."""
    base = Path(os.environ.get("KVFABRIC_CACHE", Path.home() / ".cache" / "kvfabric"))
    return base / "models"


def build(env: VllmEnv, model: HybridModel, cache: Path | None = None) -> Path:
    """Build ``model`` in the vLLM environment once; return its directory (a cached one if present).

    The model is written to a temporary directory beside the cache and renamed into place, so a
    concurrent build (another test session) never sees a half-written model.
    """
    root = cache or model_cache_dir()
    out = root / f"{model.name}-{model.digest()}"
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model.name}-", dir=root))
    try:
        subprocess.run(
            [str(env.python), "-c", _BUILD_SCRIPT, str(tmp), json.dumps(model.spec())],
            check=True,
            env=env.environ(),
            capture_output=True,
            timeout=600,
        )
        try:
            tmp.rename(out)
        except OSError:  # another build won the race: keep its copy
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
