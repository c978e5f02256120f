"""Asynchronous loads (``load_async``, vLLM's ``load_async=True``): the step never waits for them.

The scheduler half plans a background load for a request the engine keeps waiting, unscheduled;
the worker half runs it on a thread of its own and reports the request finished only once nothing
more is written into its blocks and its failed blocks were handed out first (vLLM requires the
errors no later than the finish, and 0.32 asks for the finished ones first in a step). A hung
server costs the waiting request its deadline, never the other requests' steps, and a load given up
at its deadline writes nothing afterwards.
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch

from kvfabric.connector.keys import NamespaceSpec
from kvfabric.connector.resilient import CircuitBreaker, Endpoint, ResilientCache
from kvfabric.connector.scheduler import SchedulerHalf
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.connector.steps import RequestInfo, ScheduledRequest, StepInput, StepPlan
from kvfabric.connector.worker import WorkerHalf
from kvfabric.testing.memtransport import MemoryTransport
from kvfabric.testing.serverproc import wait_until

BLOCK, CHUNK = 4, 16
SPEC = NamespaceSpec("m", "r", "float32", 2, 1, 4, BLOCK, CHUNK)
PROMPT = tuple(range(1, 3 * CHUNK + 1))  # three whole chunks
SRC = tuple(range(0, 12))
DST = tuple(range(12, 24))


class Rig:
    """A worker with a real host data path over a fake transport, and the round-1 bytes it saved."""

    def __init__(self, load_deadline_ms: int = 30000) -> None:
        self.store = MemoryTransport()
        cache = ResilientCache([Endpoint("m", lambda: self.store, CircuitBreaker(100, 60.0))])
        settings = ConnectorSettings(
            chunk_tokens=CHUNK, lookup_deadline_ms=30000, load_deadline_ms=load_deadline_ms, load_async=True
        )
        self.worker = WorkerHalf(settings, SPEC, cache=cache)
        gen = torch.Generator().manual_seed(0)
        self.kv = {f"l{i}": torch.randn(40, 1, BLOCK, 8, generator=gen) for i in range(2)}
        self.worker.register_kv_caches(self.kv)
        self.sched = SchedulerHalf(settings, SPEC, cache=cache)
        # Round 1 computes the prompt in blocks SRC and stores its chunks.
        first = RequestInfo("r1", PROMPT)
        self.sched.num_new_matched_tokens(first, 0)
        self.sched.update_state_after_alloc(first, SRC, 0)
        self._step(self.sched.build_plan(StepInput((ScheduledRequest("r1", 0, len(PROMPT), SRC, True),))))
        assert self.worker.wait_for_stores(30)
        self.sched.request_finished("r1")
        self.saved = {name: t[list(SRC)].clone() for name, t in self.kv.items()}
        for t in self.kv.values():
            t[list(DST)] = -1.0

    def _step(self, plan: StepPlan) -> float:
        """Run one engine step with ``plan``; return how long the step's forward hooks waited."""
        self.worker.bind_plan(plan)
        t0 = time.monotonic()
        self.worker.start_load()
        for name, t in self.kv.items():
            self.worker.wait_for_layer_load(name)
            self.worker.save_kv_layer(name, t)
        self.worker.wait_for_save()
        waited = time.monotonic() - t0
        self.worker.clear_plan()
        return waited

    def request_background_load(self) -> StepPlan:
        """Round 2 hits; the engine allocates DST and waits: the step's plan carries the load."""
        req = RequestInfo("r2", (*PROMPT, 99))
        hit = self.sched.num_new_matched_tokens(req, 0)
        assert hit == 3 * CHUNK
        self.sched.load_in_background("r2")
        self.sched.update_state_after_alloc(req, DST, hit)
        plan = self.sched.build_plan(StepInput(()))  # r2 is not scheduled while it waits
        (load,) = plan.loads
        assert load.background
        return plan

    def loaded(self, blocks: range) -> bool:
        dst = [DST[b] for b in blocks]
        return all(torch.equal(t[dst], self.saved[name][list(blocks)]) for name, t in self.kv.items())

    def untouched(self, blocks: range) -> bool:
        return all(bool((t[[DST[b] for b in blocks]] == -1.0).all()) for t in self.kv.values())

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.store.release.set()  # a hung transport call must not outlive the test
        self.worker.shutdown()
        self.sched.shutdown()


def test_a_background_load_never_holds_the_step_and_is_finished_only_when_placed() -> None:
    with Rig() as rig:
        plan = rig.request_background_load()
        rig.store.hang.set()  # the server stops answering: the load is in flight
        waited = rig._step(plan)
        assert waited < 5, "the step waited for a background load"
        assert rig.worker.take_finished_loads() == set()
        assert rig.untouched(range(12))
        rig.store.release.set()
        done = wait_until(rig.worker.take_finished_loads, 30, what="the background load")
        assert done == {"r2"}
        assert rig.worker.take_load_errors() == set()
        assert rig.loaded(range(12)), "all three chunks placed"
        # Scheduled at last, with the loaded tokens computed: nothing is loaded again.
        again = rig.sched.build_plan(StepInput((ScheduledRequest("r2", 3 * CHUNK, 1, DST, True),)))
        assert again.loads == []


def test_a_failed_background_load_hands_out_its_blocks_before_its_finish() -> None:
    with Rig() as rig:
        plan = rig.request_background_load()
        (load,) = plan.loads
        rig.store.corrupt_keys.add(load.keys[1])  # chunk 1 arrives damaged
        rig._step(plan)
        wait_until(rig.worker.take_load_reports, 30, what="the background load to end")
        # Over, but not yet reportable: vLLM asks for finished loads before the step's errors.
        assert rig.worker.take_finished_loads() == set()
        errors = rig.worker.take_load_errors()
        assert errors == set(DST[4:12]), "chunk 1 failed, and chunk 2 after it"
        assert rig.worker.take_finished_loads() == {"r2"}
        assert rig.loaded(range(4)), "chunk 0 arrived intact and is used"
        assert rig.untouched(range(4, 12)), "no damaged byte reached the KV cache"


def test_a_background_load_given_up_at_its_deadline_writes_nothing_afterwards() -> None:
    with Rig(load_deadline_ms=300) as rig:
        plan = rig.request_background_load()
        rig.store.hang.set()
        rig._step(plan)
        wait_until(rig.worker.take_load_reports, 30, what="the deadline")
        assert rig.worker.take_load_errors() == set(DST)
        assert rig.worker.take_finished_loads() == {"r2"}
        # vLLM may now hand the blocks to another request; the hung call coming back must not
        # write into them.
        rig.store.release.set()
        time.sleep(1.0)
        assert rig.untouched(range(12))


def test_hits_that_arrive_together_load_side_by_side() -> None:
    """Two background loads are in flight at once (each on a data path of its own), not in line."""
    with Rig() as rig:
        plan = rig.request_background_load()
        (load,) = plan.loads
        other = dataclasses.replace(
            load, req_id="r3", block_ids=[[b + 12 for b in bs] for bs in load.block_ids]
        )
        rig.store.hang.set()
        before = rig.store.calls.count("load_into")
        rig._step(StepPlan(loads=[load, other]))
        wait_until(lambda: rig.store.calls.count("load_into") - before >= 2, 10, what="two loads in flight")
        rig.store.release.set()
        done: set[str] = set()

        def both() -> bool:
            done.update(rig.worker.take_finished_loads())
            return done == {"r2", "r3"}

        wait_until(both, 30, what="both loads finished")
        assert rig.worker.take_load_errors() == set()


def test_after_a_failed_background_load_the_recomputed_chunks_are_saved_again() -> None:
    """Chunk 1 fails to load: the engine computes from there, and the half saves chunks 1 and 2."""
    with Rig() as rig:
        plan = rig.request_background_load()
        (load,) = plan.loads
        for key in load.keys[1:]:
            del rig.store.blocks[(rig.sched.namespace, key)]  # gone since the lookup
        rig._step(plan)
        wait_until(rig.worker.take_load_reports, 30, what="the background load to end")
        assert rig.worker.take_load_errors() == set(DST[4:12])
        assert rig.worker.take_finished_loads() == {"r2"}
        # vLLM schedules r2 from the first failed block on: chunk 0 is computed, the rest is not.
        n = len(PROMPT) + 1
        again = rig.sched.build_plan(StepInput((ScheduledRequest("r2", CHUNK, n - CHUNK, DST, True),)))
        assert again.loads == []
        saved = [key for spec in again.saves for key in spec.keys]
        assert saved[:2] == load.keys[1:3], "the recomputed chunks are stored again"


def test_an_empty_background_load_is_finished_at_once() -> None:
    with Rig() as rig:
        plan = rig.request_background_load()
        (load,) = plan.loads
        rig._step(StepPlan(loads=[dataclasses.replace(load, keys=[], block_ids=[], tiers=[])]))
        assert rig.worker.take_finished_loads() == {"r2"}, "the engine would wait for it for ever"
        assert rig.worker.counters.get("background_loads") == 0, "finished at once, not queued"


def test_a_request_gets_at_most_one_background_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load that fails from its first block sends the request back to vLLM's lookup; a second
    asynchronous load of a chunk that keeps failing (a foreign key, a disabled worker) would loop."""
    from tests.connector.test_connector_vllm import fake_vllm_config

    from kvfabric.connector import vllm as kvvllm

    monkeypatch.delenv("KVFABRIC_SOCKET", raising=False)
    monkeypatch.delenv("KVFABRIC_REMOTE", raising=False)
    sched = kvvllm.KVFabricConnector(
        fake_vllm_config(chunk_tokens=32, load_async=True), SimpleNamespace(name="SCHEDULER")
    )
    half = sched.scheduler_half

    def hit(info: RequestInfo, computed: int) -> int:
        st = half._state(info)  # a lookup that found 64 tokens (no server here)
        st.hit_tokens, st.matched_chunks = 64, 2
        return 64

    monkeypatch.setattr(half, "num_new_matched_tokens", hit)
    req = SimpleNamespace(request_id="r", prompt_token_ids=list(range(100)), lora_request=None)
    assert sched.get_num_new_matched_tokens(req, 0) == (64, True)
    # Asked again before its load was planned (vLLM could not allocate its blocks yet): still async.
    assert sched.get_num_new_matched_tokens(req, 0) == (64, True)
    half.update_state_after_alloc(RequestInfo("r", tuple(range(100))), list(range(1, 8)), 64)
    half.cache = half.cache or SimpleNamespace(close=lambda: None)  # type: ignore[assignment]  # (plan anyway)
    (spec,) = half.build_plan(StepInput()).loads
    assert spec.background
    assert sched.get_num_new_matched_tokens(req, 0) == (64, False), "the retry loads synchronously"
    sched.request_finished(req, [])
    assert sched.get_num_new_matched_tokens(req, 0) == (64, True), "a new request may load asynchronously"
    sched.shutdown()


def test_a_background_load_that_cannot_be_queued_is_finished_with_every_block_failed() -> None:
    """The loader pool refuses the load (it was shut down): the engine still hears of it, recomputes."""
    with Rig() as rig:
        plan = rig.request_background_load()
        (load,) = plan.loads
        rig._step(plan)  # the first load makes the loader pool
        wait_until(rig.worker.take_finished_loads, 30, what="the first load")
        pool = rig.worker._background_pool
        assert pool is not None
        pool.shutdown(wait=True)
        rig._step(StepPlan(loads=[dataclasses.replace(load, req_id="r3")]))
        assert rig.worker.take_finished_loads() == set(), "its failed blocks come first"
        assert rig.worker.take_load_errors() == set(DST)
        assert rig.worker.take_finished_loads() == {"r3"}


def test_shutdown_with_a_load_in_flight_and_a_hung_server_ends_within_its_one_deadline() -> None:
    """Shutdown takes one deadline when it starts, shared by the load in flight and the stores' drain.

    The server hangs with a background load in flight (its own deadline 8 s) and a save queued behind
    it. vLLM terminates a worker that has not exited within its grace, so shutdown must return within
    ``drain_s`` (1 s here), whatever the load's deadline. Before, it waited for the load's whole
    deadline and only then started a drain of ``drain_s`` for each data path.
    """
    with Rig(load_deadline_ms=8000) as rig:
        plan = rig.request_background_load()
        # A new request will compute and save its prompt (looked up while the server still answers).
        other = tuple(range(500, 500 + 2 * CHUNK))
        fresh = RequestInfo("r3", other)
        assert rig.sched.num_new_matched_tokens(fresh, 0) == 0
        blocks = tuple(range(24, 32))
        rig.sched.update_state_after_alloc(fresh, blocks, 0)
        saving = rig.sched.build_plan(StepInput((ScheduledRequest("r3", 0, len(other), blocks, True),)))
        rig.store.hang.set()
        t0 = time.monotonic()
        rig._step(plan)
        rig._step(saving)  # its store queues behind the hung server
        assert rig.worker.take_load_reports() == [], "the load is still in flight"
        rig.worker.shutdown(drain_s=1.0)
        elapsed = time.monotonic() - t0
        # Generous for a loaded machine, far below the load's 8 s deadline it used to wait for.
        assert elapsed < 1.0 + 2.0, f"the steps and shutdown took {elapsed:.1f} s"
