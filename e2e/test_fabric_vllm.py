"""Real vLLM in the whole fabric: injected by the webhook, run by the pod runner, served across nodes.

Two replicas of vLLM's OpenAI server (the pinned CPU build ``scripts/vllm-env.sh`` makes, with a
random-weight tiny Llama generated here) run as an ordinary inference Deployment on the two GPU
nodes. Nothing in its manifest is kvfabric's but the pool label: the webhook adds
``--kv-transfer-config``, the node's socket and the pool's settings. A prompt answered on node a
is then a hit from the shared tier on node b, with identical tokens, and vLLM's own metrics on node
b count the loaded tokens and the tier they came from.

The pod runner cannot run an image's entrypoint, so the connector payload's init container is
turned off (``kvfabric.io/inject-payload: "false"``) and the pods import kvfabric from this
checkout, as an engine image with kvfabric installed would (the payload image itself is run by a
real kubelet in ``test_real_kubelet.py``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfabric.demo.fabric import Fabric, wait_pool_ready
from kvfabric.demo.workloads import one_per_gpu_node, pool_manifest, ready_pods
from kvfabric.localcluster.testing import wait_for
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

pytestmark = pytest.mark.vllm

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
    wait_for(
        lambda: _shared_blocks_indexed(fabric, ns, b["spec"]["nodeName"]) >= 3,
        timeout=60,
        message="node b's cache server to index the 3 blocks node a wrote",
    )
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
