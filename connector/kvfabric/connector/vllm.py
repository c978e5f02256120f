"""The vLLM KV connector (``KVConnectorBase_V1``, vLLM 0.33) of kvfabric.

Load it with::

    --kv-transfer-config '{"kv_connector":"KVFabricConnector",
                           "kv_connector_module_path":"kvfabric.connector.vllm",
                           "kv_role":"kv_both","kv_load_failure_policy":"recompute"}'

``kv_connector_extra_config`` may override any :class:`~kvfabric.connector.settings.ConnectorSettings`
field (``{"chunk_tokens": 512}``); everything else comes from the ``KVFABRIC_*`` environment the
operator injects.

vLLM is imported conditionally: without it this module still imports and :class:`KVFabricConnector`
still works on duck-typed arguments (its base is then a small stand-in), which is how the tests on
machines without a GPU exercise it. All logic lives in
:class:`~kvfabric.connector.core.KVFabricConnectorCore`; this class only maps vLLM's configuration and roles
onto it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from kvfabric.connector.core import ConnectorMetadata, KVFabricConnectorCore, Role, build_cache
from kvfabric.connector.keys import NamespaceSpec
from kvfabric.connector.settings import ConnectorSettings

log = logging.getLogger(__name__)

try:  # pragma: no cover - depends on the environment
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1 as _VllmBase,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata as _VllmMetadata,
    )

    VLLM_AVAILABLE = True
except ImportError:  # vLLM is not installed (no GPU here): use the stand-ins below.
    VLLM_AVAILABLE = False

    class _VllmMetadata:  # type: ignore[no-redef]
        """Stand-in for ``KVConnectorMetadata``."""

    class _VllmBase:  # type: ignore[no-redef]
        """Stand-in for ``KVConnectorBase_V1``: the non-abstract bookkeeping the connector relies on."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            self._vllm_config = vllm_config
            self._role = role
            self._kv_cache_config = kv_cache_config
            self._connector_metadata: Any = None

        @property
        def role(self) -> Any:
            return self._role

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self) -> Any:
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None


@dataclass
class KVFabricMetadata(ConnectorMetadata, _VllmMetadata):  # type: ignore[misc]
    """The connector's per-step metadata, typed as vLLM's ``KVConnectorMetadata``."""


def _role_of(role: Any) -> Role:
    # vLLM's KVConnectorRole and ours share member names and values.
    name = getattr(role, "name", str(role)).upper()
    return Role.SCHEDULER if "SCHEDULER" in name else Role.WORKER


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (scheduler process) or no vLLM: rank 0
        return 0


def namespace_spec_from_vllm(vllm_config: Any, settings: ConnectorSettings, tp_rank: int) -> NamespaceSpec:
    """Derive the compatibility namespace from vLLM's model, cache and parallel configuration."""
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    kv_dtype = str(getattr(cache, "cache_dtype", "auto"))
    if kv_dtype == "auto":
        kv_dtype = str(model.dtype).removeprefix("torch.")
    block_size = int(cache.block_size)
    chunk = settings.chunk_tokens
    if chunk % block_size:
        chunk = -(-chunk // block_size) * block_size
        log.warning(
            "chunk_tokens %d is not a multiple of block_size %d; using %d",
            settings.chunk_tokens,
            block_size,
            chunk,
        )
    return NamespaceSpec(
        model_id=str(model.model),
        model_revision=str(getattr(model, "revision", None) or settings.model_revision or ""),
        kv_dtype=kv_dtype,
        num_layers=int(model.get_num_layers(parallel)),
        num_kv_heads=int(model.get_num_kv_heads(parallel)),
        head_dim=int(model.get_head_size()),
        block_size=block_size,
        chunk_tokens=chunk,
        tp_size=int(getattr(parallel, "tensor_parallel_size", 1)),
        tp_rank=tp_rank,
        tenant=settings.tenant,
    )


class KVFabricConnector(_VllmBase):  # type: ignore[misc]
    """kvfabric as a vLLM KV connector: prefix chunks from the node's cache server, stored back async."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        """Construct one half (vLLM builds one per role); reads settings from env + extra config."""
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        settings = ConnectorSettings.load(extra)
        our_role = _role_of(role)
        rank = _tp_rank() if our_role is Role.WORKER else 0
        spec = namespace_spec_from_vllm(vllm_config, settings, rank)
        if spec.chunk_tokens != settings.chunk_tokens:
            settings = settings.model_copy(update={"chunk_tokens": spec.chunk_tokens})
        rank0 = namespace_spec_from_vllm(vllm_config, settings, 0)
        self.settings = settings
        self._core = KVFabricConnectorCore(
            our_role, settings, spec, cache=build_cache(settings), scheduler_spec=rank0
        )
        log.info(
            "kvfabric connector (%s) namespace=%s pool=%s socket=%s remote=%s",
            our_role.name.lower(),
            self._core.namespace[:16],
            settings.pool or "-",
            settings.socket,
            settings.remote,
        )

    @property
    def core(self) -> KVFabricConnectorCore:
        """The vLLM-agnostic implementation."""
        return self._core

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache is best-effort: vLLM never waits for this connector to deliver KV."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """Accept any layout: gather/scatter index the block dimension of whatever vLLM allocates."""
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Return True: ``wait_for_layer_load`` really blocks, so its hook must run."""
        return True

    # ---------------- scheduler side ----------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Return external prefix tokens available beyond ``num_computed_tokens`` (synchronous load)."""
        if getattr(request, "lora_request", None) is not None:
            return 0, False  # LoRA adapters are not part of the namespace yet: never share their KV
        return self._core.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Remember the blocks the hit must fill."""
        self._core.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVFabricMetadata:
        """Build this step's load/save specs."""
        meta = self._core.build_connector_meta(scheduler_output)
        return KVFabricMetadata(loads=meta.loads, saves=meta.saves)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Free blocks at once: saves copied them out during the step."""
        return self._core.request_finished(request, block_ids)

    # ---------------- worker side ----------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Remember the per-layer KV tensors."""
        self._core.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Bind this step's metadata (base bookkeeping + core)."""
        super().bind_connector_metadata(connector_metadata)
        self._core.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        """Clear this step's metadata."""
        super().clear_connector_metadata()
        self._core.clear_connector_metadata()

    def handle_preemptions(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: no save ever references engine blocks after its step (both signatures)."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start this step's loads."""
        self._core.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait (bounded) for the loads, then scatter this layer."""
        self._core.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Copy this layer's finished chunks out."""
        self._core.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        """Submit this step's stores to the background storer."""
        self._core.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Report nothing pending (loads are synchronous, saves hold no blocks)."""
        return self._core.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks vLLM must recompute (``kv_load_failure_policy="recompute"``)."""
        return self._core.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        """Stop background threads and close the transports."""
        self._core.shutdown()
