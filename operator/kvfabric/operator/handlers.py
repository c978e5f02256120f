"""kopf wiring: thin handlers that feed the level-triggered reconciler and the pure injector.

Every handler is ``async``: kopf runs sync handlers in a thread pool, but these only touch in-memory
state and the event loop's reconcile queue, which must happen on the loop.

Only ``@kopf.on.event``, ``@kopf.index``, ``@kopf.on.mutate`` and ``@kopf.on.probe`` handlers are used.
None of them makes kopf persist anything: no diff-base or progress annotations, no finalizers. A
restarted operator therefore sees exactly what a fresh one sees, and ``kubectl replace`` or a GitOps
re-apply can never leave kopf believing a change was "already handled" (kopf #966).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from kvfabric.operator.admission import injection_patch, review_response
from kvfabric.operator.api.v1alpha1 import GROUP, PLURAL, POOL_LABEL, VERSION
from kvfabric.operator.controller import Controller, Election
from kvfabric.operator.injection import (
    SKIP_NO_PAYLOAD_KEY,
    InjectionResult,
    PoolTarget,
    inject,
    pool_key_of,
    pool_target,
)
from kvfabric.operator.kube import SA_TOKEN, ApiError, KubeClient, bearer_token, load_configuration
from kvfabric.operator.opmetrics import WebhookCounter
from kvfabric.operator.reconcile import PoolKey
from kvfabric.operator.render import names
from kvfabric.operator.runtimestats import GcPauses, LoopLag, current_native_id, thread_cpu_seconds
from kvfabric.operator.servingcert import ServingCertificate

log = logging.getLogger("kvfabric.operator")

WEBHOOK_ID = "mutate-pods"
_CHILD_KINDS = (
    ("apps", "v1", "daemonsets"),
    ("", "v1", "configmaps"),
    ("", "v1", "services"),
    ("", "v1", "persistentvolumeclaims"),
)


@dataclass
class WebhookRegistration:
    """The MutatingWebhookConfiguration this operator applies and keeps current.

    ``render`` maps the names of pools with ``failurePolicy: Fail`` to the configuration (see
    :func:`kvfabric.operator.webhookconfig.render_webhook_configuration`).
    """

    render: Callable[[list[str]], dict[str, Any]]
    namespaces: list[str] | None = None
    required: frozenset[str] | None = None

    async def sync(self, client: KubeClient) -> None:
        """Apply the configuration for the pools that exist now, if it changed."""
        pools: list[dict[str, Any]] = []
        scopes: list[str | None] = list(self.namespaces) if self.namespaces else [None]
        for ns in scopes:
            pools += await client.list("KVCachePool", ns)
        required = frozenset(
            p["metadata"]["name"]
            for p in pools
            if (p.get("spec", {}).get("consumers") or {}).get("failurePolicy") == "Fail"
        )
        if required != self.required:
            await client.apply(self.render(sorted(required)), field_manager=names.FIELD_MANAGER)
            self.required = required


@dataclass
class OperatorApp:
    """The operator's runtime state, shared by its handlers (one per process).

    kopf's loop keeps what the webhook needs (pools, namespace labels) and serves admissions; the
    :class:`~kvfabric.operator.controller.Controller` reconciles on its own thread, with its own client.
    """

    client: KubeClient
    injection_enabled: bool
    kubeconfig: str | None = None
    context: str | None = None
    registration: WebhookRegistration | None = None
    resync_seconds: float = 30.0
    namespaces: list[str] | None = None
    election: Election | None = None
    controller: Controller = field(init=False)
    pools: dict[PoolKey, PoolTarget] = field(default_factory=dict)
    namespace_labels: dict[str, dict[str, str]] = field(default_factory=dict)
    freeze_gc: bool = False
    """Freeze the garbage collector's view once the caches are complete (the operator process does)."""
    serving: ServingCertificate | None = None
    """The webhook's serving certificate, refreshed in place on kopf's loop."""
    csi_driver: str | None = None
    """The node plugin's driver name when it is installed: consumers get a CSI volume, no hostPath."""
    webhook_pods: WebhookCounter = field(default_factory=WebhookCounter)
    """What the injection webhook did with each pod (``--metrics-addr`` serves it)."""
    gc_pauses: GcPauses = field(default_factory=GcPauses)
    loop_lag: LoopLag = field(default_factory=LoopLag)
    """How late kopf's loop (the webhook's) wakes up: what an admission waits before it is read."""
    _serving_task: asyncio.Task[None] | None = None
    _lag_task: asyncio.Task[None] | None = None
    unknown_pool_wait: float = 0.25
    """How long an admission waits for the watch to deliver a pool it names that is not known yet,
    before it reads the pool from the API server (once, within :attr:`unknown_pool_read_timeout`)."""
    unknown_pool_read_timeout: float = 2.0
    _pool_added: asyncio.Event | None = None
    _webhook_thread: int | None = None

    async def pools_for(self, pod: Mapping[str, Any], namespace: str | None) -> Mapping[PoolKey, PoolTarget]:
        """The known pools, with the pod's own pool among them if it exists.

        Right after start-up (before kopf has delivered every pool), while the pool watch
        reconnects, or right after a pool was created, the pod's pool may be missing from
        :attr:`pools`: answering "pool-not-found" then would silently skip a ``Fail`` pool's pod.
        The admission first waits :attr:`unknown_pool_wait` for the pool's watch event (a pool
        created a moment before its pods usually arrives in that time, and costs the API server
        nothing), then reads the pool from the API server once, bounded; a pool found so is
        remembered. Pods of known pools, the whole of a storm, never wait or call.
        """
        key = pool_key_of(pod, namespace)
        if key is None or key in self.pools:
            return self.pools
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.unknown_pool_wait
        while key not in self.pools and (remaining := deadline - loop.time()) > 0:
            if self._pool_added is None:
                self._pool_added = asyncio.Event()
            added = self._pool_added
            try:
                async with asyncio.timeout(remaining):
                    await added.wait()
            except TimeoutError:
                break
        if key in self.pools:
            return self.pools
        try:
            async with asyncio.timeout(self.unknown_pool_read_timeout):
                raw = await self.client.get("KVCachePool", key[0], key[1])
        except (ApiError, OSError, TimeoutError) as exc:
            log.warning("could not read KVCachePool %s/%s for injection: %s", *key, exc)
            return self.pools
        target = pool_target(raw) if raw is not None else None
        if target is not None and key not in self.pools:
            self.pools[key] = target
        return self.pools

    def pool_seen(self, key: PoolKey, target: PoolTarget) -> None:
        """Record a pool's injection view (from its watch) and wake the admissions waiting for it."""
        self.pools[key] = target
        if self._pool_added is not None:
            self._pool_added.set()
            self._pool_added = None

    async def injection(self, pod: Mapping[str, Any], namespace: str | None) -> InjectionResult | None:
        """What the webhook does with ``pod`` (counted), or None when it failed (logged: admit unchanged)."""
        try:
            pools = await self.pools_for(pod, namespace)
            result = inject(
                pod, pools, self.namespace_labels, request_namespace=namespace, csi_driver=self.csi_driver
            )
        except Exception:
            # Fail open: a bug here must never block an inference pod.
            log.exception("injection failed; admitting the pod unchanged")
            self.webhook_pods.count(injected=False, error=True)
            return None
        self.webhook_pods.count(injected=result.injected, skip_reason=result.skip_reason)
        if result.skip_reason == SKIP_NO_PAYLOAD_KEY:
            # An install without the CSI node plugin: the fix is the cluster admin's, say it.
            log.warning("pod %s not injected: %s", pod.get("metadata", {}).get("name"), result.detail)
        return result

    async def admit(self, review: Mapping[str, Any]) -> dict[str, Any]:
        """Answer an AdmissionReview of a pod creation: allowed, patched with only what was injected."""
        request = review["request"]
        pod = request["object"]
        result = await self.injection(pod, request.get("namespace") or None)
        patch = []
        if result is not None:
            try:
                patch = injection_patch(pod, result.pod)
            except Exception:  # fail open, as above
                log.exception("could not build the injection patch; admitting the pod unchanged")
        return review_response(review, patch)

    def __post_init__(self) -> None:
        self.controller = Controller(
            self.client.clone,
            injection_enabled=self.injection_enabled,
            namespaces=self.namespaces,
            resync_seconds=self.resync_seconds,
            election=self.election,
            webhook_not_after=lambda: self.serving.not_after if self.serving is not None else None,
            freeze_gc=self.freeze_gc,
        )

    def runtime(self) -> dict[str, Any]:
        """Loop lag, garbage-collector pauses and CPU per thread, cumulative (the ``runtime`` probe)."""
        threads = {"controller": self.controller.native_id}
        if self._webhook_thread is not None:
            threads["webhook"] = self._webhook_thread
        return {
            "webhook_loop_lag": self.loop_lag.histogram.snapshot(),
            "gc": self.gc_pauses.snapshot(),
            "thread_cpu_s": thread_cpu_seconds({k: v for k, v in threads.items() if v is not None}),
            # What the reconciles cost the API server (GETs, applies, status writes, informers' lists).
            "controller_api_requests": self.controller.api_requests(),
        }

    @property
    def reconciles(self) -> int:
        """Reconciles run by this replica (a probe, and the benchmark, read it)."""
        return self.controller.reconciles


def configure_settings(settings: kopf.OperatorSettings) -> None:
    """Apply the operator's kopf settings (also used by tests)."""
    # Our handlers keep no state in the objects; these storages are configured so that, should a
    # stateful handler ever be added, kopf writes under our own prefix instead of kopf.zalando.org.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvfabric.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kvfabric.io", key="last-handled-configuration"
    )
    settings.persistence.finalizer = "kvfabric.io/operator"
    # kopf would otherwise turn handler log lines into Kubernetes Events; we post our own, meaningful ones.
    settings.posting.enabled = False
    # Server-side filtering: without it kopf would stream every ConfigMap, Service, DaemonSet, PVC and
    # Pod of the cluster and drop the unrelated ones itself (the handlers' labels= filter client-side).
    owned = f"{names.MANAGED_BY}={names.MANAGED_BY_VALUE},{names.OWNER_POOL_LABEL}"
    for group, version, plural in _CHILD_KINDS:
        settings.watching.label_selectors[group, version, plural] = owned
    settings.watching.label_selectors["", "v1", "pods"] = POOL_LABEL
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60
    # The injection webhook configuration is shipped as a manifest (or registered by the CLI), never
    # generated by kopf: kopf's managed mode cannot set a namespaceSelector or timeout (kopf #864).
    settings.admission.managed = None


def build_registry(
    app: OperatorApp,
    *,
    webhook_server: Any | None,
    namespaces: list[str] | None,
) -> kopf.OperatorRegistry:
    """Register every handler on a fresh registry bound to ``app``."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_settings(settings)
        if webhook_server is not None:
            settings.admission.server = webhook_server
        if app.registration is not None:
            # Registered before any watch starts, so pods created right after start-up are injected.
            # Right after the CRD is installed the API server answers 429/404 for a moment: retry
            # briefly here rather than let kopf retry the whole start-up a minute later.
            for attempt in range(60):
                try:
                    await app.registration.sync(app.client)
                    break
                except ApiError as exc:
                    if attempt == 59 or exc.status not in (404, 429, 500, 503):
                        raise
                    await asyncio.sleep(0.5)
        if app.serving is not None:
            app._serving_task = asyncio.get_running_loop().create_task(app.serving.run())
        app.gc_pauses.install()
        app._webhook_thread = current_native_id()
        app._lag_task = asyncio.get_running_loop().create_task(app.loop_lag.run())
        app.controller.start()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        # A custom registry does not inherit kopf's default login handlers; use the same kubeconfig
        # (or in-cluster account) as our own client, passed explicitly.
        cfg, in_cluster = load_configuration(app.kubeconfig, app.context)
        token = bearer_token(cfg)
        if in_cluster and SA_TOKEN.exists():
            token = SA_TOKEN.read_text().strip()
        return kopf.ConnectionInfo(
            server=cfg.host,
            ca_path=cfg.ssl_ca_cert,
            insecure=not cfg.verify_ssl,
            scheme="Bearer" if token else None,
            token=token,
            certificate_path=cfg.cert_file,
            private_key_path=cfg.key_file,
        )

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        for task in (app._serving_task, app._lag_task):
            if task is not None:
                task.cancel()
        # Joined off the loop: the controller releases its Lease, so a standby takes over at once.
        await asyncio.to_thread(app.controller.stop)
        await app.client.close()

    @kopf.on.probe(id="reconciles", registry=registry)
    async def probe_reconciles(**_: Any) -> int:
        return app.reconciles

    @kopf.on.probe(id="runtime", registry=registry)
    async def probe_runtime(**_: Any) -> dict[str, Any]:
        return app.runtime()

    @kopf.on.probe(id="leader", registry=registry)
    async def probe_leader(**_: Any) -> bool:
        return app.controller.leading

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def pool_event(
        *, event: kopf.RawEvent, namespace: str | None, name: str, body: kopf.Body, **_: Any
    ) -> None:
        key = (namespace or "", name)
        if event.get("type") == "DELETED":
            gone = app.pools.pop(key, None)
            app.controller.forget(key, dict(body))
            if app.registration is not None and gone is not None and gone.injection_required:
                try:
                    await app.registration.sync(app.client)
                except ApiError as exc:
                    log.warning("could not update the webhook configuration: %s", exc)
            return
        target = pool_target(body)
        previous = app.pools.get(key)
        if target is not None:
            # Kept here (not in a kopf index) so the webhook sees a pool as soon as it is known.
            app.pool_seen(key, target)
        if not app.controller.own_status_echo(key, body):
            # Our own status write coming back is skipped: reconciling it would only find that
            # nothing changed (half of all passes while pools come up, each a dozen API calls).
            version = (body.get("metadata") or {}).get("resourceVersion")
            app.controller.trigger(key, version=str(version) if version else None)
        required = target is not None and target.injection_required
        if app.registration is not None and (previous is None or previous.injection_required != required):
            try:
                await app.registration.sync(app.client)
            except ApiError as exc:  # the next pool event or restart retries; injection still works
                log.warning("could not update the webhook configuration: %s", exc)

    # Children, cache-server pods and consumer pods are watched by the controller's informers (its
    # own thread), which map each change to its pool: kopf watches only pools and namespaces.

    @kopf.on.event("", "v1", "namespaces", registry=registry)
    async def namespace_event(
        *, event: kopf.RawEvent, name: str, labels: Mapping[str, str], **_: Any
    ) -> None:
        if event.get("type") == "DELETED":
            app.namespace_labels.pop(name, None)
        else:
            app.namespace_labels[name] = dict(labels)

    if webhook_server is not None:

        @kopf.on.mutate("", "v1", "pods", id=WEBHOOK_ID, operations=["CREATE"], registry=registry)
        async def mutate_pod(*, body: kopf.Body, patch: kopf.Patch, namespace: str | None, **_: Any) -> None:
            # Pod creations reach OperatorApp.admit directly (PodWebhookServer); this is kopf's path,
            # for a server that does not shortcut it.
            result = await app.injection(body, namespace)
            if result is None:
                return
            new_pod = result.pod

            def replace(raw: kopf.RawBody) -> None:
                target = cast(dict[str, Any], raw)
                target.clear()
                target.update(new_pod)

            patch.fns.append(replace)

    return registry
