"""Debug timings of a hit's stages: where the time between a request's arrival and its first token goes.

Off unless ``KVFABRIC_STAGE_TIMES=1`` is in the engine's environment when this module is imported;
off, every call is one test of a module-level flag (nothing is timed or stored). On, each stage
adds its wall time and the CPU time of the thread that ran it (``time.thread_time``), and the
worker writes one line per step that loaded anything and one per background load (the scheduler
one per lookup: it may run in another process) to the ``kvfabric.stages`` logger at DEBUG
(the logger is given its own stderr handler, so vLLM's logging settings need not change):

    kvfabric stages: lookup=1.23/1.10 load_rpc=... verify=... wait=... scatter=... step=...

Each value is ``wall_ms/cpu_ms``, summed over the step (a stage run on several threads sums their
CPU). Stages: ``lookup`` (the scheduler's lookup of one request), ``load_rpc`` (the
loader thread's fetch or borrow of the payloads), ``verify`` (their checksums and MACs),
``wait`` (the engine thread waiting for the loader), ``scatter`` (the engine thread writing the
payloads into the paged KV cache) and ``step`` (the whole step, from ``start_load_kv`` to
``wait_for_save``: the load and the forward pass, which includes vLLM's prefill of the tail).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator

log = logging.getLogger("kvfabric.stages")

ENABLED = os.environ.get("KVFABRIC_STAGE_TIMES", "") not in ("", "0")
"""Whether stages are timed (read once, at import: the check on the hot path is this flag)."""

_lock = threading.Lock()
_totals: dict[str, list[float]] = {}


def _configure() -> None:
    if ENABLED and not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.DEBUG)
        log.propagate = False


_configure()


def add(stage: str, wall_s: float, cpu_s: float) -> None:
    """Add one run of ``stage`` (no-op when off)."""
    if not ENABLED:
        return
    with _lock:
        t = _totals.setdefault(stage, [0.0, 0.0])
        t[0] += wall_s
        t[1] += cpu_s


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Time the block as one run of stage ``name`` (costs one flag test when off)."""
    if not ENABLED:
        yield
        return
    w0, c0 = time.perf_counter(), time.thread_time()
    try:
        yield
    finally:
        add(name, time.perf_counter() - w0, time.thread_time() - c0)


def take() -> dict[str, tuple[float, float]]:
    """Return (and reset) the stages timed since the last call: name -> (wall s, CPU s)."""
    with _lock:
        out = {k: (v[0], v[1]) for k, v in _totals.items()}
        _totals.clear()
    return out


def format_line(totals: dict[str, tuple[float, float]]) -> str:
    """The log line of one step's totals (milliseconds, ``wall/cpu``)."""
    parts = [f"{k}={w * 1000:.2f}/{c * 1000:.2f}" for k, (w, c) in totals.items()]
    return "kvfabric stages: " + " ".join(parts)


def flush(only_if: str) -> None:
    """Log and reset the totals, if stage ``only_if`` ran since the last flush (no-op when off)."""
    if not ENABLED:
        return
    with _lock:
        if only_if not in _totals:
            return
    log.debug(format_line(take()))
