"""The injection webhook's wire format: an AdmissionReview in, the smallest JSON patch out.

kopf's admission machinery builds a handler cause per review, deep-copies the pod and diffs the whole
of it (``jsonpatch.from_diff``) to find what a handler changed: most of a review's CPU on the loop
that serves every admission. :class:`PodWebhookServer` is kopf's own server (TLS, certificate
reloads, the client configuration) with one change: reviews of pod creations go straight to the
operator's ``admit`` (:meth:`kvfabric.operator.handlers.OperatorApp.admit`), which patches only what
:func:`~kvfabric.operator.injection.inject` changed (:func:`injection_patch`); anything else (another
path, an operation or resource the injector does not handle) goes to kopf as before.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import kopf

JsonPatch = list[dict[str, Any]]
Admit = Callable[[Mapping[str, Any]], Awaitable[dict[str, Any] | None]]


def _pointer(path: str, key: str) -> str:
    return f"{path}/{key.replace('~', '~0').replace('/', '~1')}"


def injection_patch(before: Mapping[str, Any], after: Mapping[str, Any]) -> JsonPatch:
    """RFC 6902 operations that turn ``before`` into ``after``, touching only what differs.

    Objects are compared key by key (an annotation added is one ``add``); a list that only grew at its
    end (an env variable, a volume, a mount appended) gets one ``add .../-`` per new entry; any other
    changed list or value is replaced whole. Equal subtrees cost one C-level comparison each.
    """
    ops: JsonPatch = []
    _diff(before, after, "", ops)
    return ops


def _diff(old: Any, new: Any, path: str, ops: JsonPatch) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in old:
            if key not in new:
                ops.append({"op": "remove", "path": _pointer(path, key)})
        for key, value in new.items():
            if key not in old:
                ops.append({"op": "add", "path": _pointer(path, key), "value": value})
            elif old[key] != value:
                _diff(old[key], value, _pointer(path, key), ops)
        return
    if isinstance(old, list) and isinstance(new, list):
        n = len(old)
        if len(new) >= n and new[:n] == old:
            ops += [{"op": "add", "path": f"{path}/-", "value": v} for v in new[n:]]
            return
        if len(new) == n:  # same entries, some changed in place (a container, a variable's value)
            for i, (a, b) in enumerate(zip(old, new, strict=True)):
                if a != b:
                    _diff(a, b, f"{path}/{i}", ops)
            return
    ops.append({"op": "replace", "path": path, "value": new})


def review_response(review: Mapping[str, Any], patch: JsonPatch) -> dict[str, Any]:
    """The AdmissionReview answer allowing the object, with ``patch`` when it changes anything."""
    request = review.get("request") or {}
    answer: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": True}
    if patch:
        answer["patch"] = base64.b64encode(json.dumps(patch, separators=(",", ":")).encode()).decode()
        answer["patchType"] = "JSONPatch"
    return {
        "apiVersion": review.get("apiVersion", "admission.k8s.io/v1"),
        "kind": review.get("kind", "AdmissionReview"),
        "response": answer,
    }


def is_pod_creation(review: Mapping[str, Any]) -> bool:
    """Whether ``review`` asks about a new pod (the only admission the injector answers itself)."""
    request = review.get("request")
    if not isinstance(request, Mapping):
        return False
    resource = request.get("resource") or {}
    return (
        request.get("operation") == "CREATE"
        and not request.get("subResource")
        and resource.get("group") == ""
        and resource.get("resource") == "pods"
        and isinstance(request.get("object"), Mapping)
        and request.get("userInfo") is not None
    )


class PodWebhookServer(kopf.WebhookServer):
    """kopf's webhook server whose ``webhook_id`` reviews of pod creations ``admit`` answers directly."""

    def __init__(self, *args: Any, webhook_id: str, admit: Admit | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.admit = admit
        """Set before the server starts (the operator's app is built after its server)."""
        self.webhook_id = webhook_id

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        """Serve as kopf's server does, answering pod creations through ``admit``."""

        async def direct(request: Any, *, webhook: Any = None, **kwargs: Any) -> Any:
            if self.admit is not None and webhook == self.webhook_id and is_pod_creation(request):
                answer = await self.admit(request)
                if answer is not None:
                    return answer
            return await fn(request, webhook=webhook, **kwargs)

        async for config in super().__call__(direct):
            yield config
