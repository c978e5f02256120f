"""kvfabric's connector with a recorder, loaded by vLLM through ``kv_connector_module_path``.

:class:`RecordingConnector` is :class:`~kvfabric.connector.vllm.KVFabricConnector` (so vLLM treats
it exactly as the product: ``SupportsHMA`` or not, same hooks) plus two records, written as JSON
lines under ``$KVF_SPY_DIR``:

- ``init``: the role, whether vLLM kept its hybrid KV cache manager on, and the KV cache groups it
  made (spec class, block size, window, attention chunk, layer names);
- ``keys`` (scheduler): the namespace, the key chain and the group plan's kinds in order, from which
  a test computes the key of any stored object (to delete it in the cache server);
- ``events`` (scheduler): every non-empty ``take_events()`` (the connector's KV events, as vLLM
  publishes them), and in ``init`` each group's fields as vLLM's own functions name them
  (``get_kv_cache_spec_kind``, ``get_kv_cache_spec_sliding_window``) and vLLM's ``hash_block_size``;
- ``block0``: every step (at ``wait_for_save``, after the forward and every synchronous load) in
  which block 0 of some layer differs from its bytes at ``register_kv_caches``. Block 0 is vLLM's
  null block: every sliding-window or chunked-local table points its out-of-window positions at
  it, so nobody may write it. The snapshot is re-taken after a change, so each write is reported
  once, with the step's number and whether the step had loads.

Nothing here changes what the connector does. The test process reads the records with
:func:`read_records`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvfabric.connector.vllm import KVFabricConnector

if TYPE_CHECKING:  # the vLLM child imports this module: nothing of the test harness at run time
    from kvfabric.testing.vllmenv import VllmEnv

SPY_DIR_ENV = "KVF_SPY_DIR"
MODULE = "tests.vllm.spyconnector"
CLASS = "RecordingConnector"
ROOT = Path(__file__).resolve().parents[2]


def _event_fields(spec: Any) -> dict[str, Any]:
    """The group fields vLLM's own KV cache manager puts on this group's events."""
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
    except ImportError:  # a vLLM without them
        return {}
    return {
        "event_kind": get_kv_cache_spec_kind(spec).value,
        "event_window": get_kv_cache_spec_sliding_window(spec),
    }


def _hash(h: Any) -> Any:
    return h.hex() if isinstance(h, bytes) else h


def _event_record(e: Any) -> dict[str, Any]:
    """One KV event as JSON: its class, group fields, block size, hashes (hex) and tokens."""
    return {
        "type": type(e).__name__,
        "group_idx": getattr(e, "group_idx", None),
        "kind": getattr(e, "kv_cache_spec_kind", None),
        "window": getattr(e, "kv_cache_spec_sliding_window", None),
        "block_size": getattr(e, "block_size", None),
        "medium": getattr(e, "medium", None),
        "block_hashes": [_hash(h) for h in getattr(e, "block_hashes", ())],
        "parent_block_hash": _hash(getattr(e, "parent_block_hash", None)),
        "token_ids": list(getattr(e, "token_ids", None) or ()),
    }


def _spec_facts(spec: Any) -> dict[str, Any]:
    try:
        page = int(spec.page_size_bytes)
    except Exception:  # a spec without pages (not expected for attention): recorded as 0
        page = 0
    return {
        **_event_fields(spec),
        "type": type(spec).__name__,
        "block_size": int(getattr(spec, "block_size", 0) or 0),
        "sliding_window": getattr(spec, "sliding_window", None),
        "attention_chunk_size": getattr(spec, "attention_chunk_size", None),
        "page_size_bytes": page,
    }


class RecordingConnector(KVFabricConnector):
    """The product's connector, recording its KV cache groups and every write to block 0."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        """Record vLLM's decisions first (so they are on file even if the connector refuses)."""
        self._spy_path = Path(os.environ.get(SPY_DIR_ENV, ".")) / f"spy-{os.getpid()}.jsonl"
        self._spy_role = "scheduler" if "SCHEDULER" in getattr(role, "name", str(role)).upper() else "worker"
        groups = [
            {"layers": list(g.layer_names), **_spec_facts(g.kv_cache_spec)}
            for g in (getattr(kv_cache_config, "kv_cache_groups", None) or ())
        ]
        sched = getattr(vllm_config, "scheduler_config", None)
        self._record(
            "init",
            {
                "disable_hybrid_kv_cache_manager": getattr(sched, "disable_hybrid_kv_cache_manager", None),
                "groups": groups,
                "hash_block_size": getattr(kv_cache_config, "hash_block_size", None),
            },
        )
        self._block0: dict[str, torch.Tensor] = {}
        self._caches: dict[str, torch.Tensor] = {}
        self._steps = 0
        super().__init__(vllm_config, role, kv_cache_config)
        if self._spy_role == "scheduler":
            half = self.scheduler_half
            plan = getattr(half, "plan", None)
            kinds = [str(k.type.value) for k in plan.kinds] if plan is not None else ["full"]
            self._record(
                "keys",
                {
                    "namespace": half.namespace,
                    "key_chain": half.key_chain,
                    "kinds": kinds,
                    "chunk_tokens": half.chunk_tokens,
                    "block_size": half.block_size,
                },
            )

    def _record(self, what: str, data: dict[str, Any]) -> None:
        with open(self._spy_path, "a") as f:
            f.write(json.dumps({"what": what, "role": self._spy_role, "pid": os.getpid(), **data}) + "\n")

    def take_events(self) -> list[Any]:
        """The product's events, recorded as vLLM will publish them."""
        events = super().take_events()
        if events:
            self._record("events", {"events": [_event_record(e) for e in events]})
        return events

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Snapshot block 0 of every layer, then register as the product does."""
        for name, t in kv_caches.items():
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] > 0:
                self._caches[name] = t
                self._block0[name] = t[0].clone()
        self._record("registered", {"layers": len(self._caches)})
        super().register_kv_caches(kv_caches)

    def wait_for_save(self) -> None:
        """Submit the step's stores, then compare every layer's block 0 with its snapshot."""
        plan = self._get_connector_metadata() if self.has_connector_metadata() else None
        loads = len(getattr(plan, "loads", ()) or ())
        super().wait_for_save()
        self._steps += 1
        changed = [n for n, t in self._caches.items() if not torch.equal(t[0], self._block0[n])]
        if changed:
            self._record("block0", {"step": self._steps, "layers": changed, "loads": loads})
            for n in changed:
                self._block0[n] = self._caches[n][0].clone()


def read_records(spy_dir: Path) -> list[dict[str, Any]]:
    """Every record the connectors of all vLLM processes pointed at ``spy_dir`` wrote."""
    out: list[dict[str, Any]] = []
    for path in sorted(spy_dir.glob("spy-*.jsonl")):
        out.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return out


def spy_environ(env: VllmEnv, spy_dir: Path) -> dict[str, str]:
    """A vLLM child's extra environment: ``tests.vllm`` importable, records written to ``spy_dir``."""
    spy_dir.mkdir(parents=True, exist_ok=True)
    return {
        "PYTHONPATH": os.pathsep.join([env.environ()["PYTHONPATH"], str(ROOT)]),
        SPY_DIR_ENV: str(spy_dir),
    }


def spy_transfer_config(base: dict[str, Any]) -> dict[str, Any]:
    """``base`` (a :func:`~kvfabric.testing.vllmenv.connector_config`) loading this class instead."""
    return {**base, "kv_connector": CLASS, "kv_connector_module_path": MODULE}
