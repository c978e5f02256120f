"""``vllm:kvfabric_node_cache_serving`` follows a real node cache server: stopped, killed, back.

The gauge is registered the way vLLM registers a connector's metrics (``build_prom_metrics`` with
vLLM's metric classes bound to a registry) and read from that registry, as a scrape would. Every
wait below is bounded by the probe's detection bound (its interval plus its timeout) with slack for
a loaded machine.
"""

from __future__ import annotations

import signal
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvfabric.connector import vllm as kvvllm
from kvfabric.connector.nodehealth import INTERVAL_SECONDS, TIMEOUT_SECONDS
from kvfabric.connector.vllmmetrics import KVFabricPromMetrics
from kvfabric.testing.serverproc import MiB, cache_server, wait_until

pytestmark = pytest.mark.process

BOUND = INTERVAL_SECONDS + TIMEOUT_SECONDS
SLACK = 4 * BOUND  # a machine shared with other work; still a few seconds, not "eventually"
ENGINES = {0: ["tiny", 0], 1: ["tiny", 1]}


def _metric_types(registry: CollectorRegistry) -> dict[type, type]:
    def bound(base: type) -> type:
        class Bound(base):  # type: ignore[misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    return {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


def _serving(registry: CollectorRegistry) -> list[float | None]:
    name = "vllm:kvfabric_node_cache_serving"
    return [registry.get_sample_value(name, {"model_name": "tiny", "engine": str(i)}) for i in ENGINES]


def test_the_gauge_reads_0_while_the_node_server_is_stopped_or_killed_and_1_once_it_serves_again() -> None:
    with cache_server(dram_bytes=8 * MiB, local_disk_bytes=None, tcp=False) as srv:
        registry = CollectorRegistry()
        config = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(
                kv_connector_extra_config={"socket": str(srv.config.listen.unix_socket)}
            )
        )
        prom = kvvllm.KVFabricConnector.build_prom_metrics(
            config, _metric_types(registry), ["model_name", "engine"], ENGINES
        )
        assert isinstance(prom, KVFabricPromMetrics)
        assert prom.node_probe is not None
        try:
            wait_until(lambda: _serving(registry) == [1.0, 1.0], timeout=SLACK, what="serving")
            assert srv.proc is not None
            srv.proc.send_signal(signal.SIGSTOP)  # alive, answering nothing
            try:
                wait_until(lambda: _serving(registry) == [0.0, 0.0], timeout=SLACK, what="stopped reads 0")
            finally:
                srv.proc.send_signal(signal.SIGCONT)
            wait_until(lambda: _serving(registry) == [1.0, 1.0], timeout=SLACK, what="continued reads 1")
            srv.kill()
            wait_until(lambda: _serving(registry) == [0.0, 0.0], timeout=SLACK, what="killed reads 0")
            srv.start()
            wait_until(lambda: _serving(registry) == [1.0, 1.0], timeout=SLACK, what="restarted reads 1")
        finally:
            prom.node_probe.stop()


def test_without_a_node_socket_there_is_no_gauge() -> None:
    registry = CollectorRegistry()
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"socket": None}))
    prom = kvvllm.KVFabricConnector.build_prom_metrics(
        config, _metric_types(registry), ["model_name", "engine"], ENGINES
    )
    assert prom.node_probe is None
    assert _serving(registry) == [None, None]
