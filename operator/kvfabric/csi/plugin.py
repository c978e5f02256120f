"""The node plugin's gRPC services: CSI Identity and Node, and the kubelet's plugin registration.

The kubelet finds the plugin through a registration socket in its ``plugins_registry`` directory
(GetInfo names the driver and its CSI endpoint), then calls NodePublishVolume for every pod with a
``csi.kvfabric.io`` inline volume, and NodeUnpublishVolume when the pod goes. Publishing is a
read-only bind of the pool's run directory, or of a directory of the plugin's own holding the pod's
payload scope key (:mod:`kvfabric.csi.publish` decides which); there is no controller service, no
staging, nothing to attach.
"""

# ruff: noqa: N802
# (the gRPC method names are the protocol's)
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol, TypeVar

import grpc
from google.protobuf import wrappers_pb2

from kvfabric.contract.consumer_env import KEY_VOLUME_CONTENT
from kvfabric.contract.consumer_keys import KEY_FILE_NAME
from kvfabric.contract.node_paths import HOST_RUN_ROOT
from kvfabric.csi import mounts
from kvfabric.csi.publish import (
    CONTENT_ATTRIBUTE,
    DEFAULT_KEY_ROOT,
    DRIVER_NAME,
    Code,
    ConsumerKey,
    Publication,
    Refused,
    checked_target,
    key_dir,
    key_file_text,
    plan_publish,
)
from kvfabric.csi.v1 import csi_pb2, csi_pb2_grpc, pluginregistration_pb2, pluginregistration_pb2_grpc

log = logging.getLogger(__name__)

CSI_VERSIONS: Final = ["1.0.0"]
_GRPC_CODES: Final = {
    Code.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Code.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Code.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Code.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    Code.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}
_T = TypeVar("_T")


class Authorizer(Protocol):
    """What the plugin asks the API server (:class:`kvfabric.csi.access.ApiAuthorizer`)."""

    def __call__(self, p: Publication) -> str | None:
        """Why the pod's namespace may not consume another namespace's pool (None: it may)."""

    def pool_exists(self, namespace: str, pool: str) -> bool:
        """Whether the KVCachePool exists (before the plugin creates its run directory)."""

    def consumer_key(self, namespace: str, pool: str) -> ConsumerKey:
        """The pool's consumer root and key space (:class:`Refused` when either cannot be read)."""


@dataclass
class Mounter:
    """The node's side effects, swappable in tests that run without CAP_SYS_ADMIN."""

    bind_read_only: Callable[[str, str, str], None] = mounts.bind_read_only
    unmount: Callable[[str], None] = mounts.unmount
    is_mounted: Callable[[str], bool] = mounts.is_mounted
    ensure_directory: Callable[[str], None] = mounts.ensure_directory
    write_key_directory: Callable[[str, str, str], None] = mounts.write_key_directory
    remove_key_directory: Callable[[str, str], None] = mounts.remove_key_directory


@dataclass
class _TargetLock:
    """One target's lock and how many calls hold or wait for it (the entry goes when none do)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    users: int = 0


@dataclass
class NodePlugin:
    """State shared by the three services: who we are, where the node's directories are."""

    node_name: str
    kubelet_root: str
    run_root: str = HOST_RUN_ROOT
    driver_name: str = DRIVER_NAME
    version: str = "0.2.0"
    staging_root: str = "/run/kvfabric-csi"
    """A directory private to the plugin's mount namespace (an emptyDir) where binds are made
    read-only before they are attached (:func:`kvfabric.csi.mounts.bind_read_only`)."""
    key_root: str = DEFAULT_KEY_ROOT
    """A directory private to the plugin where each key volume's directory is made (0700; the
    per-volume directories inside are 0755, their key file 0444)."""
    mounter: Mounter = field(default_factory=Mounter)
    authorizer: Authorizer | None = None
    """Decides cross-namespace publications and confirms pools exist; without one, a pod gets only
    the pools of its own namespace whose run directory the cache server already made."""
    published: dict[str, Publication] = field(default_factory=dict)
    registered: threading.Event = field(default_factory=threading.Event)
    _locks: dict[str, _TargetLock] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        """The CSI socket, as the kubelet sees it (the plugin mounts the kubelet's root at its path)."""
        return f"{self.kubelet_root}/plugins/{self.driver_name}/csi.sock"

    @property
    def registration_socket(self) -> str:
        """The socket the kubelet's plugin watcher discovers."""
        return f"{self.kubelet_root}/plugins_registry/{self.driver_name}-reg.sock"

    @contextmanager
    def target_lock(self, target: str) -> Iterator[None]:
        """Serialize calls for one target path (the kubelet retries; calls must be idempotent).

        The entry is dropped when no call holds or waits for it: every pod's volume has a target of
        its own, so a map that kept them would grow with every pod the node ever ran.
        """
        with self._guard:
            entry = self._locks.setdefault(target, _TargetLock())
            entry.users += 1
        try:
            with entry.lock:
                yield
        finally:
            with self._guard:
                entry.users -= 1
                if not entry.users:
                    del self._locks[target]

    def authorize(self, p: Publication) -> None:
        """Raise :class:`Refused` unless the pod's namespace may consume the pool."""
        if not p.cross_namespace:
            return
        if self.authorizer is None:
            raise Refused(
                Code.PERMISSION_DENIED,
                f"volumeAttributes.namespace {p.namespace!r}: this plugin publishes only pools of the pod's "
                f"own namespace {p.pod_namespace!r} (started without API access)",
            )
        reason = self.authorizer(p)
        if reason is not None:
            raise Refused(
                Code.PERMISSION_DENIED,
                f"a pod of namespace {p.pod_namespace!r} may not use KVCachePool "
                f"{p.namespace}/{p.pool}: {reason}",
            )

    def publish(self, p: Publication) -> None:
        """Bind the pool's run directory (or the pod's key) at the target, read-only; idempotent.

        Only if the pod's namespace may have the pool (:meth:`authorize`).
        """
        with self.target_lock(p.target):
            if self.mounter.is_mounted(p.target):
                previous = self.published.get(p.target)
                if previous is not None and previous.source != p.source:
                    raise Refused(
                        Code.ALREADY_EXISTS, f"{p.target} is already published from {previous.source}"
                    )
                return  # the kubelet retried: nothing to do, nothing to ask the API again
            self.authorize(p)
            if p.is_key:
                self._publish_key(p)
            else:
                self._publish_run_directory(p)
            self.published[p.target] = p
        log.info(
            "published",
            extra={
                "pool": f"{p.namespace}/{p.pool}",
                "pod": f"{p.pod_namespace}/{p.pod}",
                "target": p.target,
                "source": p.source,
                "content": p.content or "run-directory",
            },
        )

    def _publish_key(self, p: Publication) -> None:
        """Write the pod's scope key into a fresh directory of the plugin's own and bind that.

        The scope is the namespace the kubelet names (or the pool's shared scope), never one the
        volume's attributes name; without the pool's consumer root nothing is published.
        """
        if self.authorizer is None:
            raise Refused(
                Code.FAILED_PRECONDITION,
                f"volumeAttributes.{CONTENT_ATTRIBUTE} {KEY_VOLUME_CONTENT!r}: this plugin was started "
                "without API access and cannot read consumer keys",
            )
        key = self.authorizer.consumer_key(p.namespace, p.pool)
        text = key_file_text(key.root, p.pod_namespace, shared=key.shared)
        self.mounter.write_key_directory(p.source, KEY_FILE_NAME, text)
        try:
            self.mounter.bind_read_only(p.source, p.target, self.staging_root)
        except BaseException:
            self.mounter.remove_key_directory(p.source, KEY_FILE_NAME)
            raise

    def _publish_run_directory(self, p: Publication) -> None:
        """Bind the pool's run directory (made first for a pool the API server has)."""
        self.mounter.ensure_directory(self.run_root)
        if not os.path.isdir(p.source):
            # The pod may start before its node's cache server: the directory then is made here,
            # empty (the server's init container makes it the server's), and the connector
            # recomputes until the socket appears. Only for a pool that exists: names a pod
            # makes up must not become directories on every node.
            if self.authorizer is None or not self.authorizer.pool_exists(p.namespace, p.pool):
                raise Refused(
                    Code.FAILED_PRECONDITION,
                    f"no KVCachePool {p.namespace}/{p.pool} serves this node (volumeAttributes.pool)",
                )
            self.mounter.ensure_directory(p.source)
        self.mounter.bind_read_only(p.source, p.target, self.staging_root)

    def unpublish(self, target: str) -> None:
        """Unmount and remove the target, and a key volume's directory; idempotent.

        A target never published (or already gone) is success.
        """
        with self.target_lock(target):
            self.mounter.unmount(target)
            # Derived from the target, not from `published`: a restarted plugin still cleans up.
            self.mounter.remove_key_directory(key_dir(target, self.key_root), KEY_FILE_NAME)
            gone = self.published.pop(target, None)
        log.info("unpublished", extra={"target": target, "pod": gone.pod if gone else None})


def _refusing(context: grpc.ServicerContext, call: Callable[[], _T]) -> _T:
    try:
        return call()
    except Refused as exc:
        log.warning("refused", extra={"reason": exc.message, "code": exc.code.value})
        context.abort(_GRPC_CODES[exc.code], exc.message)
    except OSError as exc:
        log.error("mount failed", extra={"error": str(exc)})
        context.abort(grpc.StatusCode.INTERNAL, str(exc))


class IdentityService(csi_pb2_grpc.IdentityServicer):
    """CSI Identity: the driver's name and version; no controller service to advertise."""

    def __init__(self, plugin: NodePlugin) -> None:
        self.plugin = plugin

    def GetPluginInfo(
        self, request: csi_pb2.GetPluginInfoRequest, context: grpc.ServicerContext
    ) -> csi_pb2.GetPluginInfoResponse:
        """The driver name the kubelet registered and its version."""
        return csi_pb2.GetPluginInfoResponse(name=self.plugin.driver_name, vendor_version=self.plugin.version)

    def GetPluginCapabilities(
        self, request: csi_pb2.GetPluginCapabilitiesRequest, context: grpc.ServicerContext
    ) -> csi_pb2.GetPluginCapabilitiesResponse:
        """None: no controller service (inline volumes need no provisioning)."""
        return csi_pb2.GetPluginCapabilitiesResponse(capabilities=[])

    def Probe(self, request: csi_pb2.ProbeRequest, context: grpc.ServicerContext) -> csi_pb2.ProbeResponse:
        """Ready whenever it answers: the plugin holds no state it must load first."""
        return csi_pb2.ProbeResponse(ready=wrappers_pb2.BoolValue(value=True))


class NodeService(csi_pb2_grpc.NodeServicer):
    """CSI Node: publish and unpublish; staging, stats and expansion stay UNIMPLEMENTED."""

    def __init__(self, plugin: NodePlugin) -> None:
        self.plugin = plugin

    def NodeGetCapabilities(
        self, request: csi_pb2.NodeGetCapabilitiesRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodeGetCapabilitiesResponse:
        """None: no staging, no stats, no expansion."""
        return csi_pb2.NodeGetCapabilitiesResponse(capabilities=[])

    def NodeGetInfo(
        self, request: csi_pb2.NodeGetInfoRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodeGetInfoResponse:
        """The node id: the node's name."""
        return csi_pb2.NodeGetInfoResponse(node_id=self.plugin.node_name)

    def NodePublishVolume(
        self, request: csi_pb2.NodePublishVolumeRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodePublishVolumeResponse:
        """Check the request, then bind the pool's run directory read-only at the target."""

        def publish() -> csi_pb2.NodePublishVolumeResponse:
            if not request.HasField("volume_capability"):
                raise Refused(Code.INVALID_ARGUMENT, "volume_capability is missing")
            p = plan_publish(
                volume_id=request.volume_id,
                target_path=request.target_path,
                volume_context=dict(request.volume_context),
                block=request.volume_capability.HasField("block"),
                readonly=request.readonly,
                kubelet_root=self.plugin.kubelet_root,
                run_root=self.plugin.run_root,
                key_root=self.plugin.key_root,
            )
            self.plugin.publish(p)
            return csi_pb2.NodePublishVolumeResponse()

        return _refusing(context, publish)

    def NodeUnpublishVolume(
        self, request: csi_pb2.NodeUnpublishVolumeRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodeUnpublishVolumeResponse:
        """Unmount and remove the target; idempotent."""

        def unpublish() -> csi_pb2.NodeUnpublishVolumeResponse:
            if not request.volume_id:
                raise Refused(Code.INVALID_ARGUMENT, "volume_id is empty")
            self.plugin.unpublish(checked_target(request.target_path, self.plugin.kubelet_root))
            return csi_pb2.NodeUnpublishVolumeResponse()

        return _refusing(context, unpublish)


class RegistrationService(pluginregistration_pb2_grpc.RegistrationServicer):
    """The kubelet's plugin watcher: who we are and where our CSI endpoint is."""

    def __init__(self, plugin: NodePlugin) -> None:
        self.plugin = plugin

    def GetInfo(
        self, request: pluginregistration_pb2.InfoRequest, context: grpc.ServicerContext
    ) -> pluginregistration_pb2.PluginInfo:
        """Tell the kubelet the driver name, the CSI endpoint and the CSI versions served."""
        return pluginregistration_pb2.PluginInfo(
            type="CSIPlugin",
            name=self.plugin.driver_name,
            endpoint=self.plugin.endpoint,
            supported_versions=CSI_VERSIONS,
        )

    def NotifyRegistrationStatus(
        self, request: pluginregistration_pb2.RegistrationStatus, context: grpc.ServicerContext
    ) -> pluginregistration_pb2.RegistrationStatusResponse:
        """Record the kubelet's verdict on the registration."""
        if request.plugin_registered:
            self.plugin.registered.set()
            log.info("registered with the kubelet", extra={"driver": self.plugin.driver_name})
        else:
            self.plugin.registered.clear()
            log.error("the kubelet refused the registration", extra={"error": request.error})
        return pluginregistration_pb2.RegistrationStatusResponse()


def _listen(path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    with suppress(FileNotFoundError):
        os.unlink(path)  # a previous run's socket (killed without cleaning up)


@dataclass
class RunningPlugin:
    """The two servers of a started plugin; :meth:`stop` removes the registration socket first."""

    plugin: NodePlugin
    csi: grpc.Server
    registration: grpc.Server

    def stop(self, grace: float = 2.0) -> None:
        """Stop: deregister (the watcher sees the socket go), then drain the CSI calls in flight."""
        for path in (self.plugin.registration_socket, self.plugin.endpoint):
            with suppress(FileNotFoundError):
                os.unlink(path)
        self.registration.stop(grace).wait()
        self.csi.stop(grace).wait()


def start(plugin: NodePlugin) -> RunningPlugin:
    """Serve the CSI socket, then the registration socket (the kubelet calls the CSI one right away)."""
    csi = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="csi"))
    csi_pb2_grpc.add_IdentityServicer_to_server(IdentityService(plugin), csi)  # type: ignore[no-untyped-call]
    csi_pb2_grpc.add_NodeServicer_to_server(NodeService(plugin), csi)  # type: ignore[no-untyped-call]
    _listen(plugin.endpoint)
    csi.add_insecure_port(f"unix://{plugin.endpoint}")  # root-only directory; the kubelet is the client
    csi.start()
    registration = grpc.server(futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="csi-reg"))
    pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(RegistrationService(plugin), registration)  # type: ignore[no-untyped-call]
    _listen(plugin.registration_socket)
    registration.add_insecure_port(f"unix://{plugin.registration_socket}")
    registration.start()
    log.info(
        "serving",
        extra={"driver": plugin.driver_name, "endpoint": plugin.endpoint, "node": plugin.node_name},
    )
    return RunningPlugin(plugin, csi, registration)
