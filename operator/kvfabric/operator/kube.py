"""A small asyncio Kubernetes client: the few verbs the reconciler needs, over aiohttp.

kopf is not a client, and the official client is synchronous. This one reuses the official client's
kubeconfig / in-cluster loading for credentials and does the HTTP itself, so server-side apply is a
plain ``PATCH`` with ``application/apply-patch+yaml`` and the event loop is never blocked.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

import aiohttp

# kind -> (API path prefix, plural) for every kind the operator touches.
_KINDS: Final[dict[str, tuple[str, str]]] = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Secret": ("/api/v1", "secrets"),
    "Service": ("/api/v1", "services"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
    "Pod": ("/api/v1", "pods"),
    "Event": ("/api/v1", "events"),
    "Namespace": ("/api/v1", "namespaces"),
    "DaemonSet": ("/apis/apps/v1", "daemonsets"),
    "Lease": ("/apis/coordination.k8s.io/v1", "leases"),
    "KVCachePool": ("/apis/kvfabric.io/v1alpha1", "kvcachepools"),
    "MutatingWebhookConfiguration": (
        "/apis/admissionregistration.k8s.io/v1",
        "mutatingwebhookconfigurations",
    ),
}
_CLUSTER_SCOPED: Final = {"Namespace", "MutatingWebhookConfiguration"}
SA_TOKEN: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


class ApiError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, body: str, *, method: str, path: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body

    @property
    def message(self) -> str:
        """Return the Status object's message (what the API server says is wrong), else the body."""
        try:
            return str(json.loads(self.body).get("message") or self.body[:1000])
        except ValueError:
            return self.body[:1000]

    @property
    def rejected(self) -> bool:
        """Whether the request itself was refused (invalid, forbidden): retrying unchanged cannot help."""
        return 400 <= self.status < 500 and self.status not in (404, 408, 409, 429)

    @property
    def reason(self) -> str:
        """Return the Status object's reason (e.g. ``Conflict``), if any."""
        try:
            return str(json.loads(self.body).get("reason", ""))
        except ValueError:
            return ""


def load_configuration(kubeconfig: str | None = None, context: str | None = None) -> tuple[Any, bool]:
    """Return the official client's Configuration for a kubeconfig or the in-cluster account.

    The second value says whether the in-cluster account was used. The path is passed explicitly
    because the official client reads ``$KUBECONFIG`` only once, at import time.
    """
    from kubernetes import client as k8s_client
    from kubernetes import config as k8s_config

    cfg = k8s_client.Configuration()
    # expanduser, not Path.home(): the latter raises for a uid without a passwd entry (distroless images).
    path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    if Path(path).exists():
        k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=path, context=context, client_configuration=cfg
        )
        return cfg, False
    k8s_config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    return cfg, True


def bearer_token(cfg: Any) -> str | None:
    """Return the bearer token of a Configuration, if it has one."""
    auth = cfg.api_key.get("BearerToken") or cfg.api_key.get("authorization")
    if not auth:
        return None
    return str(auth).removeprefix("Bearer ").removeprefix("bearer ")


def resource_path(kind: str, namespace: str | None = None, name: str | None = None) -> str:
    """Return the REST path of a collection (``name`` None) or an object of a known kind."""
    prefix, plural = _KINDS[kind]
    path = prefix
    if namespace is not None and kind not in _CLUSTER_SCOPED:
        path += f"/namespaces/{quote(namespace, safe='')}"
    path += f"/{plural}"
    if name is not None:
        path += f"/{quote(name, safe='')}"
    return path


class KubeClient:
    """Async access to one API server with one identity."""

    def __init__(
        self,
        server: str,
        *,
        ssl_context: ssl.SSLContext | bool,
        token: str | None = None,
        token_file: Path | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.server = server.rstrip("/")
        self._ssl = ssl_context
        self._token = token
        self._token_file = token_file
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self.requests: collections.Counter[str] = collections.Counter()
        """Requests sent, by method (watches as ``WATCH``): the benchmark reports them."""

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None, context: str | None = None) -> KubeClient:
        """Build a client from a kubeconfig (``$KUBECONFIG``/``~/.kube/config``) or the in-cluster account."""
        cfg, in_cluster = load_configuration(kubeconfig, context)
        ctx: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=cfg.ssl_ca_cert) if cfg.verify_ssl else False
        )
        if cfg.cert_file and cfg.key_file:
            if not isinstance(ctx, ssl.SSLContext):
                ctx = ssl.create_default_context()
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        # Projected service-account tokens rotate: re-read the file on every request.
        return cls(
            str(cfg.host),
            ssl_context=ctx,
            token=bearer_token(cfg),
            token_file=SA_TOKEN if in_cluster else None,
        )

    def clone(self) -> KubeClient:
        """Return a client with the same server and identity and its own HTTP session (for another loop)."""
        clone = KubeClient(self.server, ssl_context=self._ssl, token=self._token, token_file=self._token_file)
        clone._timeout = self._timeout
        return clone

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        token = self._token
        if self._token_file is not None and self._token_file.exists():
            token = self._token_file.read_text().strip()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        """Send one request; return the decoded JSON body or raise :class:`ApiError`."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(ssl=self._ssl, limit=32)
            )
        self.requests[method] += 1
        data = None if body is None else json.dumps(body)
        if data is not None and content_type is None:
            content_type = "application/json"
        async with self._session.request(
            method, self.server + path, params=params, data=data, headers=self._headers(content_type)
        ) as response:
            text = await response.text()
            if response.status >= 300:
                raise ApiError(response.status, text, method=method, path=path)
            return dict(json.loads(text)) if text else {}

    async def list_page(self, kind: str, namespace: str | None, params: dict[str, str]) -> dict[str, Any]:
        """Return one page of a collection as the API server sends it (items, metadata.continue, ...)."""
        return await self.request("GET", resource_path(kind, namespace), params=params)

    async def watch(
        self, kind: str, namespace: str | None, params: dict[str, str]
    ) -> AsyncIterator[dict[str, Any]]:
        """Yield a collection's watch events (``{"type": ..., "object": ...}``) until the server ends it."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(ssl=self._ssl, limit=32)
            )
        path = resource_path(kind, namespace)
        self.requests["WATCH"] += 1
        query = {**params, "watch": "true", "allowWatchBookmarks": "true"}
        # No total timeout: the server ends the stream after timeoutSeconds; a silent stream is dead.
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=30, sock_read=float(query.get("timeoutSeconds", 300)) + 30
        )
        async with self._session.get(
            self.server + path, params=query, headers=self._headers(None), timeout=timeout
        ) as response:
            if response.status >= 300:
                raise ApiError(response.status, await response.text(), method="WATCH", path=path)
            async for line in response.content:
                if line.strip():
                    yield dict(json.loads(line))

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """Return one object, or None when it does not exist."""
        try:
            return await self.request("GET", resource_path(kind, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(
        self,
        kind: str,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        """Return the items of a collection (all namespaces when ``namespace`` is None)."""
        params = {}
        if label_selector:
            params["labelSelector"] = label_selector
        if field_selector:
            params["fieldSelector"] = field_selector
        answer = await self.request("GET", resource_path(kind, namespace), params=params or None)
        return list(answer.get("items") or [])

    async def apply(self, obj: dict[str, Any], *, field_manager: str, force: bool = True) -> dict[str, Any]:
        """Server-side apply ``obj`` (which must carry apiVersion, kind and metadata.name)."""
        meta = obj["metadata"]
        path = resource_path(obj["kind"], meta.get("namespace"), meta["name"])
        params = {"fieldManager": field_manager, "force": "true" if force else "false"}
        # JSON is YAML, so the apply content type accepts the JSON encoding.
        return await self.request(
            "PATCH", path, params=params, body=obj, content_type="application/apply-patch+yaml"
        )

    async def patch_status(
        self,
        kind: str,
        namespace: str,
        name: str,
        status: dict[str, Any],
        *,
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        """Merge-patch the status subresource (guarded by ``resource_version`` when given)."""
        body: dict[str, Any] = {"status": status}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        return await self.request(
            "PATCH",
            resource_path(kind, namespace, name) + "/status",
            body=body,
            content_type="application/merge-patch+json",
        )

    async def patch(
        self,
        kind: str,
        namespace: str | None,
        name: str,
        body: Any,
        *,
        content_type: str = "application/merge-patch+json",
    ) -> dict[str, Any]:
        """Patch one object: a JSON merge patch (a dict), or a JSON patch (a list, with its content type)."""
        return await self.request(
            "PATCH", resource_path(kind, namespace, name), body=body, content_type=content_type
        )

    async def delete(self, kind: str, namespace: str | None, name: str) -> bool:
        """Delete one object (background propagation); return False when it was already gone."""
        try:
            await self.request(
                "DELETE",
                resource_path(kind, namespace, name),
                body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            )
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Replace ``obj`` (PUT; its metadata.resourceVersion makes it a compare-and-swap)."""
        meta = obj["metadata"]
        return await self.request(
            "PUT", resource_path(obj["kind"], meta.get("namespace"), meta["name"]), body=obj
        )

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create ``obj`` (POST to its collection)."""
        meta = obj["metadata"]
        return await self.request("POST", resource_path(obj["kind"], meta.get("namespace")), body=obj)


async def gather_limited(limit: int, *coros: Any) -> list[Any]:
    """Run coroutines concurrently, at most ``limit`` at a time; return their results in order."""
    semaphore = asyncio.Semaphore(limit)

    async def one(coro: Any) -> Any:
        async with semaphore:
            return await coro

    return list(await asyncio.gather(*(one(c) for c in coros)))
