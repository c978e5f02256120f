"""The operator's own Prometheus metrics: what its injection webhook did with each pod it was sent.

``kvfabric operator --metrics-addr HOST:PORT`` serves them at ``/metrics`` (the Deployment of the
install does, on its ``metrics`` port). A pod reaches the webhook only when it asks for a pool (the
label ``kvfabric.io/pool``), so every pod counted as ``skipped`` or ``error`` runs without the cache
although it asked for it: the alert ``KVFabricInjectionFailing`` (docs/operations.md) watches that.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, start_http_server

from kvfabric.operator import injection

__all__ = ["ERROR", "INJECTED", "SKIPPED", "SKIP_REASONS", "WebhookCounter", "parse_addr", "serve"]

INJECTED: Final = "injected"
SKIPPED: Final = "skipped"
ERROR: Final = "error"
SKIP_REASONS: Final = (
    injection.SKIP_POOL_NOT_FOUND,
    injection.SKIP_NAMESPACE_NOT_SELECTED,
    injection.SKIP_POD_SELECTOR,
    injection.SKIP_NO_CONTAINER,
    injection.SKIP_EXPANDABLE_SEGMENTS,
    injection.SKIP_POD_SECURITY,
    injection.SKIP_NO_PAYLOAD_KEY,
)


class WebhookCounter:
    """``kvfabric_operator_webhook_pods_total{result, reason}`` on a registry of its own.

    Every result and skip reason is exported at 0 from the start: Prometheus' ``increase()`` cannot see
    a series' first value, so a first skip would otherwise never fire an alert.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._pods = Counter(
            "kvfabric_operator_webhook_pods",
            "Pods the injection webhook was sent, by result: injected, skipped (reason: why, as the pod's "
            "kvfabric.io/skip-reason annotation says) or error (admitted unchanged after a failure)",
            ["result", "reason"],
            registry=self.registry,
        )
        for result, reason in [(INJECTED, ""), (ERROR, ""), *((SKIPPED, r) for r in SKIP_REASONS)]:
            self._pods.labels(result, reason)

    def count(self, *, injected: bool, skip_reason: str | None = None, error: bool = False) -> None:
        """Count one admission."""
        if error:
            self._pods.labels(ERROR, "").inc()
        elif injected:
            self._pods.labels(INJECTED, "").inc()
        else:
            self._pods.labels(SKIPPED, skip_reason or "").inc()


def parse_addr(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); a clear error naming the flag otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--metrics-addr {addr!r}: expected HOST:PORT, e.g. 0.0.0.0:8081")
    return host.strip("[]"), int(port)


def serve(counter: WebhookCounter, addr: str) -> None:
    """Serve ``counter``'s registry at ``http://addr/metrics`` on a daemon thread."""
    host, port = parse_addr(addr)
    start_http_server(port, addr=host, registry=counter.registry)
