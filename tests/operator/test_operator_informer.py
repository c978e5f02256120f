"""Informer caches: paginated list, watch, relist on 410, indexes; the reader answers from them."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.operator.cacheinsight import scrape_targets
from kvfabric.operator.controller import Controller
from kvfabric.operator.informer import CachedReader, Informer, parse_selector
from kvfabric.operator.kube import ApiError, KubeClient
from kvfabric.operator.podhealth import diagnose, server_pod_view
from kvfabric.operator.status import consumer_counts, consumer_view


def pod(name: str, pool: str, ns: str = "ns", rv: str = "1") -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {"kvfabric.io/pool": pool},
            "resourceVersion": rv,
        }
    }


class FakeApi:
    """Pages of a list, then scripted watch streams; records every request."""

    def __init__(self, items: list[dict[str, Any]], streams: list[list[dict[str, Any]]]) -> None:
        self.items = items
        self.streams = streams
        self.lists = 0
        self.watches: list[dict[str, str]] = []
        self.fallback_lists = 0
        self.done = asyncio.Event()

    async def list_page(self, kind: str, namespace: str | None, params: dict[str, str]) -> dict[str, Any]:
        self.lists += 1
        start = int(params.get("continue", "0"))
        page = self.items[start : start + 2]
        more = start + 2 < len(self.items)
        return {
            "items": page,
            "metadata": {"resourceVersion": "10", **({"continue": str(start + 2)} if more else {})},
        }

    async def watch(
        self, kind: str, namespace: str | None, params: dict[str, str]
    ) -> AsyncIterator[dict[str, Any]]:
        self.watches.append(params)
        if not self.streams:
            self.done.set()
            await asyncio.Event().wait()
        for event in self.streams.pop(0):
            if event.get("raise") == 410:
                raise ApiError(410, "gone", method="WATCH", path="pods")
            yield event

    async def list(self, kind: str, namespace: str | None = None, **kw: Any) -> list[dict[str, Any]]:
        self.fallback_lists += 1
        return []

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return None


async def run_until_idle(informer: Informer, api: FakeApi) -> None:
    task = asyncio.ensure_future(informer.run())
    await asyncio.wait_for(api.done.wait(), 5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.mark.asyncio
async def test_list_pages_watch_and_index() -> None:
    api = FakeApi(
        [pod("a", "p1"), pod("b", "p1"), pod("c", "p2")],
        [
            [
                {"type": "ADDED", "object": pod("d", "p2", rv="11")},
                {"type": "MODIFIED", "object": pod("a", "p2", rv="12")},  # relabelled to another pool
                {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "13"}}},
                {"type": "DELETED", "object": pod("b", "p1", rv="14")},
            ]
        ],
    )
    changed: list[str] = []
    informer = Informer(
        api,  # type: ignore[arg-type]
        "Pod",
        label_selector="kvfabric.io/pool",
        index_label="kvfabric.io/pool",
        on_change=lambda o: changed.append(o["metadata"]["name"]),
    )
    await run_until_idle(informer, api)
    assert api.lists == 2  # two pages
    assert api.watches[0]["resourceVersion"] == "10"
    assert api.watches[1]["resourceVersion"] == "14"  # resumes after the last event (bookmarks count)
    assert sorted(o["metadata"]["name"] for o in informer.by_index("p2")) == ["a", "c", "d"]
    assert informer.by_index("p1") == []
    assert changed == ["a", "b", "c", "d", "a", "b"]


@pytest.mark.asyncio
async def test_expired_watch_relists_and_drops_vanished_objects() -> None:
    api = FakeApi([pod("a", "p1"), pod("b", "p1")], [[{"raise": 410}]])
    informer = Informer(api, "Pod", label_selector="kvfabric.io/pool", index_label="kvfabric.io/pool")  # type: ignore[arg-type]
    task = asyncio.ensure_future(informer.run())
    await asyncio.wait_for(informer.synced.wait(), 5)
    api.items = [pod("b", "p1", rv="20")]  # "a" was deleted while the watch was down
    await asyncio.wait_for(api.done.wait(), 10)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert informer.relists == 2
    assert [o["metadata"]["name"] for o in informer.by_index("p1")] == ["b"]


@pytest.mark.asyncio
async def test_reader_uses_the_index_only_for_covered_selectors() -> None:
    api = FakeApi([pod("a", "p1"), pod("x", "p1", ns="other")], [])
    informer = Informer(api, "Pod", label_selector="kvfabric.io/pool", index_label="kvfabric.io/pool")  # type: ignore[arg-type]
    reader = CachedReader(api, [informer])  # type: ignore[arg-type]
    # Not synced yet: the API server answers.
    await reader.list("Pod", None, label_selector="kvfabric.io/pool=p1")
    assert api.fallback_lists == 1
    await run_until_idle(informer, api)
    informer.synced.set()
    got = await reader.list("Pod", None, label_selector="kvfabric.io/pool=p1")
    assert sorted(o["metadata"]["name"] for o in got) == ["a", "x"]
    assert [
        o["metadata"]["name"] for o in await reader.list("Pod", "ns", label_selector="kvfabric.io/pool=p1")
    ] == ["a"]
    assert api.fallback_lists == 1
    # Another label, a set-based selector or a field selector are not covered by this cache.
    await reader.list("Pod", "ns", label_selector="app=x")
    await reader.list("Pod", "ns", label_selector="kvfabric.io/pool in (p1)")
    await reader.list("Pod", "ns", label_selector="kvfabric.io/pool=p1", field_selector="spec.nodeName=n")
    assert api.fallback_lists == 4
    assert await reader.get("Pod", "ns", "a") is not None


def test_parse_selector() -> None:
    assert parse_selector("a=b,c") == ({"a": "b"}, {"c"})
    assert parse_selector("a!=b") is None
    assert parse_selector("a in (b)") is None
    assert parse_selector("") == ({}, set())


def full_pod(i: int, pool: str = "p1") -> dict[str, Any]:
    """A consumer pod as the API server sends it: managed fields, a spec and a status full of lists."""
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"c-{i}",
            "namespace": "ns",
            "uid": f"uid-{i}",
            "resourceVersion": str(100 + i),
            "labels": {"kvfabric.io/pool": pool, "app": "engine"},
            "annotations": {"kvfabric.io/config-hash": "abc", "kvfabric.io/injected": '{"pool":"ns/p1"}'},
            "ownerReferences": [{"kind": "ReplicaSet", "name": "rs", "uid": "u", "controller": True}],
            "managedFields": [
                {"manager": m, "fieldsV1": {"f:metadata": {"f:labels": {".": {}, "f:app": {}}}}}
                for m in ("kubectl", "kvfabric-operator", "kwok")
            ],
        },
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai",
                    "env": [{"name": f"KVFABRIC_{k}", "value": "v"} for k in range(12)],
                    "volumeMounts": [{"name": "kvfabric-run", "mountPath": "/run/kvfabric"}],
                }
            ],
            "volumes": [{"name": "kvfabric-run", "hostPath": {"path": "/run/kvfabric"}}],
        },
        "status": {
            "phase": "Running",
            "conditions": [{"type": t, "status": "True"} for t in ("PodScheduled", "Initialized", "Ready")],
        },
    }
    decoded: dict[str, Any] = json.loads(json.dumps(body))  # as decoded from the wire
    return decoded


def tracked_in(obj: object) -> int:
    """How many of the containers reachable from ``obj`` Python's garbage collector tracks."""
    count = int(gc.is_tracked(obj))
    if isinstance(obj, dict):
        count += sum(tracked_in(v) for v in obj.values())
    elif isinstance(obj, list | tuple):
        count += sum(tracked_in(v) for v in obj)
    return count


@pytest.mark.asyncio
async def test_cached_consumer_pods_cost_the_garbage_collector_two_objects_each() -> None:
    # The operator caches every opted-in pod of the cluster; each full pass of the garbage collector
    # walks every tracked object while holding the GIL, i.e. while the webhook cannot answer. Full
    # pods made that a 0.3 s stall per pass at 1,000 pods (a second at 5,000): the consumer informer
    # keeps only what the pools' status counts, two tracked dicts per pod whatever the pod's size.
    n = 300
    api = FakeApi([full_pod(i) for i in range(n)], [])
    controller = Controller(lambda: cast(KubeClient, api), injection_enabled=True)
    (consumers,) = [
        i for i in controller.informers(cast(KubeClient, api)) if i.index_label == "kvfabric.io/pool"
    ]
    await run_until_idle(consumers, api)
    gc.collect()
    assert len(consumers.objects) == n
    assert sum(tracked_in(o) for o in consumers.objects.values()) == 2 * n
    # ... and what is kept is what the pools' status reads: the same counts as from the full pods.
    assert consumer_counts(list(consumers.objects.values()), "abc") == consumer_counts(
        [full_pod(i) for i in range(n)], "abc"
    )
    assert [p["metadata"]["name"] for p in consumers.by_index("p1", "ns")] != []


@pytest.mark.asyncio
async def test_cached_objects_drop_managed_fields_only() -> None:
    # Server-side apply's bookkeeping is most of a small object's dicts and no reader uses it.
    api = FakeApi([full_pod(0)], [])
    informer = Informer(
        cast(KubeClient, api), "Pod", label_selector="kvfabric.io/pool", index_label="kvfabric.io/pool"
    )
    await run_until_idle(informer, api)
    (cached,) = informer.objects.values()
    expected = full_pod(0)
    del expected["metadata"]["managedFields"]
    assert cached == expected


_annotation_values = st.one_of(st.none(), st.sampled_from(["abc", "old", "", '{"transport":"tcp"}', "x"]))


@given(
    pods=st.lists(
        st.fixed_dictionaries(
            {
                "hash": _annotation_values,
                "injected": _annotation_values,
                "skip": _annotation_values,
                "phase": st.one_of(st.none(), st.sampled_from(["Pending", "Running", "Succeeded", "Failed"])),
                "deleting": st.booleans(),
            }
        ),
        max_size=12,
    )
)
@settings(max_examples=200, deadline=None)
def test_consumer_counts_are_the_same_from_the_cached_view(pods: list[dict[str, Any]]) -> None:
    full = []
    for i, p in enumerate(pods):
        pod_ = full_pod(i)
        annotations: dict[str, str] = {}
        for key, field in (
            ("kvfabric.io/config-hash", "hash"),
            ("kvfabric.io/injected", "injected"),
            ("kvfabric.io/skip-reason", "skip"),
        ):
            if p[field] is not None:
                annotations[key] = p[field]
        pod_["metadata"]["annotations"] = annotations
        if p["phase"] is None:
            del pod_["status"]["phase"]
        else:
            pod_["status"]["phase"] = p["phase"]
        if p["deleting"]:
            pod_["metadata"]["deletionTimestamp"] = "2026-12-06T00:00:00Z"
        full.append(pod_)
    assert consumer_counts([consumer_view(p) for p in full], "abc") == consumer_counts(full, "abc")


def server_pod(i: int, state: dict[str, Any]) -> dict[str, Any]:
    """A cache-server pod in one of many states, with the spec the API server sends."""
    status: dict[str, Any] = {"phase": state["phase"], "conditions": []}
    if state["ready"] is not None:
        status["conditions"].append(
            {"type": "Ready", "status": state["ready"], "lastTransitionTime": "2026-12-06T00:01:00Z"}
        )
    if state["unschedulable"]:
        status["conditions"].append(
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "no"}
        )
    if state["waiting"] is not None:
        status["containerStatuses"] = [
            {"name": "server", "ready": False, "state": {"waiting": {"reason": state["waiting"]}}}
        ]
    elif state["phase"] == "Running":
        status["containerStatuses"] = [
            {"name": "server", "ready": True, "state": {"running": {"startedAt": "2026-12-06T00:00:00Z"}}}
        ]
    if state["ip"]:
        status["podIP"] = f"10.0.0.{i}"
    spec: dict[str, Any] = {
        "containers": [{"name": "server", "image": "kvfabric", "env": [{"name": "A", "value": "1"}]}],
        "volumes": [{"name": "run", "hostPath": {"path": "/run/kvfabric"}}],
        "tolerations": [{"operator": "Exists"}],
    }
    if state["scheduled"]:
        spec["nodeName"] = f"node-{i}"
    else:
        term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [f"node-{i}"]}]}
        spec["affinity"] = {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
        }
    meta: dict[str, Any] = {
        "name": f"p-cache-{i}",
        "namespace": "ns",
        "labels": {"kvfabric.io/owner-pool": "p", "app.kubernetes.io/managed-by": "kvfabric-operator"},
        "resourceVersion": str(i + 1),
        "managedFields": [{"manager": "kwok", "fieldsV1": {"f:status": {}}}],
    }
    if state["deleting"]:
        meta["deletionTimestamp"] = "2026-12-06T00:02:00Z"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": status}


_server_states = st.fixed_dictionaries(
    {
        "phase": st.sampled_from(["Pending", "Running", "Failed"]),
        "ready": st.sampled_from([None, "True", "False"]),
        "unschedulable": st.booleans(),
        "waiting": st.sampled_from([None, "CrashLoopBackOff", "ImagePullBackOff", "ContainerCreating"]),
        "ip": st.booleans(),
        "scheduled": st.booleans(),
        "deleting": st.booleans(),
    }
)


@given(states=st.lists(_server_states, max_size=6))
@settings(max_examples=200, deadline=None)
def test_what_is_read_of_server_pods_is_the_same_from_the_cached_view(states: list[dict[str, Any]]) -> None:
    full = [server_pod(i, s) for i, s in enumerate(states)]
    views = [server_pod_view(p) for p in full]
    for missing in (0, 2):
        assert diagnose(views, "FailedCreate: quota", missing) == diagnose(
            full, "FailedCreate: quota", missing
        )
    assert scrape_targets(views, 9400) == scrape_targets(full, 9400)


@pytest.mark.asyncio
async def test_the_cache_server_pod_informer_keeps_the_server_view() -> None:
    pod_ = server_pod(
        1,
        {
            "phase": "Running",
            "ready": "True",
            "unschedulable": False,
            "waiting": None,
            "ip": True,
            "scheduled": True,
            "deleting": False,
        },
    )
    api = FakeApi([pod_], [])
    controller = Controller(lambda: cast(KubeClient, api), injection_enabled=True)
    (servers,) = [
        i
        for i in controller.informers(cast(KubeClient, api))
        if i.kind == "Pod" and i.index_label == "kvfabric.io/owner-pool"
    ]
    await run_until_idle(servers, api)
    (cached,) = servers.objects.values()
    assert cached == server_pod_view(pod_)
    assert cached["spec"] == {"nodeName": "node-1"}
    assert "managedFields" not in cached["metadata"]
