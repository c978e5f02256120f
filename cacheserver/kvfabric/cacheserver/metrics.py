"""OpenTelemetry metrics exported for Prometheus, plus the HTTP endpoint for scrapes and probes.

Engine events are counted in :class:`~kvfabric.cacheserver.engine.stats.Counters` (the engine imports no
metrics library); observable instruments read them at scrape time. Latency histograms and request
counters are recorded by the service directly.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfabric.cacheserver.engine.base import READ_MISSES, MissReason, TierUsage
from kvfabric.cacheserver.engine.ids import is_hex64
from kvfabric.cacheserver.engine.stats import Counters
from kvfabric.cacheserver.engine.tiered import TieredStore
from kvfabric.cacheserver.health import ListenerProbes
from kvfabric.cacheserver.namespaces import NamespaceRegistry
from kvfabric.cacheserver.transport.residencyfeed import FeedStats

__all__ = ["Metrics", "ProbeServer", "namespace_label"]

# Latency buckets from 50 us to 10 s: lookups are sub-millisecond, 64 MiB disk loads tens of ms.
_LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)  # fmt: skip

# Engine counter name -> (exported name, description, unit).
_ENGINE_COUNTERS: dict[str, tuple[str, str, str]] = {
    "hits": ("kvfabric.cache.hits", "Loads served, per tier the block was found in", "1"),
    "misses": ("kvfabric.cache.misses", "Loads of a key no tier holds", "1"),
    "evictions": ("kvfabric.cache.evictions", "Blocks evicted for capacity, per tier", "1"),
    "expirations": ("kvfabric.cache.expirations", "Blocks deleted by TTL bucket expiry, per tier", "1"),
    "expired_buckets": ("kvfabric.cache.expired_buckets", "TTL buckets expired by this server", "1"),
    "checksum_failures": ("kvfabric.cache.checksum_failures", "Corrupt blocks detected and removed", "1"),
    "dropped_stores": ("kvfabric.cache.dropped_stores", "Stores dropped under backpressure", "1"),
    "dropped_writebacks": ("kvfabric.cache.dropped_writebacks", "Write-backs to a disk tier dropped", "1"),
    "writes_refused": ("kvfabric.cache.writes_refused", "Disk writes refused: budget or disk full", "1"),
    "writes_superseded": (
        "kvfabric.cache.writes_superseded",
        "Block writes abandoned before their rename: a newer copy or a delete of the key is known",
        "1",
    ),
    "meta_failures": (
        "kvfabric.cache.names_dropped",
        "Chunk names read back from a block file that failed their checksum: dropped, the block still serves",
        "1",
    ),
    "bytes_written": ("kvfabric.cache.tier_written", "Payload bytes written back to a disk tier", "By"),
    "stores": ("kvfabric.cache.stores", "Blocks stored into DRAM", "1"),
    "adopted_blocks": (
        "kvfabric.handover.adopted_blocks",
        "DRAM blocks this server took over from its predecessor at a hand-over (0: a hand-over that "
        "carried none)",
        "1",
    ),
    "quarantined_staging": (
        "kvfabric.arena.quarantined",
        "Staging bytes a same-node client sealed against shrinking and abandoned: the server cannot free "
        "them, so they stay charged to the staging arena for the server's lifetime",
        "By",
    ),
    "adopted_bytes": ("kvfabric.handover.adopted", "DRAM bytes taken over at a hand-over", "By"),
    "handover_dropped_stores": (
        "kvfabric.handover.dropped_stores",
        "Stores dropped while DRAM was frozen for a hand-over",
        "1",
    ),
}

# Counters exported at 0 from the start, per tier ("" for a tier-less one), rather than from their first
# event: Prometheus' increase() and rate() cannot see a series' first value, so a counter that appears
# at 1 would never fire an alert on `increase(...) > 0`, and a dashboard would show "no data" for "none".
# The callable picks the tiers from the server's tier names (fastest first: DRAM, then the others).
_ZERO_FROM_START: dict[str, Callable[[list[str]], list[str]]] = {
    "hits": lambda tiers: tiers,
    "misses": lambda tiers: [""],
    "evictions": lambda tiers: tiers,
    "checksum_failures": lambda tiers: tiers,
    "dropped_stores": lambda tiers: ["arena", *tiers[:1]],
    "writes_refused": lambda tiers: tiers[1:],
    "stores": lambda tiers: [""],
    "quarantined_staging": lambda tiers: [""],
    "handover_dropped_stores": lambda tiers: tiers[:1],
}


# Per-tier usage gauges: (exported name, description, unit, what of a TierUsage it reads).
_TIER_GAUGES: list[tuple[str, str, str, Callable[[TierUsage], int]]] = [
    ("kvfabric.tier.used", "Bytes used per tier", "By", lambda u: u.used_bytes),
    ("kvfabric.tier.capacity", "Tier budgets", "By", lambda u: u.capacity_bytes),
    ("kvfabric.tier.blocks", "Blocks per tier", "1", lambda u: u.blocks),
]


class Metrics:
    """The server's instruments, on a private Prometheus registry."""

    def __init__(self, store: TieredStore, *, max_namespaces: int = 64) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._reader = PrometheusMetricReader(registry=self.registry)
        self.provider = MeterProvider(metric_readers=[self._reader], views=_views())
        meter = self.provider.get_meter("kvfabric.cacheserver")
        self._store = store
        self.namespaces = NamespaceRegistry(max_namespaces)
        # Straight on the Prometheus registry, not through OpenTelemetry: the label set shrinks when a
        # description is evicted, and an OTel asynchronous instrument cannot say "this series is gone".
        self.registry.register(_NamespaceCollector(self.namespaces))
        _observe_engine_counters(meter, store.counters, [str(u.name) for u in store.usage()])
        self._observe_tiers(meter)
        self._observe_volume_clock(meter)
        self._create_request_instruments(meter)

    def _observe_tiers(self, meter: Meter) -> None:
        """Per-tier usage gauges (:data:`_TIER_GAUGES`), read from the store at scrape time."""
        for name, desc, unit, read in _TIER_GAUGES:
            meter.create_observable_gauge(name, callbacks=[self._usage_cb(read)], unit=unit, description=desc)

    def _observe_volume_clock(self, meter: Meter) -> None:
        """Gauges of the shared volume's clock, read from the store at scrape time."""
        meter.create_observable_gauge(
            "kvfabric.volume.stamps_local_clock",
            callbacks=[self._clock_cb("stamps_local")],
            unit="1",
            description="1 when the shared volume's timestamps follow this server's clock (a client-stamped "
            "filesystem such as CephFS, Lustre or FUSE, or clocks in sync); 0 when the volume stamps its own",
        )
        meter.create_observable_gauge(
            "kvfabric.volume.clock_spread",
            callbacks=[self._clock_cb("spread")],
            unit="s",
            description="Latest minus earliest clock among the live servers sharing the volume",
        )

    def _create_request_instruments(self, meter: Meter) -> None:
        """The counters and latency histograms the service records per request."""
        self.lookups = meter.create_counter("kvfabric.cache.lookups", unit="1", description="Lookup requests")
        self.lookup_keys = meter.create_counter(
            "kvfabric.cache.lookup_keys",
            unit="1",
            description="Keys asked for in lookups, by result (hit/miss)",
        )
        self.lookup_reports_dropped = meter.create_counter(
            "kvfabric.cache.lookup_reports_dropped",
            unit="1",
            description="Lookup reports from same-node clients dropped uncounted, by reason "
            "(implausible: more keys than its lookups could ask for; rate: beyond what the connection "
            "could have looked up over RPC)",
        )
        self.bytes_out = meter.create_counter(
            "kvfabric.cache.bytes_out", unit="By", description="Payload bytes served, by transport"
        )
        self.bytes_in = meter.create_counter(
            "kvfabric.cache.bytes_in", unit="By", description="Payload bytes accepted, by transport"
        )
        self.load_duration = meter.create_histogram(
            "kvfabric.load.duration", unit="s", description="Load latency (server side), by transport"
        )
        self.store_duration = meter.create_histogram(
            "kvfabric.store.duration", unit="s", description="Store latency (server side), by transport"
        )
        self.describes = meter.create_counter(
            "kvfabric.cache.describes",
            unit="1",
            description="Namespace descriptions received, by result (accepted/refused: malformed or "
            "not hashing to the namespace)",
        )
        self.lookup_duration = meter.create_histogram(
            "kvfabric.lookup.duration", unit="s", description="Lookup latency (server side)"
        )

    def _usage_cb(
        self, read: Callable[[TierUsage], int]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def cb(_: CallbackOptions) -> Iterable[Observation]:
            for u in self._store.usage():
                yield Observation(read(u), {"tier": u.name})

        return cb

    def _clock_cb(self, what: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def cb(_: CallbackOptions) -> Iterable[Observation]:
            clock = self._store.clock
            if what == "spread":
                yield Observation(clock.spread())
            elif clock.stamps_local_clock is not None:
                yield Observation(int(clock.stamps_local_clock))

        return cb

    def watch_listeners(self, probes: ListenerProbes) -> None:
        """Export ``kvfabric_listener_up`` from ``probes``."""
        self.registry.register(_ListenerCollector(probes))

    def count_lookups(self, namespace: str, lookups: int, hits: int, misses: int) -> bool:
        """Count ``lookups`` lookups of ``namespace`` that found ``hits`` keys and missed ``misses``.

        Both ways a lookup is answered feed the same counters: the RPC, and the same-node clients'
        reports of lookups they answered from the published index. Returns whether the namespace is
        described (False: ask the client to describe it).
        """
        self.lookups.add(lookups)
        self.lookup_keys.add(hits, {"result": "hit"})
        self.lookup_keys.add(misses, {"result": "miss"})
        return self.namespaces.count_lookup(namespace, hits, misses)

    def count_dropped_report(self, reason: str) -> None:
        """Count a same-node client's lookup report dropped for ``reason`` (it claimed too much)."""
        self.lookup_reports_dropped.add(1, {"reason": reason})

    def watch_residency(self, read: Callable[[], FeedStats]) -> None:
        """Export the residency feed's numbers (``read()``: subscribers, records, names)."""
        self.registry.register(_ResidencyCollector(read))

    def exposition(self) -> bytes:
        """Prometheus text exposition of every instrument."""
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        """Stop the meter provider."""
        self.provider.shutdown()


def _views() -> list[View]:
    """Every ``*.duration`` histogram uses :data:`_LATENCY_BUCKETS`."""
    return [
        View(
            instrument_name="kvfabric.*.duration",
            aggregation=ExplicitBucketHistogramAggregation(_LATENCY_BUCKETS),
        )
    ]


def _observe_engine_counters(meter: Meter, counters: Counters, tiers: list[str]) -> None:
    """One observable counter per engine event (:data:`_ENGINE_COUNTERS`), plus read misses by reason.

    ``tiers`` are the server's tier names, fastest first (for :data:`_ZERO_FROM_START`).
    """
    for key, (name, desc, unit) in _ENGINE_COUNTERS.items():
        zero = _ZERO_FROM_START[key](tiers) if key in _ZERO_FROM_START else []
        meter.create_observable_counter(
            name, callbacks=[_counter_cb(counters, key, zero)], unit=unit, description=desc
        )
    meter.create_observable_counter(
        "kvfabric.cache.read_misses",
        callbacks=[_read_misses_cb(counters, tiers)],
        unit="1",
        description="Reads an index promised that missed, per tier and reason "
        "(absent, corrupt, stale, stale-handle, io-error); the entry is dropped",
    )


def _counter_cb(
    counters: Counters, key: str, zero: list[str]
) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def cb(_: CallbackOptions) -> Iterable[Observation]:
        values = dict.fromkeys(zero, 0)
        for (name, tier), value in counters.snapshot().items():
            if name == key:
                values[tier] = value
        for tier, value in values.items():
            yield Observation(value, {"tier": tier} if tier else {})

    return cb


def _read_misses_cb(
    counters: Counters, tiers: list[str]
) -> Callable[[CallbackOptions], Iterable[Observation]]:
    """Read misses per tier and reason; every reason of every tier from 0 (see :data:`_ZERO_FROM_START`)."""
    prefix = f"{READ_MISSES}."

    def cb(_: CallbackOptions) -> Iterable[Observation]:
        values = {(tier, reason.value): 0 for tier in tiers for reason in MissReason}
        for (name, tier), value in counters.snapshot().items():
            if name.startswith(prefix):
                values[(tier, name.removeprefix(prefix))] = value
        for (tier, reason), value in values.items():
            yield Observation(value, {"tier": tier, "reason": reason})

    return cb


EXPORTED_FIELDS: tuple[str, ...] = (
    "model",
    "revision",
    "dtype",
    "payload_layout",
    "kv_layout",
    "device",
    "attn_backend",
    "layers",
    "kv_heads",
    "head_dim",
    "block_size",
    "chunk_tokens",
    "tp_size",
    "tp_rank",
    "lora",
    "payload_format",
    "scheme",
)
"""The fields of a description exported by the (unauthenticated) metrics listener: an allowlist.

Left out on purpose: the digest (a capability: whoever knows it can look up and load the namespace's
chunks), ``payload_key_id`` (with the rest of the description it recomputes the digest) and
``tenant`` (another tenant's name is no business of whoever can reach the port). Those two are
exported only as :data:`HASHED_FIELDS`, which tell namespaces apart without saying what they hold."""

HASHED_FIELDS: dict[str, str] = {"key_space": "payload_key_id", "tenant_label": "tenant"}
"""Exported label -> the description field it is a one-way hash of (8 hex; "" where the field is empty):
enough to tell that two namespaces of one model differ in payload key or tenant, not which."""

NAMESPACE_LABELS: tuple[str, ...] = ("namespace_label", *EXPORTED_FIELDS, *HASHED_FIELDS)
"""Labels of ``kvfabric_namespace_info``: :func:`namespace_label`, the exported fields ("" if absent),
then the hashed ones."""

_LABEL_CONTEXT = b"kvfabric metrics label"
_FIELD_CONTEXT = b"kvfabric metrics field\0"


def _hashed(field: str, value: str) -> str:
    if not value:
        return ""
    return hashlib.sha256(_FIELD_CONTEXT + field.encode() + b"\0" + value.encode()).hexdigest()[:8]


def namespace_label(namespace: str) -> str:
    """The label a namespace is exported under: 16 hex of SHA-256 over a context and its digest.

    Stable across servers (the operator merges nodes by it) and not reversible: the digest has the
    payload key's fingerprint in it, which nobody outside the namespace can guess.
    """
    return hashlib.sha256(_LABEL_CONTEXT + namespace.encode()).hexdigest()[:16]


class _NamespaceCollector(Collector):
    """``kvfabric_namespace_info`` and the per-namespace counters of the described namespaces."""

    def __init__(self, registry: NamespaceRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        snap = self._registry.snapshot()
        info = GaugeMetricFamily(
            "kvfabric_namespace_info",
            "A compatibility namespace a client described (1 while this server keeps its description), "
            "under a label derived from its digest; the digest itself is never exported",
            labels=NAMESPACE_LABELS,
        )
        lookups = CounterMetricFamily(
            "kvfabric_namespace_lookup_keys",
            "Keys asked for in lookups of a described namespace, by result (hit/miss), since it was "
            "described",
            labels=("namespace_label", "result"),
        )
        stores = CounterMetricFamily(
            "kvfabric_namespace_stores",
            "Blocks offered for storing under a described namespace (Store accepted, ShmStoreBegin "
            "slots handed out), since it was described",
            labels=("namespace_label",),
        )
        for ns, entry in snap.items():
            label = namespace_label(ns)
            values = [entry.fields.get(field, "") for field in EXPORTED_FIELDS]
            values += [_hashed(source, entry.fields.get(source, "")) for source in HASHED_FIELDS.values()]
            info.add_metric([label, *values], 1)
            lookups.add_metric([label, "hit"], entry.lookup_hits)
            lookups.add_metric([label, "miss"], entry.lookup_misses)
            stores.add_metric([label], entry.stores)
        evicted = CounterMetricFamily(
            "kvfabric_namespace_descriptions_evicted",
            "Namespace descriptions forgotten because more namespaces than limits.max_described_namespaces "
            "were described",
        )
        evicted.add_metric([], self._registry.evicted)
        yield from (info, lookups, stores, evicted)


class _ListenerCollector(Collector):
    """``kvfabric_listener_up{listener}``: 1 while the listener's last probe was answered in time."""

    def __init__(self, probes: ListenerProbes) -> None:
        self._probes = probes

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily(
            "kvfabric_listener_up",
            "1 while a same-node listener (grpc, blocks, index) answers its probe from inside the server",
            labels=("listener",),
        )
        states = self._probes.states()
        for name in self._probes.probes:
            state = states.get(name)
            up.add_metric([name], 1 if state is not None and state.up else 0)
        yield up


class _ResidencyCollector(Collector):
    """The residency feed (docs/routing.md): whether same-node engines follow it, and how much it sent."""

    def __init__(self, read: Callable[[], FeedStats]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        stats = self._read()
        subscribers, records, pending_bytes = stats.subscribers, stats.records, stats.pending_bytes
        gauge = GaugeMetricFamily(
            "kvfabric_residency_subscribers",
            "Connections following the residency feed for a namespace this server knows, their snapshot "
            "delivered (one per engine that announces this node's tiers)",
        )
        gauge.add_metric([], subscribers)
        sent = CounterMetricFamily(
            "kvfabric_residency_records",
            "Residency records (stored, removed) queued to subscribers, snapshots included",
        )
        sent.add_metric([], records)
        pending = GaugeMetricFamily(
            "kvfabric_residency_pending_meta_bytes",
            "Bytes of chunk metadata held for chunks not stored yet (bounded; the oldest goes first)",
        )
        pending.add_metric([], pending_bytes)
        names = GaugeMetricFamily(
            "kvfabric_residency_names_bytes",
            "Bytes of chunk metadata held for resident chunks (bounded by limits.max_resident_names_bytes)",
        )
        names.add_metric([], stats.names_bytes)
        dropped = CounterMetricFamily(
            "kvfabric_residency_names_dropped",
            "Names of resident chunks dropped, the chunk still served but unannounced, by reason "
            "(undecodable: read back from disk with a valid checksum but not decodable; memory_bound: "
            "the oldest past limits.max_resident_names_bytes)",
            labels=("reason",),
        )
        for reason, n in sorted(stats.names_dropped.items()):
            dropped.add_metric([reason], n)
        yield from (gauge, sent, pending, names, dropped)


MAX_QUERY_BYTES = 4 << 20
HTTP_TIMEOUT_SECONDS = 10.0  # a client silent this long mid-request is dropped (its thread freed)
MAX_TOKEN_ID = 2**32 - 1  # token ids are uint32 (the feed packs them so)
QueryFn = Callable[[str, list[int], str | None], dict[str, int]]


def parse_query(body: bytes) -> tuple[str, list[int], str | None]:
    """``POST /query``'s JSON body (namespace, token_ids, lora_name); ValueError names the field."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ValueError("the body must be a JSON object") from None
    if not isinstance(doc, dict):
        raise ValueError("the body must be a JSON object")
    namespace = doc.get("namespace")
    if not isinstance(namespace, str) or not is_hex64(namespace):
        raise ValueError("namespace: 64 lower-case hex characters (the namespace digest)")
    tokens = doc.get("token_ids")
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in tokens):
        raise ValueError(f"token_ids: an array of integers from 0 to {MAX_TOKEN_ID}")
    lora = doc.get("lora_name")
    if lora is not None and not isinstance(lora, str):
        raise ValueError("lora_name: a string or null")
    return namespace, tokens, lora


class ProbeServer:
    """``GET /metrics``, ``/healthz`` (process alive) and ``/readyz`` (serving) on a background thread.

    ``/readyz`` is 200 only while :attr:`ready` (the server published its sockets and is not shutting
    down) and every listener of :attr:`listeners` answers its probe; the body's first line is
    ``ready`` or ``not ready``, then one line per listener (``listener <name> up`` or
    ``listener <name> down: <why>``).
    """

    def __init__(self, host: str, port: int, metrics: Metrics, *, query: QueryFn | None = None) -> None:
        self.ready = False
        self.listeners: ListenerProbes | None = None
        outer = self

        class Handler(BaseHTTPRequestHandler):
            timeout = HTTP_TIMEOUT_SECONDS  # the socket's: a stalled client cannot hold a thread

            def do_POST(self) -> None:
                if self.path.split("?", 1)[0] != "/query":
                    self._send(404, b"not found\n", "text/plain")
                    return
                if query is None:
                    self._send(404, b"/query is off: set metrics.residency_query: true\n", "text/plain")
                    return
                raw_length = (self.headers.get("Content-Length") or "").strip()
                if not raw_length.isdigit():  # negative, or not a number: read(-1) would wait for EOF
                    self.close_connection = True
                    self._send(400, b"Content-Length: a non-negative integer is required\n", "text/plain")
                    return
                length = int(raw_length)
                if length > MAX_QUERY_BYTES:
                    self.close_connection = True
                    self._send(413, b"a query body holds at most 4 MiB\n", "text/plain")
                    return
                try:
                    namespace, tokens, lora = parse_query(self.rfile.read(length))
                except ValueError as exc:
                    self._send(400, f"{exc}\n".encode(), "text/plain")
                    return
                body = json.dumps({"matched_tokens": query(namespace, tokens, lora)}).encode()
                self._send(200, body, "application/json")

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, metrics.exposition(), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._send(200, b"ok\n", "text/plain")
                elif path == "/readyz":
                    ok, body = outer.readiness()
                    self._send(200 if ok else 503, body.encode(), "text/plain")
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return  # scrapes every few seconds would drown the logs

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics-http", daemon=True)

    def readiness(self) -> tuple[bool, str]:
        """Whether the server is ready, and the ``/readyz`` body that says why (class docstring)."""
        ok, lines = self.ready, []
        if not self.ready:
            lines.append("server not serving (starting, handing over or shutting down)")
        if self.listeners is not None:
            up, lines_ = self.listeners.report()
            ok, lines = ok and up, lines + lines_
        return ok, "\n".join(["ready" if ok else "not ready", *lines]) + "\n"

    def start(self) -> None:
        """Start serving."""
        self._thread.start()

    def stop(self) -> None:
        """Stop serving."""
        self._httpd.shutdown()
        self._httpd.server_close()
