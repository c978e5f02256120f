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
) -> dict[str, Any]:
    """Return the webhook configuration; exactly one of ``url`` and ``service`` must be given."""
    if (url is None) == (service is None):
        raise ValueError("give exactly one of url or service")
    client_config: dict[str, Any] = {"url": url} if url is not None else {"service": service}
    if ca_bundle is not None:
        client_config["caBundle"] = base64.b64encode(ca_bundle).decode()
    excluded = sorted({"kube-system", *(excluded_namespaces or [])})
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name, "labels": {names.MANAGED_BY: names.MANAGED_BY_VALUE}},
        "webhooks": [
            {
                "name": "pods.kvfabric.io",
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
                "objectSelector": {"matchExpressions": [{"key": POOL_LABEL, "operator": "Exists"}]},
                "namespaceSelector": {
                    "matchExpressions": [
                        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": excluded}
                    ]
                },
                # Fail open: a down operator must never block inference pods; skipped pods are visible
                # in pool status (consumers.matched vs injected).
                "failurePolicy": "Ignore",
                "sideEffects": "None",
                "timeoutSeconds": timeout_seconds,
                "reinvocationPolicy": "IfNeeded",
                "matchPolicy": "Equivalent",
            }
        ],
    }
