"""The pod runner executes what a pod spec says, on a node of the real cluster."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfabric.localcluster.podrunner import spec
from kvfabric.localcluster.podrunner.runner import pod_request
from kvfabric.localcluster.testing import ClusterHandle, pod_runner, wait_for

NODE = "runner-cpu-0"


@pytest.fixture(scope="module")
def runner(cluster: ClusterHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pod_runner(cluster, tmp_path_factory.mktemp("runner"), [f"{NODE}:0"]) as base:
        yield base


SERVER = (
    "import http.server, os, pathlib, sys\n"
    "out = pathlib.Path('/data/seen.json')\n"
    "import json; out.write_text(json.dumps({'node': os.environ['NODE'], 'pod': os.environ['POD'],"
    " 'greeting': os.environ['GREETING'], 'config': pathlib.Path('/etc/app/app.conf').read_text(),"
    " 'argv': sys.argv[1:]}))\n"
    "http.server.test(HandlerClass=http.server.SimpleHTTPRequestHandler, port=8080, bind='127.0.0.1')\n"
)


def _pod(name: str, *, probe_port: int = 8080) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": NODE},
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "app",
                    "image": "python:3.11",
                    "command": [sys.executable, "-c", SERVER],
                    "args": ["$(GREETING)", "$$literal"],
                    "env": [
                        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {
                            "name": "GREETING",
                            "valueFrom": {"configMapKeyRef": {"name": "app", "key": "greeting"}},
                        },
                    ],
                    "ports": [{"name": "http", "containerPort": 8080}],
                    "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
                    "volumeMounts": [
                        {"name": "data", "mountPath": "/data"},
                        {"name": "conf", "mountPath": "/etc/app", "readOnly": True},
                    ],
                }
            ],
            "volumes": [
                {"name": "data", "hostPath": {"path": "/var/lib/test-app", "type": "DirectoryOrCreate"}},
                {"name": "conf", "configMap": {"name": "app"}},
            ],
        },
    }


@pytest.mark.cluster
def test_runs_the_pod_spec_and_reports_ready(cluster: ClusterHandle, namespace: str, runner: Path) -> None:
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "app"},
            "data": {"greeting": "hello", "app.conf": "mode=test\n"},
        },
        namespace=namespace,
    )
    cluster.apply(_pod("web"), namespace=namespace)

    pod = wait_for(
        lambda: (
            (p := cluster.get_json("pod", "web", "-n", namespace))
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
            and p
        ),
        message="pod Ready (its readiness probe passed)",
    )
    assert pod["status"]["phase"] == "Running"
    assert pod["spec"]["nodeName"] == NODE

    # hostPath maps to this node's directory; env, downward API, ConfigMap volume and $(VAR) all held.
    seen = json.loads((runner / "nodes" / NODE / "host/var/lib/test-app/seen.json").read_text())
    assert seen == {
        "node": NODE,
        "pod": "web",
        "greeting": "hello",
        "config": "mode=test\n",
        "argv": ["hello", "$literal"],
    }
    status, _ = pod_request(pod["metadata"]["uid"], 8080, "/")
    assert status == 200

    cluster.kubectl("delete", "pod", "web", "-n", namespace, "--wait=true", timeout=60)
    status, _ = pod_request(pod["metadata"]["uid"], 8080, "/", timeout=2)
    assert status == 0  # the process and its network namespace are gone


@pytest.mark.cluster
def test_an_exiting_container_is_restarted_and_reported(
    cluster: ClusterHandle, namespace: str, runner: Path
) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "crash"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": NODE},
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "c", "image": "x", "command": ["sh", "-c", "exit 3"]}],
        },
    }
    cluster.apply(pod, namespace=namespace)
    status = wait_for(
        lambda: (
            (s := cluster.get_json("pod", "crash", "-n", namespace)["status"].get("containerStatuses"))
            and s[0]["restartCount"] >= 1
            and s[0]
        ),
        message="a restart",
    )
    assert status["ready"] is False
    assert status["state"].get("terminated", {}).get("exitCode", 3) == 3


@pytest.mark.cluster
def test_a_pod_without_command_is_reported_not_run(
    cluster: ClusterHandle, namespace: str, runner: Path
) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "nocmd"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": NODE},
            "containers": [{"name": "c", "image": "nginx:1.27"}],
        },
    }
    cluster.apply(pod, namespace=namespace)
    waiting = wait_for(
        lambda: (
            (s := cluster.get_json("pod", "nocmd", "-n", namespace)["status"].get("containerStatuses"))
            and s[0]["state"].get("waiting")
        ),
        message="a waiting reason",
    )
    assert waiting["reason"] == "CreateContainerConfigError"
    assert "entrypoint" in waiting["message"]


def test_expand_follows_kubelet_rules() -> None:
    env = {"A": "1", "B": "two"}
    assert spec.expand("$(A)-$(B)-$(C)-$$(A)", env) == "1-two-$(C)-$(A)"


def test_mounts_are_ordered_parent_first(tmp_path: Path) -> None:
    c = {
        "name": "c",
        "volumeMounts": [{"name": "b", "mountPath": "/a/b/c"}, {"name": "a", "mountPath": "/a"}],
    }
    ms = spec.mounts(c, {"a": tmp_path, "b": tmp_path})
    assert [m.target for m in ms] == ["/a", "/a/b/c"]
    with pytest.raises(ValueError, match="names no volume"):
        spec.mounts({"name": "c", "volumeMounts": [{"name": "x", "mountPath": "/x"}]}, {})


@pytest.mark.cluster
def test_init_containers_run_to_completion_first(
    cluster: ClusterHandle, namespace: str, runner: Path
) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "init"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": NODE},
            "terminationGracePeriodSeconds": 1,
            "initContainers": [
                {
                    "name": "prepare",
                    "image": "x",
                    "command": ["sh", "-c", "echo prepared > /work/flag"],
                    "volumeMounts": [{"name": "work", "mountPath": "/work"}],
                }
            ],
            "containers": [
                {
                    "name": "main",
                    "image": "x",
                    "command": ["sleep", "3600"],
                    "readinessProbe": {"exec": {"command": ["grep", "-q", "prepared", "/work/flag"]}},
                    "volumeMounts": [{"name": "work", "mountPath": "/work"}],
                }
            ],
            "volumes": [{"name": "work", "emptyDir": {}}],
        },
    }
    cluster.apply(pod, namespace=namespace)
    wait_for(
        lambda: any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in cluster.get_json("pod", "init", "-n", namespace)["status"].get("conditions", [])
        ),
        message="main Ready after the init container prepared its volume",
    )


@pytest.mark.cluster
def test_a_failing_init_container_keeps_the_pod_from_starting(
    cluster: ClusterHandle, namespace: str, runner: Path
) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "badinit"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": NODE},
            "restartPolicy": "Never",
            "initContainers": [{"name": "prepare", "image": "x", "command": ["sh", "-c", "exit 7"]}],
            "containers": [{"name": "main", "image": "x", "command": ["sleep", "3600"]}],
        },
    }
    cluster.apply(pod, namespace=namespace)
    waiting = wait_for(
        lambda: (
            (s := cluster.get_json("pod", "badinit", "-n", namespace)["status"].get("containerStatuses"))
            and s[0]["state"].get("waiting")
        ),
        message="the init failure reported",
    )
    assert waiting["reason"] == "Init:Error"
    assert "exited 7" in waiting["message"]


def test_identity_follows_the_kubelet_rules() -> None:
    pod = {"spec": {"securityContext": {"runAsUser": 1000, "fsGroup": 3000, "supplementalGroups": [4000]}}}
    assert spec.identity(pod, {"securityContext": {"runAsUser": 2000, "runAsGroup": 2500}}) == (
        2000,
        2500,
        (4000, 3000),
    )
    assert spec.identity(pod, {}) == (1000, None, (4000, 3000))
    assert spec.identity({"spec": {}}, {}) == (None, None, ())


@pytest.mark.cluster
@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="needs a Python every user can execute")
def test_containers_run_as_the_pods_user_and_groups(
    cluster: ClusterHandle, namespace: str, tmp_path: Path
) -> None:
    # Writes its ids into a hostPath, then tries what another uid must not be able to do.
    script = (
        "import os, pathlib, json\n"
        "out = {'uid': os.getuid(), 'gid': os.getgid(), 'groups': sorted(os.getgroups())}\n"
        "try:\n"
        "    pathlib.Path('/data/root-only/x').write_text('x'); out['root_only'] = 'written'\n"
        "except PermissionError:\n"
        "    out['root_only'] = 'denied'\n"
        "pathlib.Path('/scratch/ok').write_text('ok'); out['empty_dir'] = 'written'\n"
        "out['secret'] = pathlib.Path('/secret/token').read_text()\n"
        "out['root'] = sorted(os.listdir('/root'))\n"
        "pathlib.Path('/data/ids.json').write_text(json.dumps(out))\n"
        "import time; time.sleep(3600)\n"
    )
    node = "runner-ids-0"
    stack = contextlib.ExitStack()
    runner = stack.enter_context(
        pod_runner(cluster, tmp_path / "runner", [f"{node}:0"], run_as_pod_user=True)
    )
    stack.callback(cluster.kubectl, "delete", "node", node, "--wait=false", check=False)
    host = runner / "nodes" / node / "host/var/lib/test-ids"
    (host / "root-only").mkdir(parents=True, exist_ok=True)
    (host / "root-only").chmod(0o755)
    host.chmod(0o777)
    cluster.apply(
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "ids"}, "stringData": {"token": "t0k"}},
        namespace=namespace,
    )
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "ids"},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "terminationGracePeriodSeconds": 2,
                "securityContext": {"runAsUser": 1234, "runAsGroup": 2345, "fsGroup": 3456},
                "containers": [
                    {
                        "name": "app",
                        "image": "python:3.11",
                        # The runner's own Python, under this machine's 0700 /root: the runner shadows
                        # /root and binds back only the interpreter and the caches, read-only.
                        "command": [sys.executable, "-c", script],
                        "volumeMounts": [
                            {"name": "data", "mountPath": "/data"},
                            {"name": "scratch", "mountPath": "/scratch"},
                            {"name": "secret", "mountPath": "/secret", "readOnly": True},
                        ],
                    }
                ],
                "volumes": [
                    {"name": "data", "hostPath": {"path": "/var/lib/test-ids", "type": "DirectoryOrCreate"}},
                    {"name": "scratch", "emptyDir": {}},
                    {"name": "secret", "secret": {"secretName": "ids", "defaultMode": 0o440}},
                ],
            },
        },
        namespace=namespace,
    )
    with stack:
        ids = wait_for(
            lambda: (host / "ids.json").exists() and json.loads((host / "ids.json").read_text()),
            message="the container to report its ids",
        )
        cluster.kubectl("delete", "pod", "ids", "-n", namespace, "--wait=false", check=False)
    assert ids["uid"] == 1234
    assert ids["gid"] == 2345
    assert 3456 in ids["groups"]
    assert ids["root_only"] == "denied"  # a root-owned 0755 directory is not the pod's to write
    assert ids["empty_dir"] == "written"
    assert ids["secret"] == "t0k"  # mode 0440, readable through fsGroup only
    # Of root's home the pod's user sees the interpreter and the caches, nothing else.
    assert set(ids["root"]) <= {".pyenv", ".cache"}, ids["root"]


def test_read_only_root_filesystem_leaves_only_the_volumes_writable(
    runner: Path, cluster: ClusterHandle, namespace: str
) -> None:
    script = (
        "import json, os, pathlib, sys\n"
        "out = {}\n"
        "probe = '/var/tmp/kvf-ro-' + os.environ['POD_UID']\n"
        "for name, path in [('root', probe), ('volume', '/scratch/ok')]:\n"
        "    try:\n"
        "        pathlib.Path(path).write_text('x'); out[name] = 'written'\n"
        "    except OSError as exc:\n"
        "        out[name] = exc.strerror\n"
        "pathlib.Path('/data/' + os.environ['POD_NAME'] + '.json').write_text(json.dumps(out))\n"
        "import time; time.sleep(3600)\n"
    )
    host = runner / "nodes" / NODE / "host/var/lib/test-ro"

    def pod(name: str, read_only: bool) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": NODE},
                "terminationGracePeriodSeconds": 2,
                "containers": [
                    {
                        "name": "app",
                        "image": "python:3.12",
                        "command": [sys.executable, "-c", script],
                        "env": [
                            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                            {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
                        ],
                        "securityContext": {"readOnlyRootFilesystem": read_only},
                        "volumeMounts": [
                            {"name": "data", "mountPath": "/data"},
                            {"name": "scratch", "mountPath": "/scratch"},
                        ],
                    }
                ],
                "volumes": [
                    {"name": "data", "hostPath": {"path": "/var/lib/test-ro", "type": "DirectoryOrCreate"}},
                    {"name": "scratch", "emptyDir": {}},
                ],
            },
        }

    cluster.apply(pod("ro", True), pod("rw", False), namespace=namespace)
    try:

        def report(name: str) -> Any:
            path = host / f"{name}.json"
            return path.exists() and json.loads(path.read_text())

        seen = {
            name: wait_for(functools.partial(report, name), message=f"pod {name} to report")
            for name in ("ro", "rw")
        }
    finally:
        cluster.kubectl("delete", "pod", "ro", "rw", "-n", namespace, "--wait=false", check=False)
    assert seen["ro"] == {"root": "Read-only file system", "volume": "written"}
    assert seen["rw"] == {"root": "written", "volume": "written"}
