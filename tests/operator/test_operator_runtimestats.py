"""The runtime probe's measures: a blocked loop shows as lag, every GC pass is recorded."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from kvfabric.operator.runtimestats import GcPauses, LoopLag, thread_cpu_seconds


@pytest.mark.asyncio
async def test_a_callback_that_holds_the_loop_shows_as_lag() -> None:
    lag = LoopLag(interval=0.002)
    task = asyncio.ensure_future(lag.run())
    await asyncio.sleep(0.02)
    time.sleep(0.08)  # noqa: ASYNC251 - what a long pure-Python callback (or a GC pass) does to the loop
    await asyncio.sleep(0.02)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    snap = lag.histogram.snapshot()
    assert snap["max_ms"] >= 70
    assert snap["le_ms"]["100"] + snap["le_ms"]["200"] + snap["le_ms"]["500"] >= 1
    assert snap["n"] == sum(snap["le_ms"].values())


def test_every_collection_is_recorded_with_its_wall_and_cpu_time() -> None:
    pauses = GcPauses(count_tracked=True)
    pauses.install()
    pauses.install()  # idempotent: one callback
    try:
        before = pauses.snapshot()["gen2"]["n"]
        gc.collect()
        gc.collect()
        snap = pauses.snapshot()
    finally:
        gc.callbacks.remove(pauses._callback)
    assert pauses._callback not in gc.callbacks
    assert snap["gen2"]["n"] == before + 2
    assert snap["gen2_cpu"]["n"] == snap["gen2"]["n"]
    assert snap["tracked_objects"] > 0
    assert "tracked_objects" not in GcPauses().snapshot()  # the heap walk only when asked for


def test_cpu_seconds_of_named_threads() -> None:
    me = threading.get_native_id()
    assert set(thread_cpu_seconds({"me": me, "gone": 2**30})) == {"me"}
