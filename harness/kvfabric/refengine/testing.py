"""Test helpers for the reference engine: a tiny model configuration and deterministic prompts."""

from __future__ import annotations

import torch

from kvfabric.refengine.model import ModelConfig
from kvfabric.refengine.presets import PRESETS

TINY: ModelConfig = PRESETS["tiny"]
"""A model small enough that a test prefill takes milliseconds."""


def prompt(n: int, seed: int, vocab_size: int = TINY.vocab_size) -> list[int]:
    """Return ``n`` pseudo-random token ids (deterministic per seed)."""
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, vocab_size, (n,), generator=g)]
