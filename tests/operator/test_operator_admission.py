"""The injection webhook's own admission path: no API call, the smallest patch, kopf for the rest."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import socket
from typing import Any, cast

import aiohttp
import jsonpatch
import kopf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.operator import handlers
from kvfabric.operator.admission import PodWebhookServer, injection_patch
from kvfabric.operator.injection import inject, pool_target
from kvfabric.operator.kube import KubeClient


class NoApiClient(KubeClient):
    """A client that fails the test by recording any call to the API server."""

    def __init__(self) -> None:
        super().__init__("https://127.0.0.1:1", ssl_context=False)
        self.calls: list[str] = []

    async def request(self, method: str, path: str, **_: Any) -> Any:
        self.calls.append(f"{method} {path}")
        raise AssertionError(f"API call on the admission path: {method} {path}")


def pool(name: str = "pool-a", ns: str = "team") -> dict[str, Any]:
    return {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name, "namespace": ns, "uid": "u1", "generation": 1},
        "spec": {"image": {"tag": "v0.2.0"}, "tiers": {"memory": {"size": "256Mi"}}},
    }


def consumer(name: str = "engine-0", pool_name: str = "pool-a", **extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "team", "labels": {"kvfabric.io/pool": pool_name}},
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.11.0",
                    "env": [{"name": "HF_HOME", "value": "/h"}],
                }
            ],
            **extra,
        },
    }


def review(pod: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "r-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "team",
            "operation": operation,
            "userInfo": {"username": "test"},
            "object": pod,
        },
    }


def patched(pod: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    assert answer["response"]["allowed"] is True
    if "patch" not in answer["response"]:
        return pod
    ops = json.loads(base64.b64decode(answer["response"]["patch"]))
    result: dict[str, Any] = jsonpatch.apply_patch(pod, ops)
    return result


def app(client: KubeClient | None = None) -> handlers.OperatorApp:
    return handlers.OperatorApp(client=client or NoApiClient(), injection_enabled=True)


async def deliver_pool(a: handlers.OperatorApp, body: dict[str, Any]) -> None:
    """Feed a pool to the app as kopf's watch does: through the registered event handler."""
    registry = handlers.build_registry(a, webhook_server=None, namespaces=None)
    (handler,) = [h for h in registry._watching.get_all_handlers() if h.id.endswith("pool_event")]
    fn = cast(Any, handler.fn)
    meta = body["metadata"]
    await fn(
        event={"type": "ADDED", "object": body},
        namespace=meta["namespace"],
        name=meta["name"],
        body=kopf.Body(cast(kopf.RawBody, body)),
    )


@pytest.mark.asyncio
async def test_a_pod_of_a_known_pool_is_injected_without_any_api_call() -> None:
    client = NoApiClient()
    a = app(client)
    await deliver_pool(a, pool())
    pod = consumer()
    answer = await a.admit(review(copy.deepcopy(pod)))
    assert client.calls == []
    out = patched(pod, answer)
    assert "kvfabric.io/injected" in out["metadata"]["annotations"]
    assert out == inject(pod, a.pools, {}, request_namespace="team").pod


@pytest.mark.asyncio
async def test_a_pod_whose_pool_arrives_during_its_admission_waits_for_the_watch_not_the_api() -> None:
    # A pool created a moment before its first pod: the pod must not be skipped as pool-not-found
    # (a Fail pool's pod would run without the cache), and the API server is never asked.
    client = NoApiClient()
    a = app(client)
    pod = consumer()
    admission = asyncio.ensure_future(a.admit(review(copy.deepcopy(pod))))
    await asyncio.sleep(0.05)
    assert not admission.done()
    await deliver_pool(a, pool())
    out = patched(pod, await asyncio.wait_for(admission, 5))
    assert "kvfabric.io/injected" in out["metadata"]["annotations"]
    assert client.calls == []


class AbsentPoolClient(NoApiClient):
    """A client whose API server holds no pool: a GET of one answers "not found" (recorded)."""

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        self.calls.append(f"get {kind} {namespace}/{name}")
        return None


@pytest.mark.asyncio
async def test_a_pod_naming_a_pool_that_never_comes_is_skipped_after_the_wait_and_one_read() -> None:
    client = AbsentPoolClient()
    a = app(client)
    a.unknown_pool_wait = 0.2
    await deliver_pool(a, pool("other"))
    pod = consumer()
    loop = asyncio.get_running_loop()
    start = loop.time()
    out = patched(pod, await a.admit(review(copy.deepcopy(pod))))
    assert loop.time() - start >= 0.2
    assert out["metadata"]["annotations"]["kvfabric.io/skip-reason"] == "pool-not-found"
    # The watch did not bring it: the API server is asked once before the pod is admitted without.
    assert client.calls == ["get KVCachePool team/pool-a"]


@pytest.mark.asyncio
async def test_the_patch_adds_only_what_was_injected() -> None:
    # The user's container, env entries and labels are never rewritten: every op adds.
    a = app()
    await deliver_pool(a, pool())
    pod = consumer(tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}])
    answer = await a.admit(review(copy.deepcopy(pod)))
    ops = json.loads(base64.b64decode(answer["response"]["patch"]))
    assert {op["op"] for op in ops} == {"add"}
    paths = sorted(op["path"] for op in ops)
    assert paths == sorted(
        [
            "/metadata/annotations",
            "/spec/volumes",
            "/spec/initContainers",
            "/spec/containers/0/args",
            "/spec/containers/0/volumeMounts",
            *["/spec/containers/0/env/-"] * (len(patched(pod, answer)["spec"]["containers"][0]["env"]) - 1),
        ]
    )


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.sampled_from(["a", "b", "x/y", "t~1"]))
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(["a", "b", "c/d", "e~f"]), inner, max_size=4),
    ),
    max_leaves=20,
)


@given(
    before=st.dictionaries(st.sampled_from(["a", "b", "c"]), _json, max_size=3),
    after=st.dictionaries(st.sampled_from(["a", "b", "c"]), _json, max_size=3),
)
@settings(max_examples=300, deadline=None)
def test_the_patch_turns_any_document_into_any_other(before: dict[str, Any], after: dict[str, Any]) -> None:
    ops = injection_patch(before, after)
    assert jsonpatch.apply_patch(copy.deepcopy(before), ops) == after
    assert (ops == []) == (before == after)


_env = st.lists(
    st.fixed_dictionaries(
        {
            "name": st.sampled_from(["HF_HOME", "PYTHONPATH", "KVFABRIC_PAYLOAD_KEY", "X"]),
            "value": st.sampled_from(["1", "/p"]),
        }
    ),
    max_size=3,
)
_container = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["vllm", "side", "main"]),
        "image": st.sampled_from(["vllm/vllm-openai", "busybox"]),
    },
    optional={
        "env": _env,
        "args": st.lists(st.sampled_from(["serve", "--kv-transfer-config", "{}"]), max_size=3),
        "command": st.sampled_from([["sh", "-c", "vllm serve m"], ["vllm", "serve"]]),
        "volumeMounts": st.lists(
            st.fixed_dictionaries(
                {"name": st.sampled_from(["kvfabric-run", "data"]), "mountPath": st.just("/m")}
            ),
            max_size=2,
        ),
    },
)


@given(
    containers=st.lists(_container, min_size=1, max_size=3, unique_by=lambda c: c["name"]),
    annotations=st.one_of(
        st.none(),
        st.dictionaries(
            st.sampled_from(["kvfabric.io/injected", "kvfabric.io/config-hash", "user"]),
            st.just("v"),
            max_size=2,
        ),
    ),
    volumes=st.one_of(
        st.none(),
        st.lists(
            st.fixed_dictionaries(
                {"name": st.sampled_from(["data", "kvfabric-run"]), "emptyDir": st.just({})}
            ),
            max_size=2,
        ),
    ),
    pool_name=st.sampled_from(["pool-a", "missing"]),
)
@settings(max_examples=150, deadline=None)
def test_the_patch_of_any_pod_yields_exactly_the_injected_pod(
    containers: list[dict[str, Any]],
    annotations: dict[str, str] | None,
    volumes: list[dict[str, Any]] | None,
    pool_name: str,
) -> None:
    target = pool_target(pool())
    assert target is not None
    pod = consumer(pool_name=pool_name)
    pod["spec"]["containers"] = containers
    if annotations is not None:
        pod["metadata"]["annotations"] = annotations
    if volumes is not None:
        pod["spec"]["volumes"] = volumes
    pod = json.loads(json.dumps(pod))  # as decoded from a review: no object shared by two fields
    result = inject(pod, {("team", "pool-a"): target}, {}, request_namespace="team")
    assert jsonpatch.apply_patch(copy.deepcopy(pod), injection_patch(pod, result.pod)) == result.pod


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.asyncio
async def test_the_server_answers_pod_creations_itself_and_passes_the_rest_to_kopf() -> None:
    a = app()
    await deliver_pool(a, pool())
    port = free_port()
    server = PodWebhookServer(
        addr="127.0.0.1", port=port, insecure=True, webhook_id=handlers.WEBHOOK_ID, admit=a.admit
    )
    to_kopf: list[str] = []

    async def kopf_fn(request: Any, **_: Any) -> Any:
        to_kopf.append(request["request"]["operation"])
        return {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {"uid": "k", "allowed": True},
        }

    configs = server(kopf_fn)
    await configs.__anext__()
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}/{handlers.WEBHOOK_ID}"
            async with session.post(url, json=review(consumer())) as response:
                created = await response.json()
            async with session.post(url, json=review(consumer(), operation="UPDATE")) as response:
                updated = await response.json()
            async with session.post(f"http://127.0.0.1:{port}/other", json=review(consumer())) as response:
                other = await response.json()
    finally:
        await configs.aclose()  # type: ignore[attr-defined]
    assert "patch" in created["response"]
    assert updated["response"]["uid"] == other["response"]["uid"] == "k"
    assert to_kopf == ["UPDATE", "CREATE"]


@pytest.mark.asyncio
async def test_the_watch_event_of_our_own_status_write_triggers_no_reconcile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # While pools come up every status write came back as a pool event and cost a reconcile that
    # found nothing to do. Only that exact version is skipped: any other change is reconciled.
    a = app()
    triggered: list[tuple[str, str]] = []
    monkeypatch.setattr(a.controller, "trigger", lambda key, version=None: triggered.append(key))
    a.controller._status_written[("team", "pool-a")] = "42"
    body = pool()
    for version in ("41", "42", "43"):
        body["metadata"]["resourceVersion"] = version
        await deliver_pool(a, body)
    assert triggered == [("team", "pool-a"), ("team", "pool-a")]  # 41 and 43, not our own 42
    a.controller._forget(("team", "pool-a"))
    await deliver_pool(a, body | {"metadata": {**body["metadata"], "resourceVersion": "42"}})
    assert len(triggered) == 3
