"""The operator's own metrics, scraped by a real Prometheus: a pod the webhook skips fires the alert.

The operator runs as a process with ``--metrics-addr`` (as the installed Deployment does on its
``metrics`` port); Prometheus evaluates the shipped alert rules with every ``for`` cut to 1 s.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.operator.conftest import OperatorProcess

from kvfabric.localcluster.testing import ClusterHandle, wait_for
from kvfabric.operator.opmetrics import SKIP_REASONS, parse_addr
from kvfabric.testing.opstools import OpsToolsError, prometheus_binaries
from kvfabric.testing.prometheus import PrometheusServer, Target, prometheus_server, rules_without_delay
from kvfabric.testing.serverproc import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "charts" / "kvfabric" / "files" / "monitoring"


def _samples(url: str) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        families = text_string_to_metric_families(resp.read().decode())
    return {
        (s.labels["result"], s.labels["reason"]): s.value
        for f in families
        for s in f.samples
        if s.name == "kvfabric_operator_webhook_pods_total"
    }


@pytest.fixture
def metered_operator(
    cluster: ClusterHandle, crd: None, operator: OperatorProcess, tmp_path: Path
) -> Iterator[tuple[OperatorProcess, int]]:
    """An operator serving its metrics on a free port (the session's one is stopped meanwhile)."""
    port = free_port()
    proc = OperatorProcess(cluster, tmp_path, extra_args=[f"--metrics-addr=127.0.0.1:{port}"])
    operator.stop()
    try:
        proc.start()
        yield proc, port
    finally:
        proc.stop()
        cluster.kubectl(
            "delete", "mutatingwebhookconfiguration", proc.config_name, "--ignore-not-found", check=False
        )
        operator.start()


@pytest.fixture
def prom(tmp_path: Path) -> Iterator[PrometheusServer]:
    try:
        prometheus_binaries()
    except OpsToolsError as exc:
        pytest.skip(str(exc))
    rules = rules_without_delay(MONITORING / "alerts.yaml", tmp_path / "alerts.yaml")
    with prometheus_server(job="kvfabric-operator", rule_files=[rules]) as server:
        yield server


def test_a_pod_the_webhook_skips_fires_the_injection_alert(
    cluster: ClusterHandle,
    namespace: str,
    metered_operator: tuple[OperatorProcess, int],
    prom: PrometheusServer,
) -> None:
    _, port = metered_operator
    url = f"http://127.0.0.1:{port}/metrics"
    # Every result and reason from 0, before any pod: a first skip is an increase Prometheus sees.
    assert _samples(url) == {("injected", ""): 0, ("error", ""): 0} | {
        ("skipped", r): 0 for r in SKIP_REASONS
    }
    prom.set_targets(
        [Target(f"127.0.0.1:{port}", {"namespace": "kvfabric-system", "pod": "kvfabric-operator-0"})]
    )
    wait_for(lambda: prom.targets_up() == {f"127.0.0.1:{port}": "up"}, timeout=60, message="operator scraped")
    wait_for(lambda: (prom.value('count_over_time(up{job="kvfabric-operator"}[1m])') or 0) > 3, timeout=60)
    assert prom.firing() == {}

    # A pod asking for a pool that does not exist: admitted unchanged, and counted.
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "consumer", "labels": {"kvfabric.io/pool": "no-such-pool"}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0"}]},
        },
        namespace=namespace,
    )
    pod = cluster.get_json("pod", "consumer", "-n", namespace)
    assert pod["metadata"]["annotations"]["kvfabric.io/skip-reason"] == "pool-not-found", json.dumps(
        pod["metadata"]
    )
    assert _samples(url)[("skipped", "pool-not-found")] == 1
    prom.wait_firing("KVFabricInjectionFailing", result="skipped", reason="pool-not-found")
    # The dashboard's panel on the operator has data.
    dashboard = json.loads((MONITORING / "dashboard.json").read_text())
    (expr,) = [
        t["expr"]
        for p in dashboard["panels"]
        for t in p.get("targets", [])
        if "kvfabric_operator_" in t["expr"]
    ]
    got = prom.query(expr.replace("$__rate_interval", "1m"))
    assert {(s["metric"]["result"], s["metric"].get("reason", "")) for s in got} >= {
        ("skipped", "pool-not-found")
    }


def test_a_bad_metrics_address_is_a_clear_error() -> None:
    assert parse_addr("0.0.0.0:8081") == ("0.0.0.0", 8081)
    assert parse_addr("[::1]:9000") == ("::1", 9000)
    for bad in ("8081", "host:", ":8081", "host:port", "host:70000"):
        with pytest.raises(ValueError, match="--metrics-addr"):
            parse_addr(bad)
