"""``vllm:kvfabric_node_cache_serving`` in real vLLM's ``/metrics``: 1 while the node server serves.

One OpenAI server with the connector on one cache server, idle (no request is sent: the gauge
follows the server without the engine stepping). The server is killed, then started again. The
detection bound itself is the process-level test's (``tests/connector/test_connector_node_serving_gauge.py``);
here the deadlines are generous, since vLLM's metrics path on this shared machine is slow.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfabric.testing.serverproc import ServerProcess, cache_server, wait_until
from kvfabric.testing.vllmenv import VllmEnv, VllmServer, connector_config, metric_sum

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

GAUGE = "vllm:kvfabric_node_cache_serving"


@pytest.fixture(scope="module")
def served(
    vllm_env: VllmEnv, tiny_model: Path, vllm_workdir: Path
) -> Iterator[tuple[ServerProcess, VllmServer]]:
    with cache_server(server_id="gauge-node") as srv:
        vllm = VllmServer(
            vllm_env,
            tiny_model,
            vllm_workdir / "gauge-server.log",
            connector_config(srv.config.listen.unix_socket),
            max_model_len=2048,
        )
        try:
            vllm.start()
            yield srv, vllm
        finally:
            vllm.stop()


def _gauge(vllm: VllmServer) -> tuple[int, float]:
    text = vllm.metrics()
    return text.count(GAUGE + "{"), metric_sum(text, GAUGE)


def test_the_engines_gauge_follows_its_node_cache_server(served: tuple[ServerProcess, VllmServer]) -> None:
    srv, vllm = served
    wait_until(lambda: _gauge(vllm) == (1, 1.0), timeout=60, what="one engine's gauge at 1")
    srv.kill()
    wait_until(lambda: _gauge(vllm) == (1, 0.0), timeout=60, what="0 once the server is killed")
    srv.start()
    wait_until(lambda: _gauge(vllm) == (1, 1.0), timeout=60, what="1 once it serves again")
