"""kopf wiring: the registry holds only stateless handlers, and the settings filter watches server-side."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import cast

import kopf
import pytest

from kvfabric.operator import handlers
from kvfabric.operator.kube import KubeClient


def app() -> handlers.OperatorApp:
    return handlers.OperatorApp(
        client=KubeClient("https://127.0.0.1:1", ssl_context=False), injection_enabled=True
    )


def test_settings() -> None:
    settings = kopf.OperatorSettings()
    handlers.configure_settings(settings)
    assert settings.posting.enabled is False
    assert settings.admission.managed is None
    selectors = dict(settings.watching.label_selectors.items())
    assert any("app.kubernetes.io/managed-by=kvfabric-operator" in v for v in selectors.values())
    assert "kvfabric.io/pool" in selectors.values()


@pytest.mark.parametrize("webhook", [True, False])
def test_registry_has_no_stateful_handlers(webhook: bool) -> None:
    registry = handlers.build_registry(app(), webhook_server=object() if webhook else None, namespaces=None)
    # No on.create/update/delete/resume, timers or daemons: nothing kopf would persist in the objects.
    assert not registry._changing.get_all_handlers()
    assert not registry._spawning.get_all_handlers()
    # Children's events reach their pool through the controller's informers (no kopf
    # per-object workers for thousands of pods), each filtered server-side to the operator's objects.
    a = app()
    informers = {(i.kind, i.label_selector, i.index_label) for i in a.controller.informers(a.client)}
    owned = "app.kubernetes.io/managed-by=kvfabric-operator,kvfabric.io/owner-pool"
    assert {
        ("DaemonSet", owned, "kvfabric.io/owner-pool"),
        ("ConfigMap", owned, "kvfabric.io/owner-pool"),
        ("Service", owned, "kvfabric.io/owner-pool"),
        ("PersistentVolumeClaim", owned, "kvfabric.io/owner-pool"),
        ("Pod", owned, "kvfabric.io/owner-pool"),
        ("Pod", "kvfabric.io/pool", "kvfabric.io/pool"),
    } <= informers
    webhooks = {h.id for h in registry._webhooks.get_all_handlers()}
    assert webhooks == ({handlers.WEBHOOK_ID} if webhook else set())


def consumer_pod() -> kopf.Body:
    return kopf.Body(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "engine-0", "namespace": "team", "labels": {"kvfabric.io/pool": "pool-a"}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0"}]},
        }
    )


async def admit(a: handlers.OperatorApp) -> kopf.Patch:
    registry = handlers.build_registry(a, webhook_server=object(), namespaces=None)
    (webhook,) = registry._webhooks.get_all_handlers()
    patch = kopf.Patch()
    # Called as kopf calls it, with the keyword arguments the handler reads (it takes **_ for the rest).
    fn = cast(Callable[..., Awaitable[None]], webhook.fn)
    await fn(body=consumer_pod(), patch=patch, namespace="team")
    return patch


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["pool-lookup", "injection"])
async def test_the_webhook_admits_the_pod_unchanged_when_injection_raises(
    where: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Fail open: whatever breaks while injecting, the pod is admitted as it came (no patch), never
    # refused, so a bug in the operator cannot stop inference pods, a Fail pool's included.
    a = app()

    async def no_pools(*_: object) -> dict[object, object]:
        return {}

    def boom(*_: object, **__: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(a, "pools_for", boom if where == "pool-lookup" else no_pools)
    if where == "injection":
        monkeypatch.setattr(handlers, "inject", boom)
    patch = await admit(a)
    assert patch.fns == []
    assert dict(patch) == {}
    assert "injection failed; admitting the pod unchanged" in caplog.text


@pytest.mark.asyncio
async def test_without_an_exception_the_webhook_patches_the_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    # The control for the test above: the same pod, its pool unknown, is patched (the skip reason).
    a = app()

    async def no_pools(*_: object) -> dict[object, object]:
        return {}

    monkeypatch.setattr(a, "pools_for", no_pools)
    patch = await admit(a)
    assert len(patch.fns) == 1
    pod = dict(consumer_pod())
    patch.fns[0](pod)  # type: ignore[arg-type]
    assert pod["metadata"]["annotations"]["kvfabric.io/skip-reason"] == "pool-not-found"
