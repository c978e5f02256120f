"""Test helpers: an in-memory transport with the client's interface and injectable faults.

Integration tests use real cache-server processes; this fake is for fast unit tests of the
connector's logic and of the resilience layer (it can hang, refuse or corrupt on demand).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvfabric.client.errors import CacheUnavailable
from kvfabric.client.results import LookupResult, StoreResult


class MemoryTransport:
    """A dict-backed stand-in for ``kvfabric.client.CacheClient``."""

    def __init__(self, tier: str = "dram") -> None:
        self.blocks: dict[tuple[str, str], bytes] = {}
        self.tier = tier
        self.calls: list[str] = []
        self.hang = threading.Event()  # set: calls block until released (like a SIGSTOPped server)
        self.release = threading.Event()
        self.down = False  # True: calls raise CacheUnavailable
        self.corrupt_keys: set[str] = set()  # loads of these keys return a flipped byte
        self._lock = threading.Lock()

    def _enter(self, name: str, timeout: float) -> None:
        with self._lock:
            self.calls.append(name)
        if self.down:
            raise CacheUnavailable("fake server is down")
        if self.hang.is_set():
            # Ignore ``timeout`` on purpose: the resilience layer must not rely on the transport.
            self.release.wait()

    def lookup(self, namespace: str, keys: Sequence[str], *, timeout: float) -> LookupResult:
        """Count leading stored keys."""
        self._enter("lookup", timeout)
        n = 0
        for k in keys:
            if (namespace, k) not in self.blocks:
                break
            n += 1
        return LookupResult(n, [self.tier] * n)

    def load_into(
        self, namespace: str, keys: Sequence[str], buffers: Sequence[memoryview], *, timeout: float
    ) -> int:
        """Copy leading payloads into buffers."""
        self._enter("load_into", timeout)
        n = 0
        for k, buf in zip(keys, buffers, strict=True):
            data = self.blocks.get((namespace, k))
            if data is None or len(data) != len(buf):
                break
            buf[:] = data
            if k in self.corrupt_keys:
                buf[len(buf) // 2] ^= 0xFF
            n += 1
        return n

    def store(
        self,
        namespace: str,
        keys: Sequence[str],
        payloads: Sequence[bytes | bytearray | memoryview],
        *,
        timeout: float,
    ) -> StoreResult:
        """Store payloads."""
        self._enter("store", timeout)
        for k, p in zip(keys, payloads, strict=True):
            self.blocks[(namespace, k)] = bytes(p)
        return StoreResult(len(keys), 0)

    def close(self) -> None:
        """Nothing to release."""
