"""Run inside the real-vLLM environment: kvfabric's group plan on vLLM's own spec classes.

usage: ``python -m tests.vllm.recurrent_probe [WHEEL]`` (the vLLM environment's python, this checkout
on ``PYTHONPATH``). Builds ``KVCacheConfig`` objects from vLLM's real classes, a recurrent group
(``MambaSpec`` of every Mamba / linear-attention backend vLLM has, in every cache mode) beside a
full-attention group, plus a Gemma 3-shaped control, runs the connector's
:func:`~kvfabric.connector.vllm.group_plan_from_vllm` on each and prints one JSON object: per case
the refusal's message (or the plan's description). With ``WHEEL`` (a vLLM release wheel) the same
runs on that release's ``kv_cache_interface.py``, loaded from the wheel over the installed vLLM's
other modules (the conformance wheel is a CUDA build that cannot be installed here).
"""

from __future__ import annotations

import json
import sys
import types
import zipfile
from types import SimpleNamespace
from typing import Any

INTERFACE_PY = "vllm/v1/kv_cache_interface.py"
BACKENDS = ("MAMBA1", "MAMBA2", "SHORT_CONV", "LINEAR", "GDN_ATTN")
MODES = ("none", "align", "all")


def _interface(wheel: str | None) -> Any:
    """The installed ``vllm.v1.kv_cache_interface``, or the one in ``wheel``."""
    if wheel is None:
        import vllm.v1.kv_cache_interface as mod

        return mod
    source = zipfile.ZipFile(wheel).read(INTERFACE_PY).decode()
    mod = types.ModuleType("kvfabric_probe_kv_cache_interface")
    sys.modules[mod.__name__] = mod  # dataclasses resolve annotations through it
    exec(compile(source, f"{wheel}!{INTERFACE_PY}", "exec"), mod.__dict__)  # vLLM's own source
    return mod


def _plan(mod: Any, specs: list[Any]) -> dict[str, Any]:
    from kvfabric.connector.groups import UnsupportedGroupsError
    from kvfabric.connector.vllm import group_plan_from_vllm

    groups = [mod.KVCacheGroupSpec([f"layers.{i}"], spec) for i, spec in enumerate(specs)]
    config = mod.KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=128))
    try:
        plan = group_plan_from_vllm(vllm_config, config)
    except UnsupportedGroupsError as exc:
        return {"refused": str(exc)}
    return {"plan": plan.describe() if plan is not None else None}


def main(argv: list[str]) -> None:
    """Print every case's outcome as one JSON object."""
    import torch

    mod = _interface(argv[0] if argv else None)
    full = mod.FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32)
    cases: dict[str, Any] = {
        "classes": sorted(n for n in dir(mod) if n.endswith("Spec")),
        "gemma3": _plan(
            mod,
            [
                mod.SlidingWindowSpec(
                    block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=200
                ),
                full,
            ],
        ),
    }
    enum = mod.MambaAttentionBackendEnum
    for backend in BACKENDS:
        for mode in MODES:
            state = mod.MambaSpec(
                block_size=128,
                shapes=((4, 16), (2, 8, 8)),
                dtypes=(torch.float32, torch.float32),
                mamba_type=getattr(enum, backend),
                mamba_cache_mode=mode,
            )
            cases[f"{backend}/{mode}"] = _plan(mod, [full, state])
    print(json.dumps(cases))


if __name__ == "__main__":
    main(sys.argv[1:])
