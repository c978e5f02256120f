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
    watching = {h.id for h in registry._watching.get_all_handlers()}
    assert {
        "child-daemonsets",
        "child-configmaps",
        "child-services",
        "child-persistentvolumeclaims",
    } <= watching
    webhooks = {h.id for h in registry._webhooks.get_all_handlers()}
    assert webhooks == ({handlers.WEBHOOK_ID} if webhook else set())
