"""What a NodePublishVolume request may publish: a pure decision, checked before any mount.

Two kinds of volume: the pool's run directory (the cache server's sockets; no ``content``
attribute), and, with ``content: payload-key``, a directory holding the pod's payload *scope key*
(``kvfabric.contract.consumer_keys``), which the plugin derives for the namespace the kubelet names,
whatever the attributes say. Both are authorized alike.

The kubelet is trusted (its socket is root-only), the pod's author is not: the volume attributes
come from the pod spec, so anyone who may create a pod in a namespace chooses them. The kubelet
adds the pod's namespace (``podInfoOnMount`` on the CSIDriver). A pod of the pool's own namespace
may always have it; a pod of another namespace only if the pool's ``spec.consumers.namespaceSelector``
selects its namespace, which :func:`cross_namespace_refusal` checks against the live objects (the
plugin reads them from the API server; the webhook's decision is not trusted, the pod may not have
passed through it).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Final

from kvfabric.contract.consumer_env import CONSUMER_KEYS_SECRET, KEY_VOLUME_CONTENT, consumer_keys_entry
from kvfabric.contract.consumer_keys import decode_key, encode_key, scope_for, scope_key
from kvfabric.contract.node_paths import HOST_RUN_ROOT, host_dir
from kvfabric.contract.selectors import label_selector_matches

DRIVER_NAME: Final = "csi.kvfabric.io"
POOL_ATTRIBUTE: Final = "pool"
# Optional: the pool's namespace (default: the pod's own).
NAMESPACE_ATTRIBUTE: Final = "namespace"
# Optional: what the volume holds; absent: the pool's run directory.
CONTENT_ATTRIBUTE: Final = "content"
CONTENTS: Final = frozenset({KEY_VOLUME_CONTENT})
DEFAULT_KEY_ROOT: Final = "/run/kvfabric-csi/keys"
SHARED_KEY_SPACE: Final = "Shared"
"""``spec.consumers.keySpace`` of a pool whose consumer namespaces share one key space."""
# Set by the kubelet (podInfoOnMount and inline ephemeral volumes), never by the pod's author.
POD_NAMESPACE_KEY: Final = "csi.storage.k8s.io/pod.namespace"
POD_NAME_KEY: Final = "csi.storage.k8s.io/pod.name"
POD_UID_KEY: Final = "csi.storage.k8s.io/pod.uid"
EPHEMERAL_KEY: Final = "csi.storage.k8s.io/ephemeral"
_KUBELET_KEYS: Final = frozenset(
    {
        POD_NAMESPACE_KEY,
        POD_NAME_KEY,
        POD_UID_KEY,
        EPHEMERAL_KEY,
        "csi.storage.k8s.io/serviceAccount.name",
        "csi.storage.k8s.io/serviceAccount.tokens",  # only if an admin adds tokenRequests
    }
)
# fullmatch, never match with "$": that also accepts a trailing newline.
_DNS_LABEL: Final = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_UID: Final = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[-0-9a-zA-Z]{1,64}")


class Code(Enum):
    """The gRPC status a refusal maps to (the CSI spec's error table for NodePublishVolume)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    UNAVAILABLE = "UNAVAILABLE"


class Refused(Exception):  # noqa: N818 (a refusal, not an error of the plugin)
    """The request is refused; the message names the field at fault."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Publication:
    """A checked request: bind ``source`` read-only at ``target``.

    ``source`` is the pool's run directory, or for a key volume (``content``) a directory of the
    plugin's own that it fills with the pod's key first.
    """

    source: str
    target: str
    namespace: str
    """The pool's namespace."""
    pool: str
    pod_namespace: str
    pod: str
    content: str = ""
    """``volumeAttributes.content``: empty for the run directory, ``payload-key`` for the key."""

    @property
    def is_key(self) -> bool:
        """Whether this volume carries the pod's payload key (not the pool's sockets)."""
        return self.content == KEY_VOLUME_CONTENT

    @property
    def cross_namespace(self) -> bool:
        """Whether the pod is of another namespace than the pool (the API must be asked)."""
        return self.namespace != self.pod_namespace


def checked_target(target_path: str, kubelet_root: str) -> str:
    """Return ``target_path`` if it is a normalized absolute path below the kubelet's pods directory.

    Defence in depth: only the kubelet can call, but a mount at any other path (``/etc``) would be a
    way to hide a node's own files.
    """
    pods = posixpath.join(kubelet_root, "pods") + "/"
    if not target_path or not target_path.startswith("/") or posixpath.normpath(target_path) != target_path:
        raise Refused(Code.INVALID_ARGUMENT, f"target_path {target_path!r} is not a normalized absolute path")
    if not target_path.startswith(pods):
        raise Refused(Code.INVALID_ARGUMENT, f"target_path {target_path!r} is not below {pods}")
    return target_path


def key_dir(target: str, key_root: str = DEFAULT_KEY_ROOT) -> str:
    """The plugin's own directory behind the key volume at ``target``.

    One per target (a pod's volume); its name is a digest of the kubelet's target path, nothing the
    pod's author chose.
    """
    return posixpath.join(key_root, hashlib.sha256(target.encode()).hexdigest()[:32])


def plan_publish(
    *,
    volume_id: str,
    target_path: str,
    volume_context: Mapping[str, str],
    block: bool,
    kubelet_root: str,
    readonly: bool = True,
    run_root: str = HOST_RUN_ROOT,
    key_root: str = DEFAULT_KEY_ROOT,
) -> Publication:
    """Check a NodePublishVolume request; return what to publish or raise :class:`Refused`."""
    if not volume_id:
        raise Refused(Code.INVALID_ARGUMENT, "volume_id is empty")
    target = checked_target(target_path, kubelet_root)
    if block:
        raise Refused(Code.INVALID_ARGUMENT, "volume_capability: only mount volumes are served, not block")
    if not readonly:
        # The kubelet then mounts the volume read-only into every container of the pod as well.
        raise Refused(Code.INVALID_ARGUMENT, f"{DRIVER_NAME} volumes must be readOnly: true (csi.readOnly)")
    if volume_context.get(EPHEMERAL_KEY) != "true":
        raise Refused(
            Code.FAILED_PRECONDITION,
            f"{DRIVER_NAME} serves only CSI ephemeral inline volumes (volume_context[{EPHEMERAL_KEY!r}] "
            "is not 'true')",
        )
    namespace = volume_context.get(POD_NAMESPACE_KEY, "")
    if not _DNS_LABEL.fullmatch(namespace):
        raise Refused(
            Code.FAILED_PRECONDITION,
            f"volume_context[{POD_NAMESPACE_KEY!r}] is missing: the CSIDriver must set podInfoOnMount",
        )
    # podInfoOnMount passes the pod's uid too, and the kubelet's target lies in that pod's directory:
    # a context without it (the CSIDriver edited) would let the attributes name the namespace.
    uid = volume_context.get(POD_UID_KEY, "")
    if not _UID.fullmatch(uid) or not target.startswith(posixpath.join(kubelet_root, "pods", uid) + "/"):
        raise Refused(
            Code.FAILED_PRECONDITION,
            f"volume_context[{POD_UID_KEY!r}] {uid!r} is missing or not the target's pod: the CSIDriver "
            "must set podInfoOnMount",
        )
    unknown = sorted(
        set(volume_context) - _KUBELET_KEYS - {POOL_ATTRIBUTE, NAMESPACE_ATTRIBUTE, CONTENT_ATTRIBUTE}
    )
    if unknown:
        raise Refused(
            Code.INVALID_ARGUMENT,
            f"volumeAttributes {unknown} are not known; {DRIVER_NAME} takes {POOL_ATTRIBUTE!r} and "
            f"optionally {NAMESPACE_ATTRIBUTE!r} and {CONTENT_ATTRIBUTE!r}",
        )
    content = volume_context.get(CONTENT_ATTRIBUTE, "")
    if CONTENT_ATTRIBUTE in volume_context and content not in CONTENTS:
        raise Refused(
            Code.INVALID_ARGUMENT,
            f"volumeAttributes.{CONTENT_ATTRIBUTE} {content[:64]!r} is not known; it may be "
            f"{sorted(CONTENTS)} (or absent: the pool's socket directory)",
        )
    pool = volume_context.get(POOL_ATTRIBUTE, "")
    if not _DNS_LABEL.fullmatch(pool):
        raise Refused(
            Code.INVALID_ARGUMENT,
            f"volumeAttributes.{POOL_ATTRIBUTE} {pool!r} must name a KVCachePool (a DNS label)",
        )
    pool_namespace = volume_context.get(NAMESPACE_ATTRIBUTE, namespace)
    if not _DNS_LABEL.fullmatch(pool_namespace):
        raise Refused(
            Code.INVALID_ARGUMENT,
            f"volumeAttributes.{NAMESPACE_ATTRIBUTE} {pool_namespace!r} must name a namespace (a DNS label)",
        )
    return Publication(
        source=key_dir(target, key_root) if content else host_dir(pool_namespace, pool, run_root),
        target=target,
        namespace=pool_namespace,
        pool=pool,
        pod_namespace=namespace,
        pod=volume_context.get(POD_NAME_KEY, ""),
        content=content,
    )


def cross_namespace_refusal(
    pool_body: Mapping[str, Any] | None, pod_namespace: str, namespace_labels: Mapping[str, str]
) -> str | None:
    """Why a pod of ``pod_namespace`` may not consume the pool (None: it may).

    ``pool_body`` is the KVCachePool as the API server has it (None: there is none). Only the pool's
    own ``spec.consumers.namespaceSelector`` grants another namespace access, as for the webhook.
    """
    if pool_body is None:
        return "no such KVCachePool"
    meta = pool_body.get("metadata") or {}
    name = f"{meta.get('namespace')}/{meta.get('name')}"
    selector = ((pool_body.get("spec") or {}).get("consumers") or {}).get("namespaceSelector")
    if selector is None:
        return f"{name} has no spec.consumers.namespaceSelector: only pods of its own namespace may use it"
    if not label_selector_matches(selector, namespace_labels):
        return f"spec.consumers.namespaceSelector of {name} does not select namespace {pod_namespace}"
    return None


@dataclass(frozen=True)
class ConsumerKey:
    """What the plugin needs to derive a pod's scope key: the pool's consumer root and key space."""

    root: bytes = field(repr=False)
    shared: bool
    """``spec.consumers.keySpace: Shared``: every consumer namespace gets the one shared scope."""


def pool_shares_keys(pool_body: Mapping[str, Any]) -> bool:
    """Whether the pool's consumer namespaces share one key space (``spec.consumers.keySpace``).

    Anything but ``Shared`` (absent, ``PerNamespace``, a value this plugin does not know) is a key
    space per namespace: the choice that shares nothing.
    """
    consumers = (pool_body.get("spec") or {}).get("consumers") or {}
    return consumers.get("keySpace") == SHARED_KEY_SPACE


def consumer_root_from_secret(secret_data: Mapping[str, str] | None, pool_namespace: str, pool: str) -> bytes:
    """The pool's consumer root from the data (base64, as the API has it) of the consumer-keys Secret.

    :class:`Refused` (``UNAVAILABLE``: the kubelet retries, the operator may not have written it yet)
    when the Secret or the pool's entry is missing or is not a key: never an empty or a wrong key.
    """
    entry = consumer_keys_entry(pool_namespace, pool)
    if secret_data is None:
        raise Refused(
            Code.UNAVAILABLE,
            f"Secret {CONSUMER_KEYS_SECRET} (in the plugin's namespace) is missing: the operator writes "
            f"the consumer key of KVCachePool {pool_namespace}/{pool} there",
        )
    value = secret_data.get(entry)
    if not value:
        raise Refused(
            Code.UNAVAILABLE,
            f"Secret {CONSUMER_KEYS_SECRET} has no entry {entry!r}: no consumer key for KVCachePool "
            f"{pool_namespace}/{pool} yet",
        )
    try:
        return decode_key(base64.b64decode(value, validate=True).decode("ascii"))
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise Refused(
            Code.UNAVAILABLE, f"Secret {CONSUMER_KEYS_SECRET} entry {entry!r} does not hold a key"
        ) from None


def key_file_text(root: bytes, pod_namespace: str, *, shared: bool) -> str:
    """What the key volume of a pod of ``pod_namespace`` holds: its scope key, hex, one line."""
    return encode_key(scope_key(root, scope_for(pod_namespace, shared=shared))) + "\n"
