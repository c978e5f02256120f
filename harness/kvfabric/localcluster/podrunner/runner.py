"""The pod runner's I/O: node heartbeats, pod discovery, processes, probes and status reports."""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config

from kvfabric.localcluster import nodes
from kvfabric.localcluster.podrunner import spec
from kvfabric.localcluster.podrunner.relay import PortRelay

log = logging.getLogger("kvfabric.podrunner")

_POLL = 0.5
_HEARTBEAT = 10.0
_MAX_BACKOFF = 10.0


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


IMAGES_FILE = "images.json"
"""In the runner's base: the images the runner knows, ``{image: {VAR: value}}`` (:func:`add_image`)."""


def add_image(base: Path, image: str, env: dict[str, str]) -> None:
    """Teach the runner serving ``base`` an image: its containers start with ``env`` added.

    The runner runs every container from this host's filesystem (it has no images), so an image is
    only what its environment selects: a release's ``PYTHONPATH`` makes a container of
    ``kvfabric:<release>`` run that release's code. Read at each container's start (later pods see it).
    """
    path = base / IMAGES_FILE
    table = json.loads(path.read_text()) if path.exists() else {}
    table[image] = env
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table))
    tmp.replace(path)


def netns_name(pod_uid: str) -> str:
    """The network namespace of a pod (``ip netns exec NAME ...`` reaches its ports)."""
    return f"kvf-{pod_uid.replace('-', '')[:12]}"


def pod_request(
    pod_uid: str, port: int, path: str, *, data: str | None = None, timeout: float = 30.0
) -> tuple[int, str]:
    """An HTTP request to ``127.0.0.1:port`` inside a pod's network namespace: ``(status, body)``.

    The test-side counterpart of ``kubectl port-forward``.
    """
    cmd = [
        "ip",
        "netns",
        "exec",
        netns_name(pod_uid),
        "curl",
        "-s",
        "-m",
        str(timeout),
        "-o",
        "/dev/stdout",
        "-w",
        "\n%{http_code}",
        f"http://127.0.0.1:{port}{path}",
    ]
    if data is not None:
        cmd += ["-H", "Content-Type: application/json", "--data-binary", "@-"]
    out = subprocess.run(cmd, input=data, capture_output=True, text=True, timeout=timeout + 5, check=False)
    body, _, code = out.stdout.rpartition("\n")
    return (int(code) if code.isdigit() else 0), body


@dataclass
class NodeSpec:
    """A node the runner registers and serves."""

    name: str
    gpus: int = 8


class _Container:
    def __init__(self, plan: spec.ContainerPlan, log_path: Path) -> None:
        self.plan = plan
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.started_at = ""
        self.finished_at = ""
        self.exit_code: int | None = None
        self.ready = False
        self.next_start = 0.0
        self.probe_ok = 0
        self.probe_fail = 0
        self.next_probe = 0.0


class PodWorker(threading.Thread):
    """Runs one pod until it is deleted or the runner stops."""

    def __init__(self, runner: PodRunner, pod: dict[str, Any], pod_ip: str) -> None:
        super().__init__(name=f"pod-{pod['metadata']['name']}", daemon=True)
        self.runner = runner
        self.pod = pod
        self.uid = pod["metadata"]["uid"]
        self.ns = pod["metadata"]["namespace"]
        self.name = pod["metadata"]["name"]
        self.node = pod["spec"]["nodeName"]
        self.pod_ip = pod_ip
        self.host_network = bool(pod["spec"].get("hostNetwork"))
        self.netns = netns_name(self.uid)
        self.dir = runner.base / "pods" / f"{self.ns}_{self.name}_{self.uid[:8]}"
        self.stop_event = threading.Event()
        self.deleted = threading.Event()
        self.containers: list[_Container] = []
        self._last_status: Any = None
        self._relay: PortRelay | None = None

    # --- setup -------------------------------------------------------------------------------
    def _volume_dirs(self) -> dict[str, Path]:
        dirs: dict[str, Path] = {}
        for vol in self.pod["spec"].get("volumes", []):
            name = vol["name"]
            if "hostPath" in vol:
                host_path = vol["hostPath"]["path"]
                # /run and /dev/shm are tmpfs on a real node; keep them in memory here too, so a
                # hostPath directory there behaves as it would in production.
                root = (
                    self.runner.tmpfs_base
                    if host_path.startswith(("/run/", "/dev/shm/"))
                    else self.runner.base
                )
                path = root / "nodes" / self.node / "host" / host_path.lstrip("/")
                if vol["hostPath"].get("type") in ("FileOrCreate", "File"):
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.touch()
                else:
                    path.mkdir(parents=True, exist_ok=True)
                dirs[name] = path
            elif "persistentVolumeClaim" in vol:
                claim = vol["persistentVolumeClaim"]["claimName"]
                path = self.runner.base / "shared" / "pvc" / self.ns / claim
                path.mkdir(parents=True, exist_ok=True)
                dirs[name] = path
            elif "emptyDir" in vol:
                medium = vol["emptyDir"].get("medium", "")
                root = (
                    Path("/dev/shm/kvfabric-podrunner") / self.uid if medium == "Memory" else self.dir / "vol"
                )
                path = root / name
                path.mkdir(parents=True, exist_ok=True)
                path.chmod(0o777)  # as the kubelet makes an emptyDir: writable whatever the pod's uid
                self._give_to_fs_group(path)
                dirs[name] = path
            elif "configMap" in vol or "secret" in vol:
                kind = "configMapRef" if "configMap" in vol else "secretRef"
                src = vol.get("configMap") or vol["secret"]
                ref_name = src.get("name") or src.get("secretName", "")
                data = self.runner.lookup(kind, self.ns, ref_name)
                if data is None and not src.get("optional", False):
                    raise ValueError(f"volume {name}: {kind[:-3]} {ref_name!r} not found")
                path = self.dir / "vol" / name
                path.mkdir(parents=True, exist_ok=True)
                items = src.get("items") or [{"key": k, "path": k} for k in (data or {})]
                for item in items:
                    target = path / item["path"]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text((data or {}).get(item["key"], ""))
                    target.chmod(item.get("mode", src.get("defaultMode", 0o644)))
                self._give_to_fs_group(path)
                dirs[name] = path
            elif "downwardAPI" in vol:
                path = self.dir / "vol" / name
                path.mkdir(parents=True, exist_ok=True)
                for item in vol["downwardAPI"].get("items", []):
                    if "fieldRef" in item:
                        value = spec.field_ref(
                            self.pod, item["fieldRef"]["fieldPath"], self.pod_ip, self.runner.host_ip
                        )
                        (path / item["path"]).write_text(value)
                dirs[name] = path
            else:
                raise ValueError(f"volume {name}: this kind of volume is not supported by the pod runner")
        return dirs

    def _give_to_fs_group(self, path: Path) -> None:
        """Hand a volume to the pod's ``fsGroup`` (group-owned, group-readable), as the kubelet does."""
        fs_group = (self.pod["spec"].get("securityContext") or {}).get("fsGroup")
        if fs_group is None:
            return
        for p in [path, *path.rglob("*")]:
            os.chown(p, -1, int(fs_group))
            if p.is_dir():
                p.chmod(p.stat().st_mode | 0o2070)  # setgid: new files stay in the group

    def _plans(self, volume_dirs: dict[str, Path], kind: str = "containers") -> list[spec.ContainerPlan]:
        plans = []
        for c in self.pod["spec"].get(kind) or []:
            env = spec.container_env(
                self.pod, c, pod_ip=self.pod_ip, host_ip=self.runner.host_ip, lookup=self.runner.lookup
            )
            full_env = {
                "PATH": self.runner.path,
                "HOME": "/root",
                "LANG": "C.UTF-8",
                "HOSTNAME": self.name,
                **self.runner.image_env(c.get("image", "")),
                **env,
            }
            user, group, groups = (
                spec.identity(self.pod, c) if self.runner.run_as_pod_user else (None, None, ())
            )
            container_mounts = spec.mounts(c, volume_dirs)
            for m in container_mounts:
                # Like the kubelet, create a missing subPath as a directory.
                m.source.mkdir(parents=True, exist_ok=True)
            plans.append(
                spec.ContainerPlan(
                    name=c["name"],
                    argv=spec.argv(c, full_env),
                    env=full_env,
                    mounts=container_mounts,
                    working_dir=c.get("workingDir"),
                    readiness=spec.readiness_probe(c),
                    user=user,
                    group=group,
                    groups=groups,
                    read_only_root=bool((c.get("securityContext") or {}).get("readOnlyRootFilesystem")),
                    home_shadow=self.dir / f"{c['name']}.root",
                )
            )
        return plans

    def _setup_netns(self) -> None:
        if self.host_network:
            return
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "add", self.netns], capture_output=True, check=True)
        subprocess.run(["ip", "-n", self.netns, "link", "set", "lo", "up"], capture_output=True, check=True)
        if self.runner.relay_ports:
            self._relay = PortRelay(f"/var/run/netns/{self.netns}", self.runner.relay_ports)

    def _start(self, c: _Container) -> None:
        script = self.dir / f"{c.plan.name}.sh"
        script.write_text(spec.launch_script(c.plan))
        prefix = ["unshare", "--mount", "--propagation", "private"]
        if not self.host_network:
            # `ip netns exec` enters the pod's network namespace and a fresh mount namespace.
            prefix = ["ip", "netns", "exec", self.netns]
        with c.log_path.open("ab") as out:
            c.proc = subprocess.Popen(
                [*prefix, "bash", str(script)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        c.started_at = _now()
        c.exit_code = None
        c.ready = False
        c.probe_ok = c.probe_fail = 0
        c.next_probe = time.monotonic() + (c.plan.readiness.initial_delay if c.plan.readiness else 0)
        log.info("started %s/%s container %s pid %d", self.ns, self.name, c.plan.name, c.proc.pid)

    # --- probes ------------------------------------------------------------------------------
    def _probe(self, c: _Container) -> bool:
        p = c.plan.readiness
        assert p is not None
        assert c.proc is not None
        enter = [] if self.host_network else ["ip", "netns", "exec", self.netns]
        if p.kind == "http":
            cmd = [
                *enter,
                "curl",
                "-sf",
                "-o",
                "/dev/null",
                "-m",
                str(p.timeout),
                f"http://127.0.0.1:{p.port}{p.path}",
            ]
        elif p.kind == "tcp":
            cmd = [*enter, "bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{p.port}"]
        else:
            cmd = ["nsenter", "-t", str(c.proc.pid), "-m", "-n", *p.command]
        try:
            return (
                subprocess.run(cmd, capture_output=True, timeout=p.timeout + 2, check=False).returncode == 0
            )
        except subprocess.TimeoutExpired:
            return False

    # --- main loop ---------------------------------------------------------------------------
    def run(self) -> None:
        """Set the pod up, run its containers and probes until stopped, then tear it down."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            volume_dirs = self._volume_dirs()
            init_plans = self._plans(volume_dirs, "initContainers")
            plans = self._plans(volume_dirs)
            self._setup_netns()
        except (ValueError, OSError, subprocess.CalledProcessError) as exc:
            log.warning("cannot start %s/%s: %s", self.ns, self.name, exc)
            self._report_config_error(str(exc))
            self.stop_event.wait()
            self._finish()
            return
        for plan in init_plans:
            if not self._run_init(plan):
                self.stop_event.wait()
                self._finish()
                return
        self.containers = [_Container(p, self.dir / f"{p.name}.log") for p in plans]
        for c in self.containers:
            self._start(c)
        policy = self.pod["spec"].get("restartPolicy", "Always")
        while not self.stop_event.is_set():
            now = time.monotonic()
            for c in self.containers:
                assert c.proc is not None
                rc = c.proc.poll()
                if rc is not None and c.exit_code is None:
                    c.exit_code, c.finished_at, c.ready = rc, _now(), False
                    log.info("%s/%s container %s exited %d", self.ns, self.name, c.plan.name, rc)
                    if policy == "Always" or (policy == "OnFailure" and rc != 0):
                        c.next_start = now + min(2.0**c.restarts, _MAX_BACKOFF)
                if c.exit_code is not None and c.next_start and now >= c.next_start:
                    c.restarts += 1
                    c.next_start = 0.0
                    self._start(c)
                elif c.exit_code is None:
                    self._maybe_probe(c, now)
            self._report()
            self.stop_event.wait(_POLL)
        self._finish()

    def _run_init(self, plan: spec.ContainerPlan) -> bool:
        """Run one init container to success, retrying failures unless ``restartPolicy: Never``."""
        c = _Container(plan, self.dir / f"init-{plan.name}.log")
        never = self.pod["spec"].get("restartPolicy", "Always") == "Never"
        while not self.stop_event.is_set():
            self._start(c)
            assert c.proc is not None
            while c.proc.poll() is None:
                if self.stop_event.wait(0.1):
                    self.containers = [c]  # so _finish stops it
                    return False
            if c.proc.returncode == 0:
                return True
            log.info("%s/%s init container %s exited %d", self.ns, self.name, plan.name, c.proc.returncode)
            self._report_config_error(
                f"init container {plan.name} exited {c.proc.returncode}", reason="Init:Error"
            )
            if never:
                return False
            c.restarts += 1
            self.stop_event.wait(min(2.0**c.restarts, _MAX_BACKOFF))
        return False

    def _maybe_probe(self, c: _Container, now: float) -> None:
        p = c.plan.readiness
        if p is None:
            c.ready = True
            return
        if now < c.next_probe:
            return
        c.next_probe = now + p.period
        if self._probe(c):
            c.probe_ok, c.probe_fail = c.probe_ok + 1, 0
            if c.probe_ok >= p.success_threshold:
                c.ready = True
        else:
            c.probe_ok, c.probe_fail = 0, c.probe_fail + 1
            if c.probe_fail >= p.failure_threshold:
                c.ready = False

    def _finish(self) -> None:
        grace = min(float(self.pod["spec"].get("terminationGracePeriodSeconds", 30)), 10.0)
        for c in self.containers:
            if c.proc is not None and c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for c in self.containers:
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
        if self._relay is not None:
            self._relay.close()
        if not self.host_network:
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, check=False)
        shutil.rmtree(Path("/dev/shm/kvfabric-podrunner") / self.uid, ignore_errors=True)
        if self.deleted.is_set():
            with contextlib.suppress(client.ApiException):
                self.runner.core.delete_namespaced_pod(
                    self.name,
                    self.ns,
                    grace_period_seconds=0,
                    body=client.V1DeleteOptions(
                        grace_period_seconds=0, preconditions=client.V1Preconditions(uid=self.uid)
                    ),
                )
        log.info("stopped %s/%s", self.ns, self.name)

    # --- status ------------------------------------------------------------------------------
    def _container_status(self, c: _Container) -> dict[str, Any]:
        image = next(x.get("image", "") for x in self.pod["spec"]["containers"] if x["name"] == c.plan.name)
        state: dict[str, Any]
        if c.exit_code is None:
            state = {"running": {"startedAt": c.started_at}}
        else:
            state = {
                "terminated": {
                    "exitCode": c.exit_code,
                    "reason": "Completed" if c.exit_code == 0 else "Error",
                    "startedAt": c.started_at,
                    "finishedAt": c.finished_at,
                }
            }
        pid = c.proc.pid if c.proc else 0
        return {
            "name": c.plan.name,
            "ready": c.ready,
            "started": c.exit_code is None,
            "restartCount": c.restarts,
            "image": image,
            "imageID": f"podrunner://{image}",
            "containerID": f"podrunner://{pid}",
            "state": state,
        }

    def _report(self) -> None:
        statuses = [self._container_status(c) for c in self.containers]
        all_ready = all(c.ready for c in self.containers)
        policy = self.pod["spec"].get("restartPolicy", "Always")
        phase = "Running"
        if policy != "Always" and all(c.exit_code is not None and not c.next_start for c in self.containers):
            phase = "Succeeded" if all(c.exit_code == 0 for c in self.containers) else "Failed"
        key = (phase, all_ready, [(s["ready"], s["restartCount"], list(s["state"])) for s in statuses])
        if key == self._last_status:
            return
        cond = "True" if all_ready else "False"
        body = {
            "status": {
                "phase": phase,
                "hostIP": self.runner.host_ip,
                "podIP": self.pod_ip,
                "podIPs": [{"ip": self.pod_ip}],
                "startTime": statuses[0]["state"].get("running", {}).get("startedAt", _now())
                if statuses
                else _now(),
                "conditions": [
                    {"type": "PodScheduled", "status": "True"},
                    {"type": "Initialized", "status": "True"},
                    {"type": "ContainersReady", "status": cond, "lastTransitionTime": _now()},
                    {"type": "Ready", "status": cond, "lastTransitionTime": _now()},
                ],
                "containerStatuses": statuses,
            }
        }
        try:
            self.runner.core.patch_namespaced_pod_status(self.name, self.ns, body)
            self._last_status = key
        except client.ApiException as exc:
            if exc.status == 404:
                self.stop_event.set()
            else:
                log.warning("status update of %s/%s failed: %s", self.ns, self.name, exc.reason)

    def _report_config_error(self, message: str, reason: str = "CreateContainerConfigError") -> None:
        statuses = [
            {
                "name": c["name"],
                "ready": False,
                "restartCount": 0,
                "image": c.get("image", ""),
                "imageID": "",
                "state": {"waiting": {"reason": reason, "message": message}},
            }
            for c in self.pod["spec"]["containers"]
        ]
        body = {
            "status": {
                "phase": "Pending",
                "hostIP": self.runner.host_ip,
                "containerStatuses": statuses,
                "conditions": [
                    {"type": "Ready", "status": "False", "reason": "ContainersNotReady", "message": message}
                ],
            }
        }
        with contextlib.suppress(client.ApiException):
            self.runner.core.patch_namespaced_pod_status(self.name, self.ns, body)


class PodRunner:
    """Registers fake nodes and runs the pods bound to them until :meth:`stop`."""

    def __init__(
        self,
        kubeconfig: Path,
        base: Path,
        node_specs: list[NodeSpec],
        *,
        run_as_pod_user: bool = False,
        relay_ports: tuple[int, ...] = (),
    ) -> None:
        """``relay_ports``: host loopback ports every pod reaches at the same address (relay.py)."""
        api = config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
        self.run_as_pod_user = run_as_pod_user
        self.relay_ports = relay_ports
        self.core = client.CoreV1Api(api)
        self.coord = client.CoordinationV1Api(api)
        self.base = base.absolute()
        self.nodes = node_specs
        self.host_ip = "127.0.0.1"
        self.tmpfs_base = Path("/dev/shm/kvfabric-podrunner") / f"runner-{os.getpid()}"
        # The engine's own environment comes first so `kvfabric` and `python` resolve to this install.
        self.path = os.pathsep.join(
            [str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin"]
        )
        self.workers: dict[str, PodWorker] = {}
        self._ips = itertools.count(2)
        self._stop = threading.Event()

    def image_env(self, image: str) -> dict[str, str]:
        """The environment ``image`` selects (:func:`add_image`); empty for one it was not taught."""
        path = self.base / IMAGES_FILE
        if not path.exists():
            return {}
        return dict(json.loads(path.read_text()).get(image, {}))

    def lookup(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        """``data`` of a ConfigMap or (decoded) Secret, or ``None``."""
        try:
            if kind == "configMapRef":
                return dict(self.core.read_namespaced_config_map(name, namespace).data or {})
            secret = self.core.read_namespaced_secret(name, namespace)
            return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    # --- nodes -------------------------------------------------------------------------------
    def register_nodes(self) -> None:
        """Create (or adopt) the runner's nodes and mark them Ready."""
        for n in self.nodes:
            manifest = nodes.node_manifest(n.name, gpus=n.gpus, managed_by_kwok=False)
            manifest["metadata"]["labels"]["kvfabric.io/pod-runner"] = "true"
            try:
                self.core.create_node(manifest)  # type: ignore[arg-type]  # the client accepts dicts
            except client.ApiException as exc:
                if exc.status != 409:
                    raise
            self.core.patch_node_status(
                n.name, {"status": {**manifest["status"], "conditions": self._conditions()}}
            )
        self._heartbeat()

    def _conditions(self) -> list[dict[str, str]]:
        now = _now()
        ready = {
            "type": "Ready",
            "status": "True",
            "reason": "PodRunnerReady",
            "message": "pod runner is serving",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        others = [
            {
                "type": t,
                "status": "False",
                "reason": "PodRunner",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
            for t in ("MemoryPressure", "DiskPressure", "PIDPressure")
        ]
        return [ready, *others]

    def _heartbeat(self) -> None:
        for n in self.nodes:
            with contextlib.suppress(client.ApiException):
                self.core.patch_node_status(n.name, {"status": {"conditions": self._conditions()}})
            lease = {
                "metadata": {"name": n.name, "namespace": "kube-node-lease"},
                "spec": {
                    "holderIdentity": n.name,
                    "leaseDurationSeconds": 40,
                    "renewTime": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                },
            }
            try:
                self.coord.patch_namespaced_lease(n.name, "kube-node-lease", lease)
            except client.ApiException as exc:
                if exc.status == 404:
                    with contextlib.suppress(client.ApiException):
                        self.coord.create_namespaced_lease("kube-node-lease", lease)  # type: ignore[arg-type]

    # --- pods --------------------------------------------------------------------------------
    def sync_once(self) -> None:
        """Start workers for new pods, stop those whose pods are deleted or gone."""
        seen: set[str] = set()
        for n in self.nodes:
            pods = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={n.name}")
            for pod in pods.items:
                raw = self.core.api_client.sanitize_for_serialization(pod)
                uid = raw["metadata"]["uid"]
                seen.add(uid)
                worker = self.workers.get(uid)
                terminating = raw["metadata"].get("deletionTimestamp") is not None
                if (
                    worker is None
                    and not terminating
                    and raw["status"].get("phase") not in ("Succeeded", "Failed")
                ):
                    idx = next(self._ips)
                    worker = PodWorker(self, raw, f"10.244.{idx // 250}.{idx % 250 + 1}")
                    self.workers[uid] = worker
                    worker.start()
                elif worker is None and terminating:
                    with contextlib.suppress(client.ApiException):
                        self.core.delete_namespaced_pod(
                            raw["metadata"]["name"], raw["metadata"]["namespace"], grace_period_seconds=0
                        )
                elif worker is not None and terminating and not worker.stop_event.is_set():
                    worker.deleted.set()
                    worker.stop_event.set()
        for uid, worker in list(self.workers.items()):
            if uid not in seen:
                worker.stop_event.set()
            if not worker.is_alive() and worker.stop_event.is_set():
                del self.workers[uid]

    def run(self) -> None:
        """Serve until :meth:`stop`; then stop every pod and delete the nodes."""
        self.register_nodes()
        last_beat = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sync_once()
            except (client.ApiException, OSError) as exc:  # the API server may restart; keep going
                log.warning("sync failed: %s", exc)
            if time.monotonic() - last_beat > _HEARTBEAT:
                self._heartbeat()
                last_beat = time.monotonic()
            self._stop.wait(_POLL)
        for worker in self.workers.values():
            worker.stop_event.set()
        for worker in self.workers.values():
            worker.join(timeout=15)
        for n in self.nodes:
            with contextlib.suppress(client.ApiException):
                self.core.delete_node(n.name)
        shutil.rmtree(self.tmpfs_base, ignore_errors=True)

    def stop(self) -> None:
        """Ask :meth:`run` to finish."""
        self._stop.set()
