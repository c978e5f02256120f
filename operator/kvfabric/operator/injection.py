"""Connector injection into consumer pods: a pure function of (pod, known pools, namespace labels).

The webhook handler in :mod:`kvfabric.operator.handlers` only feeds this function from kopf's indexes
and turns its result into a JSON patch. Every addition is "set if absent", so running it twice yields
the same pod (the API server may reinvoke webhooks), and nothing here can raise for a well-formed pod.
"""

from __future__ import annotations

import copy
import json
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvfabric.contract.consumer_env import ConsumerVar, key_env
from kvfabric.contract.selectors import label_selector_matches
from kvfabric.operator.api.v1alpha1 import POOL_LABEL, KVCachePool, LabelSelector
from kvfabric.operator.render import names
from kvfabric.operator.render.connection import ConnectionSettings, connection_settings
from kvfabric.operator.routingevents import add_kv_events_config, label_for_llmd

KV_TRANSFER_FLAG: Final = "--kv-transfer-config"
KV_TRANSFER_CONFIG: Final = {
    "kv_connector": "KVFabricConnector",
    "kv_connector_module_path": "kvfabric.connector.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
_SHELLS: Final = {"sh", "bash", "/bin/sh", "/bin/bash", "/usr/bin/env"}

# Skip reasons written to the kvfabric.io/skip-reason annotation.
SKIP_POOL_NOT_FOUND: Final = "pool-not-found"
SKIP_NAMESPACE_NOT_SELECTED: Final = "namespace-not-selected"
SKIP_POD_SELECTOR: Final = "pod-selector-mismatch"
SKIP_NO_CONTAINER: Final = "no-suitable-container"
SKIP_EXPANDABLE_SEGMENTS: Final = "expandable-segments"
SKIP_POD_SECURITY: Final = "pod-security"
SKIP_NO_PAYLOAD_KEY: Final = "no-payload-key"

# The variables that say which payload key a consumer seals with: the webhook owns them (a value the
# pod set is replaced, or dropped where its placement gets none), unlike the settings, where the user's
# explicit value wins. Only the key itself decides what a pod can read or forge (docs/security.md).
KEY_VARS: Final = (ConsumerVar.PAYLOAD_KEY, ConsumerVar.PAYLOAD_KEY_FILE, ConsumerVar.KEY_SCOPE)

PSS_ENFORCE_LABEL: Final = "pod-security.kubernetes.io/enforce"
# Pod Security levels that forbid hostPath volumes: the node's socket directory cannot be mounted.
_NO_HOSTPATH_LEVELS: Final = frozenset({"baseline", "restricted"})


def enforced_pod_security(labels: Mapping[str, str]) -> str | None:
    """The Pod Security level a namespace enforces (its ``enforce`` label), or None.

    Only the label is seen: a cluster-wide default set in the API server's AdmissionConfiguration
    is not, and such clusters should label their inference namespaces (docs/security.md).
    """
    level = labels.get(PSS_ENFORCE_LABEL)
    return level.strip().lower() if isinstance(level, str) and level.strip() else None


def expandable_segments_on(container: Mapping[str, Any]) -> bool:
    """Whether the container sets ``PYTORCH_CUDA_ALLOC_CONF`` with ``expandable_segments:True``.

    vLLM 0.33 refuses to start with any KV connector under that setting unless its cumem allocator
    is on, so injecting would turn a running pod into a crash loop (docs/connector.md).
    """
    for var in container.get("env") or []:
        if var.get("name") == "PYTORCH_CUDA_ALLOC_CONF":
            conf = str(var.get("value") or "").replace(" ", "").lower()
            return "expandable_segments:true" in conf.split(",")
    return False


@dataclass(frozen=True)
class PoolTarget:
    """What the webhook needs to know about one pool (kept current from pool events)."""

    namespace: str
    name: str
    connection: ConnectionSettings
    pod_selector: LabelSelector | None
    namespace_selector: LabelSelector | None
    injection_required: bool = False


def pool_target(pool_body: Mapping[str, Any]) -> PoolTarget | None:
    """Return the injection view of a pool object, or None if it does not parse."""
    try:
        pool = KVCachePool.model_validate(dict(pool_body))
    except ValueError:
        return None
    return PoolTarget(
        namespace=pool.namespace,
        name=pool.name,
        connection=connection_settings(pool),
        pod_selector=pool.spec.consumers.pod_selector,
        namespace_selector=pool.spec.consumers.namespace_selector,
        injection_required=pool.spec.consumers.failure_policy.value == "Fail",
    )


def pool_key_of(pod: Mapping[str, Any], request_namespace: str | None = None) -> tuple[str, str] | None:
    """The (namespace, name) of the pool a pod opted in to, or None when it did not opt in."""
    meta = pod.get("metadata") or {}
    name = (meta.get("labels") or {}).get(POOL_LABEL)
    if not name:
        return None
    pod_ns = meta.get("namespace") or request_namespace or "default"
    return (meta.get("annotations") or {}).get(names.POOL_NAMESPACE_ANNOTATION) or pod_ns, str(name)


def selector_matches(selector: LabelSelector, labels: Mapping[str, str]) -> bool:
    """Return whether ``labels`` satisfy a Kubernetes label selector (the CSI plugin's own check too)."""
    return label_selector_matches(selector.model_dump(by_alias=True, mode="json"), labels)


@dataclass(frozen=True)
class InjectionResult:
    """The mutated pod and what happened."""

    pod: dict[str, Any]
    injected: bool
    skip_reason: str | None = None
    detail: str = ""


def is_vllm(container: Mapping[str, Any]) -> bool:
    """Return whether a container runs vLLM (its image, command or args mention it)."""
    words = [str(container.get("image", ""))]
    words += [str(w) for w in container.get("command") or []]
    words += [str(w) for w in container.get("args") or []]
    return any("vllm" in w.lower() for w in words)


def _has_kv_transfer_config(container: Mapping[str, Any]) -> bool:
    words = [str(w) for w in (container.get("command") or []) + (container.get("args") or [])]
    if any(KV_TRANSFER_FLAG in w for w in words):
        return True
    return any(e.get("name") == "VLLM_KV_TRANSFER_CONFIG" for e in container.get("env") or [])


def _is_shell(container: Mapping[str, Any]) -> bool:
    command = container.get("command") or []
    return bool(command) and str(command[0]) in _SHELLS and "-c" in [str(c) for c in command[1:3]]


def _annotate(pod: dict[str, Any], values: Mapping[str, str | None]) -> None:
    meta = pod.setdefault("metadata", {})
    annotations = meta.get("annotations") or {}
    for key, value in values.items():
        if value is None:
            annotations.pop(key, None)
        else:
            annotations[key] = value
    meta["annotations"] = annotations


def _skip(pod: dict[str, Any], reason: str, detail: str) -> InjectionResult:
    # The webhook's own annotations are dropped too: a pod cannot claim to be injected.
    _annotate(
        pod,
        {
            names.SKIP_REASON_ANNOTATION: reason,
            names.INJECTED_ANNOTATION: None,
            names.CONFIG_HASH_ANNOTATION: None,
        },
    )
    return InjectionResult(pod=pod, injected=False, skip_reason=reason, detail=detail)


def inject(
    pod: Mapping[str, Any],
    pools: Mapping[tuple[str, str], PoolTarget],
    namespace_labels: Mapping[str, Mapping[str, str]],
    *,
    request_namespace: str | None = None,
    csi_driver: str | None = None,
) -> InjectionResult:
    """Return ``pod`` with the connector injected, or annotated with why it was skipped.

    With ``csi_driver`` (the operator was installed with the node plugin, ``manifests/csi``), consumers
    get the node's socket directory as a CSI ephemeral inline volume, which every Pod Security level
    admits, instead of a hostPath. The plugin checks the pool's namespaceSelector itself before it
    publishes the directory into a pod of another namespace.
    """
    out: dict[str, Any] = copy.deepcopy(dict(pod))
    meta = out.setdefault("metadata", {})
    labels: dict[str, str] = meta.get("labels") or {}
    pool_name = labels.get(POOL_LABEL)
    if not pool_name:
        return InjectionResult(pod=out, injected=False, detail="not opted in")
    annotations = meta.get("annotations") or {}
    pod_ns = meta.get("namespace") or request_namespace or "default"
    pool_ns = annotations.get(names.POOL_NAMESPACE_ANNOTATION) or pod_ns
    target = pools.get((pool_ns, pool_name))
    if target is None:
        return _skip(out, SKIP_POOL_NOT_FOUND, f"no KVCachePool {pool_ns}/{pool_name}")
    if pool_ns != pod_ns:
        selector = target.namespace_selector
        if selector is None or not selector_matches(selector, namespace_labels.get(pod_ns, {})):
            return _skip(
                out, SKIP_NAMESPACE_NOT_SELECTED, f"namespace {pod_ns} not selected by {pool_ns}/{pool_name}"
            )
    if target.pod_selector is not None and not selector_matches(target.pod_selector, labels):
        return _skip(out, SKIP_POD_SELECTOR, "pod labels do not match spec.consumers.podSelector")
    # Secrets cannot be referenced across namespaces: consumers in the pool's own namespace read the
    # pool's secret; elsewhere the CSI node plugin is the only way a pod gets its namespace's key (a
    # file in a volume it publishes). Without the plugin such a pod would seal with a public key,
    # which lets any other consumer forge what it loads: it is not injected at all.
    same_namespace = pool_ns == pod_ns
    if not same_namespace and csi_driver is None:
        return _skip(
            out,
            SKIP_NO_PAYLOAD_KEY,
            f"pod in namespace {pod_ns} cannot get a payload key for {pool_ns}/{pool_name}: install the "
            f"CSI node plugin (manifests/default), or run the engine in namespace {pool_ns}",
        )

    conn = target.connection
    containers: list[dict[str, Any]] = out.setdefault("spec", {}).get("containers") or []
    wanted = annotations.get(names.TARGET_CONTAINERS_ANNOTATION)
    if wanted:
        wanted_names = [w.strip() for w in wanted.split(",") if w.strip()]
        by_name = {c.get("name"): c for c in containers}
        if not wanted_names or any(w not in by_name for w in wanted_names):
            return _skip(out, SKIP_NO_CONTAINER, f"containers {wanted!r} not all found")
        targets = [by_name[w] for w in wanted_names]
    else:
        targets = [c for c in containers if is_vllm(c)] or containers[:1]
    if not targets:
        return _skip(out, SKIP_NO_CONTAINER, "the pod has no containers")
    if any(expandable_segments_on(c) for c in targets):
        return _skip(
            out,
            SKIP_EXPANDABLE_SEGMENTS,
            "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True: vLLM refuses KV connectors with it",
        )
    key_env = _key_env(conn, pod_ns, same_namespace=same_namespace)
    key_volume = None if same_namespace else _key_volume(conn, str(csi_driver))
    if (
        annotations.get(names.CONFIG_HASH_ANNOTATION) == conn.config_hash
        and names.INJECTED_ANNOTATION in annotations
    ):
        # Already injected with the current settings (webhook reinvocation): change nothing but what
        # the webhook owns, which a pod that wrote these annotations itself must not set either.
        _own_key_material(out["spec"], targets, key_env, key_volume)
        return InjectionResult(pod=out, injected=True, detail="already injected")

    env = conn.env_with_hash
    # Only consumers in the pool's own namespace get the TCP credentials (Secrets cannot be referenced
    # across namespaces); others use the node's Unix socket, with their namespace's key from the CSI
    # node plugin (docs/security.md).
    credentials = [e for e in conn.credential_env if e["name"] not in KEY_VARS] if same_namespace else []
    if not same_namespace:
        env = {k: v for k, v in env.items() if k != ConsumerVar.REMOTE.value}
    # Pod Security baseline and restricted forbid hostPath: the node's socket cannot be mounted.
    # With the pool's TCP listener (mutual TLS and the token, same namespace only) the pod is wired
    # to it alone; otherwise injecting would get the pod rejected, so it is skipped with the reason.
    level = enforced_pod_security(namespace_labels.get(pod_ns, {}))
    csi = csi_driver is not None
    node_local = csi or level not in _NO_HOSTPATH_LEVELS
    if not node_local:
        if not (conn.tcp and same_namespace):
            return _skip(
                out,
                SKIP_POD_SECURITY,
                f"namespace {pod_ns} enforces Pod Security {level!r}, which forbids the hostPath of the "
                f"node's cache socket; enable spec.server.tcp on {pool_ns}/{pool_name} to serve pods "
                "here over mutual TLS",
            )
        env = {k: v for k, v in env.items() if k != ConsumerVar.SOCKET.value}
    notes: list[str] = []
    event_notes: list[str] = []
    for container in targets:
        existing = container.get("env") or []
        present = {e.get("name") for e in existing}
        # A value the user set wins: it is their explicit override.
        existing += [{"name": k, "value": v} for k, v in env.items() if k not in present]
        existing += [e for e in credentials if e["name"] not in present]
        container["env"] = existing
        mounts = container.get("volumeMounts") or []
        if node_local and not any(m.get("name") == names.RUN_VOLUME for m in mounts):
            # Read-only: the directory holds only the server's sockets (blocks live in memfds the
            # server owns), and a read-only mount lets no consumer, root or not, unlink or replace
            # them; connecting to a socket needs no write access to the mount.
            mounts.append({"name": names.RUN_VOLUME, "mountPath": conn.host_dir, "readOnly": True})
        if conn.tcp and credentials and not any(m.get("name") == names.CLIENT_TLS_VOLUME for m in mounts):
            mounts.append(
                {"name": names.CLIENT_TLS_VOLUME, "mountPath": names.CLIENT_TLS_MOUNT, "readOnly": True}
            )
        container["volumeMounts"] = mounts
        if is_vllm(container):
            notes.append(_add_kv_transfer_config(container))
            if conn.routing_events is not None:
                event_notes.append(add_kv_events_config(container, conn.routing_events))

    volumes = out["spec"].get("volumes") or []
    if node_local and not any(v.get("name") == names.RUN_VOLUME for v in volumes):
        # DirectoryOrCreate: the pod must start even before (or without) its node's cache server;
        # the connector then falls back to recompute.
        if csi:
            # Published read-only by the node plugin, which learns the pod's namespace from the kubelet
            # and checks it against the pool named here.
            attributes = {"pool": conn.pool, "namespace": conn.namespace}
            volumes.append(
                {
                    "name": names.RUN_VOLUME,
                    "csi": {"driver": csi_driver, "readOnly": True, "volumeAttributes": attributes},
                }
            )
        else:
            volumes.append(
                {"name": names.RUN_VOLUME, "hostPath": {"path": conn.host_dir, "type": "DirectoryOrCreate"}}
            )
    if conn.tcp and credentials and not any(v.get("name") == names.CLIENT_TLS_VOLUME for v in volumes):
        # One projected volume: the client certificate and the token, both kept current by the
        # kubelet, so rotating either needs no restart (the connector watches the files).
        volumes.append(
            {
                "name": names.CLIENT_TLS_VOLUME,
                "projected": {
                    "sources": [
                        {"secret": {"name": names.client_tls_secret_name(conn.pool), "optional": True}},
                        {
                            "secret": {
                                "name": names.credentials_secret_name(conn.pool),
                                "items": [{"key": names.TOKEN_KEY, "path": names.TOKEN_KEY}],
                                "optional": True,
                            }
                        },
                    ]
                },
            }
        )
    out["spec"]["volumes"] = volumes
    _own_key_material(out["spec"], targets, key_env, key_volume)
    vllm_targets = [c for c in targets if is_vllm(c)]
    payload = bool(vllm_targets) and annotations.get(names.PAYLOAD_ANNOTATION) != "false"
    if payload:
        _add_payload(out["spec"], vllm_targets, conn.connector_image)
    detail = {
        "pool": f"{conn.namespace}/{conn.pool}",
        "containers": [c.get("name") for c in targets],
        "env": sorted([*env, *(str(e["name"]) for e in key_env)]),
        "volumes": [names.RUN_VOLUME] if node_local else [],
        "payloadKey": "secret" if same_namespace else "csi",
        "transport": "unix" if node_local else "tcp",
        "kvTransferConfig": [n for n in notes if n],
    }
    if node_local:
        detail["socketVolume"] = "csi" if csi else "hostPath"
    if conn.routing_events is not None and vllm_targets:
        detail["kvEvents"] = event_notes
        pod_labels = dict(out["metadata"].get("labels") or {})
        label_for_llmd(pod_labels, conn.routing_events)
        out["metadata"]["labels"] = pod_labels
    if payload:
        detail["payload"] = conn.connector_image
    _annotate(
        out,
        {
            names.INJECTED_ANNOTATION: json.dumps(detail, sort_keys=True, separators=(",", ":")),
            names.CONFIG_HASH_ANNOTATION: conn.config_hash,
            names.SKIP_REASON_ANNOTATION: None,
        },
    )
    return InjectionResult(pod=out, injected=True, detail=f"{conn.namespace}/{conn.pool}")


def _key_env(conn: ConnectionSettings, pod_namespace: str, *, same_namespace: bool) -> list[dict[str, Any]]:
    """The variables that give a consumer its payload key (and nothing else: see :data:`KEY_VARS`).

    In the pool's namespace: the pool's secret by ``secretKeyRef`` and the scope to derive the key for
    (the pod's namespace, which the API server puts in the admission request, or the shared scope).
    Elsewhere: the file the CSI node plugin publishes, holding that namespace's key alone. Every
    consumer names its scope (:func:`kvfabric.contract.consumer_env.key_env`): it is in the
    namespace digest, so a Shared pool's consumers of every namespace agree on it.
    """
    contract = key_env(pod_namespace, conn.namespace, shared=conn.shared_key_space)
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(contract.items())]
    if same_namespace:
        env.insert(0, next(e for e in conn.credential_env if e["name"] == ConsumerVar.PAYLOAD_KEY.value))
    return env


def _key_volume(conn: ConnectionSettings, driver: str) -> dict[str, Any]:
    """The CSI inline volume in which the node plugin publishes the pod's payload key (read-only).

    It names the pool only: the plugin learns the pod's namespace from the kubelet, checks it against
    the pool's namespaceSelector and derives that namespace's key, whatever the pod spec says.
    """
    attributes = {
        "pool": conn.pool,
        "namespace": conn.namespace,
        names.KEY_CONTENT_ATTRIBUTE: names.KEY_CONTENT,
    }
    return {
        "name": names.KEY_VOLUME,
        "csi": {"driver": driver, "readOnly": True, "volumeAttributes": attributes},
    }


def _own_key_material(
    pod_spec: dict[str, Any],
    containers: list[dict[str, Any]],
    key_env: list[dict[str, Any]],
    key_volume: dict[str, Any] | None,
) -> None:
    """Set the key variables, volume and mount to the webhook's, replacing whatever the pod wrote.

    In place (an entry keeps its position), so a second invocation yields the same pod.
    """
    mount = (
        None
        if key_volume is None
        else {"name": names.KEY_VOLUME, "mountPath": names.KEY_MOUNT, "readOnly": True}
    )
    for container in containers:
        env = list(container.get("env") or [])
        for var in KEY_VARS:
            wanted = next((e for e in key_env if e["name"] == var), None)
            env = _put_owned(env, _named(var), wanted)
        container["env"] = env
        container["volumeMounts"] = _put_owned(
            list(container.get("volumeMounts") or []),
            lambda m: m.get("name") == names.KEY_VOLUME or m.get("mountPath") == names.KEY_MOUNT,
            mount,
        )
    pod_spec["volumes"] = _put_owned(
        list(pod_spec.get("volumes") or []), lambda v: v.get("name") == names.KEY_VOLUME, key_volume
    )


def _named(name: str) -> Callable[[dict[str, Any]], bool]:
    return lambda entry: entry.get("name") == name


def _put_owned(
    items: list[dict[str, Any]], owned: Callable[[dict[str, Any]], bool], new: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """``items`` with every owned entry dropped and ``new`` (if any) where the first one was, else last."""
    out: list[dict[str, Any]] = []
    placed = new is None
    for item in items:
        if not owned(item):
            out.append(item)
        elif not placed:
            out.append(new)  # type: ignore[arg-type]
            placed = True
    if not placed:
        out.append(new)  # type: ignore[arg-type]
    return out


def _add_payload(pod_spec: dict[str, Any], containers: list[dict[str, Any]], image: str) -> None:
    """Add the connector payload for vLLM containers, as the OpenTelemetry operator's auto-instrumentation.

    An init container copies kvfabric and its dependencies into an emptyDir; the vLLM containers
    import them through ``PYTHONPATH`` (prepended to any value the user set). Everything is
    set-if-absent, so a second invocation changes nothing.
    """
    volumes = pod_spec.get("volumes") or []
    if not any(v.get("name") == names.PAYLOAD_VOLUME for v in volumes):
        volumes.append({"name": names.PAYLOAD_VOLUME, "emptyDir": {}})
    pod_spec["volumes"] = volumes
    inits = pod_spec.get("initContainers") or []
    if not any(c.get("name") == names.PAYLOAD_VOLUME for c in inits):
        inits.append(
            {
                "name": names.PAYLOAD_VOLUME,
                "image": image,
                "args": [names.PAYLOAD_MOUNT],
                "volumeMounts": [{"name": names.PAYLOAD_VOLUME, "mountPath": names.PAYLOAD_MOUNT}],
                "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
                # Passes Pod Security restricted on its own (the pod's other containers are the user's).
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "runAsNonRoot": True,
                    "capabilities": {"drop": ["ALL"]},
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
            }
        )
    pod_spec["initContainers"] = inits
    for container in containers:
        mounts = container.get("volumeMounts") or []
        if not any(m.get("name") == names.PAYLOAD_VOLUME for m in mounts):
            mounts.append({"name": names.PAYLOAD_VOLUME, "mountPath": names.PAYLOAD_MOUNT, "readOnly": True})
        container["volumeMounts"] = mounts
        env = container.get("env") or []
        current = next((e for e in env if e.get("name") == "PYTHONPATH"), None)
        if current is None:
            env.append({"name": "PYTHONPATH", "value": names.PAYLOAD_PYTHONPATH})
        elif "value" in current and names.PAYLOAD_PYTHONPATH not in str(current["value"]).split(":"):
            current["value"] = f"{names.PAYLOAD_PYTHONPATH}:{current['value']}"
        container["env"] = env


def _add_kv_transfer_config(container: dict[str, Any]) -> str:
    name = str(container.get("name", ""))
    if _has_kv_transfer_config(container):
        return f"{name}:user-set"
    value = json.dumps(KV_TRANSFER_CONFIG, separators=(",", ":"))
    if _is_shell(container):
        # A `sh -c "vllm serve ..."` script: append the flag to the script when it is a single command
        # line; anything more complex is left alone and recorded.
        command = list(container.get("command") or [])
        args = list(container.get("args") or [])
        script_holder, index = (args, 0) if len(command) <= 2 and args else (command, 2)
        if (
            index < len(script_holder)
            and "\n" not in str(script_holder[index]).strip()
            and "vllm" in str(script_holder[index])
        ):
            script_holder[index] = (
                f"{str(script_holder[index]).rstrip()} {KV_TRANSFER_FLAG} {shlex.quote(value)}"
            )
            if script_holder is args:
                container["args"] = args
            else:
                container["command"] = command
            return f"{name}:shell-appended"
        return f"{name}:shell-not-modified"
    args = list(container.get("args") or [])
    args += [KV_TRANSFER_FLAG, value]
    container["args"] = args
    return f"{name}:args"
