"""reconcile_pool against an in-memory API: apply, prune, status, conflicts, invalid configs."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from kvfabric.operator import reconcile
from kvfabric.operator.kube import ApiError
from kvfabric.operator.render import ConfigError, names


class FakeKube:
    """Just enough of KubeClient: objects keyed by (kind, namespace, name)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str | None, str], dict[str, Any]] = {}
        self.applied: list[tuple[str, str]] = []
        self.deleted: list[tuple[str, str]] = []
        self.events: list[dict[str, Any]] = []
        self.status_patches = 0
        self.conflict_next_status = False
        self._rv = 0

    def _bump(self, obj: dict[str, Any]) -> None:
        self._rv += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self._rv)

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    async def list(
        self,
        kind: str,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        wanted = dict(part.split("=", 1) for part in (label_selector or "").split(",") if "=" in part)
        out = []
        for (k, ns, _), obj in self.objects.items():
            labels = obj.get("metadata", {}).get("labels") or {}
            if (
                k == kind
                and (namespace is None or ns == namespace)
                and all(labels.get(a) == b for a, b in wanted.items())
            ):
                out.append(copy.deepcopy(obj))
        return out

    async def apply(self, obj: dict[str, Any], *, field_manager: str, force: bool = True) -> dict[str, Any]:
        assert field_manager == names.FIELD_MANAGER
        key = (obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        stored = copy.deepcopy(obj)
        self._bump(stored)
        self.objects[key] = stored
        self.applied.append((obj["kind"], obj["metadata"]["name"]))
        return stored

    async def patch_status(
        self,
        kind: str,
        namespace: str,
        name: str,
        status: dict[str, Any],
        *,
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        if self.conflict_next_status:
            self.conflict_next_status = False
            raise ApiError(409, '{"reason":"Conflict"}', method="PATCH", path="status")
        obj = self.objects[(kind, namespace, name)]
        assert resource_version == obj["metadata"]["resourceVersion"]
        obj["status"] = copy.deepcopy(status)
        self._bump(obj)
        self.status_patches += 1
        return obj

    async def delete(self, kind: str, namespace: str | None, name: str) -> bool:
        self.deleted.append((kind, name))
        return self.objects.pop((kind, namespace, name), None) is not None

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] == "Event":
            self.events.append(obj)
            return obj
        key = (obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        if key in self.objects:
            raise ApiError(409, '{"reason":"AlreadyExists"}', method="POST", path=str(key))
        stored = copy.deepcopy(obj)
        self._bump(stored)
        self.objects[key] = stored
        return stored

    async def patch(
        self,
        kind: str,
        namespace: str | None,
        name: str,
        body: Any,
        *,
        content_type: str = "application/merge-patch+json",
    ) -> dict[str, Any]:
        """A merge patch of ``data`` (set or null), or a JSON patch of test/remove ops."""
        obj = self.objects.get((kind, namespace, name))
        if obj is None:
            raise ApiError(404, '{"reason":"NotFound"}', method="PATCH", path=name)
        data = obj.setdefault("data", {})
        if content_type == "application/json-patch+json":
            for op in body:
                item = op["path"].removeprefix("/data/")
                if item not in data or (op["op"] == "test" and data[item] != op["value"]):
                    raise ApiError(422, '{"reason":"Invalid"}', method="PATCH", path=name)
                if op["op"] == "remove":
                    del data[item]
        else:
            for item, value in body["data"].items():
                if value is None:
                    data.pop(item, None)
                else:
                    data[item] = value
        self._bump(obj)
        return copy.deepcopy(obj)


def add_pool(kube: FakeKube, **spec: Any) -> dict[str, Any]:
    pool = {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "generation": 1},
        "spec": {"image": {"tag": "v1"}, "tiers": {"memory": {"size": "1Gi"}}, **spec},
    }
    kube._bump(pool)
    kube.objects[("KVCachePool", "ns", "p")] = pool
    return pool


async def run(kube: FakeKube) -> reconcile.ReconcileResult | None:
    return await reconcile.reconcile_pool(kube, "ns", "p", injection_enabled=True)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_first_pass_applies_children_and_writes_status() -> None:
    kube = FakeKube()
    add_pool(kube)
    result = await run(kube)
    assert result is not None
    assert result.applied == 5  # ConfigMap, DaemonSet, two Services, NetworkPolicy
    assert kube.applied[0] == ("ConfigMap", "p-config")  # before the DaemonSet that mounts it
    status = kube.objects[("KVCachePool", "ns", "p")]["status"]
    assert status["observedGeneration"] == 1
    assert status["connection"]["configMap"] == "p-config"
    assert {c["type"] for c in status["conditions"]} >= {"Ready", "ConfigValid"}


@pytest.mark.asyncio
async def test_second_pass_without_change_writes_nothing() -> None:
    kube = FakeKube()
    add_pool(kube)
    await run(kube)
    patches, events = kube.status_patches, len(kube.events)
    result = await run(kube)
    assert result is not None
    assert not result.status_changed
    assert kube.status_patches == patches
    assert len(kube.events) == events


@pytest.mark.asyncio
async def test_prunes_children_no_longer_rendered() -> None:
    kube = FakeKube()
    add_pool(kube)
    await run(kube)
    kube.objects[("KVCachePool", "ns", "p")]["spec"]["metrics"] = {"enabled": False}
    result = await run(kube)
    assert result is not None
    assert result.pruned == 1
    assert ("Service", "p-metrics") in kube.deleted
    assert ("Service", None, "p-metrics") not in kube.objects


@pytest.mark.asyncio
async def test_the_prune_passes_by_labelled_objects_the_pool_does_not_own() -> None:
    """Labels select, the owner reference decides: a copy of the labels deletes nothing."""
    kube = FakeKube()
    add_pool(kube)
    await run(kube)
    (mine,) = [o for (k, _, n), o in kube.objects.items() if k == "ConfigMap" and n == "p-config"]
    for name, refs in (("decoy", []), ("earlier", [{"kind": "KVCachePool", "name": "p", "uid": "u0"}])):
        kube.objects[("ConfigMap", "ns", name)] = {
            "kind": "ConfigMap",
            "metadata": {
                "name": name,
                "namespace": "ns",
                "labels": mine["metadata"]["labels"],
                "ownerReferences": refs,
            },
        }
    result = await run(kube)
    assert result is not None
    assert result.pruned == 0
    assert ("ConfigMap", "ns", "decoy") in kube.objects
    assert ("ConfigMap", "ns", "earlier") in kube.objects


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("ConfigMap", names.router_configmap_name("p")),
        ("ConfigMap", names.configmap_name("p")),
        ("Service", names.service_name("p")),
        ("DaemonSet", names.daemonset_name("p")),
        ("NetworkPolicy", names.network_policy_name("p")),
    ],
)
async def test_a_child_name_held_by_an_object_not_the_pools_stops_every_apply(kind: str, name: str) -> None:
    kube = FakeKube()
    add_pool(kube, consumers={"routingEvents": {}})
    theirs = {
        "kind": kind,
        "metadata": {"name": name, "namespace": "ns", "labels": {"team": "t"}},
        "data": {"x": "y"},
    }
    kube.objects[(kind, "ns", name)] = copy.deepcopy(theirs)
    result = await run(kube)
    assert result is not None
    assert result.object_conflicts == (f"{kind} {name}",)
    assert result.applied == 0
    assert kube.objects[(kind, "ns", name)] == theirs
    assert [k for k in kube.objects if k[0] not in ("KVCachePool", "Event")] == [(kind, "ns", name)]
    status = kube.objects[("KVCachePool", "ns", "p")]["status"]
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ObjectConflict")
    assert f"{kind} {name}" in degraded["message"]
    # A DaemonSet orphaned by an earlier pool of this name is deleted, not renamed.
    assert "left by an earlier pool of this name" in degraded["message"]
    assert "delete it; otherwise rename the pool" in degraded["message"]


@pytest.mark.asyncio
async def test_invalid_server_config_keeps_children_and_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    kube = FakeKube()
    add_pool(kube)
    await run(kube)
    applied = len(kube.applied)

    def broken(_pool: Any) -> Any:
        raise ConfigError("limits.max_payload_bytes exceeds tiers.dram.capacity_bytes")

    monkeypatch.setattr(reconcile, "render_children", broken)
    await run(kube)
    assert len(kube.applied) == applied  # nothing torn down or re-applied
    assert ("ConfigMap", "ns", "p-config") in kube.objects
    status = kube.objects[("KVCachePool", "ns", "p")]["status"]
    config_valid = next(c for c in status["conditions"] if c["type"] == "ConfigValid")
    assert config_valid["status"] == "False"
    assert "max_payload_bytes" in config_valid["message"]
    assert "InvalidServerConfig" in [e["reason"] for e in kube.events]


@pytest.mark.asyncio
async def test_status_conflict_asks_for_an_immediate_retry() -> None:
    kube = FakeKube()
    add_pool(kube)
    kube.conflict_next_status = True
    with pytest.raises(reconcile.RetryNow):
        await run(kube)
    assert await run(kube) is not None


@pytest.mark.asyncio
async def test_deleted_or_deleting_pool_is_left_to_the_garbage_collector() -> None:
    kube = FakeKube()
    assert await run(kube) is None
    pool = add_pool(kube)
    pool["metadata"]["deletionTimestamp"] = "2026-11-30T00:00:00Z"
    assert await run(kube) is None
    assert kube.applied == []


@pytest.mark.asyncio
async def test_missing_existing_claim_is_reported() -> None:
    kube = FakeKube()
    add_pool(kube, tiers={"memory": {"size": "1Gi"}, "shared": {"existingClaim": "rwx", "capacity": "1Ti"}})
    await run(kube)
    status = kube.objects[("KVCachePool", "ns", "p")]["status"]
    storage = next(c for c in status["conditions"] if c["type"] == "StorageReady")
    assert (storage["status"], storage["reason"]) == ("False", "ClaimNotFound")
    kube.objects[("PersistentVolumeClaim", "ns", "rwx")] = {
        "metadata": {"name": "rwx"},
        "status": {"phase": "Bound"},
    }
    await run(kube)
    status = kube.objects[("KVCachePool", "ns", "p")]["status"]
    storage = next(c for c in status["conditions"] if c["type"] == "StorageReady")
    assert storage["status"] == "True"


class RejectingKube(FakeKube):
    """The API server refuses the DaemonSet (as it does for an invalid pod template)."""

    async def apply(self, obj: dict[str, Any], *, field_manager: str, force: bool = True) -> dict[str, Any]:
        if obj["kind"] == "DaemonSet":
            message = 'DaemonSet.apps "p-cache" is invalid: hugepages'
            body = json.dumps({"kind": "Status", "reason": "Invalid", "message": message})
            raise ApiError(422, body, method="PATCH", path="daemonsets/p-cache")
        return await super().apply(obj, field_manager=field_manager, force=force)


@pytest.mark.asyncio
async def test_rejected_apply_is_reported_on_the_first_pass_then_retried() -> None:
    kube = RejectingKube()
    add_pool(kube)
    with pytest.raises(reconcile.ApplyRejectedError):
        await run(kube)
    status = kube.objects[("KVCachePool", "ns", "p")]["status"]
    by_type = {c["type"]: c for c in status["conditions"]}
    assert (by_type["Degraded"]["status"], by_type["Degraded"]["reason"]) == ("True", "ApplyFailed")
    assert 'DaemonSet.apps "p-cache" is invalid: hugepages' in by_type["Degraded"]["message"]
    assert (by_type["Ready"]["status"], by_type["Ready"]["reason"]) == ("False", "ApplyFailed")
    assert "ApplyFailed" in [e["reason"] for e in kube.events]
    # The other children were applied all the same.
    assert ("ConfigMap", "p-config") in kube.applied
    assert ("Service", "p") in kube.applied


@pytest.mark.asyncio
async def test_a_server_error_is_not_a_rejection() -> None:
    class Flaky(FakeKube):
        async def apply(
            self, obj: dict[str, Any], *, field_manager: str, force: bool = True
        ) -> dict[str, Any]:
            raise ApiError(503, "unavailable", method="PATCH", path="x")

    kube = Flaky()
    add_pool(kube)
    with pytest.raises(ApiError):
        await run(kube)
    assert "status" not in kube.objects[("KVCachePool", "ns", "p")]


class CountingKube(FakeKube):
    """Counts the reads that reach "the API server" (a reconcile from warm caches needs only the pool)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str]] = []

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        self.reads.append(("get", kind))
        return await super().get(kind, namespace, name)

    async def list(self, kind: str, namespace: str | None = None, **kw: Any) -> list[dict[str, Any]]:
        self.reads.append(("list", kind))
        return await super().list(kind, namespace, **kw)


class WriteCountingKube(CountingKube):
    """Counts every write too (apply, patch, create, delete, status)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[str, str]] = []

    async def apply(self, obj: dict[str, Any], *, field_manager: str, force: bool = True) -> dict[str, Any]:
        self.writes.append(("apply", obj["kind"]))
        return await super().apply(obj, field_manager=field_manager, force=force)

    async def patch(
        self, kind: str, namespace: str | None, name: str, body: Any, **kw: Any
    ) -> dict[str, Any]:
        self.writes.append(("patch", kind))
        return await super().patch(kind, namespace, name, body, **kw)

    async def patch_status(self, kind: str, namespace: str, name: str, status: Any, **kw: Any) -> Any:
        self.writes.append(("status", kind))
        return await super().patch_status(kind, namespace, name, status, **kw)

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.writes.append(("create", obj["kind"]))
        return await super().create(obj)

    async def delete(self, kind: str, namespace: str | None, name: str) -> bool:
        self.writes.append(("delete", kind))
        return await super().delete(kind, namespace, name)


async def _synced_reader(kube: FakeKube) -> Any:
    """The leader's informers, exactly as the controller declares them, filled from ``kube``'s objects
    (with the cache-server pods the DaemonSet would create, labelled as its template says)."""
    from kvfabric.operator.controller import Controller
    from kvfabric.operator.informer import CachedReader

    (ds,) = [o for (k, _, _), o in kube.objects.items() if k == "DaemonSet"]
    for node in ("n1", "n2"):
        labels = dict(ds["spec"]["template"]["metadata"]["labels"])
        kube.objects[("Pod", "ns", f"cache-{node}")] = {
            "kind": "Pod",
            "metadata": {"name": f"cache-{node}", "namespace": "ns", "labels": labels},
            "spec": {"nodeName": node},
            "status": {"phase": "Running", "podIP": "10.0.0.1"},
        }
    controller = Controller(lambda: kube, injection_enabled=True)  # type: ignore[arg-type,return-value]
    informers = controller.informers(kube)  # type: ignore[arg-type]
    for informer in informers:
        for obj in await FakeKube.list(kube, informer.kind, None):
            labels = obj.get("metadata", {}).get("labels") or {}
            parsed = informer.label_selector.split(",")
            if all(
                ("=" in p and labels.get(p.split("=")[0]) == p.split("=")[1]) or p in labels for p in parsed
            ):
                informer._put(obj)
        informer.synced.set()
    return CachedReader(kube, informers)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_a_reconcile_from_synced_informers_lists_nothing_from_the_api_server() -> None:
    """Pods, children and cache-server pods come from the informers' indexes: no LIST per reconcile
    (only GETs of the pool and of its credential Secrets, which may never be listed or watched)."""
    kube = CountingKube()
    add_pool(kube)
    await run(kube)  # the children exist now
    reader = await _synced_reader(kube)
    kube.reads.clear()
    result = await reconcile.reconcile_pool(kube, "ns", "p", injection_enabled=True, reader=reader)  # type: ignore[arg-type]
    assert result is not None
    assert [r for r in kube.reads if r[0] == "list"] == [], kube.reads
    assert {kind for _, kind in kube.reads} <= {"KVCachePool", "Secret"}, kube.reads
    assert reader.fallbacks == 0


@pytest.mark.asyncio
async def test_an_unchanged_pool_from_synced_informers_costs_one_get_and_no_write() -> None:
    """With the controller's memories (applied children, Secrets read or written lately), a reconcile
    of a pool nothing changed reads only the pool itself and writes nothing: no Secret GETs (four
    credentials and the consumer-keys Secret), no NetworkPolicy GET, no apply, no status echo."""
    from kvfabric.operator.secretmemo import SecretMemo

    now = [0.0]
    kube = WriteCountingKube()
    add_pool(kube)
    secrets = SecretMemo(kube, max_age=30.0, clock=lambda: now[0])
    applied: reconcile.AppliedMemo = {}

    async def once(reader: Any = None) -> reconcile.ReconcileResult | None:
        kube.reads.clear()
        kube.writes.clear()
        return await reconcile.reconcile_pool(
            kube,  # type: ignore[arg-type]
            "ns",
            "p",
            injection_enabled=True,
            reader=reader,
            applied=applied,
            secrets=secrets,
        )

    await once()  # creates the children, credentials and the consumer-keys entry
    assert ("create", "Secret") in kube.writes or ("patch", "Secret") in kube.writes
    reader = await _synced_reader(kube)
    await once(reader)  # the cache-server pods now count in the status: one status write
    result = await once(reader)
    assert result is not None
    assert not result.status_changed
    assert kube.reads == [("get", "KVCachePool")]
    assert kube.writes == []
    assert reader.fallbacks == 0
    # A resync period later the Secrets are read again (four of the pool, the consumer keys): one
    # deleted by hand meanwhile is recreated.
    del kube.objects[("Secret", "ns", names.credentials_secret_name("p"))]
    now[0] = 31.0
    await once(reader)
    assert sorted(r for r in kube.reads if r[1] == "Secret") == [("get", "Secret")] * 5, kube.reads
    # New credentials, and the consumer-keys entry derived from them.
    assert kube.writes == [("apply", "Secret"), ("patch", "Secret")], kube.writes
    assert ("Secret", "ns", names.credentials_secret_name("p")) in kube.objects
    # What was written is remembered: the next pass reads nothing again.
    await once(reader)
    assert kube.reads == [("get", "KVCachePool")]
    assert kube.writes == []


@pytest.mark.asyncio
async def test_a_remembered_secret_that_is_not_the_pools_is_read_again_before_a_conflict() -> None:
    """A pool deleted and created again under its name (a new uid) must not take its predecessor's
    remembered Secrets, now deleted by the garbage collector, for someone else's."""
    from kvfabric.operator.secretmemo import SecretMemo

    kube = FakeKube()
    add_pool(kube)
    secrets = SecretMemo(kube, max_age=3600.0)
    await reconcile.reconcile_pool(kube, "ns", "p", injection_enabled=True, secrets=secrets)  # type: ignore[arg-type]
    for key in [k for k in kube.objects if k[0] != "KVCachePool" and k[1] == "ns"]:
        del kube.objects[key]  # the garbage collector, after the pool's deletion
    pool = kube.objects[("KVCachePool", "ns", "p")]
    pool["metadata"]["uid"] = "u2"
    kube._bump(pool)
    result = await reconcile.reconcile_pool(kube, "ns", "p", injection_enabled=True, secrets=secrets)  # type: ignore[arg-type]
    assert result is not None
    assert result.secret_conflicts == ()
    credentials = kube.objects[("Secret", "ns", names.credentials_secret_name("p"))]
    assert credentials["metadata"]["ownerReferences"][0]["uid"] == "u2"


@pytest.mark.asyncio
async def test_the_first_rollout_onto_hand_over_stops_first_then_the_next_one_surges() -> None:
    kube = FakeKube()
    add_pool(kube)
    # A DaemonSet of a version without hand-over: no annotation on its template, stop-first strategy.
    kube.objects[("DaemonSet", "ns", names.daemonset_name("p"))] = {
        "kind": "DaemonSet",
        "metadata": {
            "name": names.daemonset_name("p"),
            "namespace": "ns",
            "generation": 1,
            "ownerReferences": [{"kind": "KVCachePool", "name": "p", "uid": "u1"}],  # the pool's
        },
        "spec": {
            "updateStrategy": {"rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}},
            "template": {"metadata": {"annotations": {}}},
        },
        "status": {"observedGeneration": 1, "desiredNumberScheduled": 2, "updatedNumberScheduled": 2},
    }
    await run(kube)
    ds = kube.objects[("DaemonSet", "ns", names.daemonset_name("p"))]
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    assert names.HANDOVER_ANNOTATION in ds["spec"]["template"]["metadata"]["annotations"]
    # That rollout done (every pod on the annotated template): the next apply surges.
    ds["metadata"]["generation"] = 2
    ds["status"] = {
        "observedGeneration": 2,
        "desiredNumberScheduled": 2,
        "currentNumberScheduled": 2,
        "updatedNumberScheduled": 2,
    }
    await run(kube)
    ds = kube.objects[("DaemonSet", "ns", names.daemonset_name("p"))]
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}


@pytest.mark.asyncio
async def test_a_status_write_reports_the_version_it_left_the_pool_at() -> None:
    # The controller skips the watch event of its own status write by this version (and only it).
    kube = FakeKube()
    add_pool(kube)
    result = await run(kube)
    assert result is not None
    assert result.status_changed
    assert result.status_version == kube.objects[("KVCachePool", "ns", "p")]["metadata"]["resourceVersion"]
    again = await run(kube)
    assert again is not None
    assert again.status_version is None


@pytest.mark.asyncio
async def test_children_nobody_changed_since_the_last_apply_are_not_applied_again() -> None:
    # Each pass re-applied every child (a server-side apply each, the API server's costliest write)
    # although nothing had changed: with the controller's memory, only what changed is applied.
    kube = FakeKube()
    add_pool(kube)
    memo: reconcile.AppliedMemo = {}

    async def run_with_memo() -> list[tuple[str, str]]:
        kube.applied.clear()
        await reconcile.reconcile_pool(kube, "ns", "p", injection_enabled=True, applied=memo)  # type: ignore[arg-type]
        return sorted(kube.applied)

    first = await run_with_memo()
    assert [k for k, _ in first] == [
        "ConfigMap",
        "DaemonSet",
        "NetworkPolicy",
        "Secret",
        "Service",
        "Service",
    ]
    assert [k for k, _ in await run_with_memo()] == []
    # Any other version of a child (an edit by hand, a controller's update) is applied over again.
    cm = kube.objects[("ConfigMap", "ns", "p-config")]
    cm["data"] = {"edited": "by hand"}
    kube._bump(cm)
    assert [k for k, _ in await run_with_memo()] == ["ConfigMap"]
    assert "edited" not in kube.objects[("ConfigMap", "ns", "p-config")].get("data", {})
    (policy_key,) = [key for key in kube.objects if key[0] == "NetworkPolicy"]
    policy = kube.objects[policy_key]
    rendered_spec = copy.deepcopy(policy["spec"])
    policy["spec"] = {"podSelector": {}}  # opened up by hand
    kube._bump(policy)
    assert [k for k, _ in await run_with_memo()] == ["NetworkPolicy"]
    assert kube.objects[policy_key]["spec"] == rendered_spec
    # ... and so is a deleted one, and a child whose rendering changed.
    del kube.objects[("Service", "ns", "p")]
    assert [k for k, _ in await run_with_memo()] == ["Service"]
    pool = kube.objects[("KVCachePool", "ns", "p")]
    pool["spec"]["image"]["tag"] = "v2"
    pool["metadata"]["generation"] = 2
    kube._bump(pool)
    assert "DaemonSet" in [k for k, _ in await run_with_memo()]
