"""Pure translation of a pod spec into what the runner executes: mounts, environment, argv, probes."""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


@dataclass(frozen=True)
class Mount:
    """A bind mount of ``source`` (a host path) at ``target`` inside the container."""

    source: Path
    target: str
    read_only: bool = False


@dataclass(frozen=True)
class Probe:
    """A readiness probe, reduced to what the runner executes."""

    kind: str  # "http" | "tcp" | "exec"
    port: int = 0
    path: str = "/"
    command: tuple[str, ...] = ()
    initial_delay: float = 0.0
    period: float = 1.0
    timeout: float = 1.0
    failure_threshold: int = 3
    success_threshold: int = 1


@dataclass
class ContainerPlan:
    """Everything needed to start one container."""

    name: str
    argv: list[str]
    env: dict[str, str]
    mounts: list[Mount] = field(default_factory=list)
    working_dir: str | None = None
    readiness: Probe | None = None
    user: int | None = None
    """``runAsUser`` (container, else pod); None keeps the runner's own (root)."""
    group: int | None = None
    """``runAsGroup``; with a user but no group the primary group is 0, as in a container."""
    groups: tuple[int, ...] = ()
    """Supplementary groups: the pod's ``supplementalGroups`` and ``fsGroup``."""
    read_only_root: bool = False
    home_shadow: Path | None = None
    """Where a non-root container's script parks the real /root while it shadows it (see HOME_PATHS)."""
    """``securityContext.readOnlyRootFilesystem``: only the volumes (and the kernel's own
    filesystems: /proc, /dev, /run...) stay writable."""


def field_ref(pod: dict[str, Any], path: str, pod_ip: str, host_ip: str) -> str:
    """Resolve a downward-API ``fieldPath`` the way the kubelet does."""
    meta = pod["metadata"]
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.hostIP": host_ip,
    }
    if path in simple:
        return str(simple[path])
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return str(meta.get(m.group(1), {}).get(m.group(2), ""))
    raise ValueError(f"unsupported downward-API fieldPath {path!r}")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubelet's ``$(VAR)`` expansion: known variables are replaced, ``$$`` escapes, others stay."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, text)


def container_env(
    pod: dict[str, Any],
    container: dict[str, Any],
    *,
    pod_ip: str,
    host_ip: str,
    lookup: Any,
) -> dict[str, str]:
    """The container's environment: ``envFrom`` first, then ``env`` in order, with expansion.

    ``lookup(kind, namespace, name)`` returns a ConfigMap's or Secret's ``data`` (Secret values
    already decoded) or ``None`` when it does not exist.
    """
    ns = pod["metadata"].get("namespace", "default")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        for kind in ("configMapRef", "secretRef"):
            if kind in source:
                data = lookup(kind, ns, source[kind]["name"]) or {}
                env.update({prefix + k: v for k, v in data.items()})
    for item in container.get("env", []):
        name = item["name"]
        if "value" in item:
            env[name] = expand(item["value"], env)
        elif "valueFrom" in item:
            vf = item["valueFrom"]
            if "fieldRef" in vf:
                env[name] = field_ref(pod, vf["fieldRef"]["fieldPath"], pod_ip, host_ip)
            elif "configMapKeyRef" in vf or "secretKeyRef" in vf:
                kind = "configMapRef" if "configMapKeyRef" in vf else "secretRef"
                ref = vf.get("configMapKeyRef") or vf["secretKeyRef"]
                value = (lookup(kind, ns, ref["name"]) or {}).get(ref["key"])
                if value is None and not ref.get("optional", False):
                    raise ValueError(f"env {name}: {ref['name']}/{ref['key']} not found")
                if value is not None:
                    env[name] = value
            elif "resourceFieldRef" in vf:
                env[name] = "0"
        else:
            env[name] = ""
    return env


def argv(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    """``command`` + ``args`` with ``$(VAR)`` expansion; the image's entrypoint is unknown here."""
    command = container.get("command") or []
    if not command:
        raise ValueError(
            f"container {container['name']!r} has no command: the pod runner cannot know the image's "
            "entrypoint, so pods it runs must spell their command out"
        )
    return [expand(a, env) for a in [*command, *container.get("args", [])]]


def resolve_port(port: int | str, container: dict[str, Any]) -> int:
    """A probe's port, by number or by the name of a containerPort."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"probe port {port!r} is not a containerPort of {container['name']!r}")


def readiness_probe(container: dict[str, Any]) -> Probe | None:
    """The container's readiness probe, if any."""
    raw = container.get("readinessProbe")
    if not raw:
        return None
    if "httpGet" in raw:
        probe = Probe(
            "http", port=resolve_port(raw["httpGet"]["port"], container), path=raw["httpGet"].get("path", "/")
        )
    elif "tcpSocket" in raw:
        probe = Probe("tcp", port=resolve_port(raw["tcpSocket"]["port"], container))
    elif "grpc" in raw:
        probe = Probe("tcp", port=int(raw["grpc"]["port"]))
    elif "exec" in raw:
        probe = Probe("exec", command=tuple(raw["exec"]["command"]))
    else:
        return None
    return dataclasses.replace(
        probe,
        initial_delay=float(raw.get("initialDelaySeconds", 0)),
        # Faster than the kubelet's 10 s default: tests wait on readiness.
        period=min(float(raw.get("periodSeconds", 10)), 1.0),
        timeout=float(raw.get("timeoutSeconds", 1)),
        failure_threshold=int(raw.get("failureThreshold", 3)),
        success_threshold=int(raw.get("successThreshold", 1)),
    )


def mounts(container: dict[str, Any], volume_dirs: dict[str, Path]) -> list[Mount]:
    """The container's ``volumeMounts`` as bind mounts, parents before children."""
    result = []
    for vm in container.get("volumeMounts", []):
        name = vm["name"]
        if name not in volume_dirs:
            raise ValueError(f"volumeMount {name!r} names no volume of the pod")
        source = volume_dirs[name] / vm["subPath"] if vm.get("subPath") else volume_dirs[name]
        result.append(Mount(source, vm["mountPath"], bool(vm.get("readOnly", False))))
    return sorted(result, key=lambda m: m.target.count("/"))


def identity(
    pod: dict[str, Any], container: dict[str, Any]
) -> tuple[int | None, int | None, tuple[int, ...]]:
    """The (uid, gid, supplementary groups) a container runs with, as the kubelet resolves them."""
    psc = pod.get("spec", {}).get("securityContext") or {}
    csc = container.get("securityContext") or {}
    uid = csc.get("runAsUser", psc.get("runAsUser"))
    gid = csc.get("runAsGroup", psc.get("runAsGroup"))
    groups = [int(g) for g in psc.get("supplementalGroups") or []]
    if psc.get("fsGroup") is not None:
        groups.append(int(psc["fsGroup"]))
    return (
        (None if uid is None else int(uid)),
        (None if gid is None else int(gid)),
        tuple(dict.fromkeys(groups)),
    )


# What a non-root container may see of this machine's /root: the interpreter (pyenv) and the caches
# holding the vLLM environment and the built binaries; never the rest (kubeconfigs, keys).
HOME_PATHS: tuple[str, ...] = (".pyenv", ".cache/kvfabric", ".cache/uv")


def launch_script(plan: ContainerPlan) -> str:
    """A bash script that sets up the mounts inside the private mount namespace and execs argv."""
    q = shlex.quote
    lines = ["set -euo pipefail"]
    for m in plan.mounts:
        # Mount points are created on the host's filesystem (empty directories or files), as a
        # container runtime would in the image's rootfs; one of the wrong kind is replaced.
        if m.source.is_dir():
            lines.append(f"[ -d {q(m.target)} ] || rm -f {q(m.target)}")
            lines.append(f"mkdir -p {q(m.target)}")
        else:
            lines.append(f"[ ! -d {q(m.target)} ] || rmdir {q(m.target)}")
            lines.append(f"mkdir -p {q(str(Path(m.target).parent))} && touch {q(m.target)}")
        lines.append(f"mount --bind {q(str(m.source))} {q(m.target)}")
        if m.read_only:
            lines.append(f"mount -o remount,bind,ro {q(m.target)}")
    if plan.user not in (None, 0) and plan.home_shadow is not None:
        # This machine's /root is 0700 and holds the harness's Python and caches, which a container
        # image would carry in its own rootfs: hide /root behind an empty tmpfs and bind back only
        # those, read-only, so the pod's user can run them and sees nothing else of root's.
        orig = q(str(plan.home_shadow))
        lines.append(f"mkdir -p {orig} && mount --bind /root {orig}")
        lines.append("mount -t tmpfs -o mode=0755,size=1m kvfabric-home /root")
        for sub in HOME_PATHS:
            lines.append(
                f"if [ -d {orig}/{sub} ]; then mkdir -p /root/{sub} && mount --bind {orig}/{sub} /root/{sub} "
                f"&& mount -o remount,bind,ro /root/{sub}; fi"
            )
        lines.append(f"umount -l {orig}")
    if plan.read_only_root:
        # The root mount of this private mount namespace only (a per-mount flag, not the
        # filesystem's): the host stays writable, the volumes mounted above keep their own flags.
        lines.append("mount -o remount,bind,ro /")
    if plan.working_dir:
        lines.append(f"cd {q(plan.working_dir)}")
    env_args = " ".join(q(f"{k}={v}") for k, v in plan.env.items())
    drop = ""
    if plan.user is not None or plan.group is not None or plan.groups:
        # After the mounts (which need root): become the pod's user, as the container runtime does.
        uid = 0 if plan.user is None else plan.user
        gid = 0 if plan.group is None else plan.group
        groups = f"--groups={','.join(str(g) for g in plan.groups)}" if plan.groups else "--clear-groups"
        drop = f"setpriv --reuid={uid} --regid={gid} {groups} -- "
    lines.append(f"exec {drop}env -i {env_args} {' '.join(q(a) for a in plan.argv)}")
    return "\n".join(lines) + "\n"
