"""The router configuration a pool with routing events renders: llm-d's EPP config, Dynamo's settings.

A pool with ``spec.consumers.routingEvents`` owns the ConfigMap ``<pool>-router``. Its
``epp-config.yaml`` is a complete llm-d ``EndpointPickerConfig`` (llm-d router v0.10 field names,
checked against llm-d-router's source): a ``token-producer`` that renders prompts with vLLM, the
``precise-prefix-cache-producer`` dialling every engine's KV-event publisher and replay socket on the
pool's ports, the ``prefix-cache-scorer`` reading it, tier weights for the tiers kvfabric announces,
an index sized to engines x tiers, and an ``endpoint-attribute-filter`` on the engines'
``vllm:kvfabric_node_cache_serving`` gauge that steers new requests around a node whose cache
server is restarting. ``dynamo-frontend.env`` holds the same weights for Dynamo's frontend.

Pure: the pool in, the ConfigMap out. docs/routing.md ("Point llm-d at a pool") shows the result.
"""

from __future__ import annotations

from typing import Any, Final

import yaml

from kvfabric.operator.api.v1alpha1 import KVCachePool

__all__ = [
    "ANNOUNCED_TIERS",
    "DYNAMO_KEY",
    "EPP_KEY",
    "TIER_WEIGHTS",
    "dynamo_env",
    "epp_config",
    "pod_cache_size",
    "router_data",
]

EPP_KEY: Final = "epp-config.yaml"
DYNAMO_KEY: Final = "dynamo-frontend.env"
SERVING_ATTRIBUTE: Final = "kvfabric.node_cache_serving"
SERVING_METRIC: Final = "vllm:kvfabric_node_cache_serving"
ANNOUNCED_TIERS: Final = ("gpu", "cpu", "storage")
"""The tiers an engine's KV events name: its own GPU blocks, its node's DRAM (``CPU``) and local
NVMe (``STORAGE``, locality ``LOCAL``). The shared volume and the object store are not announced."""

# What a hit in each tier is worth, per block, against a GPU hit (1.0): the share of the recompute it
# saves. The node's DRAM keeps llm-d's own weight for host memory (0.8). Local NVMe loses more, in
# proportion to its load time: in docs/performance.md ("Measured in the connector", 2026-12,
# `kvfabric bench ttft --quick`, three runs) a 16k-token hit took a median 106.6 ms from local disk
# against 37.1 ms from DRAM, 2.87 times as long, so NVMe keeps 1 - 0.2 x 2.87 = 0.43. An unlisted
# tier would be weighed 1.0 by llm-d (as much as a GPU hit).
_DRAM_WEIGHT: Final = 0.8
_DISK_OVER_DRAM_LOAD: Final = 106.6 / 37.1
TIER_WEIGHTS: Final = {
    "gpu": 1.0,
    "cpu": _DRAM_WEIGHT,
    "storage": round(1.0 - (1.0 - _DRAM_WEIGHT) * _DISK_OVER_DRAM_LOAD, 2),
}
# llm-d's default number of (endpoint, tier) entries per block key; the floor of the sizing below.
_LLMD_DEFAULT_POD_CACHE_SIZE: Final = 10
# vLLM's default block size, and llm-d's default: the EPP's keys match the engine's blocks one to one.
_BLOCK_SIZE_TOKENS: Final = 16


def pod_cache_size(engines: int) -> int:
    """Entries the index keeps per block key: every engine of the pool in every announced tier.

    A prefix every engine holds in every tier has engines x tiers entries; fewer would make llm-d
    forget some of them (its LRU per key), and the router would stop crediting those engines.
    """
    return max(_LLMD_DEFAULT_POD_CACHE_SIZE, len(ANNOUNCED_TIERS) * max(engines, 1))


def epp_config(*, port: int, replay_port: int, model_name: str | None, engines: int) -> dict[str, Any]:
    """llm-d's ``EndpointPickerConfig`` for engines publishing on ``port`` (replay on ``replay_port``)."""
    return {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {
                "type": "token-producer",
                "parameters": {"modelName": model_name or "", "vllm": {"url": "http://localhost:8000"}},
            },
            {"type": "endpoint-notification-source"},
            {"type": "metrics-data-source"},
            {
                "type": "core-metrics-extractor",
                "parameters": {
                    # Defining "vllm" replaces llm-d's built-in mapping: its five specs are repeated.
                    "engineConfigs": [
                        {
                            "name": "vllm",
                            "queuedRequestsSpec": "vllm:num_requests_waiting",
                            "runningRequestsSpec": "vllm:num_requests_running",
                            "kvUsageSpec": "vllm:kv_cache_usage_perc",
                            "loraSpec": "vllm:lora_requests_info",
                            "cacheInfoSpec": "vllm:cache_config_info",
                            "customMetrics": [
                                {"attributeKey": SERVING_ATTRIBUTE, "metricSpec": SERVING_METRIC}
                            ],
                        }
                    ]
                },
            },
            {"type": "single-profile-handler"},
            {"type": "decode-filter"},
            {
                "type": "endpoint-attribute-filter",
                "name": "kvfabric-node-cache-serving",
                "parameters": {
                    "attribute": SERVING_ATTRIBUTE,
                    "onMissing": "Pass",  # engines without the gauge (no kvfabric) stay candidates
                    "fallbackOnEmpty": True,  # every node restarting: route anyway, engines recompute
                    "algorithm": {
                        "type": "threshold",
                        "threshold": {"operator": "GreaterThanOrEqual", "value": 1},
                    },
                },
            },
            {
                "type": "precise-prefix-cache-producer",
                "parameters": {
                    "tokenProcessorConfig": {"blockSizeTokens": _BLOCK_SIZE_TOKENS},
                    "kvEventsConfig": {
                        "topicFilter": "kv@",
                        "discoverPods": True,
                        "podDiscoveryConfig": {
                            "podLabelSelector": "llm-d.ai/inference-serving=true",
                            "socketPort": port,
                            "replaySocketPort": replay_port,
                        },
                    },
                    "indexerConfig": {
                        "kvBlockIndexConfig": {"inMemoryConfig": {"podCacheSize": pod_cache_size(engines)}},
                        "kvCacheBackendConfigs": [
                            {"name": t, "weight": TIER_WEIGHTS[t]} for t in ANNOUNCED_TIERS
                        ],
                    },
                },
            },
            {
                "type": "prefix-cache-scorer",
                "parameters": {"prefixMatchInfoProducerName": "precise-prefix-cache-producer"},
            },
            {"type": "kv-cache-utilization-scorer"},
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
        ],
        "dataLayer": {
            "sources": [
                {"pluginRef": "metrics-data-source", "extractors": [{"pluginRef": "core-metrics-extractor"}]},
                {
                    "pluginRef": "endpoint-notification-source",
                    "extractors": [{"pluginRef": "precise-prefix-cache-producer"}],
                },
            ]
        },
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "decode-filter"},
                    {"pluginRef": "kvfabric-node-cache-serving"},
                    {"pluginRef": "prefix-cache-scorer", "weight": 2.0},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 1.0},
                    {"pluginRef": "queue-scorer", "weight": 1.0},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }


def dynamo_env() -> str:
    """Dynamo's frontend settings with the same tier weights (``CPU`` is host, ``STORAGE`` disk)."""
    return (
        "DYN_ROUTER_MODE=kv\n"
        f"DYN_ROUTER_HOST_CACHE_HIT_WEIGHT={TIER_WEIGHTS['cpu']}\n"
        f"DYN_ROUTER_DISK_CACHE_HIT_WEIGHT={TIER_WEIGHTS['storage']}\n"
    )


def _header(pool: KVCachePool, engines: int, model_name: str | None) -> str:
    model = (
        "# token-producer's modelName is spec.consumers.routingEvents.modelName.\n"
        if model_name
        else "# Set token-producer's modelName: the pool has no spec.consumers.routingEvents.modelName.\n"
    )
    return (
        f"# llm-d EndpointPickerConfig for KVCachePool {pool.namespace}/{pool.name}, rendered by kvfabric.\n"
        + model
        + "# Check token-producer's vllm.url: a vLLM serving the model, for /v1/completions/render.\n"
        f"# Tier weights: gpu 1.0, cpu {TIER_WEIGHTS['cpu']} (llm-d's), storage {TIER_WEIGHTS['storage']}"
        " (local NVMe, from load times measured in kvfabric's docs/performance.md).\n"
        f"# podCacheSize: {len(ANNOUNCED_TIERS)} tiers x {engines} engines following the pool's cache"
        " servers (status.cache.routingSubscribers), at least llm-d's default of 10.\n"
    )


def router_data(pool: KVCachePool) -> dict[str, str] | None:
    """The data of the ConfigMap ``<pool>-router``; None for a pool without routing events."""
    events = pool.spec.consumers.routing_events
    if events is None:
        return None
    cache = pool.status.cache if pool.status is not None else None
    engines = cache.routing_subscribers if cache is not None else 0
    config = epp_config(
        port=events.port, replay_port=events.replay_port, model_name=events.model_name, engines=engines
    )
    text = _header(pool, engines, events.model_name) + yaml.safe_dump(config, sort_keys=False)
    return {EPP_KEY: text, DYNAMO_KEY: dynamo_env()}
