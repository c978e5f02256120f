"""The MutatingWebhookConfiguration for pod injection, rendered for a URL or an in-cluster Service.

``manifests/webhook/`` ships the in-cluster variant (Service + cert-manager CA injection); the CLI's
``--register-webhook`` applies the URL variant, which local clusters without kube-proxy need.
"""

from __future__ import annotations

import base64
from typing import Any, Final

from kvfabric.operator.api.v1alpha1 import POOL_LABEL
from kvfabric.operator.render import names

DEFAULT_NAME: Final = "kvfabric-pod-injector"


def render_webhook_configuration(
    *,
    name: str = DEFAULT_NAME,
    url: str | None = None,
    service: dict[str, Any] | None = None,
    ca_bundle: bytes | None = None,
    excluded_namespaces: list[str] | None = None,
    timeout_seconds: int = 5,
    required_pools: list[str] | None = None,
) -> dict[str, Any]:
    """Return the webhook configuration; exactly one of ``url`` and ``service`` must be given.

    ``required_pools`` names pools whose ``spec.consumers.failurePolicy`` is ``Fail``: their consumers
    go through a second webhook with ``failurePolicy: Fail`` (pod creation is refused while the
    operator cannot inject), everybody else through the fail-open one. An object selector cannot see
    namespaces, so the names match pools of that name in every namespace.
    """
    if (url is None) == (service is None):
        raise ValueError("give exactly one of url or service")
    client_config: dict[str, Any] = {"url": url} if url is not None else {"service": service}
    if ca_bundle is not None:
        client_config["caBundle"] = base64.b64encode(ca_bundle).decode()
    excluded = sorted({"kube-system", *(excluded_namespaces or [])})
    required = sorted(set(required_pools or []))

    def webhook(hook_name: str, policy: str, expressions: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "name": hook_name,
            "admissionReviewVersions": ["v1"],
            "clientConfig": client_config,
            "rules": [
                {
                    "apiGroups": [""],
                    "apiVersions": ["v1"],
                    "operations": ["CREATE"],
                    "resources": ["pods"],
                    "scope": "Namespaced",
                }
            ],
            # Only opted-in pods ever reach the operator; everything else is untouched by design.
            "objectSelector": {"matchExpressions": expressions},
            "namespaceSelector": {
                "matchExpressions": [
                    {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": excluded}
                ]
            },
            "failurePolicy": policy,
            "sideEffects": "None",
            "timeoutSeconds": timeout_seconds,
            "reinvocationPolicy": "IfNeeded",
            "matchPolicy": "Equivalent",
        }

    opted_in: list[dict[str, Any]] = [{"key": POOL_LABEL, "operator": "Exists"}]
    if required:
        opted_in.append({"key": POOL_LABEL, "operator": "NotIn", "values": required})
    # Fail open by default: a down operator must never block inference pods; skipped pods are visible
    # in pool status (consumers.matched vs injected).
    webhooks = [webhook("pods.kvfabric.io", "Ignore", opted_in)]
    if required:
        webhooks.append(
            webhook(
                "required.pods.kvfabric.io",
                "Fail",
                [{"key": POOL_LABEL, "operator": "In", "values": required}],
            )
        )
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name, "labels": {names.MANAGED_BY: names.MANAGED_BY_VALUE}},
        "webhooks": webhooks,
    }
