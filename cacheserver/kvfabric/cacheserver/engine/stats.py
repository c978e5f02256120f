"""Thread-safe event counters the engine bumps and the metrics module exports."""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["Counters"]


class Counters:
    """Monotonic counters keyed by ``(name, tier)``; ``tier`` is "" for tier-less events.

    The engine stays free of any metrics library: OpenTelemetry observable counters read
    :meth:`snapshot` at scrape time.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter[tuple[str, str]] = Counter()

    def inc(self, name: str, tier: str = "", n: int = 1) -> None:
        """Add ``n`` to counter ``name`` for ``tier``."""
        key = (name, str(tier))  # a TierName counts under its plain string value
        with self._lock:
            self._c[key] += n

    def get(self, name: str, tier: str = "") -> int:
        """Return the current value of one counter."""
        with self._lock:
            return self._c[(name, str(tier))]

    def snapshot(self) -> dict[tuple[str, str], int]:
        """Return a copy of every counter."""
        with self._lock:
            return dict(self._c)
