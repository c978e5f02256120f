"""kvfabric's connector counters in vLLM's own statistics, logs and Prometheus ``/metrics``.

vLLM collects ``get_kv_connector_stats()`` from every worker and from the scheduler each step,
aggregates them (:meth:`KVFabricStats.aggregate`), logs them periodically ("KV Transfer metrics:
...") and hands them to the Prometheus metrics the connector class registers through
``build_prom_metrics`` (:class:`KVFabricPromMetrics`). The payload is a flat ``{name: number}`` of
deltas since the previous step, taken from the connector's :class:`~kvfabric.connector.resilient.Counters`.

``vllm:kvfabric_loaded_tokens`` counts tokens whose KV kvfabric actually wrote into vLLM's cache;
``vllm:kvfabric_load_failed_tokens`` those it had promised but could not load (vLLM recomputed
them). vLLM's own ``vllm:external_prefix_cache_hits`` counts the promise at admission, before the
load, so under faults only these two are exact.

``vllm:kvfabric_node_cache_serving`` (a gauge, per engine) is 1 while the node's cache server
answers the engine's Unix socket as serving, 0 while it is stopped, killed or restarting
(:mod:`kvfabric.connector.nodehealth`): a router can steer around the node without kvfabric code.

vLLM is imported conditionally, as in :mod:`kvfabric.connector.vllm`.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfabric.connector.nodehealth import NodeServingProbe
from kvfabric.connector.resilient import Counters, Reason
from kvfabric.connector.settings import ConnectorSettings

try:  # pragma: no cover - depends on the environment
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics as _VllmPromMetrics,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats as _VllmStats,
    )
except ImportError:

    @dataclass
    class _VllmStats:  # type: ignore[no-redef]
        """Stand-in for ``KVConnectorStats``."""

        data: dict[str, Any] = field(default_factory=dict)

    class _VllmPromMetrics:  # type: ignore[no-redef]
        """Stand-in for ``KVConnectorPromMetrics``."""

        def __init__(
            self,
            vllm_config: Any,
            metric_types: Mapping[type, type],
            labelnames: list[str],
            per_engine_labelvalues: dict[int, list[object]],
        ) -> None:
            from prometheus_client import Counter, Gauge, Histogram

            self._gauge_cls = metric_types[Gauge]
            self._counter_cls = metric_types[Counter]
            self._histogram_cls = metric_types[Histogram]
            self._labelnames = labelnames
            self.per_engine_labelvalues = per_engine_labelvalues


@dataclass
class KVFabricStats(_VllmStats):  # type: ignore[misc]
    """One interval's counter deltas (picklable: vLLM ships it from the workers to the frontend)."""

    def reset(self) -> None:
        """Clear the interval."""
        self.data: dict[str, Any] = {}

    def aggregate(self, other: Any) -> KVFabricStats:
        """Sum ``other`` (another worker, or the scheduler) into this interval."""
        for name, value in (getattr(other, "data", None) or {}).items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's totals, for vLLM's periodic log line."""
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        """Whether nothing happened in the interval."""
        return not any(self.data.values())

    def to_dict(self) -> dict[str, Any]:
        """The serialisable payload."""
        return dict(self.data)


class CounterDeltas:
    """What changed in a :class:`Counters` since the last :meth:`take` (one taker per counters object).

    The scheduler and worker halves may share one ``Counters`` in one process; sharing the taker
    too reports every increment exactly once.
    """

    _takers: weakref.WeakKeyDictionary[Counters, CounterDeltas] = weakref.WeakKeyDictionary()
    _takers_lock = threading.Lock()

    def __init__(self, counters: Counters) -> None:
        self._counters = counters
        self._last: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def of(cls, counters: Counters) -> CounterDeltas:
        """The shared taker of ``counters``."""
        with cls._takers_lock:
            taker = cls._takers.get(counters)
            if taker is None:
                taker = cls._takers[counters] = cls(counters)
            return taker

    def take(self) -> dict[str, int]:
        """Counter deltas since the previous call (only the ones that changed)."""
        with self._lock:
            snap = self._counters.snapshot()
            delta = {k: v - self._last.get(k, 0) for k, v in snap.items() if v != self._last.get(k, 0)}
            self._last = snap
            return delta


def stats_payload(
    deltas: Mapping[str, int], chunk_tokens: int, restore_s: float = 0.0, block_size: int = 0
) -> dict[str, Any]:
    """The stats payload of one step: counter deltas plus derived token counts and restore time.

    Tokens are whole chunks of ``chunk_tokens`` plus tail blocks of ``block_size``.
    """
    data: dict[str, Any] = dict(deltas)
    loaded = deltas.get("loaded_chunks", 0) * chunk_tokens + deltas.get("loaded_tail_blocks", 0) * block_size
    if loaded:
        data["loaded_tokens"] = loaded
    failed: dict[str, int] = {}
    for name, value in deltas.items():
        if name.startswith("fallback_chunks."):
            reason = name.removeprefix("fallback_chunks.")
            failed[reason] = failed.get(reason, 0) + value * chunk_tokens
        elif name.startswith("fallback_tail_blocks."):
            reason = name.removeprefix("fallback_tail_blocks.")
            failed[reason] = failed.get(reason, 0) + value * block_size
    for reason, tokens in failed.items():
        data["load_failed_tokens." + reason] = tokens
    suspected = sum(v for k, v in deltas.items() if k.startswith("suspect."))
    if suspected:
        data["server_suspected"] = suspected
    if restore_s > 0:
        data["restore_seconds"] = restore_s
    return data


# Stats keys exported as one counter each (per engine): the key -> (metric name, help text).
_PLAIN_COUNTERS: dict[str, tuple[str, str]] = {
    "loaded_tokens": (
        "vllm:kvfabric_loaded_tokens",
        "Prompt tokens whose KV kvfabric loaded into the KV cache (failed loads excluded)",
    ),
    "null_block_writes_refused": (
        "vllm:kvfabric_null_block_writes_refused",
        "Hits not loaded because they would have written vLLM's null block (recomputed instead)",
    ),
    "server_suspected": (
        "vllm:kvfabric_server_suspected",
        "Loads given up, and lookups refused, because the node's cache server sent no first reply "
        "within the reply bound: a hung server, or a live one slower than the bound (if it grows "
        "while the server is healthy, raise reply_floor_ms)",
    ),
    "restore_seconds": (
        "vllm:kvfabric_restore_seconds",
        "Seconds engine steps spent blocked restoring KV from kvfabric",
    ),
}


class KVFabricPromMetrics(_VllmPromMetrics):  # type: ignore[misc]
    """kvfabric's counters as Prometheus metrics in vLLM's ``/metrics`` (labelled like vLLM's own)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: Mapping[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        """Register the metrics with vLLM's metric classes (vLLM chooses the registry)."""
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        labels = list(labelnames)
        self._plain = {
            key: self._counter_cls(name=name, documentation=doc, labelnames=labels)
            for key, (name, doc) in _PLAIN_COUNTERS.items()
        }
        self._bytes = {
            "loaded_bytes": self._counter_cls(
                name="vllm:kvfabric_loaded_bytes",
                documentation="Payload bytes kvfabric loaded into the KV cache, by KV cache group kind",
                labelnames=[*labels, "kind"],
            ),
            "stored_bytes": self._counter_cls(
                name="vllm:kvfabric_stored_bytes",
                documentation="Payload bytes kvfabric stored in its cache, by KV cache group kind",
                labelnames=[*labels, "kind"],
            ),
        }
        self._failed = self._counter_cls(
            name="vllm:kvfabric_load_failed_tokens",
            documentation="Prompt tokens kvfabric promised but could not load (recomputed), by reason",
            labelnames=[*labels, "reason"],
        )
        # Every reason starts at 0: a counter whose series appears only with its first increment has
        # no earlier sample, so rate() and increase() miss that first failure and an alert on it stays
        # silent for the first burst of every engine and reason.
        for values in self.per_engine_labelvalues.values():
            for reason in Reason:
                self._failed.labels(*[str(v) for v in values], reason.value)
        self._events = self._counter_cls(
            name="vllm:kvfabric_events",
            documentation="Every kvfabric connector counter (lookups, misses by reason, stores, ...)",
            labelnames=[*labels, "event"],
        )
        self.node_probe: NodeServingProbe | None = None
        socket = node_socket_of(vllm_config)
        if socket is not None:
            serving = self._gauge_cls(
                name="vllm:kvfabric_node_cache_serving",
                documentation="1 while the node's kvfabric cache server serves this engine's Unix socket, "
                "0 while it is stopped, killed or restarting",
                labelnames=labels,
                multiprocess_mode="mostrecent",
            )

            def set_all(up: bool) -> None:
                for values in self.per_engine_labelvalues.values():
                    serving.labels(*[str(v) for v in values]).set(1 if up else 0)

            set_all(False)  # until the first probe says otherwise
            self.node_probe = NodeServingProbe(socket, set_all)
            self.node_probe.start()

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's payload to the metrics of engine ``engine_idx``."""
        values = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for name, value in transfer_stats_data.items():
            if not value or value < 0:
                continue
            what, _, kind = name.partition(".")
            if name in self._plain:
                self._plain[name].labels(*values).inc(value)
            elif what in self._bytes:  # per kind (full, sliding_window, chunked_local); bare: full
                self._bytes[what].labels(*values, kind or "full").inc(value)
            elif name.startswith("load_failed_tokens."):
                self._failed.labels(*values, name.removeprefix("load_failed_tokens.")).inc(value)
            else:  # a key with a metric of its own is not repeated as an event (a byte count among
                # event counts inflated every sum over vllm:kvfabric_events)
                self._events.labels(*values, name).inc(value)


def node_socket_of(vllm_config: Any) -> str | None:
    """The node cache server's Unix socket the engine's connector uses (settings), or None."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
    try:
        settings = ConnectorSettings.load(extra)
    except ValueError:  # the connector itself refuses these settings, naming the field
        return None
    return settings.socket if settings.enabled else None


# kvfabric tier -> vLLM's CacheHitSource value (``prompt_tokens_cached_by_source``): the node's DRAM
# is host memory; its local disk and the shared volume are disks. The object tier is a remote store,
# which vLLM's enum (0.32) leaves to its fallback, EXTERNAL_UNSPECIFIED.
TIER_SOURCES = {"dram": "host", "local_disk": "disk", "shared": "disk"}
UNSPECIFIED_SOURCE = "external_unspecified"


def hit_source(tier: str | None) -> str:
    """Return vLLM's ``CacheHitSource`` value for a hit whose slowest chunk came from ``tier``."""
    return TIER_SOURCES.get(tier or "", UNSPECIFIED_SOURCE)


def adopt_vllm_logging(name: str = "kvfabric") -> bool:
    """Send kvfabric's logs through vLLM's handlers and level (vLLM configures only ``vllm``).

    Does nothing when vLLM's logging is not configured (``VLLM_CONFIGURE_LOGGING=0``: the user's
    own configuration then applies) or when kvfabric's logger already has handlers.
    """
    ours, theirs = logging.getLogger(name), logging.getLogger("vllm")
    if not theirs.handlers or ours.handlers:
        return False
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False
    return True


class TransitionLog:
    """Log a failing/working state change once, not every request (the counters count the rest)."""

    def __init__(self, what: str, logger: logging.Logger) -> None:
        self._what = what
        self._log = logger
        self._failing: str | None = None
        self._lock = threading.Lock()

    @property
    def failing(self) -> str | None:
        """The reason of the current failure (``None`` while working)."""
        return self._failing

    def note(self, reason: str | None) -> None:
        """Record one outcome: ``None`` for success, else the failure's reason."""
        with self._lock:
            before, self._failing = self._failing, reason
        if reason is not None and before is None:
            self._log.warning(
                "kvfabric %s failing (%s): the engine recomputes; counted in vllm:kvfabric_events "
                "until they work again",
                self._what,
                reason,
            )
        elif reason is None and before is not None:
            self._log.info("kvfabric %s working again (after %s)", self._what, before)
