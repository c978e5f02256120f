"""Webhook certificate rotation under continuous pod creation, against the real API server.

The operator runs with a serving certificate valid for six seconds, so it re-issues and reloads it
every few seconds; pods of a ``failurePolicy: Fail`` pool are created one after the other the whole
time. Every creation must be admitted and injected: a rotation that restarted the listener, or
served an expired certificate, would reject some.
"""

from __future__ import annotations

import json
import ssl
import uuid
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from tests.operator.conftest import OperatorProcess

from kvfabric.localcluster.testing import ClusterHandle, wait_for
from kvfabric.operator.render import names

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _served_serial(port: int) -> int:
    pem = ssl.get_server_certificate(("127.0.0.1", port), timeout=5)
    return int(x509.load_pem_x509_certificate(pem.encode()).serial_number)


def _served_not_after(port: int) -> str:
    pem = ssl.get_server_certificate(("127.0.0.1", port), timeout=5)
    return x509.load_pem_x509_certificate(pem.encode()).not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ")


def _pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"kvfabric.io/pool": "rot", "app": "rot"}},
        "spec": {"containers": [{"name": "app", "image": "python:3.12", "command": ["sleep", "inf"]}]},
    }


def test_webhook_certificate_rotates_with_no_rejected_admission(
    cluster: ClusterHandle, namespace: str, crd: None, tmp_path: Path
) -> None:
    op = OperatorProcess(
        cluster,
        tmp_path,
        config_name=f"kvfabric-rotation-{uuid.uuid4().hex[:6]}",
        extra_args=["--webhook-cert-validity-seconds", "6", "--namespace", namespace],
    )
    op.start()
    try:
        cluster.apply(
            {
                "apiVersion": "kvfabric.io/v1alpha1",
                "kind": "KVCachePool",
                "metadata": {"name": "rot"},
                "spec": {
                    "image": {"tag": "v0.2.0"},
                    "tiers": {"memory": {"size": "1Gi"}},
                    "consumers": {"failurePolicy": "Fail"},
                },
            },
            namespace=namespace,
        )

        def required() -> bool:
            config = cluster.get_json("mutatingwebhookconfiguration", op.config_name)
            return any(w.get("failurePolicy") == "Fail" for w in config.get("webhooks", []))

        wait_for(required, timeout=60, message="the Fail webhook for the pool")
        serials = {_served_serial(op.port)}
        rejected: list[str] = []
        created = 0
        # Until the certificate has been replaced at least three times (a bounded number of pods).
        while len(serials) < 4 and created < 400:
            name = f"p-{created}"
            result = cluster.kubectl(
                "create", "-n", namespace, "-f", "-", "-o", "json", input=json.dumps(_pod(name)), check=False
            )
            created += 1
            if result.returncode != 0:
                rejected.append(result.stderr.strip())
                continue
            pod = json.loads(result.stdout)
            if names.INJECTED_ANNOTATION not in (pod["metadata"].get("annotations") or {}):
                rejected.append(f"{name} not injected: {pod['metadata'].get('annotations')}")
            serials.add(_served_serial(op.port))
        assert rejected == [], rejected[:3]
        assert len(serials) >= 4, f"only {len(serials)} certificates served over {created} pods"
        # The pool's InjectionReady names the expiry of a certificate the webhook actually served.
        served = {_served_not_after(op.port)}

        def reflects() -> bool:
            pool = cluster.get_json("kvcachepool", "rot", "-n", namespace)
            cond = next(c for c in pool["status"]["conditions"] if c["type"] == "InjectionReady")
            served.add(_served_not_after(op.port))
            return cond["status"] == "True" and any(stamp in cond["message"] for stamp in served)

        wait_for(reflects, timeout=60, message="InjectionReady naming the served certificate's expiry")
    finally:
        op.stop()
        cluster.kubectl(
            "delete", "mutatingwebhookconfiguration", op.config_name, "--ignore-not-found", check=False
        )
        cluster.kubectl("delete", "pods", "-n", namespace, "-l", "app=rot", "--wait=false", check=False)
