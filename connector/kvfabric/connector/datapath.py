"""The data-path interface: how the worker half moves chunk bytes between the cache and the KV cache.

The worker half (:mod:`kvfabric.connector.worker`) decides *what* moves: which chunks to load into
which blocks, which requests' chunks to save, what a failure means for the engine. A data path
decides *how* the bytes move and checks them. Today there is one, :mod:`kvfabric.connector.hostpath`
(host staging buffers filled from the cache server's shared memory or its gRPC stream, then
scattered into the KV tensors). A CUDA-IPC or GPUDirect path, where the server writes straight into
device memory, is one new module implementing :class:`DataPath`; the halves do not change.

Every data path guarantees, and the worker half relies on:

- **Only verified bytes reach the KV cache.** A chunk is placed into the engine's blocks only after
  its payload was checked end to end (namespace, key, shape, checksum) *after the last write that
  can reach it*; a chunk that fails ends the request's usable prefix (the leading chunks before it
  are still used).
- **Bounded.** :meth:`DataPath.finish_loads` returns by the step's load deadline even if the
  transport hangs.
- **Loads own their memory.** Memory a load was given is never handed to another load while any
  transport call that was given it may still write into it.
- **Saves copy out.** :meth:`DataPath.save_layer` copies the blocks out during the step, so the
  engine may reuse them as soon as the step ends; the store itself never blocks a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvfabric.connector.resilient import Reason
from kvfabric.connector.steps import LoadSpec, SaveSpec


@dataclass(frozen=True)
class LoadResult:
    """What one request's load placed into the engine's KV cache."""

    loaded: int
    """Leading chunks that were verified and scattered into the load's blocks."""
    reason: Reason | None
    """Why fewer chunks than asked were loaded (``None`` when all were)."""
    wait_s: float
    """Seconds the engine thread spent on this load (waiting, verifying, scattering)."""


class DataPath(Protocol):
    """Moves chunk payloads between the cache and the engine's KV cache (one per worker)."""

    @property
    def num_layers(self) -> int:
        """Layers in a chunk payload (0 before :meth:`register_kv_caches`)."""
        ...

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Adopt the engine's per-layer KV tensors (forward order)."""
        ...

    def start_loads(self, loads: Sequence[LoadSpec], deadline: float) -> None:
        """Start this step's loads (no waiting); ``deadline`` is on ``time.monotonic()``."""
        ...

    def finish_loads(self) -> list[LoadResult]:
        """Wait (until the deadline) for the started loads and place their verified chunks.

        Returns one result per started load, in order. Called at most once per start.
        """
        ...

    def abandon_loads(self) -> None:
        """Forget the started loads without placing anything (the step failed or ended)."""
        ...

    def begin_saves(self, saves: Sequence[SaveSpec]) -> None:
        """Prepare to copy out the chunks of ``saves`` (called at the step's first layer)."""
        ...

    def save_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        """Copy layer ``layer`` of every prepared chunk out of ``kv_layer``."""
        ...

    def submit_saves(self) -> None:
        """Hand the prepared chunks (all layers copied) to the background storer; never blocks."""
        ...

    def abandon_saves(self) -> int:
        """Drop the prepared chunks; return how many chunks were dropped."""
        ...

    def wait_for_stores(self, timeout: float) -> bool:
        """Wait until background stores are done (tests, shutdown); return whether they all finished."""
        ...

    def close(self, drain_s: float = ...) -> None:
        """Stop background work; queued stores get ``drain_s`` seconds to finish, the rest are dropped."""
        ...
