"""The compatibility namespaces this server's clients described, with per-namespace counters.

A client tells the server what its namespace stands for (the ``Describe`` RPC); the server keeps
the verified description of at most ``capacity`` namespaces, least recently used first out, and
counts lookups per described namespace. ``kvfabric.cacheserver.metrics`` exports them as
``kvfabric_namespace_info`` and ``kvfabric_namespace_lookup_keys_total``; the operator folds those
into the pool's ``status.cache.namespaces``.

Why bounded, and only described namespaces: a namespace is a label value chosen by the client, and
an unbounded label set is a memory and scrape-size attack. Lookups of namespaces nobody described
count only in the server-wide totals.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["DescribedNamespace", "NamespaceRegistry"]


@dataclass
class DescribedNamespace:
    """One described namespace: its readable fields and its counters since it was described."""

    fields: dict[str, str]
    lookup_hits: int = 0
    lookup_misses: int = 0
    stores: int = 0
    describes: int = field(default=1)


class NamespaceRegistry:
    """Thread-safe LRU of described namespaces (the metrics thread reads, the event loop writes)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, DescribedNamespace] = OrderedDict()
        self.evicted = 0

    def describe(self, namespace: str, fields: dict[str, str]) -> None:
        """Record (or refresh) a verified description; the least recently used one goes past capacity."""
        with self._lock:
            entry = self._entries.get(namespace)
            if entry is None:
                self._entries[namespace] = DescribedNamespace(dict(fields))
            else:
                entry.fields = dict(fields)
                entry.describes += 1
                self._entries.move_to_end(namespace)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
                self.evicted += 1

    def known(self, namespace: str) -> bool:
        """Whether ``namespace`` is described (and mark it recently used)."""
        with self._lock:
            if namespace in self._entries:
                self._entries.move_to_end(namespace)
                return True
            return False

    def count_lookup(self, namespace: str, hits: int, misses: int) -> bool:
        """Count a lookup; return whether the namespace is described (False: ask the client to)."""
        with self._lock:
            entry = self._entries.get(namespace)
            if entry is None:
                return False
            self._entries.move_to_end(namespace)
            entry.lookup_hits += hits
            entry.lookup_misses += misses
            return True

    def count_stores(self, namespace: str, n: int) -> bool:
        """Count accepted stores; return whether the namespace is described."""
        with self._lock:
            entry = self._entries.get(namespace)
            if entry is None:
                return False
            self._entries.move_to_end(namespace)
            entry.stores += n
            return True

    def snapshot(self) -> dict[str, DescribedNamespace]:
        """A copy of every entry, most recently used last."""
        with self._lock:
            return {
                ns: DescribedNamespace(dict(e.fields), e.lookup_hits, e.lookup_misses, e.stores, e.describes)
                for ns, e in self._entries.items()
            }
