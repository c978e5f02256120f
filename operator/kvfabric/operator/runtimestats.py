"""What stalls the operator's event loops: loop lag, garbage-collector pauses, CPU per thread.

The injection webhook answers on kopf's event loop; anything that holds that loop (or the GIL) for
long delays every admission behind it. These cumulative, bucketed counters say what did: how late a
loop woke up (:class:`LoopLag`), how long each collection of the cyclic garbage collector held the
GIL (:class:`GcPauses`), and how much CPU each named thread used (:func:`thread_cpu_seconds`). They are
served as kopf probes (``--liveness``), so ``kvfabric bench operator`` reads them before and after a
storm and reports the difference.
"""

from __future__ import annotations

import asyncio
import bisect
import gc
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

# Upper bounds (ms) of the histogram buckets; the last bucket holds everything above.
BUCKETS_MS: Final = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)


@dataclass
class Histogram:
    """Cumulative counts of durations by bucket (:data:`BUCKETS_MS`), their sum and maximum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_MS) + 1))
    total_ms: float = 0.0
    max_ms: float = 0.0

    def add(self, ms: float) -> None:
        """Record one duration in milliseconds."""
        self.counts[bisect.bisect_left(BUCKETS_MS, ms)] += 1
        self.total_ms += ms
        self.max_ms = max(self.max_ms, ms)

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able copy: ``{"n", "total_ms", "max_ms", "le_ms": {bound: count}}``."""
        bounds = [*(f"{b:g}" for b in BUCKETS_MS), "inf"]
        return {
            "n": sum(self.counts),
            "total_ms": round(self.total_ms, 2),
            "max_ms": round(self.max_ms, 2),
            "le_ms": dict(zip(bounds, self.counts, strict=True)),
        }


class GcPauses:
    """Every collection of the cyclic garbage collector, by generation (installed once per process)."""

    def __init__(self, *, count_tracked: bool = False) -> None:
        self.count_tracked = count_tracked
        """Also count the objects the collector tracks in each snapshot: a walk of the whole heap
        that holds the GIL for milliseconds, so only for a benchmark, never for liveness probes."""
        self.by_generation = [Histogram(), Histogram(), Histogram()]
        """Wall time of each pass: what a waiting admission saw (the OS may deschedule the pass)."""
        self.cpu_by_generation = [Histogram(), Histogram(), Histogram()]
        """CPU time of each pass: the collector's own work, whatever the machine's load."""
        self._started = 0.0
        self._started_cpu = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        # Runs with the GIL held, inside the collection: keep it to clock reads and a bisect.
        if phase == "start":
            self._started = time.perf_counter()
            self._started_cpu = time.thread_time()
        else:
            generation = info["generation"]
            self.by_generation[generation].add((time.perf_counter() - self._started) * 1000)
            self.cpu_by_generation[generation].add((time.thread_time() - self._started_cpu) * 1000)

    def install(self) -> None:
        """Start recording (idempotent)."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def snapshot(self) -> dict[str, Any]:
        """Per generation, the histogram of pauses; plus the objects the collector tracks now."""
        out: dict[str, Any] = {f"gen{g}": h.snapshot() for g, h in enumerate(self.by_generation)}
        out |= {f"gen{g}_cpu": h.snapshot() for g, h in enumerate(self.cpu_by_generation)}
        out["frozen_objects"] = gc.get_freeze_count()
        if self.count_tracked:
            out["tracked_objects"] = len(gc.get_objects())
        return out


class LoopLag:
    """How late an event loop wakes from a short sleep: the wait any callback on it would have seen.

    Sampled every ``interval`` seconds; the lateness is measured to the microsecond whatever the
    interval. Every 50 ms keeps an idle operator at 20 wake-ups a second and still gives a
    minute-long storm over a thousand samples for its percentiles.
    """

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.histogram = Histogram()

    async def run(self) -> None:
        """Measure until cancelled (run it as a task on the loop to watch)."""
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.interval)
            self.histogram.add(max(0.0, time.perf_counter() - start - self.interval) * 1000)


def thread_cpu_seconds(native_ids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) of each named thread of this process, from ``/proc``; absent if gone."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for name, tid in native_ids.items():
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[name] = round((int(fields[11]) + int(fields[12])) / tick, 2)
    return out


def current_native_id() -> int:
    """The kernel's id of the calling thread (for :func:`thread_cpu_seconds`)."""
    return threading.get_native_id()
