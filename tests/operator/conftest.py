"""Fixtures for the operator's cluster tests: the CRD installed, the operator running as a process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfabric.localcluster.testing import ClusterHandle, wait_for

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "kvfabric.io_kvcachepools.yaml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OperatorProcess:
    """``kvfabric operator`` as a subprocess with its webhook on 127.0.0.1 and a self-signed cert."""

    def __init__(
        self,
        cluster: ClusterHandle,
        workdir: Path,
        *,
        kubeconfig: Path | None = None,
        config_name: str | None = None,
        extra_args: list[str] | None = None,
        register: bool = True,
    ) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.kubeconfig = kubeconfig or cluster.kubeconfig
        self.port = _free_port()
        self.config_name = config_name or f"kvfabric-test-{uuid.uuid4().hex[:6]}"
        self.log_path = workdir / "operator.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.extra_args = list(extra_args or [])
        self.register = register

    def start(self) -> None:
        """Start the operator and wait until its webhook answers."""
        assert self.proc is None
        self.starts += 1
        log = self.log_path.open("ab")
        log.write(f"\n===== start #{self.starts} =====\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvfabric.cli",
                "operator",
                "--kubeconfig",
                str(self.kubeconfig),
                "--webhook-port",
                str(self.port),
                "--webhook-cert-dir",
                str(self.workdir / "certs"),
                *(["--register-webhook"] if self.register else []),
                "--webhook-config-name",
                self.config_name,
                "--resync-seconds",
                "5",
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        log.close()

        def webhook_up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"operator exited {self.proc.returncode}:\n{self.tail()}")
            with socket.socket() as s:
                s.settimeout(0.2)
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        try:
            wait_for(webhook_up, timeout=60, message="operator webhook listening")
        except AssertionError as exc:
            self.stop(kill=True)
            raise AssertionError(f"{exc}\n--- operator log ---\n{self.tail()}") from None

    def stop(self, *, kill: bool = False) -> None:
        """Stop the operator (SIGKILL with ``kill``: no cleanup at all, as in a crash)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def tail(self, lines: int = 60) -> str:
        """Return the end of the operator's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@pytest.fixture(scope="session")
def crd(cluster: ClusterHandle) -> None:
    """Install the generated CRD and wait until it is established."""
    cluster.kubectl("apply", "--server-side", "--field-manager=kvfabric-tests", "-f", str(CRD))
    cluster.wait_crd_established("kvcachepools.kvfabric.io")


@pytest.fixture(scope="session")
def operator(
    cluster: ClusterHandle, crd: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """The operator, running for the whole session (tests may restart it)."""
    proc = OperatorProcess(cluster, tmp_path_factory.mktemp("operator"))
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
        cluster.kubectl(
            "delete", "mutatingwebhookconfiguration", proc.config_name, "--ignore-not-found", check=False
        )
        print(f"--- operator log tail ---\n{proc.tail()}")


def get_pool(cluster: ClusterHandle, namespace: str, name: str) -> dict[str, Any]:
    """Return the pool object."""
    return cluster.get_json("kvcachepool", name, "-n", namespace)


def condition(pool: dict[str, Any], ctype: str) -> dict[str, Any]:
    """Return one status condition (empty dict when absent)."""
    for cond in (pool.get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return dict(cond)
    return {}


def is_ready(cluster: ClusterHandle, namespace: str, name: str, generation: int | None = None) -> bool:
    """Return whether the pool reports Ready for its current (or the given) generation."""
    pool = get_pool(cluster, namespace, name)
    gen = generation if generation is not None else pool["metadata"]["generation"]
    ready = condition(pool, "Ready")
    return bool(
        ready.get("status") == "True"
        and ready.get("observedGeneration") == gen
        and pool["status"].get("observedGeneration") == gen
    )


@contextlib.contextmanager
def watch_pool(cluster: ClusterHandle, namespace: str, name: str) -> Iterator[list[dict[str, Any]]]:
    """Collect every version of the pool seen by ``kubectl get -w`` while the block runs."""
    seen: list[dict[str, Any]] = []
    proc = subprocess.Popen(
        [
            str(cluster.kubectl_bin),
            f"--kubeconfig={cluster.kubeconfig}",
            "get",
            "kvcachepool",
            name,
            "-n",
            namespace,
            "-w",
            "-o",
            "json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    time.sleep(1.0)  # let the watch start before the caller changes anything
    try:
        yield seen
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
        decoder = json.JSONDecoder()
        text, idx = out.strip(), 0
        while idx < len(text):
            obj, end = decoder.raw_decode(text, idx)
            seen.append(obj)
            idx = end
            while idx < len(text) and text[idx].isspace():
                idx += 1


def patch_pod_status(cluster: ClusterHandle, namespace: str, pod: str, status: dict[str, Any]) -> None:
    """Merge ``status`` into a pod's status subresource (as a kubelet, or kwok, would report it)."""
    cluster.kubectl(
        "patch",
        "pod",
        pod,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )
