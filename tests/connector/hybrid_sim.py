"""A miniature of vLLM 0.32's hybrid KV cache manager, to drive the connector on its real objects.

Shaped as vLLM makes them (``../shared`` research, PROBED): one KV cache group per spec, block id 0
the null block every table shares, sliding-window and chunked-local positions the group no longer
keeps set back to 0 at the next schedule and their blocks returned to one pool shared by every
group (last freed, first reused: the reuse vLLM showed across groups and requests), layer slot
``k`` of every group aliasing the same bytes. Requests are scheduled with chunked prefill under a
token budget. The connector sees ``KVCacheConfig``, ``SchedulerOutput`` (new and cached requests,
``kv_connector_block_state.resolve_block_ids``), ``KVCacheBlocks`` and per-layer tensors.

The "model" writes, for each computed position, a value that depends on the layer and on every
token up to it; before each step's forward the engine checks that every position the step's first
token attends to (per group: all, the window, the open attention chunk) holds its true value, and
after it that block 0 is untouched: a wrong hit, a stale save or a write into the null block fails
the check (the oracle is recompute).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from kvfabric.connector import vllm as kvvllm


class FullAttentionSpec:
    """vLLM's spec classes are read by name."""

    def __init__(self, block_size: int, page: int) -> None:
        self.block_size = block_size
        self.num_kv_heads = 1
        self.head_size = page // (block_size * 4)
        self.dtype = "torch.float32"
        self.page_size_bytes = page


class SlidingWindowSpec(FullAttentionSpec):
    def __init__(self, block_size: int, page: int, window: int, extra: int = 0) -> None:
        super().__init__(block_size, page)
        self.sliding_window = window
        self.extra_retained_tokens = extra


class ChunkedLocalAttentionSpec(FullAttentionSpec):
    def __init__(self, block_size: int, page: int, chunk: int) -> None:
        super().__init__(block_size, page)
        self.attention_chunk_size = chunk


class MambaSpec:
    """A recurrent-state group in vLLM's ``align`` mode: block ``i`` holds the state after exactly
    ``(i + 1) * block_size`` tokens (or after the request's last token, in its last block)."""

    def __init__(self, block_size: int, page: int, state_bytes: int) -> None:
        self.block_size = block_size
        self.shapes = ((state_bytes // 4,),)
        self.dtypes = ("torch.float32",)
        self.mamba_cache_mode = "align"
        self.page_size_padded = page
        self.page_size_bytes = page
        self.real_page_size_bytes = state_bytes


def attended(spec: Any, p: int) -> range:
    """Positions token ``p`` attends to before itself (what must hold true KV when it is computed)."""
    if isinstance(spec, SlidingWindowSpec):
        return range(max(0, p - spec.sliding_window + 1), p)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return range(p // spec.attention_chunk_size * spec.attention_chunk_size, p)
    return range(p)


def expected_checks(specs: list[Any], layers_per_group: int, start: int, n: int, budget: int) -> int:
    """Positions :class:`Engine` checks for one request computed alone from ``start`` to ``n``.

    Steps of ``budget`` tokens; each step checks, per layer, every position its first token attends
    to (an attention layer) or the one state it starts from (a recurrent layer, unless at 0).
    """
    total = 0
    for first in range(start, n, budget):
        for spec in specs:
            seen = (1 if first else 0) if isinstance(spec, MambaSpec) else len(attended(spec, first))
            total += layers_per_group * seen
    return total


def skipped(spec: Any, computed: int) -> int:
    """vLLM's ``get_num_skipped_tokens``."""
    if isinstance(spec, MambaSpec):
        return max(0, computed - 1)
    if isinstance(spec, SlidingWindowSpec):
        return max(0, computed - spec.sliding_window + 1 - spec.extra_retained_tokens)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return computed // spec.attention_chunk_size * spec.attention_chunk_size
    return 0


def kv_cache_config(specs: list[Any], layers_per_group: int) -> Any:
    groups = [
        SimpleNamespace(layer_names=[f"g{g}.l{k}" for k in range(layers_per_group)], kv_cache_spec=spec)
        for g, spec in enumerate(specs)
    ]
    return SimpleNamespace(kv_cache_groups=groups, kv_cache_layout="LBHNC")


def vllm_config(chunk_tokens: int, **extra: Any) -> Any:
    class _Model:
        model = "org/hybrid-tiny"
        revision = "r1"
        dtype = "torch.float32"

        def get_num_layers(self, parallel: Any) -> int:
            return 4

        def get_num_kv_heads(self, parallel: Any) -> int:
            return 1

        def get_head_size(self) -> int:
            return 8

    return SimpleNamespace(
        model_config=_Model(),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        device_config=SimpleNamespace(device_type="cpu"),
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"chunk_tokens": chunk_tokens, "lookup_deadline_ms": 30000, **extra}
        ),
    )


@dataclass
class Req:
    req_id: str
    prompt_token_ids: list[int]
    computed: int = 0
    tables: list[list[int]] = field(default_factory=list)
    new_ids: list[list[int]] = field(default_factory=list)
    admitted: bool = False
    sent_new: bool = False
    hit: int = 0
    local: int = 0
    """Tokens the engine's own prefix cache holds at admission (block-aligned)."""
    admitted_tables: list[list[int]] = field(default_factory=list)
    loaded: bool = False
    failed_loads: int = 0
    lora_request: Any = None

    @property
    def request_id(self) -> str:
        return self.req_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids


class Engine:
    """The scheduler, block pool and KV tensors of one vLLM process (a restart is a new Engine)."""

    def __init__(
        self, specs: list[Any], layers_per_group: int, num_blocks: int, page: int, kernel: int = 0
    ) -> None:
        """``kernel``: hand the connector tensors in kernel blocks of this many tokens (vLLM does
        when a backend needs blocks smaller than a group's)."""
        self.specs = specs
        self.config = kv_cache_config(specs, layers_per_group)
        self.free = list(range(num_blocks - 1, 0, -1))  # block 0 is the null block, never handed out
        self.kv: dict[str, torch.Tensor] = {}
        self.registered: dict[str, torch.Tensor] = {}  # what the connector is given
        self.layer_group: dict[str, int] = {}
        for k in range(layers_per_group):
            base = torch.zeros(num_blocks, page // 4)  # slot k of every group aliases these bytes
            for g, spec in enumerate(specs):
                name = f"g{g}.l{k}"
                self.layer_group[name] = g
                if isinstance(spec, MambaSpec):  # int8 [blocks, 1, 1, state bytes], padded pages
                    view = base.view(torch.int8)[:, : spec.real_page_size_bytes]
                    self.kv[name] = self.registered[name] = view.view(num_blocks, 1, 1, -1)
                    continue
                self.kv[name] = base.view(num_blocks, 1, spec.block_size, page // (4 * spec.block_size))
                self.registered[name] = self.kv[name]
                if kernel and spec.block_size > kernel:
                    split = spec.block_size // kernel
                    width = page // (4 * spec.block_size)
                    self.registered[name] = base.view(num_blocks * split, 1, kernel, width)
        self.layer_index = {name: i for i, name in enumerate(self.kv)}
        self.null_writes = 0
        self.checked_positions = 0

    # ------------------------------------------------------------------------------ the model

    @staticmethod
    def truth(tokens: list[int], layer: int, upto: int) -> list[float]:
        """The value of every position ``< upto`` in layer ``layer`` (depends on the whole prefix)."""
        out, h = [], 0
        for p in range(upto):
            h = (h * 31 + tokens[p] + 7) % 1_000_003
            out.append(float(h * 8 + layer % 8))
        return out

    def _value(self, name: str, req: Req, p: int) -> float:
        g = self.layer_group[name]
        spec = self.specs[g]
        block = req.tables[g][p // spec.block_size]
        return float(self.kv[name][block, 0, p % spec.block_size, 0])

    def state(self, req: Req, name: str, tokens: int) -> torch.Tensor:
        """The true recurrent state of layer ``name`` after ``tokens`` tokens, as bytes."""
        spec = self.specs[self.layer_group[name]]
        value = self.truth(req.prompt_token_ids, self.layer_index[name], tokens)[-1] if tokens else 0.0
        return torch.full((spec.real_page_size_bytes // 4,), value).view(torch.int8).view(1, 1, -1)

    def forward_state(self, name: str, req: Req, start: int, end: int) -> None:
        """Check the state the step starts from, then write the state after ``end`` tokens."""
        g = self.layer_group[name]
        spec = self.specs[g]
        if start:
            block = req.tables[g][(start - 1) // spec.block_size]
            assert block != 0, f"{req.req_id} {name}: the state after {start} tokens is the null block"
            assert torch.equal(self.kv[name][block], self.state(req, name, start)), (
                f"{req.req_id} {name}: the state after {start} tokens is not what recompute gives"
            )
            self.checked_positions += 1
        block = req.tables[g][(end - 1) // spec.block_size]
        assert block != 0
        self.kv[name][block] = self.state(req, name, end)

    def state_offloads(self, req: Req, end: int) -> list[tuple[int, int, int]]:
        """The checkpoints a step ending at ``end`` hands over (``boundary_state_offloads``)."""
        return [
            (g, req.tables[g][end // spec.block_size - 1], end)
            for g, spec in enumerate(self.specs)
            if isinstance(spec, MambaSpec) and end % spec.block_size == 0
        ]

    def forward_layer(self, name: str, req: Req, start: int, end: int) -> None:
        """Check what token ``start`` attends to, then write positions ``[start, end)``."""
        g = self.layer_group[name]
        spec = self.specs[g]
        if isinstance(spec, MambaSpec):
            self.forward_state(name, req, start, end)
            return
        truth = self.truth(req.prompt_token_ids, self.layer_index[name], end)
        for q in attended(spec, start):
            block = req.tables[g][q // spec.block_size]
            assert block != 0, f"{req.req_id} {name}: position {q} is the null block"
            got = self._value(name, req, q)
            assert got == truth[q], (
                f"{req.req_id} {name}: position {q} holds {got}, recompute gives {truth[q]}"
            )
            self.checked_positions += 1
        for p in range(start, end):
            block = req.tables[g][p // spec.block_size]
            assert block != 0
            self.kv[name][block, 0, p % spec.block_size, :] = truth[p]

    def null_block_clean(self) -> bool:
        return all(bool((t[0] == 0).all()) for t in self.kv.values())

    # ------------------------------------------------------------------------------ blocks

    def _take(self) -> int:
        return self.free.pop()

    def _remove_skipped(self, req: Req) -> None:
        for g, spec in enumerate(self.specs):
            n = min(skipped(spec, req.computed) // spec.block_size, len(req.tables[g]))
            for pos in range(n):
                if req.tables[g][pos] != 0:
                    self.free.append(req.tables[g][pos])
                    req.tables[g][pos] = 0

    def _allocate(self, req: Req, upto: int) -> None:
        if not req.tables:
            req.tables = [[] for _ in self.specs]
        req.new_ids = [[] for _ in self.specs]
        for g, spec in enumerate(self.specs):
            table = req.tables[g]
            null_below = skipped(spec, req.computed) // spec.block_size
            while len(table) < -(-upto // spec.block_size):
                bid = 0 if len(table) < null_below else self._take()
                table.append(bid)
                req.new_ids[g].append(bid)

    def fill_local(self, req: Req) -> None:
        """Give the request's local prefix-cache hit its true KV (what vLLM's own cache holds)."""
        if not req.local:
            return
        for name in self.kv:
            g = self.layer_group[name]
            spec = self.specs[g]
            if isinstance(spec, MambaSpec):
                self.kv[name][req.tables[g][(req.local - 1) // spec.block_size]] = self.state(
                    req, name, req.local
                )
                continue
            truth = self.truth(req.prompt_token_ids, self.layer_index[name], req.local)
            for p in range(req.local):
                block = req.tables[g][p // spec.block_size]
                if block != 0:
                    self.kv[name][block, 0, p % spec.block_size, :] = truth[p]

    def free_request(self, req: Req) -> None:
        for table in req.tables:
            self.free.extend(b for b in table if b != 0)
        req.tables = []


class Driver:
    """Runs requests through one Engine and a scheduler/worker pair of connectors."""

    def __init__(
        self, engine: Engine, sched: kvvllm.KVFabricConnector, worker: kvvllm.KVFabricConnector
    ) -> None:
        self.engine = engine
        self.sched = sched
        self.worker = worker
        self.plans: list[Any] = []
        self.saved_blocks = 0
        self.feedback: list[Any] = []
        worker.register_kv_caches(engine.registered)

    def run(self, reqs: list[Req], budget: int) -> None:
        """Admit and prefill every request, ``budget`` tokens per step, round robin."""
        eng = self.engine
        waiting = list(reqs)
        running: list[Req] = []
        loading: list[Req] = []  # asynchronous loads in flight (vLLM keeps them waiting)
        while waiting or running or loading:
            new, cached = [], []
            num_scheduled: dict[str, int] = {}
            left = budget
            for req in list(running):
                if left <= 0:
                    break
                k = min(left, len(req.prompt_token_ids) - req.computed)
                eng._remove_skipped(req)
                eng._allocate(req, req.computed + k)
                num_scheduled[req.req_id] = k
                cached.append(req)
                left -= k
            while waiting and left > 0:
                req = waiting.pop(0)
                if req.loaded:  # its asynchronous load finished: scheduled from where it got to
                    k = min(left, len(req.prompt_token_ids) - req.computed)
                    eng._allocate(req, req.computed + k)
                    num_scheduled[req.req_id] = k
                    new.append(req)
                    left -= k
                    continue
                ext, background = self.sched.get_num_new_matched_tokens(req, req.local)
                ext = ext or 0
                req.hit = req.local + ext if ext else 0
                k = min(left, len(req.prompt_token_ids) - req.local - ext)
                # Allocation covers the hit and the tokens to compute; positions the hit's window
                # leaves out are the null block.
                req.computed = req.local + ext
                eng._allocate(req, req.computed + k)
                eng.fill_local(req)
                req.admitted_tables = [list(t) for t in req.tables]
                if background:
                    eng._allocate(req, req.computed)
                    blocks = SimpleNamespace(get_block_ids=lambda r=req: tuple(list(t) for t in r.tables))
                    self.sched.update_state_after_alloc(req, blocks, ext)
                    loading.append(req)
                    continue
                blocks = SimpleNamespace(get_block_ids=lambda r=req: tuple(list(t) for t in r.tables))
                self.sched.update_state_after_alloc(req, blocks, ext)
                num_scheduled[req.req_id] = k
                new.append(req)
                left -= k
            offloads = {
                r.req_id: eng.state_offloads(r, r.computed + num_scheduled[r.req_id]) for r in new + cached
            }
            state = SimpleNamespace(
                boundary_state_offloads={rid: o for rid, o in offloads.items() if o},
                req_ids=[r.req_id for r in new + cached],
                resolve_block_ids=lambda rid, rs={r.req_id: r for r in new + cached}: tuple(
                    list(t) for t in rs[rid].tables
                ),
            )
            so = SimpleNamespace(
                scheduled_new_reqs=[
                    SimpleNamespace(
                        req_id=r.req_id,
                        block_ids=tuple(list(t) for t in r.tables),
                        num_computed_tokens=r.computed,
                    )
                    for r in new
                ],
                scheduled_cached_reqs=SimpleNamespace(
                    req_ids=[r.req_id for r in cached],
                    resumed_req_ids=set(),
                    new_block_ids=[tuple(list(x) for x in r.new_ids) for r in cached],
                    num_computed_tokens=[r.computed for r in cached],
                ),
                num_scheduled_tokens=num_scheduled,
                finished_req_ids=set(),
                kv_connector_block_state=state,
                new_block_ids_to_zero=None,
            )
            meta = self.sched.build_connector_meta(so)
            self.plans.append(meta)
            by_id = {r.req_id: r for r in new + cached}
            for save in meta.saves:
                # A save reads only blocks the request holds now: a block that left the window is
                # free, or already another request's (or another group's).
                live = {b for t in by_id[save.req_id].tables for b in t if b != 0}
                read = {b for ids in save.block_ids for b in ids}
                assert read <= live, (
                    f"save of {save.req_id} reads blocks {sorted(read - live)[:8]} it no longer holds"
                )
                self.saved_blocks += len(read)
            self.worker.bind_connector_metadata(meta)
            self.worker.start_load_kv(None)
            errors: set[int] = set()
            for name in eng.kv:
                recurrent = isinstance(eng.specs[eng.layer_group[name]], MambaSpec)
                if recurrent:  # vLLM's hooks wrap attention only
                    for req in new + cached:
                        eng.forward_layer(name, req, req.computed, req.computed + num_scheduled[req.req_id])
                    continue
                self.worker.wait_for_layer_load(name)
                for req in new + cached:
                    eng.forward_layer(name, req, req.computed, req.computed + num_scheduled[req.req_id])
                self.worker.save_kv_layer(name, eng.registered[name], None)
            self.worker.wait_for_save()
            feedback = self.worker.build_connector_worker_meta()
            if feedback is not None:
                self.feedback.append(feedback)
                self.sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=feedback))
            self.worker.clear_connector_metadata()
            assert eng.null_block_clean(), "a connector write reached the null block"
            # vLLM 0.32's order: transfer results, then block-level errors (which it refuses, by
            # raising, with several KV cache groups).
            results = self.worker.get_transfer_results(set())
            errors = self.worker.get_block_ids_with_load_errors()
            if errors and len(eng.specs) > 1:
                raise RuntimeError("block-level load failures with multiple KV cache groups")
            assert not errors, f"load errors {sorted(errors)[:8]}"
            for req in [r for r in loading if r.req_id in results.finished_recving]:
                loading.remove(req)
                if req.req_id in results.failed_recving:
                    # vLLM recomputes it from the start: its blocks go, it waits to be admitted again.
                    eng.free_request(req)
                    req.computed = req.local = 0
                    req.failed_loads += 1
                else:
                    req.loaded = True
                waiting.insert(0, req)
            if loading and not (new or cached):
                time.sleep(0.01)  # the loads run on threads of their own
            for req in new + cached:
                req.computed += num_scheduled[req.req_id]
            running = [r for r in new + cached if r.computed < len(r.prompt_token_ids)]
            for req in new + cached:
                if req.computed >= len(req.prompt_token_ids):
                    if hasattr(self.sched, "request_finished_all_groups"):  # SupportsHMA
                        self.sched.request_finished_all_groups(req, tuple(list(t) for t in req.tables))
                    else:  # what vLLM calls on a connector without it (one group)
                        self.sched.request_finished(req, list(req.tables[0]))
                    eng.free_request(req)
        assert self.worker.worker_half.wait_for_stores(60)
