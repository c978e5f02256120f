"""The consumer-environment contract round-trips: pool -> injected pod env -> ConnectorSettings.

The operator writes the ``KVFABRIC_*`` variables and the connector reads them; both use
``kvfabric.contract.consumer_env``. This test renders pools, injects a pod with the real webhook
function and parses the container's environment with the real ``ConnectorSettings``: a variable
renamed on one side only, or a value the connector would parse differently, fails here.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.connector.settings import ConnectorSettings
from kvfabric.contract.consumer_env import ENV_PREFIX, ConsumerEnvironment, ConsumerVar
from kvfabric.operator.injection import inject, pool_target

_ROOT = Path(__file__).resolve().parents[2]


def _pool(consumers: dict[str, Any], chunk_tokens: int = 256, port: int = 7070) -> dict[str, Any]:
    return {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": "pool-a", "namespace": "llm"},
        "spec": {
            "image": {"tag": "v1"},
            "tiers": {"memory": {"size": "1Gi"}},
            "chunkTokens": chunk_tokens,
            # TCP on, so that every variable of the contract is injected.
            "server": {"port": port, "tcp": {"enabled": True}},
            "consumers": consumers,
        },
    }


def _pod(namespace: str = "llm") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "p",
            "namespace": namespace,
            "labels": {"kvfabric.io/pool": "pool-a"},
            "annotations": {"kvfabric.io/pool-namespace": "llm"},
        },
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0"}]},
    }


def _injected_env(body: dict[str, Any], namespace: str = "llm") -> dict[str, str]:
    """The variables of a consumer in ``namespace`` (another than the pool's: through the CSI plugin)."""
    target = pool_target(body)
    assert target is not None
    result = inject(
        _pod(namespace),
        {(target.namespace, target.name): target},
        {namespace: {"team": "a"}},
        csi_driver="csi.kvfabric.io",
    )
    assert result.injected
    env = result.pod["spec"]["containers"][0]["env"]
    return {e["name"]: _value(e) for e in env if e["name"].startswith(ENV_PREFIX)}


def _value(entry: dict[str, Any]) -> str:
    """The value the kubelet would resolve (a secretKeyRef stands for the Secret's content)."""
    if "value" in entry:
        return str(entry["value"])
    ref = entry["valueFrom"]["secretKeyRef"]
    return f"secret:{ref['name']}/{ref['key']}"


def _settings_from(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> ConnectorSettings:
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return ConnectorSettings()


def test_every_contract_variable_is_a_connector_setting() -> None:
    fields = set(ConnectorSettings.model_fields)
    for var in ConsumerVar:
        assert var.value == ENV_PREFIX + var.field.upper()
        assert var.field in fields, f"{var.value} is injected but ConnectorSettings has no {var.field!r}"


def test_injected_variables_are_exactly_the_contract() -> None:
    consumers = {
        "tenant": "t1",
        "deadlines": {"lookupMs": 50, "loadMs": 900, "storeMs": 7},
        "loadMode": "Asynchronous",
        "localIndex": False,
        "costModel": True,
    }
    same = _injected_env(_pool(consumers))
    other = _injected_env(_pool({**consumers, "namespaceSelector": {"matchLabels": {"team": "a"}}}), "apps")
    assert set(same) | set(other) == {var.value for var in ConsumerVar}
    # The key comes one way or the other: the pool's secret and a scope, or a file with the key.
    assert ConsumerVar.PAYLOAD_KEY_FILE.value not in same
    assert ConsumerVar.PAYLOAD_KEY.value not in other
    # Both name their scope (part of their namespace digest, so a Shared pool's consumers agree).
    assert ConsumerVar.KEY_SCOPE.value in same
    assert ConsumerVar.KEY_SCOPE.value in other


def test_the_key_variables_round_trip() -> None:
    selector = {"namespaceSelector": {"matchLabels": {"team": "a"}}}
    with pytest.MonkeyPatch.context() as mp:
        own = _settings_from(_injected_env(_pool(selector)), mp)
    assert own.key_scope == "llm"
    assert own.payload_key_file is None
    with pytest.MonkeyPatch.context() as mp:
        shared = _settings_from(_injected_env(_pool({**selector, "keySpace": "Shared"})), mp)
    assert shared.key_scope == "*"
    with pytest.MonkeyPatch.context() as mp:
        other = _settings_from(_injected_env(_pool(selector), "apps"), mp)
    assert other.payload_key_file == "/var/run/kvfabric/key/payload.key"
    assert other.payload_key is None
    assert other.key_scope == "apps"


@settings(max_examples=40, deadline=None)
@given(
    tenant=st.none() | st.from_regex(r"[A-Za-z0-9._-]{1,20}", fullmatch=True),
    lookup=st.none() | st.integers(1, 1000),
    load=st.none() | st.integers(1, 30000),
    store=st.none() | st.integers(1, 60000),
    chunk=st.integers(1, 512).map(lambda n: n * 16),
    port=st.integers(1024, 65535),
    load_mode=st.sampled_from([None, "Synchronous", "Asynchronous"]),
    local_index=st.sampled_from([None, True, False]),
    cost_model=st.sampled_from([None, True, False]),
)
def test_round_trip_render_inject_parse(
    tenant: str | None,
    lookup: int | None,
    load: int | None,
    store: int | None,
    chunk: int,
    port: int,
    load_mode: str | None,
    local_index: bool | None,
    cost_model: bool | None,
) -> None:
    deadlines = {k: v for k, v in (("lookupMs", lookup), ("loadMs", load), ("storeMs", store)) if v}
    consumers: dict[str, Any] = {"deadlines": deadlines}
    if tenant is not None:
        consumers["tenant"] = tenant
    if load_mode is not None:
        consumers["loadMode"] = load_mode
    if local_index is not None:
        consumers["localIndex"] = local_index
    if cost_model is not None:
        consumers["costModel"] = cost_model
    body = _pool(consumers, chunk, port)
    env = _injected_env(body)
    target = pool_target(body)
    assert target is not None
    conn = target.connection
    with pytest.MonkeyPatch.context() as mp:
        parsed = _settings_from(env, mp)
    defaults = ConnectorSettings.model_fields
    assert parsed.pool == "llm/pool-a"
    assert parsed.socket == conn.socket
    assert parsed.shared_memory is True, "same-node payloads go through the block socket's memfds"
    assert parsed.remote == conn.remote == f"pool-a.llm.svc:{port}"
    assert parsed.chunk_tokens == chunk
    assert parsed.tenant == (tenant or "")
    assert parsed.lookup_deadline_ms == (lookup or defaults["lookup_deadline_ms"].default)
    assert parsed.load_deadline_ms == (load or defaults["load_deadline_ms"].default)
    assert parsed.store_deadline_ms == (store or defaults["store_deadline_ms"].default)
    assert parsed.load_async is (load_mode == "Asynchronous")
    assert (ConsumerVar.LOAD_ASYNC.value in env) == (load_mode is not None)
    assert parsed.local_index is (defaults["local_index"].default if local_index is None else local_index)
    assert parsed.cost_model is (defaults["cost_model"].default if cost_model is None else cost_model)
    # Unset, neither is injected: the pod keeps the connector's default (and its hash is unchanged).
    assert (ConsumerVar.LOCAL_INDEX.value in env) == (local_index is not None)
    assert (ConsumerVar.COST_MODEL.value in env) == (cost_model is not None)
    assert parsed.config_hash == conn.config_hash
    assert parsed.configured
    assert parsed.token is None
    assert parsed.token_file == "/var/run/secrets/kvfabric.io/tls/token"
    assert parsed.payload_key == "secret:pool-a-credentials/payload-key"
    assert parsed.tls_ca is not None
    assert parsed.tls_cert is not None
    assert parsed.tls_key is not None


def test_hash_is_over_the_environment_only() -> None:
    a = ConsumerEnvironment(pool="n/p", socket="/s", remote="h:1", chunk_tokens=256)
    b = ConsumerEnvironment(pool="n/p", socket="/s", remote="h:1", chunk_tokens=256, tenant="")
    assert a.config_hash == b.config_hash  # an empty tenant is not injected
    assert a.to_env_with_hash()[ConsumerVar.CONFIG_HASH] == a.config_hash
    assert ConsumerEnvironment(**{**a.__dict__, "tenant": "x"}).config_hash != a.config_hash


def test_a_shared_key_space_changes_the_hash_and_the_default_keeps_it() -> None:
    a = ConsumerEnvironment(pool="n/p", socket="/s", remote=None, chunk_tokens=256)
    assert a.config_hash == ConsumerEnvironment(**{**a.__dict__, "shared_key_space": False}).config_hash
    assert a.config_hash != ConsumerEnvironment(**{**a.__dict__, "shared_key_space": True}).config_hash


def test_consumers_injected_before_key_scopes_are_stale() -> None:
    # The hash of the same environment as computed before key scopes existed: such a consumer (one
    # of another namespace sealed with the public key) must be counted stale and so restarted.
    a = ConsumerEnvironment(pool="n/p", socket="/s", remote=None, chunk_tokens=256)
    before = hashlib.sha256(json.dumps(a.to_env(), sort_keys=True).encode()).hexdigest()[:16]
    assert a.config_hash != before


@pytest.mark.parametrize(
    ("path", "setting"),
    [
        (("deadlines", "lookupMs"), "lookup_deadline_ms"),
        (("deadlines", "loadMs"), "load_deadline_ms"),
        (("deadlines", "storeMs"), "store_deadline_ms"),
        (("localIndex",), "local_index"),
        (("costModel",), "cost_model"),
    ],
)
def test_the_crd_states_the_connectors_defaults(path: tuple[str, ...], setting: str) -> None:
    """A field left unset gets the connector's default: the CRD's field doc says which, truly."""
    crd = yaml.safe_load((_ROOT / "crds" / "kvfabric.io_kvcachepools.yaml").read_text(encoding="utf-8"))
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    node = schema["properties"]["spec"]["properties"]["consumers"]
    for name in path:
        node = node["properties"][name]
    default = ConnectorSettings.model_fields[setting].default
    stated = str(default).lower() if isinstance(default, bool) else str(default)
    assert f"default: the connector's, {stated}" in " ".join(node["description"].split())
