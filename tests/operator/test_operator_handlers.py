"""kopf wiring: the registry holds only stateless handlers, and the settings filter watches server-side."""

from __future__ import annotations

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
    # Children's events reach their pool through the controller's informers (issue #14.4: no kopf
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
