"""Named model sizes of the reference engine."""

from __future__ import annotations

from kvfabric.refengine.model import ModelConfig

PRESETS: dict[str, ModelConfig] = {
    # Milliseconds per prefill: unit and end-to-end tests.
    "tiny": ModelConfig(
        vocab_size=512, hidden=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn=128
    ),
    # The benchmark model: a 16k-token prefill takes seconds on two CPU cores, so it is measurable
    # without being glacial; 2 KiB of KV per token (fp32).
    "bench": ModelConfig(),
}


def preset(name: str, seed: int = 0) -> ModelConfig:
    """Return preset ``name`` with weights from ``seed``."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None
    return ModelConfig(**{**base.as_dict(), "seed": seed})  # type: ignore[arg-type]
