"""Status is computed from observed children only; Ready means the current revision is ready everywhere."""

from __future__ import annotations

from typing import Any

from kvfabric.operator.api.v1alpha1 import KVCachePool
from kvfabric.operator.render import connection_settings, names
from kvfabric.operator.status import Observed, compute_status, consumer_counts, strip_times

NOW = "2026-11-30T12:00:00Z"
POOL = KVCachePool.model_validate(
    {
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"image": {"tag": "v1"}, "tiers": {"memory": {"size": "1Gi"}}},
    }
)
CONN = connection_settings(POOL)


def ds(
    *,
    desired: int = 3,
    ready: int = 3,
    updated: int = 3,
    available: int = 3,
    gen: int = 2,
    seen: int = 2,
    rev: str = "r1",
) -> dict[str, Any]:
    return {
        "metadata": {"generation": gen},
        "spec": {"template": {"metadata": {"annotations": {names.CONFIG_HASH_ANNOTATION: rev}}}},
        "status": {
            "observedGeneration": seen,
            "desiredNumberScheduled": desired,
            "numberReady": ready,
            "updatedNumberScheduled": updated,
            "numberAvailable": available,
            "numberUnavailable": desired - available,
        },
    }


def observe(**kw: Any) -> Observed:
    base: dict[str, Any] = {
        "generation": 4,
        "revision": "r1",
        "config_error": None,
        "daemonset": ds(),
        "claim_name": None,
        "claim": None,
        "consumer_pods": [],
        "connection": CONN,
        "injection_enabled": True,
        "metrics_service": "p-metrics",
    }
    base.update(kw)
    return Observed(**base)


def cond(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in status["conditions"] if c["type"] == ctype)
    return found


def test_all_ready() -> None:
    status, events = compute_status(observe(), NOW)
    assert cond(status, "Ready")["status"] == "True"
    assert cond(status, "Progressing")["status"] == "False"
    assert cond(status, "Degraded")["status"] == "False"
    assert status["observedGeneration"] == 4
    assert status["nodes"] == {"desired": 3, "ready": 3, "updated": 3, "available": 3}
    assert status["nodeSummary"] == "3/3"
    assert status["connection"]["socket"] == "/run/kvfabric/ns.p/cache.sock"
    assert {c["type"] for c in status["conditions"]} == {
        "Ready",
        "Progressing",
        "Degraded",
        "ConfigValid",
        "StorageReady",
        "InjectionReady",
    }
    assert all(c["observedGeneration"] == 4 and c["reason"] and c["message"] for c in status["conditions"])
    assert [e.reason for e in events] == ["PoolReady"]


def test_rollout_in_progress_is_not_ready_even_if_old_pods_are_ready() -> None:
    status, _ = compute_status(observe(daemonset=ds(updated=1, ready=3)), NOW)
    assert cond(status, "Ready")["status"] == "False"
    assert cond(status, "Progressing") | {"lastTransitionTime": None} == cond(status, "Progressing") | {
        "lastTransitionTime": None,
        "status": "True",
        "reason": "RollingOut",
    }


def test_unobserved_generation_is_progressing() -> None:
    status, _ = compute_status(observe(daemonset=ds(gen=3, seen=2)), NOW)
    assert cond(status, "Ready")["status"] == "False"
    assert cond(status, "Progressing")["reason"] == "RolloutPending"


def test_template_with_old_revision_is_not_ready() -> None:
    status, _ = compute_status(observe(daemonset=ds(rev="r0")), NOW)
    assert cond(status, "Ready")["status"] == "False"
    assert cond(status, "Progressing")["status"] == "True"


def test_no_nodes_is_not_ready() -> None:
    status, _ = compute_status(observe(daemonset=ds(desired=0, ready=0, updated=0, available=0)), NOW)
    assert cond(status, "Ready")["reason"] == "NoNodesSelected"


def test_unready_nodes_after_rollout_are_degraded() -> None:
    status, _ = compute_status(observe(daemonset=ds(ready=2, available=3)), NOW)
    assert cond(status, "Degraded")["status"] == "True"
    assert cond(status, "Ready")["status"] == "False"


def test_invalid_config() -> None:
    status, events = compute_status(observe(config_error="boom", revision=None), NOW)
    assert cond(status, "ConfigValid")["status"] == "False"
    assert cond(status, "Ready")["reason"] == "InvalidServerConfig"
    assert cond(status, "Degraded")["status"] == "True"
    assert "InvalidServerConfig" in [e.reason for e in events]


def test_storage() -> None:
    status, _ = compute_status(observe(claim_name="c", claim=None), NOW)
    assert cond(status, "StorageReady")["reason"] == "ClaimNotFound"
    assert cond(status, "Ready")["status"] == "False"
    status, _ = compute_status(observe(claim_name="c", claim={"status": {"phase": "Pending"}}), NOW)
    assert cond(status, "StorageReady")["reason"] == "ClaimPending"
    status, _ = compute_status(observe(claim_name="c", claim={"status": {"phase": "Bound"}}), NOW)
    assert cond(status, "StorageReady")["status"] == "True"
    assert cond(status, "Ready")["status"] == "True"


def test_transition_time_moves_only_on_flips() -> None:
    first, _ = compute_status(observe(), NOW)
    again, events = compute_status(observe(previous_status=first), "2026-11-30T13:00:00Z")
    assert cond(again, "Ready")["lastTransitionTime"] == NOW
    assert strip_times(first) == strip_times(again)
    assert events == []
    down, events = compute_status(
        observe(previous_status=first, daemonset=ds(ready=1)), "2026-11-30T13:00:00Z"
    )
    assert cond(down, "Ready")["lastTransitionTime"] == "2026-11-30T13:00:00Z"
    assert [e.reason for e in events] == ["PoolNotReady"]


def pod(hash_: str | None = None, skip: str | None = None, phase: str = "Running") -> dict[str, Any]:
    annotations: dict[str, str] = {}
    if hash_:
        annotations[names.CONFIG_HASH_ANNOTATION] = hash_
        annotations[names.INJECTED_ANNOTATION] = "{}"
    if skip:
        annotations[names.SKIP_REASON_ANNOTATION] = skip
    return {"metadata": {"annotations": annotations}, "status": {"phase": phase}}


def test_consumer_counts() -> None:
    pods = [pod("h1"), pod("h1"), pod("h0"), pod(skip="pool-not-found"), pod(), pod("h1", phase="Succeeded")]
    pods += [pod(skip="pod-security"), pod(skip="pod-security")]
    tcp = pod("h1")
    tcp["metadata"]["annotations"][names.INJECTED_ANNOTATION] = '{"pool":"ns/p","transport":"tcp"}'
    assert consumer_counts([*pods, tcp], "h1") == {
        "matched": 8,
        "injected": 3,
        "stale": 1,
        "skipped": 3,
        "skipped_by_reason": {"pool-not-found": 1, "pod-security": 2},
        "over_tcp": 1,
    }


def test_stale_consumers_are_reported() -> None:
    status, events = compute_status(observe(consumer_pods=[pod(CONN.config_hash), pod("old")]), NOW)
    assert status["consumers"] == {
        "matched": 2,
        "injected": 1,
        "stale": 1,
        "skipped": 0,
        "skippedByReason": {},
        "overTcp": 0,
    }
    assert "StaleConsumers" in [e.reason for e in events]


def test_a_hand_edited_injected_annotation_counts_as_injected_not_over_tcp() -> None:
    odd = pod("h1")
    odd["metadata"]["annotations"][names.INJECTED_ANNOTATION] = 'not json, "transport":"tcp"'
    counts = consumer_counts([odd], "h1")
    assert (counts["injected"], counts["over_tcp"]) == (1, 0)


def test_routing_events_condition_says_whether_engines_announce_the_pools_tiers() -> None:
    import dataclasses

    from kvfabric.operator.api.v1alpha1 import CacheInsight
    from kvfabric.operator.routingevents import RoutingEventsSettings

    routed = dataclasses.replace(CONN, routing_events=RoutingEventsSettings())
    assert "RoutingEvents" not in {c["type"] for c in compute_status(observe(), NOW)[0]["conditions"]}
    status, _ = compute_status(observe(connection=routed), NOW)
    assert cond(status, "RoutingEvents")["status"] == "Unknown"
    quiet = CacheInsight(scraped_at=NOW, nodes_scraped=3)
    status, _ = compute_status(observe(connection=routed, cache=quiet), NOW)
    assert (cond(status, "RoutingEvents")["status"], cond(status, "RoutingEvents")["reason"]) == (
        "False",
        "NoEngineFollows",
    )
    flowing = CacheInsight(scraped_at=NOW, nodes_scraped=3, routing_subscribers=4, routing_nodes=2)
    status, _ = compute_status(observe(connection=routed, cache=flowing), NOW)
    assert cond(status, "RoutingEvents")["status"] == "True"
    assert "4 engines on 2/3 nodes" in cond(status, "RoutingEvents")["message"]
