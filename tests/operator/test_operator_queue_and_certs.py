"""The reconcile queue coalesces bursts and retries; webhook certificates and configuration are sound."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509

from kvfabric.operator import certs
from kvfabric.operator.reconcile import ReconcileQueue, ReconcileResult
from kvfabric.operator.webhookconfig import render_webhook_configuration


@pytest.mark.asyncio
async def test_queue_coalesces_triggers_while_running() -> None:
    calls: list[tuple[str, str]] = []
    gate = asyncio.Event()

    async def worker(key: tuple[str, str]) -> None:
        calls.append(key)
        await gate.wait()

    queue = ReconcileQueue(worker)
    for _ in range(10):
        queue.trigger(("ns", "a"))
    queue.trigger(("ns", "b"))
    await asyncio.sleep(0.01)
    for _ in range(10):
        queue.trigger(("ns", "a"))  # arrive while "a" runs: fold into one more pass
    gate.set()
    for _ in range(100):
        if queue.idle():
            break
        await asyncio.sleep(0.01)
    assert sorted(calls) == [("ns", "a"), ("ns", "a"), ("ns", "b")]
    await queue.close()


@pytest.mark.asyncio
async def test_queue_retries_failures() -> None:
    attempts = 0

    async def worker(key: tuple[str, str]) -> None:
        nonlocal attempts
        attempts += 1
        if attempts < 2:
            raise RuntimeError("transient")

    queue = ReconcileQueue(worker, max_backoff=0.01)
    queue.trigger(("ns", "a"))
    for _ in range(200):
        if queue.idle():
            break
        await asyncio.sleep(0.01)
    assert attempts == 2
    await queue.close()


def test_generated_certificate_covers_loopback(tmp_path: Path) -> None:
    generated = certs.generate(tmp_path, ["127.0.0.1", "localhost"])
    cert = x509.load_pem_x509_certificate(generated.cert_file.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in sans.get_values_for_type(x509.IPAddress)
    assert "localhost" in sans.get_values_for_type(x509.DNSName)
    ca = x509.load_pem_x509_certificate(generated.ca_bundle())
    cert.verify_directly_issued_by(ca)
    assert generated.key_file.stat().st_mode & 0o077 == 0


def test_webhook_configuration_fails_open_and_selects_opted_in_pods() -> None:
    config = render_webhook_configuration(url="https://127.0.0.1:9443/mutate-pods", ca_bundle=b"PEM")
    hook = config["webhooks"][0]
    assert hook["failurePolicy"] == "Ignore"
    assert hook["objectSelector"] == {"matchExpressions": [{"key": "kvfabric.io/pool", "operator": "Exists"}]}
    assert hook["rules"][0]["operations"] == ["CREATE"]
    assert base64.b64decode(hook["clientConfig"]["caBundle"]) == b"PEM"
    assert "kube-system" in hook["namespaceSelector"]["matchExpressions"][0]["values"]
    with pytest.raises(ValueError, match="exactly one"):
        render_webhook_configuration()


def test_required_pools_get_a_fail_closed_webhook() -> None:
    config = render_webhook_configuration(
        url="https://127.0.0.1:9443/mutate-pods", required_pools=["b", "a", "b"]
    )
    ignore, fail = config["webhooks"]
    assert ignore["failurePolicy"] == "Ignore"
    assert ignore["objectSelector"]["matchExpressions"] == [
        {"key": "kvfabric.io/pool", "operator": "Exists"},
        {"key": "kvfabric.io/pool", "operator": "NotIn", "values": ["a", "b"]},
    ]
    assert fail["failurePolicy"] == "Fail"
    assert fail["objectSelector"]["matchExpressions"] == [
        {"key": "kvfabric.io/pool", "operator": "In", "values": ["a", "b"]}
    ]
    assert fail["clientConfig"] == ignore["clientConfig"]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("during", "passes"),
    [
        ([{"version": "7"}], 1),  # only the echo of the pass's own status write: no second pass
        ([{"version": "7"}, {"version": "8"}], 2),  # another change of the pool too
        ([{"version": "7"}, {}], 2),  # a child's event (no version) too
        ([{"version": "6"}], 2),  # an older version: not the write's echo
    ],
)
async def test_the_echo_of_a_pass_own_status_write_needs_no_further_pass(
    during: list[dict[str, str]], passes: int
) -> None:
    # The pool's watch event of a status write can overtake the write's own answer: it then arrives
    # while the pass is still running, so the controller cannot yet know the version it will leave.
    calls = 0

    async def work(key: tuple[str, str]) -> ReconcileResult:
        nonlocal calls
        calls += 1
        if calls == 1:
            for trigger in during:
                queue.trigger(key, **trigger)
        await asyncio.sleep(0)
        return ReconcileResult(status_version="7" if calls == 1 else None)

    queue = ReconcileQueue(work)
    queue.trigger(("ns", "p"))
    for _ in range(50):
        await asyncio.sleep(0.01)
        if queue.idle():
            break
    assert queue.idle()
    assert calls == passes
