"""Whether the node's cache server serves this engine now: a probe for the engine's own gauge.

A router that reads the engine's ``/metrics`` (llm-d's endpoint-attribute filter, any scraper) can
steer requests away from an engine whose node cache server is stopped, killed or restarting, with
no kvfabric code of its own: ``vllm:kvfabric_node_cache_serving`` is 1 while the server answers
its gRPC health check on the engine's Unix socket as ``SERVING``, 0 otherwise
(:class:`~kvfabric.connector.vllmmetrics.KVFabricPromMetrics` registers it).

The probe runs in vLLM's API-server process on its own daemon thread, every ``interval`` seconds
with a ``timeout``, so the gauge follows the server whether or not the engine is stepping: a
stopped, killed or draining server reads 0 within ``interval + timeout`` seconds (plus the
scrape's period), a server back serving reads 1 within ``interval``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvfabric.client import CacheClient

__all__ = ["INTERVAL_SECONDS", "TIMEOUT_SECONDS", "NodeServingProbe"]

log = logging.getLogger(__name__)

INTERVAL_SECONDS = 1.0
TIMEOUT_SECONDS = 0.5


class NodeServingProbe:
    """Checks the node cache server at a Unix socket and reports each change of its state."""

    def __init__(
        self,
        socket: str,
        on_change: Callable[[bool], None],
        *,
        interval: float = INTERVAL_SECONDS,
        timeout: float = TIMEOUT_SECONDS,
    ) -> None:
        """Probe the server at ``socket``; ``on_change(serving)`` on the first result and each change."""
        self._target = socket if socket.startswith("unix://") else f"unix://{socket}"
        self._on_change = on_change
        self.interval = interval
        self.timeout = timeout
        self.serving: bool | None = None
        """The last result (None before the first)."""
        self._client: CacheClient | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> bool:
        """Probe once now: True when the server's health check says SERVING within the timeout."""
        try:
            if self._client is None:
                self._client = CacheClient(self._target)
            serving = self._client.health(timeout=self.timeout)
        except Exception:  # a probe never raises: anything unusual reads as not serving
            log.debug("node cache server probe failed", exc_info=True)
            serving = False
        if not serving and self._client is not None:
            # A fresh channel next time: a restarted server is a new socket file.
            self._client.close()
            self._client = None
        if serving != self.serving:
            self.serving = serving
            self._on_change(serving)
        return serving

    def start(self) -> None:
        """Probe every ``interval`` seconds on a daemon thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="kvfabric-node-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.check()
            self._stop.wait(self.interval)

    def stop(self) -> None:
        """Stop probing (and close the channel)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + self.timeout + 1)
        if self._client is not None:
            self._client.close()
            self._client = None
