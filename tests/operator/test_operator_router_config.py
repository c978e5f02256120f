"""The router configuration a pool with routing events renders (``<pool>-router``), as pure functions.

The llm-d plugin types and parameter names asserted here were read from llm-d-router's source
(``deploy/config/epp-precise-prefix-cache-config.yaml``, the ``preciseprefixcache``, ``tokenizer``,
``endpointattribute`` and core-metrics-extractor plugins, ``pkg/kvevents/pool.go``,
``pkg/kvcache``): the test pins them so a rename here is a visible change.
"""

from __future__ import annotations

from typing import Any

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.operator.api.v1alpha1 import KVCachePool
from kvfabric.operator.render import names, render_children
from kvfabric.operator.render.router import (
    ANNOUNCED_TIERS,
    DYNAMO_KEY,
    EPP_KEY,
    TIER_WEIGHTS,
    epp_config,
    pod_cache_size,
)

# Plugin types llm-d-router registers (checked in its source) that the rendered configuration uses.
LLMD_TYPES = {
    "token-producer",
    "endpoint-notification-source",
    "metrics-data-source",
    "core-metrics-extractor",
    "single-profile-handler",
    "decode-filter",
    "endpoint-attribute-filter",
    "precise-prefix-cache-producer",
    "prefix-cache-scorer",
    "kv-cache-utilization-scorer",
    "queue-scorer",
    "max-score-picker",
}


def pool(routing: dict[str, Any] | None, *, subscribers: int | None = None) -> KVCachePool:
    spec: dict[str, Any] = {
        "image": {"repository": "example.com/kvfabric", "tag": "v1.2.3"},
        "tiers": {"memory": {"size": "8Gi"}},
    }
    if routing is not None:
        spec["consumers"] = {"routingEvents": routing}
    doc: dict[str, Any] = {"metadata": {"name": "pool-a", "namespace": "llm", "uid": "uid-1"}, "spec": spec}
    if subscribers is not None:
        doc["status"] = {"cache": {"routingSubscribers": subscribers, "routingNodes": 1}}
    return KVCachePool.model_validate(doc)


def router_configmap(p: KVCachePool) -> dict[str, Any] | None:
    found = [
        o
        for o in render_children(p).objects
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-router")
    ]
    assert len(found) <= 1
    return found[0] if found else None


def plugins(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Plugins by the name a reference uses (their name, else their type)."""
    return {p.get("name", p["type"]): p for p in config["plugins"]}


def test_a_pool_without_routing_events_renders_no_router_configuration() -> None:
    assert router_configmap(pool(None)) is None


def test_the_router_configmap_holds_llmds_config_for_the_pools_ports_and_model_and_dynamos_weights() -> None:
    cm = router_configmap(pool({"port": 6556, "replayPort": 6557, "modelName": "llama-8b"}, subscribers=7))
    assert cm is not None
    meta = cm["metadata"]
    assert (
        (meta["name"], meta["namespace"])
        == (names.router_configmap_name("pool-a"), "llm")
        == ("pool-a-router", "llm")
    )
    assert meta["ownerReferences"][0]["uid"] == "uid-1"
    assert meta["labels"][names.OWNER_POOL_LABEL] == "pool-a"
    assert set(cm["data"]) == {EPP_KEY, DYNAMO_KEY}
    text = cm["data"][EPP_KEY]
    assert text.startswith("# llm-d EndpointPickerConfig for KVCachePool llm/pool-a")
    config = yaml.safe_load(text)
    assert (config["apiVersion"], config["kind"]) == ("llm-d.ai/v1alpha1", "EndpointPickerConfig")
    by_name = plugins(config)
    assert by_name["token-producer"]["parameters"]["modelName"] == "llama-8b"
    producer = by_name["precise-prefix-cache-producer"]["parameters"]
    assert producer["kvEventsConfig"]["podDiscoveryConfig"] == {
        "podLabelSelector": "llm-d.ai/inference-serving=true",
        "socketPort": 6556,
        "replaySocketPort": 6557,  # replay on: without it llm-d runs no sequence checks
    }
    assert producer["kvEventsConfig"]["discoverPods"] is True
    indexer = producer["indexerConfig"]
    # Every announced tier has an explicit weight (llm-d weighs an unlisted tier 1.0, like a GPU hit).
    assert indexer["kvCacheBackendConfigs"] == [
        {"name": "gpu", "weight": 1.0},
        {"name": "cpu", "weight": 0.8},
        {"name": "storage", "weight": 0.43},
    ]
    assert indexer["kvBlockIndexConfig"]["inMemoryConfig"] == {"podCacheSize": 21}  # 7 engines x 3 tiers
    assert by_name["prefix-cache-scorer"]["parameters"] == {
        "prefixMatchInfoProducerName": "precise-prefix-cache-producer"
    }
    # A restarting node's engines are filtered out (kept when every candidate would go).
    gate = by_name["kvfabric-node-cache-serving"]
    assert gate["type"] == "endpoint-attribute-filter"
    assert gate["parameters"] == {
        "attribute": "kvfabric.node_cache_serving",
        "onMissing": "Pass",
        "fallbackOnEmpty": True,
        "algorithm": {"type": "threshold", "threshold": {"operator": "GreaterThanOrEqual", "value": 1}},
    }
    (vllm,) = by_name["core-metrics-extractor"]["parameters"]["engineConfigs"]
    assert vllm["customMetrics"] == [
        {"attributeKey": "kvfabric.node_cache_serving", "metricSpec": "vllm:kvfabric_node_cache_serving"}
    ]
    assert cm["data"][DYNAMO_KEY] == (
        "DYN_ROUTER_MODE=kv\nDYN_ROUTER_HOST_CACHE_HIT_WEIGHT=0.8\nDYN_ROUTER_DISK_CACHE_HIT_WEIGHT=0.43\n"
    )


def test_tier_weights_follow_the_measured_load_times() -> None:
    # DRAM keeps llm-d's host-memory weight; NVMe loses 2.87 times as much (106.6 ms against 37.1 ms
    # for a 16k-token hit, docs/performance.md), inside the 0.3-0.5 a router guide would start with.
    assert TIER_WEIGHTS == {"gpu": 1.0, "cpu": 0.8, "storage": 0.43}
    assert TIER_WEIGHTS["gpu"] > TIER_WEIGHTS["cpu"] > TIER_WEIGHTS["storage"] > 0
    assert tuple(TIER_WEIGHTS) == ANNOUNCED_TIERS


def test_before_any_engine_follows_the_index_keeps_llmds_default_per_key() -> None:
    cm = router_configmap(pool({}))
    assert cm is not None
    config = yaml.safe_load(cm["data"][EPP_KEY])
    producer = plugins(config)["precise-prefix-cache-producer"]["parameters"]
    assert producer["indexerConfig"]["kvBlockIndexConfig"]["inMemoryConfig"]["podCacheSize"] == 10
    assert producer["kvEventsConfig"]["podDiscoveryConfig"]["socketPort"] == 5556
    assert plugins(config)["token-producer"]["parameters"]["modelName"] == ""  # the header says to set it


@settings(deadline=None, max_examples=50)  # a shared machine: no timing, only the property
@given(
    port=st.integers(1024, 65535),
    replay=st.integers(1024, 65535),
    model=st.none() | st.from_regex(r"[A-Za-z0-9._/-]{1,40}", fullmatch=True),
    engines=st.integers(0, 10_000),
)
def test_every_reference_names_a_defined_plugin_and_the_index_holds_every_engine_in_every_tier(
    port: int, replay: int, model: str | None, engines: int
) -> None:
    config = epp_config(port=port, replay_port=replay, model_name=model, engines=engines)
    defined = plugins(config)
    assert len(defined) == len(config["plugins"])  # no two plugins under one name
    assert {p["type"] for p in config["plugins"]} <= LLMD_TYPES
    refs = [p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]]
    for source in config["dataLayer"]["sources"]:
        refs += [source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])]
    refs.append(defined["prefix-cache-scorer"]["parameters"]["prefixMatchInfoProducerName"])
    assert set(refs) <= set(defined)
    size = defined["precise-prefix-cache-producer"]["parameters"]["indexerConfig"]["kvBlockIndexConfig"]
    assert size["inMemoryConfig"]["podCacheSize"] == pod_cache_size(engines) >= len(ANNOUNCED_TIERS) * engines
    assert yaml.safe_load(yaml.safe_dump(config)) == config  # what the ConfigMap holds reads back the same
