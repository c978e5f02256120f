"""Per-pool credentials (pure planning), the TCP listener's rendering and the pool's NetworkPolicy."""

from __future__ import annotations

import base64
import datetime as dt
from typing import Any

from cryptography import x509
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.cacheserver.config import ServerConfig
from kvfabric.operator.api.v1alpha1 import KVCachePool
from kvfabric.operator.poolpki import plan_secrets, server_dns_names
from kvfabric.operator.render import names, render_children
from kvfabric.operator.render.children import build_server_config

OWNER = {"apiVersion": "kvfabric.io/v1alpha1", "kind": "KVCachePool", "name": "p", "uid": "u"}
DAY = dt.timedelta(days=1)


def pool(tcp: bool = True, validity_days: int = 30, **spec: Any) -> KVCachePool:
    body: dict[str, Any] = {
        "image": {"tag": "v1"},
        "tiers": {"memory": {"size": "1Gi"}},
        "server": {"tcp": {"enabled": tcp, "certificateValiditySeconds": validity_days * 86400}},
        **spec,
    }
    return KVCachePool.model_validate(
        {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}, "spec": body}
    )


def _apply(store: dict[str, Any], writes: list[dict[str, Any]]) -> None:
    for body in writes:
        store[body["metadata"]["name"]] = body


def _cert(store: dict[str, Any], name: str, key: str = "tls.crt") -> x509.Certificate:
    return x509.load_pem_x509_certificate(base64.b64decode(store[name]["data"][key]))


def _bundle(store: dict[str, Any], name: str) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(base64.b64decode(store[name]["data"]["ca.crt"]))


def _plan(p: KVCachePool, store: dict[str, Any], now: dt.datetime) -> list[dict[str, Any]]:
    names_ = ["p-credentials", "p-ca", "p-server-tls", "p-client-tls"]
    plan = plan_secrets(p, {n: store.get(n) for n in names_}, now, OWNER)
    _apply(store, plan.writes)
    return plan.writes


def test_tcp_off_needs_only_the_token_and_keeps_it() -> None:
    now = dt.datetime.now(dt.UTC)
    store: dict[str, Any] = {}
    plan = plan_secrets(pool(tcp=False), {}, now, OWNER)
    assert plan.wanted == {"p-credentials"}
    _apply(store, plan.writes)
    token = store["p-credentials"]["data"]["token"]
    assert len(base64.b64decode(token)) >= 32
    mac = store["p-credentials"]["data"]["payload-key"]
    assert len(base64.b64decode(mac)) >= 32
    assert mac != token
    # Level-triggered: a second pass writes nothing and never changes the token.
    assert _plan(pool(tcp=False), store, now) == []
    assert store["p-credentials"]["data"]["token"] == token
    assert store["p-credentials"]["data"]["payload-key"] == mac


def test_certificates_chain_to_the_pools_own_ca_and_cover_the_service() -> None:
    now = dt.datetime.now(dt.UTC)
    store: dict[str, Any] = {}
    _plan(pool(), store, now)
    assert set(store) == {"p-credentials", "p-ca", "p-server-tls", "p-client-tls"}
    ca = _cert(store, "p-ca")
    server, client = _cert(store, "p-server-tls"), _cert(store, "p-client-tls")
    server.verify_directly_issued_by(ca)
    client.verify_directly_issued_by(ca)
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(sans.get_values_for_type(x509.DNSName)) == set(server_dns_names(pool()))
    assert "p.ns.svc" in server_dns_names(pool())

    def eku(c: x509.Certificate) -> set[x509.ObjectIdentifier]:
        return set(c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)

    assert eku(server) == {x509.oid.ExtendedKeyUsageOID.SERVER_AUTH}
    assert eku(client) == {x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH}
    # The CA key is only in the CA Secret, which nothing mounts.
    assert "tls.key" in store["p-ca"]["data"]
    assert all(s["metadata"]["ownerReferences"] == [OWNER] for s in store.values())
    assert _plan(pool(), store, now) == []


def test_leaves_rotate_before_expiry_and_the_ca_hands_over_with_a_bundle() -> None:
    now = dt.datetime.now(dt.UTC)
    store: dict[str, Any] = {}
    _plan(pool(validity_days=30), store, now)
    first_server = _cert(store, "p-server-tls")
    # With more than a third of 30 days left nothing changes...
    assert _plan(pool(validity_days=30), store, now + 19 * DAY) == []
    # ... with less, both leaves are re-issued by the same CA.
    writes = _plan(pool(validity_days=30), store, now + 21 * DAY)
    assert {w["metadata"]["name"] for w in writes} == {"p-server-tls", "p-client-tls"}
    second = _cert(store, "p-server-tls")
    assert second.serial_number != first_server.serial_number
    second.verify_directly_issued_by(_cert(store, "p-ca"))
    # The CA lives ten times as long; near its end a new CA is made and bundled with the old one.
    old_ca = _cert(store, "p-ca")
    later = now + 201 * DAY
    _plan(pool(validity_days=30), store, later)
    new_ca = _cert(store, "p-ca")
    assert new_ca.serial_number != old_ca.serial_number
    bundle = {c.serial_number for c in _bundle(store, "p-server-tls")}
    assert bundle == {new_ca.serial_number, old_ca.serial_number}
    _cert(store, "p-client-tls").verify_directly_issued_by(new_ca)
    # Once the old CA has expired it leaves the bundle.
    _plan(pool(validity_days=30), store, now + 301 * DAY)
    assert {c.serial_number for c in _bundle(store, "p-client-tls")} == {_cert(store, "p-ca").serial_number}


def test_tcp_listener_is_off_by_default_and_mutual_tls_when_on() -> None:
    off = build_server_config(pool(tcp=False))
    assert off.listen.tcp_port is None
    ds = next(o for o in render_children(pool(tcp=False)).objects if o["kind"] == "DaemonSet")
    ports = ds["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert [p["name"] for p in ports] == ["metrics"]
    on = build_server_config(pool())
    assert on.listen.tcp_host == "0.0.0.0"
    assert on.listen.tls is not None
    assert on.listen.tls.client_ca_file is not None
    assert on.listen.token_file is not None
    ServerConfig.model_validate(on.model_dump())  # the server's own validator accepts it
    spec = next(o for o in render_children(pool()).objects if o["kind"] == "DaemonSet")["spec"]["template"][
        "spec"
    ]
    secrets = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    assert secrets == {"p-server-tls", "p-credentials"}
    mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert {names.SERVER_TLS_MOUNT, names.CREDENTIALS_MOUNT} <= mounts
    # The CA key never reaches a pod.
    assert "p-ca" not in secrets


def _policy(p: KVCachePool) -> dict[str, Any]:
    spec: dict[str, Any] = next(o for o in render_children(p).objects if o["kind"] == "NetworkPolicy")["spec"]
    return spec


def test_network_policy_admits_consumers_to_cache_and_scrapers_to_metrics_only() -> None:
    closed = _policy(pool(tcp=False))
    assert closed["podSelector"] == {"matchLabels": names.selector_labels("p")}
    assert closed["policyTypes"] == ["Ingress"]
    # TCP off: no rule for the cache port at all; metrics only from labelled scrapers.
    assert [r["ports"] for r in closed["ingress"]] == [[{"protocol": "TCP", "port": 9090}]]
    assert closed["ingress"][0]["from"] == [
        {
            "namespaceSelector": {"matchLabels": {}},
            "podSelector": {"matchLabels": {"kvfabric.io/metrics-scraper": "true"}},
        },
        # The operator's own pods (it scrapes the servers for status.cache), in its namespace only.
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvfabric-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvfabric-operator"}},
        },
    ]
    opened = _policy(
        pool(
            consumers={
                "podSelector": {"matchLabels": {"app": "vllm"}},
                "namespaceSelector": {"matchLabels": {"team": "a"}},
            }
        )
    )
    cache = opened["ingress"][0]
    assert cache["ports"] == [{"protocol": "TCP", "port": 7070}]
    consumers = {"matchLabels": {"app": "vllm", "kvfabric.io/pool": "p"}}
    assert cache["from"] == [
        {"podSelector": consumers},
        {"namespaceSelector": {"matchLabels": {"team": "a"}}, "podSelector": consumers},
    ]
    no_metrics = _policy(pool(tcp=False, metrics={"enabled": False}))
    assert no_metrics["ingress"] == []  # deny every ingress


_FOREIGN: dict[str, dict[str, Any]] = {
    "no owner": {},
    "the operator's labels copied": {"labels": names.child_labels("p", "credentials")},
    "owned by an earlier pool of that name": {
        "ownerReferences": [{**OWNER, "uid": "an-earlier-incarnation"}],
        "labels": names.child_labels("p", "credentials"),
    },
}


@settings(max_examples=60, deadline=None)
@given(
    taken=st.sets(st.sampled_from(["p-credentials", "p-ca", "p-server-tls", "p-client-tls"]), min_size=1),
    how=st.sampled_from(sorted(_FOREIGN)),
    tcp=st.booleans(),
)
def test_a_secret_that_is_not_the_pools_is_never_written_and_is_reported(
    taken: set[str], how: str, tcp: bool
) -> None:
    now = dt.datetime.now(dt.UTC)
    theirs = {
        n: {"metadata": {"name": n, "namespace": "ns", **_FOREIGN[how]}, "data": {"access-key": "dXNlcg=="}}
        for n in taken
    }
    plan = plan_secrets(pool(tcp=tcp), theirs, now, OWNER)
    conflicts = taken & plan.wanted
    assert plan.conflicts == tuple(sorted(conflicts))
    if conflicts:
        assert plan.writes == []  # nothing merged, owned or issued beside it
    else:  # only Secrets the pool does not want (TCP off): the pool proceeds, never touching them
        assert plan.writes
    assert not {w["metadata"]["name"] for w in plan.writes} & taken


def test_the_pools_own_secrets_are_known_by_the_owner_reference_to_its_uid() -> None:
    now = dt.datetime.now(dt.UTC)
    store: dict[str, Any] = {}
    _plan(pool(), store, now)
    # Its own (owner reference to uid "u"): kept as they are, no conflict.
    plan = plan_secrets(pool(), store, now, OWNER)
    assert (plan.writes, plan.conflicts) == ([], ())
    # The same Secrets under a re-created pool of the same name (another uid) are not its own.
    plan = plan_secrets(pool(), store, now, {**OWNER, "uid": "u2"})
    assert plan.conflicts == ("p-ca", "p-client-tls", "p-credentials", "p-server-tls")
    assert plan.writes == []
