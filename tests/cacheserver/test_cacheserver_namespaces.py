"""Namespace descriptions (Describe): verified, bounded, exported in /metrics of a real server process."""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfabric.cacheserver.metrics import namespace_label as lbl
from kvfabric.client import CacheClient
from kvfabric.client.errors import InvalidRequest
from kvfabric.connector.keys import NamespaceSpec
from kvfabric.contract.namespace import parse_description
from kvfabric.rpc.v1 import cache_pb2 as pb
from kvfabric.rpc.v1 import cache_pb2_grpc as pb_grpc
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for

pytestmark = [pytest.mark.process, pytest.mark.slow]

SPEC = NamespaceSpec(
    "meta-llama/Llama-3.1-8B", "0e9e39f", "bfloat16", 32, 8, 128, 16, 256, tp_size=2, tp_rank=1
)


def described(srv: ServerProcess) -> dict[str, dict[str, str]]:
    """namespace label -> labels of every kvfabric_namespace_info series the server exports."""
    with urllib.request.urlopen(srv.metrics_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, dict[str, str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvfabric_namespace_info":
                assert sample.value == 1
                out[sample.labels["namespace_label"]] = dict(sample.labels)
    return out


def samples(srv: ServerProcess, name: str) -> list[tuple[dict[str, str], float]]:
    with urllib.request.urlopen(srv.metrics_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return [
        (dict(s.labels), s.value)
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    ]


@pytest.fixture
def stub_of() -> Iterator[Any]:
    channels: list[grpc.Channel] = []

    def make(srv: ServerProcess) -> Any:
        ch = grpc.insecure_channel(srv.unix_target)
        channels.append(ch)
        return pb_grpc.CacheStub(ch)  # type: ignore[no-untyped-call]

    yield make
    for ch in channels:
        ch.close()


def test_a_described_namespace_is_exported_with_its_fields_and_lookups(stub_of: Any) -> None:
    ns = SPEC.digest()
    keys = [digest("k", i) for i in range(4)]
    with cache_server(dram_bytes=16 * MiB) as srv, CacheClient(srv.unix_target, shared_memory=True) as c:
        stub = stub_of(srv)
        # Unknown: the server asks for a description in every lookup and store answer.
        assert stub.Lookup(pb.LookupRequest(namespace=ns, keys=keys), timeout=5).describe
        assert described(srv) == {}
        c.describe(ns, SPEC.canonical().decode(), timeout=5)
        c.store(ns, keys[:3], [payload_for(k, 1000) for k in keys[:3]], timeout=5)
        resp = stub.Lookup(pb.LookupRequest(namespace=ns, keys=keys), timeout=5)
        assert (resp.matched, resp.describe) == (3, False)
        labels = described(srv)[lbl(ns)]
        assert labels["model"] == "meta-llama/Llama-3.1-8B"
        assert labels["revision"] == "0e9e39f"
        assert labels["dtype"] == "bfloat16"
        assert (labels["block_size"], labels["chunk_tokens"]) == ("16", "256")
        assert (labels["tp_size"], labels["tp_rank"]) == ("2", "1")
        assert labels["payload_layout"] == SPEC.layout
        lookups = {lb["result"]: v for lb, v in samples(srv, "kvfabric_namespace_lookup_keys_total")}
        assert lookups == {"hit": 3, "miss": 1}
        assert samples(srv, "kvfabric_namespace_stores_total") == [({"namespace_label": lbl(ns)}, 3)]
        # Another namespace's lookups never count for this one.
        other = dataclasses.replace(SPEC, model_revision="main").digest()
        assert stub.Lookup(pb.LookupRequest(namespace=other, keys=keys), timeout=5).describe
        lookups = {lb["result"]: v for lb, v in samples(srv, "kvfabric_namespace_lookup_keys_total")}
        assert lookups == {"hit": 3, "miss": 1}


def _refused(client: CacheClient, namespace: str, spec_json: str) -> str:
    with pytest.raises(InvalidRequest) as info:
        client.describe(namespace, spec_json, timeout=5)
    assert "INVALID_ARGUMENT" in str(info.value)
    return str(info.value)


def test_a_description_that_does_not_hash_to_its_namespace_is_refused_and_not_exported() -> None:
    ns = SPEC.digest()
    doc = SPEC.document()
    with cache_server(dram_bytes=16 * MiB) as srv, CacheClient(srv.unix_target) as c:
        # Claims another revision than the one the namespace was derived from.
        lie = json.dumps({**doc, "model_revision": "v2"})
        assert "not to the namespace" in _refused(c, ns, lie)
        # The right document under another namespace.
        _refused(c, digest("someone else's"), SPEC.canonical().decode())
        # Malformed: not JSON, not an object, a float, a nested value, control characters, too big,
        # no scheme.
        _refused(c, ns, "{")
        _refused(c, ns, "[1]")
        _refused(c, ns, json.dumps({**doc, "head_dim": 128.0}))
        _refused(c, ns, json.dumps({**doc, "lora": ["a"]}))
        _refused(c, ns, json.dumps({**doc, "tenant": "a\nb"}))
        _refused(c, ns, json.dumps({**doc, "tenant": "x" * 5000}))
        _refused(c, ns, json.dumps({k: v for k, v in doc.items() if k != "scheme"}))
        assert described(srv) == {}
        refused = {lb["result"]: v for lb, v in samples(srv, "kvfabric_cache_describes_total")}
        assert refused == {"refused": 9}
        # The honest description of the same namespace is accepted (key order does not matter).
        c.describe(ns, json.dumps(dict(reversed(list(doc.items())))), timeout=5)
        assert list(described(srv)) == [lbl(ns)]


def test_the_server_keeps_a_bounded_number_of_descriptions_least_recently_used_first_out(
    stub_of: Any,
) -> None:
    specs = [dataclasses.replace(SPEC, model_id=f"model-{i}") for i in range(6)]
    nss = [s.digest() for s in specs]
    with (
        cache_server(dram_bytes=16 * MiB, overrides={"limits.max_described_namespaces": 3}) as srv,
        CacheClient(srv.unix_target) as c,
    ):
        stub = stub_of(srv)
        for s in specs[:3]:
            c.describe(s.digest(), s.canonical().decode(), timeout=5)
        assert set(described(srv)) == {lbl(n) for n in nss[:3]}
        # A lookup makes model-0 the most recently used: model-1 and model-2 go first.
        assert not stub.Lookup(pb.LookupRequest(namespace=nss[0], keys=[digest(0)]), timeout=5).describe
        for s in specs[3:5]:
            c.describe(s.digest(), s.canonical().decode(), timeout=5)
        assert set(described(srv)) == {lbl(nss[0]), lbl(nss[3]), lbl(nss[4])}
        assert samples(srv, "kvfabric_namespace_descriptions_evicted_total") == [({}, 2)]
        # The forgotten one is asked for again.
        assert stub.Lookup(pb.LookupRequest(namespace=nss[1], keys=[digest(0)]), timeout=5).describe
        for s in specs:
            c.describe(s.digest(), s.canonical().decode(), timeout=5)
        assert len(described(srv)) == 3
        # ... and what is exported always verified against its namespace.
        by_label = {lbl(n): s for n, s in zip(nss, specs, strict=True)}
        for label, labels in described(srv).items():
            assert labels["model"] == by_label[label].model_id


def test_a_restarted_server_asks_for_descriptions_again(stub_of: Any) -> None:
    ns = SPEC.digest()
    with cache_server(dram_bytes=16 * MiB) as srv:
        with CacheClient(srv.unix_target) as c:
            c.describe(ns, SPEC.canonical().decode(), timeout=5)
        assert list(described(srv)) == [lbl(ns)]
        srv.kill()
        srv.start()
        assert described(srv) == {}
        stub = stub_of(srv)
        assert stub.Lookup(pb.LookupRequest(namespace=ns, keys=[digest(0)]), timeout=5).describe
        res = stub.Store(
            iter([pb.StoreChunk(namespace=ns, key=digest(1), total_length=3, data=b"abc")]), timeout=5
        )
        assert (res.accepted, res.describe) == (1, True)


def test_parse_description_round_trips_every_spec_field() -> None:
    doc = parse_description(SPEC.digest(), SPEC.canonical())
    assert doc == SPEC.document()


def test_metrics_never_publish_a_digest_a_key_fingerprint_or_a_tenant() -> None:
    """The metrics port is unauthenticated, and a namespace's digest is a capability (it names every
    chunk of the namespace): it is exported under a one-way label, and nothing exported recomputes it."""
    spec = dataclasses.replace(SPEC, tenant="team-a", payload_key_id="0f1e2d3c4b5a6978")
    ns = spec.digest()
    with cache_server(dram_bytes=16 * MiB) as srv, CacheClient(srv.unix_target) as c:
        c.describe(ns, spec.canonical().decode(), timeout=5)
        c.store(ns, [digest("k")], [payload_for(digest("k"), 1000)], timeout=5)
        c.lookup(ns, [digest("k")], timeout=5)
        with urllib.request.urlopen(srv.metrics_url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        labels = described(srv)[lbl(ns)]
        assert labels["model"] == spec.model_id
        # Only one-way labels of the key and the tenant: two namespaces can be told apart, no more.
        assert len(labels["key_space"]) == len(labels["tenant_label"]) == 8
        other = dataclasses.replace(spec, tenant="team-b", payload_key_id="1f1e2d3c4b5a6978")
        c.describe(other.digest(), other.canonical().decode(), timeout=5)
        theirs = described(srv)[lbl(other.digest())]
        assert theirs["key_space"] != labels["key_space"]
        assert theirs["tenant_label"] != labels["tenant_label"]
        assert ns not in text
        assert ns[:16] not in text
        assert "0f1e2d3c4b5a6978" not in text
        assert "team-a" not in text
        assert "tenant=" not in text
        assert "payload_key_id=" not in text
