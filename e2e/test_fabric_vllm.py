"""Real vLLM in the whole fabric: injected by the webhook, run by the pod runner, served across nodes.

Two replicas of vLLM's OpenAI server (the pinned CPU build ``scripts/vllm-env.sh`` makes, with a
random-weight tiny Llama generated here) run as an ordinary inference Deployment on the two GPU
nodes. Nothing in its manifest is kvfabric's but the pool label: the webhook adds
``--kv-transfer-config``, the node's socket and the pool's settings. A prompt answered on node a
is then a hit from the shared tier on node b, with identical tokens, and vLLM's own metrics on node
b count the loaded tokens and the tier they came from. A real Prometheus scrapes both engines and
both cache servers: the dashboard's engine panels have data, and the engines' alert fires when the
blocks an engine was promised are corrupt (its answer still the computed one).

The pod runner cannot run an image's entrypoint, so the connector payload's init container is
turned off (``kvfabric.io/inject-payload: "false"``) and the pods import kvfabric from this
checkout, as an engine image with kvfabric installed would (the payload image itself is run by a
real kubelet in ``test_real_kubelet.py``).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from kvfabric.demo.fabric import Fabric, wait_pool_ready
from kvfabric.demo.podproxy import pod_proxy
from kvfabric.demo.workloads import one_per_gpu_node, pool_manifest, ready_pods
from kvfabric.localcluster.testing import wait_for
from kvfabric.testing.opstools import prometheus_binaries
from kvfabric.testing.prometheus import (
    dashboard_queries,
    grafana_expr,
    has_data,
    prometheus_server,
    rules_without_delay,
)
from kvfabric.testing.vllmenv import (
    OPENAI_SERVER_MODULE,
    Completion,
    VllmEnv,
    completion_request,
    find_env,
    make_tiny_model,
    metric_sum,
    openai_server_args,
    skip_reason,
)

# Two vLLM servers start in the module's fixture (one to two minutes each here): past the default 180 s.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MONITORING = Path(__file__).resolve().parents[1] / "charts" / "kvfabric" / "files" / "monitoring"
# The dashboard's token-rate panels: data there must be a positive rate, not a zero.
POSITIVE = frozenset({"Prompt tokens loaded instead of computed", "Tokens that failed to load"})
POOL = "pool-vllm"
CHUNK = 256  # a multiple of the CPU backend's 128-token KV block
BLOCK = 128
PORT = 8000
APP = "vllm"


def vllm_deployment(env: VllmEnv, model: Path) -> dict[str, Any]:
    """vLLM's OpenAI server as a two-replica inference Deployment that opts in to the pool."""
    labels = {"app": APP}
    # The environment a vLLM child gets in the real-vLLM tests, minus what the pod runner sets.
    wanted = (
        "PYTHONPATH",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "VLLM_NO_USAGE_STATS",
        "DO_NOT_TRACK",
        "VLLM_CPU_NUM_OF_RESERVED_CPU",
        "VLLM_CPU_KVCACHE_SPACE",
        "TOKENIZERS_PARALLELISM",
    )
    environ = env.environ()
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": APP},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {
                    "labels": {**labels, "kvfabric.io/pool": POOL},
                    "annotations": {"kvfabric.io/inject-payload": "false"},
                },
                "spec": {
                    "terminationGracePeriodSeconds": 10,
                    **one_per_gpu_node(labels),
                    "containers": [
                        {
                            "name": "vllm",
                            "image": "vllm/vllm-openai-cpu:v0.32.0",
                            "command": [str(env.python), "-m", OPENAI_SERVER_MODULE],
                            "args": openai_server_args(model, PORT, 2048),
                            "env": [{"name": k, "value": environ[k]} for k in wanted if k in environ],
                            "ports": [{"name": "http", "containerPort": PORT}],
                            "readinessProbe": {
                                "httpGet": {"path": "/health", "port": "http"},
                                "periodSeconds": 2,
                            },
                            "resources": {"limits": {"nvidia.com/gpu": "1"}},
                        }
                    ],
                },
            },
        },
    }


@pytest.fixture(scope="module")
def vllm_fabric(fabric: Fabric, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fabric, str]]:
    env = find_env()
    if env is None:
        pytest.skip(skip_reason())
    if fabric.runner_base is None:
        pytest.skip("the vLLM environment is on this host: the pods must be run by the pod runner here")
    model = make_tiny_model(env, tmp_path_factory.mktemp("vllm-model") / "tiny-llama")
    with fabric.cluster.namespace("e2e-vllm") as ns:
        fabric.cluster.apply(pool_manifest(POOL, chunk_tokens=CHUNK), namespace=ns)
        wait_pool_ready(fabric.cluster, ns, POOL)
        fabric.cluster.apply(vllm_deployment(env, model), namespace=ns)
        wait_for(
            lambda: len(ready_pods(fabric.cluster, ns, f"app={APP}")) == 2,
            timeout=600,
            message="two ready vLLM servers (start-up takes one to two minutes each here)",
        )
        yield fabric, ns


def _complete(fabric: Fabric, pod: dict[str, Any], prompt: list[int], max_tokens: int) -> Completion:
    """A greedy completion through the pod's network namespace."""
    body = json.dumps(completion_request(prompt, max_tokens))
    status, text = fabric.request(pod, PORT, "/v1/completions", data=body, timeout=300)
    assert status == 200, f"vLLM on {pod['spec']['nodeName']} answered {status}: {text[:1000]}"
    return Completion.parse(json.loads(text))


def _metrics(fabric: Fabric, pod: dict[str, Any]) -> str:
    status, text = fabric.request(pod, PORT, "/metrics")
    assert status == 200, text[:500]
    return text


def _shared_blocks_indexed(fabric: Fabric, ns: str, node: str) -> float:
    """Blocks of the shared tier that ``node``'s cache server has indexed (its own metrics)."""
    selector = f"app.kubernetes.io/name=kvfabric-cache,app.kubernetes.io/instance={POOL}"
    (pod,) = [p for p in ready_pods(fabric.cluster, ns, selector) if p["spec"]["nodeName"] == node]
    ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    status, text = fabric.request(pod, ports["metrics"], "/metrics")
    assert status == 200, text[:500]
    return metric_sum(text, "kvfabric_tier_blocks", tier="shared")


def test_real_vllm_injected_by_the_webhook_hits_the_shared_tier_on_the_other_node(
    vllm_fabric: tuple[Fabric, str],
) -> None:
    fabric, ns = vllm_fabric
    pods = {p["spec"]["nodeName"]: p for p in ready_pods(fabric.cluster, ns, f"app={APP}")}
    a, b = (pods[n] for n in fabric.gpu_nodes[:2])
    for pod in (a, b):
        container = pod["spec"]["containers"][0]
        assert "--kv-transfer-config" in container["args"], "the webhook wired the connector in"
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env["KVFABRIC_CHUNK_TOKENS"] == str(CHUNK)
    rng = random.Random(11)
    prompt = [rng.randrange(3, 8192) for _ in range(700)]
    cold = _complete(fabric, a, prompt, 16)
    assert cold.cached_tokens == 0
    # Round 1 computed the KV of 715 tokens: two chunks and one 128-token tail block, written back to
    # the shared volume by node a's server; node b's server learns them from a's journal. Asked once
    # only when it has: a retry would be a hit in node b's own vLLM prefix cache, not kvfabric's.
    _wait_indexed_on_b(fabric, ns, a, b, 3)
    loaded0 = metric_sum(_metrics(fabric, b), "vllm:kvfabric_loaded_tokens")
    warm = _complete(fabric, b, prompt, 16)
    assert warm.tokens == cold.tokens, "KV loaded from the other node gives the tokens computing it gave"
    hit = 2 * CHUNK + BLOCK  # the last prompt token is always computed: 640 of 700
    assert warm.cached_tokens == hit
    # vLLM's front end publishes the engine's stats every few seconds.
    text = wait_for(
        lambda: (t := _metrics(fabric, b)) and metric_sum(t, "vllm:kvfabric_loaded_tokens") > loaded0 and t,
        timeout=60,
        message="kvfabric's loaded tokens in vLLM's /metrics",
    )
    assert metric_sum(text, "vllm:kvfabric_loaded_tokens") - loaded0 == hit
    # vLLM's own per-source counter names the tier: the shared volume is a disk.
    assert metric_sum(text, "vllm:prompt_tokens_cached_by_source", source="disk") >= hit


def _cache_server(fabric: Fabric, ns: str, node: str) -> dict[str, Any]:
    selector = f"app.kubernetes.io/name=kvfabric-cache,app.kubernetes.io/instance={POOL}"
    (pod,) = [p for p in ready_pods(fabric.cluster, ns, selector) if p["spec"]["nodeName"] == node]
    return pod


def _metrics_port(pod: dict[str, Any]) -> int:
    return int(
        next(
            p["containerPort"]
            for c in pod["spec"]["containers"]
            for p in c.get("ports", [])
            if p["name"] == "metrics"
        )
    )


def _shared_volume(fabric: Fabric, ns: str) -> Path:
    """The host directory of the pool's shared volume (where the pod runner keeps its claim's files)."""
    assert fabric.runner_base is not None
    (claim,) = fabric.cluster.get_json("pvc", "-n", ns)["items"]
    return fabric.runner_base / "shared" / "pvc" / ns / str(claim["metadata"]["name"])


def _wait_indexed_on_b(
    fabric: Fabric, ns: str, a: dict[str, Any], b: dict[str, Any], at_least: float
) -> None:
    """Wait until node b's server indexes ``at_least`` shared blocks (else say what each node holds)."""
    try:
        wait_for(
            lambda: _shared_blocks_indexed(fabric, ns, b["spec"]["nodeName"]) >= at_least,
            timeout=120,
            message=f"node b's cache server to index {at_least:.0f} shared blocks",
        )
    except AssertionError as exc:
        tiers = {}
        for pod in (a, b):
            server = _cache_server(fabric, ns, pod["spec"]["nodeName"])
            _status, text = fabric.request(server, _metrics_port(server), "/metrics")
            tiers[pod["spec"]["nodeName"]] = {
                tier: metric_sum(text, "kvfabric_tier_blocks", tier=tier)
                for tier in ("dram", "local_disk", "shared")
            }
        raise AssertionError(f"{exc}; blocks per node and tier: {tiers}") from None


def _counted_more_than(fabric: Fabric, engine: dict[str, Any], failed: float) -> bool:
    return metric_sum(_metrics(fabric, engine), "vllm:kvfabric_load_failed_tokens") > failed


def _flip_a_byte_of_blocks_written_since(root: Path, since: float) -> int:
    """Corrupt every block file under ``root`` written after ``since`` (one byte near its end)."""
    flipped = 0
    for path in root.rglob("*.blk"):
        if path.stat().st_mtime > since:
            with path.open("r+b") as f:
                f.seek(-100, 2)
                byte = f.read(1)
                f.seek(-100, 2)
                f.write(bytes([byte[0] ^ 0xFF]))
            flipped += 1
    return flipped


def test_prometheus_scrapes_the_engines_and_the_dashboards_engine_panels_have_data(
    vllm_fabric: tuple[Fabric, str], tmp_path: Path
) -> None:
    """A real Prometheus scrapes both vLLM engines and both cache servers of the pool.

    Each labelled as a PodMonitor labels it (the engines under job ``vllm``, as a user's own monitor of
    vLLM would), through :class:`~kvfabric.demo.podproxy.PodProxy` (the pods' network namespaces are
    not the host's). A prompt node b loads from the shared tier gives the engine panels their loaded
    tokens and GPU-seconds saved; a prompt whose blocks are corrupted on the shared volume before node
    b asks for them gives the failed-load panel its data and fires ``KVFabricLoadsFailing`` (its ``for``
    cut to 1 s), while node b's answer stays the one computed on node a.
    """
    try:
        prometheus_binaries()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    fabric, ns = vllm_fabric
    pods = {p["spec"]["nodeName"]: p for p in ready_pods(fabric.cluster, ns, f"app={APP}")}
    a, b = (pods[n] for n in fabric.gpu_nodes[:2])
    rules = rules_without_delay(MONITORING / "alerts.yaml", tmp_path / "alerts.yaml")
    engine_panels = [(t, e) for t, e in dashboard_queries(MONITORING / "dashboard.json") if "vllm:" in e]
    assert len(engine_panels) == 3, engine_panels
    with pod_proxy(fabric) as proxy, prometheus_server(rule_files=[rules], interval="2s") as prom:
        targets = [
            proxy.target(p, PORT, {"job": "vllm", "namespace": ns, "pod": p["metadata"]["name"]})
            for p in (a, b)
        ]
        for node in fabric.gpu_nodes[:2]:
            server = _cache_server(fabric, ns, node)
            labels = {
                "job": "kvfabric-cache",
                "namespace": ns,
                "pool": POOL,
                "node": node,
                "pod": server["metadata"]["name"],
            }
            targets.append(proxy.target(server, _metrics_port(server), labels))
        prom.set_targets(targets)
        wait_for(
            lambda: sorted(prom.targets_up().values()) == ["up"] * 4,
            timeout=60,
            message="the four targets up",
        )
        with_data: set[str] = set()

        def panels_with_data() -> set[str]:
            """Engine panels that have shown a number (a positive one, for the two token rates)."""
            for title, expr in engine_panels:
                got = prom.query(grafana_expr(expr))
                if has_data(got) and (title not in POSITIVE or any(float(v["value"][1]) > 0 for v in got)):
                    with_data.add(title)
            return with_data

        rng = random.Random(12)
        b_node = b["spec"]["nodeName"]
        # Hits: node a computes a prompt, node b loads it from the shared tier. Twice: a counter series
        # a scrape sees for the first time has no rate yet (Prometheus does not assume it began at 0).
        for _ in range(2):
            prompt = [rng.randrange(3, 8192) for _ in range(700)]
            indexed = _shared_blocks_indexed(fabric, ns, b_node)
            cold = _complete(fabric, a, prompt, 4)
            _wait_indexed_on_b(fabric, ns, a, b, indexed + 3)
            warm = _complete(fabric, b, prompt, 4)
            assert warm.tokens == cold.tokens
            assert warm.cached_tokens == 2 * CHUNK + BLOCK
        wait_for(
            lambda: (
                {"Prompt tokens loaded instead of computed", "GPU-seconds saved (estimate)"}
                <= panels_with_data()
            ),
            timeout=90,
            message="the loaded tokens and the GPU-seconds saved in Prometheus",
        )

        # Failed loads: the blocks node b's server indexed are corrupt on the shared volume when it
        # reads them; node b recomputes, and counts why. Twice, for the same reason as above: the
        # connector's failed-load counter has a series per reason only from that reason's first failure.
        for _ in range(2):
            prompt = [rng.randrange(3, 8192) for _ in range(700)]
            indexed = _shared_blocks_indexed(fabric, ns, b_node)
            since = time.time()
            cold = _complete(fabric, a, prompt, 4)
            _wait_indexed_on_b(fabric, ns, a, b, indexed + 3)
            assert _flip_a_byte_of_blocks_written_since(_shared_volume(fabric, ns), since) == 3
            failed = metric_sum(_metrics(fabric, b), "vllm:kvfabric_load_failed_tokens")
            recomputed = _complete(fabric, b, prompt, 4)
            assert recomputed.tokens == cold.tokens, "a corrupt block is a miss, never a wrong answer"
            wait_for(
                partial(_counted_more_than, fabric, b, failed),
                timeout=60,
                message="node b's engine to count the tokens it could not load",
            )
        wait_for(
            lambda: "Tokens that failed to load" in panels_with_data(),
            timeout=90,
            message="the failed loads in Prometheus",
        )
        prom.wait_firing("KVFabricLoadsFailing", timeout=90, namespace=ns, pod=b["metadata"]["name"])
        assert not prom.is_firing("KVFabricLoadsFailing", pod=a["metadata"]["name"])
    assert with_data == {t for t, _ in engine_panels}
