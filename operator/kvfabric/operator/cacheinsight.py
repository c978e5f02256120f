"""Cache insight for a pool's status: hit rate, misses by reason and bytes per tier, from its servers.

Each cache server exposes Prometheus metrics (``kvfabric.cacheserver.metrics``). The operator
scrapes the pool's ready cache-server pods at a bounded rate (:class:`Scraper`: at most one pass
per pool per interval, a few requests at a time, a short timeout each), and :func:`summarize`
folds the per-node numbers into ``status.cache``: lookup hits and misses and the hit rate (what
``kubectl get kvp -o wide`` prints), load misses by reason, and per tier the total bytes used and
the fullest node; and the compatibility namespaces the consumers described to the servers
(:func:`summarize_namespaces`: label, model, revision, dtype, layout..., nodes, hits and lookups),
with :func:`namespace_splits` naming models served under several namespaces. A silent 0 % hit
rate (a config mismatch between consumers) becomes visible, and so does its cause.

A namespace is known here only by its *label* (``namespace_label``: 16 hex characters of a one-way
hash of its digest, the same on every server): the digest itself is a capability (whoever knows it
can look up and load the namespace's chunks), and servers export neither it nor the description
fields that would recompute it (the payload key's fingerprint) or name another tenant: those two come
only as one-way 8-hex labels (``key_space``, ``tenant_label``) that tell namespaces apart.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvfabric.operator.api.v1alpha1 import CacheInsight, NamespaceInUse, TierUsage

# One server exports at most limits.max_described_namespaces (64 by default) namespaces; the
# operator still bounds what it keeps per node, whatever a server sends.
MAX_NAMESPACES_PER_NODE = 256
MAX_NAMESPACES_LISTED = 16
_MAX_FIELD_CHARS = 512
LABEL_CHARS = 16
"""Length of a namespace label (``kvfabric.cacheserver.metrics.namespace_label``)."""


@dataclass
class NodeNamespace:
    """One described namespace as one cache server reports it."""

    fields: dict[str, str] = field(default_factory=dict)
    lookup_hits: int = 0
    lookup_misses: int = 0
    stores: int = 0


@dataclass
class NodeCache:
    """One cache server's counters and gauges."""

    lookup_hits: int = 0
    lookup_misses: int = 0
    load_misses: dict[str, int] = field(default_factory=dict)  # reason -> count
    used: dict[str, int] = field(default_factory=dict)  # tier -> bytes
    capacity: dict[str, int] = field(default_factory=dict)
    namespaces: dict[str, NodeNamespace] = field(default_factory=dict)  # label -> what it is
    routing_subscribers: int = 0  # engines following the residency feed


def parse_metrics(text: str) -> NodeCache:
    """Parse a cache server's exposition (unknown metrics are ignored)."""
    node = NodeCache()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, int(sample.value)
            if name == "kvfabric_cache_lookup_keys_total":
                if labels.get("result") == "hit":
                    node.lookup_hits += value
                elif labels.get("result") == "miss":
                    node.lookup_misses += value
            elif name == "kvfabric_cache_misses_total":
                node.load_misses["absent"] = node.load_misses.get("absent", 0) + value
            elif name == "kvfabric_cache_read_misses_total":
                reason = labels.get("reason", "unknown")
                node.load_misses[reason] = node.load_misses.get(reason, 0) + value
            elif name == "kvfabric_tier_used_bytes" and "tier" in labels:
                node.used[labels["tier"]] = value
            elif name == "kvfabric_tier_capacity_bytes" and "tier" in labels:
                node.capacity[labels["tier"]] = value
            elif name.startswith("kvfabric_namespace_"):
                _parse_namespace_sample(node, name, labels, value)
            elif name == "kvfabric_residency_subscribers":
                node.routing_subscribers = max(0, value)
    return node


def _parse_namespace_sample(node: NodeCache, name: str, labels: Mapping[str, str], value: int) -> None:
    label = labels.get("namespace_label", "")
    if len(label) != LABEL_CHARS or not all(ch in "0123456789abcdef" for ch in label):
        return
    entry = node.namespaces.get(label)
    if entry is None:
        if len(node.namespaces) >= MAX_NAMESPACES_PER_NODE:
            return
        entry = node.namespaces[label] = NodeNamespace()
    if name == "kvfabric_namespace_info":
        entry.fields = {
            k: v[:_MAX_FIELD_CHARS] for k, v in sorted(labels.items()) if k != "namespace_label" and v
        }
    elif name == "kvfabric_namespace_lookup_keys_total":
        if labels.get("result") == "hit":
            entry.lookup_hits += value
        elif labels.get("result") == "miss":
            entry.lookup_misses += value
    elif name == "kvfabric_namespace_stores_total":
        entry.stores += value


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def summarize(nodes: Mapping[str, NodeCache], scraped_at: str, unreachable: int = 0) -> CacheInsight:
    """Fold per-node numbers into the pool's ``status.cache``."""
    hits = sum(n.lookup_hits for n in nodes.values())
    misses = sum(n.lookup_misses for n in nodes.values())
    reasons: dict[str, int] = {}
    for n in nodes.values():
        for reason, count in n.load_misses.items():
            reasons[reason] = reasons.get(reason, 0) + count
    tiers: list[TierUsage] = []
    for tier in sorted({t for n in nodes.values() for t in n.used}):
        used = {name: n.used.get(tier, 0) for name, n in nodes.items() if tier in n.used}

        def fill(name: str, tier: str = tier) -> float:
            cap = nodes[name].capacity.get(tier, 0)
            return nodes[name].used.get(tier, 0) / cap if cap else 0.0

        worst = max(sorted(used), key=fill)
        tiers.append(
            TierUsage(
                tier=tier,
                used_bytes=sum(used.values()),
                capacity_bytes=sum(nodes[name].capacity.get(tier, 0) for name in used),
                worst_node=worst,
                worst_node_used=_percent(nodes[worst].used.get(tier, 0), nodes[worst].capacity.get(tier, 0)),
            )
        )
    in_use = summarize_namespaces(nodes)
    return CacheInsight(
        namespaces_in_use=len(in_use),
        namespaces=in_use[:MAX_NAMESPACES_LISTED],
        namespace_splits=namespace_splits(in_use)[:8],
        scraped_at=scraped_at,
        nodes_scraped=len(nodes),
        nodes_unreachable=unreachable,
        lookup_hits=hits,
        lookup_misses=misses,
        hit_rate=_percent(hits, hits + misses),
        load_misses_by_reason=dict(sorted(reasons.items())),
        tiers=tiers,
        routing_subscribers=sum(n.routing_subscribers for n in nodes.values()),
        routing_nodes=sum(1 for n in nodes.values() if n.routing_subscribers > 0),
    )


def summarize_namespaces(nodes: Mapping[str, NodeCache]) -> list[NamespaceInUse]:
    """Every described namespace across the nodes, most looked-up first (then by label)."""
    merged: dict[str, NamespaceInUse] = {}
    for node_name in sorted(nodes):
        for label, seen in nodes[node_name].namespaces.items():
            if not seen.fields:
                continue  # counters without a description: the server no longer exports it
            entry = merged.setdefault(label, NamespaceInUse(digest=label, fields=seen.fields))
            entry.node_count += 1
            if len(entry.nodes) < 16:
                entry.nodes.append(node_name)
            entry.lookup_hits += seen.lookup_hits
            entry.lookup_misses += seen.lookup_misses
            entry.stores += seen.stores
    for entry in merged.values():
        entry.hit_rate = _percent(entry.lookup_hits, entry.lookup_hits + entry.lookup_misses)
    return sorted(merged.values(), key=lambda e: (-(e.lookup_hits + e.lookup_misses), e.digest))


# Fields whose difference is by design: the ranks of one tensor-parallel engine, tenants kept apart,
# engine-wide LoRA adapters (another adapter is another model), payload keys (every consumer namespace
# seals with a key of its own, so one model under several keys is the normal case).
_BY_DESIGN = ("tp_rank", "tenant_label", "lora", "key_space")


def namespace_splits(in_use: Iterable[NamespaceInUse]) -> list[str]:
    """Models served under several namespaces for one TP rank (and tenant), and the fields that differ.

    Such consumers never share a chunk: the usual cause of a silent 0 % hit rate between two engines
    (another revision, dtype, block size, attention backend or payload key). Pure; sorted by model.
    """
    groups: dict[tuple[str, ...], list[NamespaceInUse]] = {}
    for entry in in_use:
        key = (entry.fields.get("model", ""), *(entry.fields.get(k, "") for k in _BY_DESIGN))
        groups.setdefault(key, []).append(entry)
    out: list[str] = []
    for (model, rank, *_), entries in sorted(groups.items()):
        if len(entries) < 2:
            continue
        names = sorted({k for e in entries for k in e.fields} - set(_BY_DESIGN))
        differ = [k for k in names if len({e.fields.get(k, "") for e in entries}) > 1]
        detail = "; ".join(
            f"{k}: " + ", ".join(sorted({e.fields.get(k, "") or '""' for e in entries})) for k in differ
        )
        digests = ", ".join(e.digest[:12] for e in entries)
        out.append(
            f"model {model or '?'} (tp_rank {rank or '?'}) has {len(entries)} namespaces ({digests}) "
            f"that never share chunks; they differ in {detail or 'fields not exported'}"[:1024]
        )
    return out


def scrape_targets(pods: Iterable[dict[str, Any]], port: int) -> dict[str, str]:
    """Node name -> metrics URL of every ready cache-server pod that has an IP."""
    out: dict[str, str] = {}
    for pod in pods:
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        ip = status.get("podIP")
        if ready and ip:
            host = f"[{ip}]" if ":" in ip else ip
            out[str((pod.get("spec") or {}).get("nodeName") or ip)] = f"http://{host}:{port}/metrics"
    return out


class Scraper:
    """Bounded-rate scraping: at most one pass per pool per ``interval``, ``concurrency`` requests at once.

    One exception makes a new pool show its numbers soon: a pool whose last pass reached no server
    (none was ready yet, or none answered) is due again as soon as its set of ready servers changes,
    but never sooner than ``retry_gap`` after that pass. A pass in flight is never doubled.
    """

    def __init__(
        self,
        *,
        interval: float = 60.0,
        concurrency: int = 8,
        timeout: float = 2.0,
        retry_gap: float = 5.0,
        on_update: Callable[[tuple[str, str]], None] | None = None,
    ) -> None:
        self.interval = interval
        self.retry_gap = min(retry_gap, interval)
        self._reached: dict[tuple[str, str], bool] = {}
        self._inflight: set[tuple[str, str]] = set()
        self.on_update = on_update
        self._tasks: set[asyncio.Task[None]] = set()
        self.timeout = timeout
        self._semaphore = asyncio.Semaphore(concurrency)
        self._last: dict[tuple[str, str], float] = {}
        self._targets: dict[tuple[str, str], dict[str, str]] = {}
        self.insights: dict[tuple[str, str], CacheInsight] = {}
        self.requests = 0

    def due(self, key: tuple[str, str], targets: Mapping[str, str] | None = None) -> bool:
        """Whether ``key`` may be scraped now (class docstring); ``targets``: its ready servers now."""
        if key in self._inflight:
            return False
        last = self._last.get(key)
        if last is None:
            return True
        elapsed = time.monotonic() - last
        if elapsed >= self.interval:
            return True
        changed = targets is not None and self._targets.get(key) != dict(targets)
        return changed and not self._reached.get(key, False) and elapsed >= self.retry_gap

    async def _fetch(self, session: Any, url: str) -> NodeCache | None:
        import aiohttp

        async with self._semaphore:
            self.requests += 1
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=self.timeout)) as response:
                    if response.status != 200:
                        return None
                    return parse_metrics(await response.text())
            except (aiohttp.ClientError, TimeoutError, ValueError):
                return None

    async def scrape(self, key: tuple[str, str], targets: Mapping[str, str], now: str) -> CacheInsight | None:
        """Scrape ``targets`` (node -> URL) if the pool is due; return (and keep) its insight."""
        if not self.due(key, targets):
            return self.insights.get(key)
        self._claim(key, targets)
        return await self._pass(key, targets, now)

    def _claim(self, key: tuple[str, str], targets: Mapping[str, str]) -> None:
        self._last[key] = time.monotonic()
        self._targets[key] = dict(targets)
        self._inflight.add(key)

    async def _pass(self, key: tuple[str, str], targets: Mapping[str, str], now: str) -> CacheInsight | None:
        try:
            return await self._pass_once(key, targets, now)
        finally:
            self._inflight.discard(key)

    async def _pass_once(
        self, key: tuple[str, str], targets: Mapping[str, str], now: str
    ) -> CacheInsight | None:
        if not targets:
            self._reached[key] = False
            return self.insights.get(key)
        import aiohttp

        async with aiohttp.ClientSession() as session:
            names = sorted(targets)
            results = await asyncio.gather(*(self._fetch(session, targets[n]) for n in names))
        nodes = {n: r for n, r in zip(names, results, strict=True) if r is not None}
        self._reached[key] = bool(nodes)
        insight = summarize(nodes, now, unreachable=len(names) - len(nodes))
        self.insights[key] = insight
        return insight

    def schedule(self, key: tuple[str, str], targets: Mapping[str, str], now: str) -> None:
        """Start a pass in the background if ``key`` is due (a reconcile never waits for a scrape)."""
        if not self.due(key, targets):
            return
        # Claimed now, not when the pass starts: reconciles in between start no second pass.
        self._claim(key, targets)

        async def one() -> None:
            before = self.insights.get(key)
            insight = await self._pass(key, targets, now)
            if insight is not None and insight != before and self.on_update is not None:
                self.on_update(key)

        task = asyncio.get_running_loop().create_task(one())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Cancel passes in flight."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def forget(self, key: tuple[str, str]) -> None:
        """Drop a deleted pool."""
        self._last.pop(key, None)
        self._targets.pop(key, None)
        self._reached.pop(key, None)
        self.insights.pop(key, None)
