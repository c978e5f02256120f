"""Injection is a pure function of (pod, pools, namespace labels): idempotent and never raising."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.operator import injection
from kvfabric.operator.injection import KV_TRANSFER_FLAG, inject, pool_target
from kvfabric.operator.render import names


def pool_body(name: str = "pool-a", namespace: str = "llm", **consumers: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"image": {"tag": "v1"}, "tiers": {"memory": {"size": "1Gi"}}, "consumers": consumers},
    }


def pools(*bodies: dict[str, Any]) -> dict[tuple[str, str], injection.PoolTarget]:
    out = {}
    for body in bodies:
        target = pool_target(body)
        assert target is not None
        out[(target.namespace, target.name)] = target
    return out


def pod(
    containers: list[dict[str, Any]] | None = None,
    *,
    pool: str | None = "pool-a",
    namespace: str = "llm",
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    all_labels = dict(labels or {})
    if pool is not None:
        all_labels["kvfabric.io/pool"] = pool
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "p",
            "namespace": namespace,
            "labels": all_labels,
            "annotations": annotations or {},
        },
        "spec": {"containers": containers or [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0"}]},
    }


POOLS = pools(pool_body())
CSI = "csi.kvfabric.io"


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def test_tcp_pool_wires_its_credentials_into_same_namespace_consumers() -> None:
    tcp = pool_body()
    tcp["spec"]["server"] = {"tcp": {"enabled": True}}
    result = inject(pod(), pools(tcp), {})
    container = result.pod["spec"]["containers"][0]
    env = env_of(container)
    assert env["KVFABRIC_REMOTE"] == "pool-a.llm.svc:7070"
    assert env["KVFABRIC_TLS_CA"] == "/var/run/secrets/kvfabric.io/tls/ca.crt"
    assert env["KVFABRIC_TLS_CERT"] == "/var/run/secrets/kvfabric.io/tls/tls.crt"
    assert env["KVFABRIC_TLS_KEY"] == "/var/run/secrets/kvfabric.io/tls/tls.key"
    # The token is a file of the pool's Secret (projected with the client certificate, kept current
    # by the kubelet and re-read by the connector), never a value in the pod spec nor an env var
    # that a rotation could not change.
    assert env["KVFABRIC_TOKEN_FILE"] == "/var/run/secrets/kvfabric.io/tls/token"
    assert not any(e["name"] == "KVFABRIC_TOKEN" for e in container["env"])
    mac = next(e for e in container["env"] if e["name"] == "KVFABRIC_PAYLOAD_KEY")
    assert mac["valueFrom"]["secretKeyRef"]["name"] == "pool-a-credentials"
    assert "pool-a-credentials" not in json.dumps(result.pod["metadata"])
    assert {
        "name": names.CLIENT_TLS_VOLUME,
        "projected": {
            "sources": [
                {"secret": {"name": "pool-a-client-tls", "optional": True}},
                {
                    "secret": {
                        "name": "pool-a-credentials",
                        "items": [{"key": "token", "path": "token"}],
                        "optional": True,
                    }
                },
            ]
        },
    } in result.pod["spec"]["volumes"]
    assert inject(result.pod, pools(tcp), {}).pod == result.pod  # idempotent
    # A consumer in another namespace cannot reference the Secret: no TCP wiring, the socket only
    # (and its key from the CSI plugin).
    tcp["spec"]["consumers"] = {"namespaceSelector": {"matchLabels": {"team": "a"}}}
    other = inject(
        pod(namespace="apps", annotations={names.POOL_NAMESPACE_ANNOTATION: "llm"}),
        pools(tcp),
        {"apps": {"team": "a"}},
        csi_driver=CSI,
    )
    assert other.injected
    other_env = [e["name"] for e in other.pod["spec"]["containers"][0]["env"]]
    assert "KVFABRIC_TOKEN_FILE" not in other_env
    assert "KVFABRIC_PAYLOAD_KEY" not in other_env
    assert "KVFABRIC_REMOTE" not in other_env
    assert "KVFABRIC_SOCKET" in other_env


def test_vllm_pod_gets_env_volume_args_and_annotations() -> None:
    result = inject(pod(), POOLS, {})
    assert result.injected
    container = result.pod["spec"]["containers"][0]
    env = env_of(container)
    target = POOLS[("llm", "pool-a")].connection
    assert env["KVFABRIC_SOCKET"] == "/run/kvfabric/llm.pool-a/cache.sock"
    assert "KVFABRIC_SHM_DIR" not in env  # no shared directory: payloads come as sealed memfds
    assert "KVFABRIC_REMOTE" not in env  # the TCP listener is off by default (see the tcp test below)
    assert env["KVFABRIC_CHUNK_TOKENS"] == "256"
    assert env["KVFABRIC_POOL"] == "llm/pool-a"
    assert env["KVFABRIC_CONFIG_HASH"] == target.config_hash
    assert "KVFABRIC_TENANT" not in env
    # The payload MAC key is wired from the pool's Secret, even with TCP off.
    mac = next(e for e in container["env"] if e["name"] == "KVFABRIC_PAYLOAD_KEY")
    assert mac["valueFrom"]["secretKeyRef"] == {
        "name": "pool-a-credentials",
        "key": "payload-key",
        "optional": True,
    }
    assert not any(e["name"] == "KVFABRIC_TOKEN" for e in container["env"])
    args = container["args"]
    assert args[-2] == KV_TRANSFER_FLAG
    assert json.loads(args[-1]) == {
        "kv_connector": "KVFabricConnector",
        "kv_connector_module_path": "kvfabric.connector.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
    }
    # Read-only: a consumer can connect to the sockets but not unlink or replace them.
    assert {"name": "kvfabric-run", "mountPath": "/run/kvfabric/llm.pool-a", "readOnly": True} in container[
        "volumeMounts"
    ]
    assert result.pod["spec"]["volumes"] == [
        {
            "name": "kvfabric-run",
            "hostPath": {"path": "/run/kvfabric/llm.pool-a", "type": "DirectoryOrCreate"},
        },
        {"name": names.PAYLOAD_VOLUME, "emptyDir": {}},  # the connector payload, for vLLM containers
    ]
    annotations = result.pod["metadata"]["annotations"]
    assert annotations[names.CONFIG_HASH_ANNOTATION] == target.config_hash
    assert json.loads(annotations[names.INJECTED_ANNOTATION])["containers"] == ["vllm"]
    assert names.SKIP_REASON_ANNOTATION not in annotations


def test_idempotent() -> None:
    for original in (
        pod(),
        pod([{"name": "vllm", "image": "x:1", "command": ["sh", "-c", "vllm serve m --port 8000"]}]),
        pod([{"name": "app", "image": "python:3.12"}]),
    ):
        once = inject(original, POOLS, {}).pod
        twice = inject(once, POOLS, {}).pod
        assert once == twice


def test_input_is_not_mutated() -> None:
    original = pod()
    snapshot = copy.deepcopy(original)
    inject(original, POOLS, {})
    assert original == snapshot


def test_user_kv_transfer_config_and_env_win() -> None:
    container = {
        "name": "vllm",
        "image": "vllm/vllm-openai:v0.11.0",
        "args": ["--kv-transfer-config", '{"kv_connector":"Mine"}'],
        "env": [{"name": "KVFABRIC_CHUNK_TOKENS", "value": "512"}],
    }
    result = inject(pod([container]), POOLS, {})
    out = result.pod["spec"]["containers"][0]
    assert out["args"] == ["--kv-transfer-config", '{"kv_connector":"Mine"}']
    assert env_of(out)["KVFABRIC_CHUNK_TOKENS"] == "512"


def test_shell_command_gets_the_flag_appended() -> None:
    container = {"name": "engine", "image": "x:1", "command": ["sh", "-c"], "args": ["exec vllm serve m"]}
    out = inject(pod([container]), POOLS, {}).pod["spec"]["containers"][0]
    assert out["args"][0].startswith("exec vllm serve m --kv-transfer-config '{")


def test_multiline_shell_script_is_left_alone() -> None:
    script = "set -e\nvllm serve m\n"
    container = {"name": "engine", "image": "x:1", "command": ["bash", "-c", script]}
    result = inject(pod([container]), POOLS, {})
    out = result.pod["spec"]["containers"][0]
    assert out["command"][2] == script
    assert "engine:shell-not-modified" in result.pod["metadata"]["annotations"][names.INJECTED_ANNOTATION]
    assert "KVFABRIC_SOCKET" in env_of(out)


def test_non_vllm_pod_gets_env_in_first_container_only() -> None:
    result = inject(
        pod([{"name": "app", "image": "python:3.12"}, {"name": "sidecar", "image": "envoy:1"}]), POOLS, {}
    )
    app, sidecar = result.pod["spec"]["containers"]
    assert "KVFABRIC_SOCKET" in env_of(app)
    assert "args" not in app
    assert "env" not in sidecar


def test_target_containers_annotation() -> None:
    containers = [{"name": "app", "image": "a:1"}, {"name": "engine", "image": "b:1"}]
    result = inject(pod(containers, annotations={names.TARGET_CONTAINERS_ANNOTATION: "engine"}), POOLS, {})
    assert "env" not in result.pod["spec"]["containers"][0]
    assert "KVFABRIC_SOCKET" in env_of(result.pod["spec"]["containers"][1])
    missing = inject(pod(containers, annotations={names.TARGET_CONTAINERS_ANNOTATION: "nope"}), POOLS, {})
    assert missing.skip_reason == injection.SKIP_NO_CONTAINER
    assert missing.pod["metadata"]["annotations"][names.SKIP_REASON_ANNOTATION] == "no-suitable-container"


def test_expandable_segments_are_a_skip_reason() -> None:
    env = [{"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "max_split_size_mb:64,expandable_segments:True"}]
    result = inject(pod([{"name": "vllm", "image": "vllm/vllm-openai:v0.33.0", "env": env}]), POOLS, {})
    assert result.skip_reason == injection.SKIP_EXPANDABLE_SEGMENTS
    assert result.pod["metadata"]["annotations"][names.SKIP_REASON_ANNOTATION] == "expandable-segments"
    assert not any(e["name"].startswith("KVFABRIC_") for e in result.pod["spec"]["containers"][0]["env"])
    off = [{"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:False"}]
    assert inject(pod([{"name": "vllm", "image": "v:1", "env": off}]), POOLS, {}).injected


def test_unlabelled_pod_is_untouched() -> None:
    original = pod(pool=None)
    result = inject(original, POOLS, {})
    assert result.pod == original
    assert not result.injected


def test_unknown_pool_is_skipped_and_annotated() -> None:
    result = inject(pod(pool="missing"), POOLS, {})
    assert not result.injected
    assert result.pod["metadata"]["annotations"] == {names.SKIP_REASON_ANNOTATION: "pool-not-found"}
    assert result.pod["spec"] == pod()["spec"]


def test_cross_namespace_needs_the_namespace_selector() -> None:
    annotations = {names.POOL_NAMESPACE_ANNOTATION: "llm"}
    other = pod(namespace="team-b", annotations=annotations)
    result = inject(other, POOLS, {"team-b": {"team": "b"}})
    assert result.skip_reason == injection.SKIP_NAMESPACE_NOT_SELECTED
    selecting = pools(pool_body(namespaceSelector={"matchLabels": {"team": "b"}}))
    assert inject(other, selecting, {"team-b": {"team": "b"}}, csi_driver=CSI).injected
    assert (
        inject(other, selecting, {"team-b": {"team": "c"}}, csi_driver=CSI).skip_reason
        == injection.SKIP_NAMESPACE_NOT_SELECTED
    )


def test_pod_selector() -> None:
    selective = pools(
        pool_body(podSelector={"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gold"]}]})
    )
    assert inject(pod(labels={"tier": "gold"}), selective, {}).injected
    assert inject(pod(labels={"tier": "bronze"}), selective, {}).skip_reason == injection.SKIP_POD_SELECTOR


def test_tenant_and_deadlines_are_injected() -> None:
    tuned = pools(pool_body(tenant="team-a", deadlines={"lookupMs": 5, "loadMs": 200, "storeMs": 1000}))
    env = env_of(inject(pod(), tuned, {}).pod["spec"]["containers"][0])
    assert env["KVFABRIC_TENANT"] == "team-a"
    assert env["KVFABRIC_LOOKUP_DEADLINE_MS"] == "5"
    assert env["KVFABRIC_LOAD_DEADLINE_MS"] == "200"
    assert env["KVFABRIC_STORE_DEADLINE_MS"] == "1000"


@pytest.mark.parametrize(
    "container",
    [
        {"name": "x", "image": "vllm/vllm-openai:v1"},
        {"name": "x", "image": "img:1", "command": ["vllm", "serve"]},
        {"name": "x", "image": "img:1", "command": ["python", "-m", "vllm.entrypoints.openai.api_server"]},
    ],
)
def test_vllm_detection(container: dict[str, Any]) -> None:
    assert injection.is_vllm(container)


def test_garbage_pool_is_ignored() -> None:
    assert pool_target({"metadata": {"name": "x"}, "spec": {"nope": 1}}) is None


def test_vllm_pod_gets_the_connector_payload() -> None:
    out = inject(pod(), POOLS, {}).pod
    spec = out["spec"]
    init = {c["name"]: c for c in spec["initContainers"]}[names.PAYLOAD_VOLUME]
    # Default: the cache server's registry path, image name "connector", the pool's tag.
    assert init["image"] == "ghcr.io/kvfabric/connector:v1"
    assert init["volumeMounts"] == [{"name": names.PAYLOAD_VOLUME, "mountPath": names.PAYLOAD_MOUNT}]
    assert {"name": names.PAYLOAD_VOLUME, "emptyDir": {}} in spec["volumes"]
    container = spec["containers"][0]
    assert env_of(container)["PYTHONPATH"] == names.PAYLOAD_PYTHONPATH
    assert {"name": names.PAYLOAD_VOLUME, "mountPath": names.PAYLOAD_MOUNT, "readOnly": True} in container[
        "volumeMounts"
    ]
    detail = json.loads(out["metadata"]["annotations"][names.INJECTED_ANNOTATION])
    assert detail["payload"] == "ghcr.io/kvfabric/connector:v1"
    # Idempotent: a second pass (webhook reinvocation) adds nothing.
    assert inject(out, POOLS, {}).pod == out


def test_payload_respects_user_pythonpath_opt_out_and_pinned_image() -> None:
    user = {
        "name": "vllm",
        "image": "vllm/vllm-openai:v0.11.0",
        "env": [{"name": "PYTHONPATH", "value": "/app"}],
    }
    container = inject(pod([user]), POOLS, {}).pod["spec"]["containers"][0]
    assert env_of(container)["PYTHONPATH"] == f"{names.PAYLOAD_PYTHONPATH}:/app"

    opted_out = inject(pod(annotations={names.PAYLOAD_ANNOTATION: "false"}), POOLS, {}).pod
    assert "initContainers" not in opted_out["spec"]
    assert "PYTHONPATH" not in env_of(opted_out["spec"]["containers"][0])

    custom = pools(pool_body(connectorImage="registry.local/kv/connector@sha256:" + "a" * 64))
    init = inject(pod(), custom, {}).pod["spec"]["initContainers"][0]
    assert init["image"] == "registry.local/kv/connector@sha256:" + "a" * 64


def test_non_vllm_pods_get_no_payload() -> None:
    plain = {"name": "engine", "image": "ghcr.io/kvfabric/engine:v0.2.0", "command": ["kvfabric", "engine"]}
    out = inject(pod([plain]), POOLS, {}).pod
    assert "initContainers" not in out["spec"]
    assert "PYTHONPATH" not in env_of(out["spec"]["containers"][0])


def _has_host_path(pod_spec: dict[str, Any]) -> bool:
    return any("hostPath" in v for v in pod_spec.get("volumes") or [])


@pytest.mark.parametrize("level", ["baseline", "restricted", " Baseline "])
def test_pod_security_namespace_without_tcp_is_skipped_with_the_reason(level: str) -> None:
    result = inject(pod(), POOLS, {"llm": {injection.PSS_ENFORCE_LABEL: level}})
    assert not result.injected
    assert result.skip_reason == injection.SKIP_POD_SECURITY
    assert "spec.server.tcp" in result.detail
    assert result.pod["metadata"]["annotations"][names.SKIP_REASON_ANNOTATION] == "pod-security"
    assert not _has_host_path(result.pod["spec"])


@pytest.mark.parametrize("level", ["baseline", "restricted"])
def test_pod_security_namespace_with_tcp_is_wired_to_the_listener_alone(level: str) -> None:
    tcp = pool_body()
    tcp["spec"]["server"] = {"tcp": {"enabled": True}}
    labels = {"llm": {injection.PSS_ENFORCE_LABEL: level}}
    result = inject(pod(), pools(tcp), labels)
    assert result.injected
    spec = result.pod["spec"]
    assert not _has_host_path(spec)
    container = spec["containers"][0]
    names_ = {e["name"] for e in container["env"]}
    assert "KVFABRIC_REMOTE" in names_
    assert "KVFABRIC_TOKEN_FILE" in names_
    assert "KVFABRIC_SOCKET" not in names_
    assert all(m["name"] != names.RUN_VOLUME for m in container.get("volumeMounts", []))
    detail = json.loads(result.pod["metadata"]["annotations"][names.INJECTED_ANNOTATION])
    assert (detail["transport"], detail["volumes"]) == ("tcp", [])
    assert inject(result.pod, pools(tcp), labels).pod == result.pod  # idempotent
    # The connector payload's init container passes restricted by itself.
    init = spec["initContainers"][0]["securityContext"]
    assert init["seccompProfile"] == {"type": "RuntimeDefault"}
    assert init["runAsNonRoot"]
    assert not init["allowPrivilegeEscalation"]


def test_pod_security_privileged_or_unlabelled_namespace_keeps_the_node_socket() -> None:
    for labels in ({}, {"llm": {injection.PSS_ENFORCE_LABEL: "privileged"}}):
        result = inject(pod(), POOLS, labels)
        assert result.injected
        assert _has_host_path(result.pod["spec"])
        assert "KVFABRIC_SOCKET" in env_of(result.pod["spec"]["containers"][0])


def test_pod_security_namespace_consuming_another_namespaces_tcp_pool_is_skipped() -> None:
    # Secrets do not cross namespaces: no TCP credentials, no payload key, and no hostPath either.
    tcp = pool_body(namespaceSelector={"matchLabels": {"team": "a"}})
    tcp["spec"]["server"] = {"tcp": {"enabled": True}}
    result = inject(
        pod(namespace="apps", annotations={names.POOL_NAMESPACE_ANNOTATION: "llm"}),
        pools(tcp),
        {"apps": {"team": "a", injection.PSS_ENFORCE_LABEL: "baseline"}},
    )
    assert result.skip_reason == injection.SKIP_NO_PAYLOAD_KEY


@pytest.mark.parametrize("level", [None, "privileged", "baseline", "restricted"])
def test_with_the_csi_plugin_consumers_get_a_csi_volume_and_no_host_path(level: str | None) -> None:
    labels = {"llm": {injection.PSS_ENFORCE_LABEL: level}} if level else {}
    result = inject(pod(), POOLS, labels, csi_driver=CSI)
    assert result.injected, result.detail
    spec = result.pod["spec"]
    assert not _has_host_path(spec)
    run = next(v for v in spec["volumes"] if v["name"] == names.RUN_VOLUME)
    attributes = {"pool": "pool-a", "namespace": "llm"}
    assert run == {
        "name": names.RUN_VOLUME,
        "csi": {"driver": CSI, "readOnly": True, "volumeAttributes": attributes},
    }
    container = spec["containers"][0]
    assert env_of(container)["KVFABRIC_SOCKET"] == "/run/kvfabric/llm.pool-a/cache.sock"
    mount = next(m for m in container["volumeMounts"] if m["name"] == names.RUN_VOLUME)
    assert mount == {"name": names.RUN_VOLUME, "mountPath": "/run/kvfabric/llm.pool-a", "readOnly": True}
    detail = json.loads(result.pod["metadata"]["annotations"][names.INJECTED_ANNOTATION])
    assert (detail["transport"], detail["socketVolume"]) == ("unix", "csi")
    assert inject(result.pod, POOLS, labels, csi_driver=CSI).pod == result.pod  # idempotent


def test_with_the_csi_plugin_a_baseline_namespace_consumes_another_namespaces_pool() -> None:
    # The pool's own namespace cannot enforce baseline (its DaemonSet needs hostPaths), so engines in
    # a baseline namespace are always cross-namespace consumers: the plugin serves them (it checks
    # the selector itself); without it they are skipped with the reason.
    cross = pool_body(namespaceSelector={"matchLabels": {"team": "a"}})
    body = pod(namespace="apps", annotations={names.POOL_NAMESPACE_ANNOTATION: "llm"})
    strict = {"apps": {"team": "a", injection.PSS_ENFORCE_LABEL: "baseline"}}
    served = inject(body, pools(cross), strict, csi_driver=CSI)
    assert served.injected, served.detail
    assert not _has_host_path(served.pod["spec"])
    run = next(v for v in served.pod["spec"]["volumes"] if v["name"] == names.RUN_VOLUME)
    assert run["csi"]["volumeAttributes"] == {"pool": "pool-a", "namespace": "llm"}
    without = inject(body, pools(cross), strict)
    assert without.skip_reason == injection.SKIP_NO_PAYLOAD_KEY
    # The webhook's own selector check still applies first.
    other = {"apps": {"team": "b", injection.PSS_ENFORCE_LABEL: "baseline"}}
    assert (
        inject(body, pools(cross), other, csi_driver=CSI).skip_reason == injection.SKIP_NAMESPACE_NOT_SELECTED
    )


# --- payload keys per consumer namespace -----------------------------------------------------------
# Literal names on purpose: they are the contract with the connector and the CSI node plugin.
KEY_VOLUME = "kvfabric-key"
KEY_MOUNT = "/var/run/kvfabric/key"
KEY_FILE = "/var/run/kvfabric/key/payload.key"
SELECTING = {"matchLabels": {"team": "a"}}
TEAM_A = {"apps": {"team": "a"}}


def _key_vars(container: dict[str, Any]) -> list[dict[str, Any]]:
    wanted = ("KVFABRIC_PAYLOAD_KEY", "KVFABRIC_PAYLOAD_KEY_FILE", "KVFABRIC_KEY_SCOPE")
    return [e for e in container.get("env") or [] if e["name"] in wanted]


def _cross(**annotations: str) -> dict[str, Any]:
    return pod(namespace="apps", annotations={names.POOL_NAMESPACE_ANNOTATION: "llm", **annotations})


@pytest.mark.parametrize(("key_space", "scope"), [(None, "llm"), ("PerNamespace", "llm"), ("Shared", "*")])
@pytest.mark.parametrize("csi", [None, CSI])
def test_a_consumer_in_the_pools_namespace_derives_its_namespaces_key_from_the_pools_secret(
    key_space: str | None, scope: str, csi: str | None
) -> None:
    consumers = {"keySpace": key_space} if key_space else {}
    result = inject(pod(), pools(pool_body(**consumers)), {}, csi_driver=csi)
    assert result.injected, result.detail
    container = result.pod["spec"]["containers"][0]
    ref = {"name": "pool-a-credentials", "key": "payload-key", "optional": True}
    assert _key_vars(container) == [
        {"name": "KVFABRIC_PAYLOAD_KEY", "valueFrom": {"secretKeyRef": ref}},
        {"name": "KVFABRIC_KEY_SCOPE", "value": scope},
    ]
    assert not any(v["name"] == KEY_VOLUME for v in result.pod["spec"]["volumes"])
    assert inject(result.pod, pools(pool_body(**consumers)), {}, csi_driver=csi).pod == result.pod


@pytest.mark.parametrize("level", [None, "baseline", "restricted"])
@pytest.mark.parametrize("tcp", [False, True])
def test_a_consumer_in_another_namespace_gets_its_key_as_a_file_from_the_csi_plugin(
    level: str | None, tcp: bool
) -> None:
    body = pool_body(namespaceSelector=SELECTING)
    if tcp:
        body["spec"]["server"] = {"tcp": {"enabled": True}}
    labels = {"apps": {"team": "a", **({injection.PSS_ENFORCE_LABEL: level} if level else {})}}
    two = [
        {"name": "vllm", "image": "vllm/vllm-openai:v0.11.0"},
        {"name": "sidecar", "image": "busybox:1"},
    ]
    result = inject(
        pod(two, namespace="apps", annotations={names.POOL_NAMESPACE_ANNOTATION: "llm"}),
        pools(body),
        labels,
        csi_driver=CSI,
    )
    assert result.injected, result.detail
    spec = result.pod["spec"]
    key = [v for v in spec["volumes"] if v["name"] == KEY_VOLUME]
    assert key == [
        {
            "name": KEY_VOLUME,
            "csi": {
                "driver": CSI,
                "readOnly": True,
                "volumeAttributes": {"pool": "pool-a", "namespace": "llm", "content": "payload-key"},
            },
        }
    ]
    # Beside the socket, in the same containers (the engine), read-only; not in the sidecar.
    vllm, sidecar = spec["containers"]
    assert {"name": KEY_VOLUME, "mountPath": KEY_MOUNT, "readOnly": True} in vllm["volumeMounts"]
    assert any(m["name"] == names.RUN_VOLUME for m in vllm["volumeMounts"])
    assert not sidecar.get("volumeMounts")
    assert _key_vars(vllm) == [
        {"name": "KVFABRIC_PAYLOAD_KEY_FILE", "value": KEY_FILE},
        {"name": "KVFABRIC_KEY_SCOPE", "value": "apps"},
    ]
    # No Secret of the pool's namespace is referenced anywhere (the kubelet could not resolve it).
    assert "secretKeyRef" not in json.dumps(spec)
    assert "pool-a-credentials" not in json.dumps(spec)
    assert not _has_host_path(spec)
    detail = json.loads(result.pod["metadata"]["annotations"][names.INJECTED_ANNOTATION])
    assert detail["payloadKey"] == "csi"
    assert inject(result.pod, pools(body), labels, csi_driver=CSI).pod == result.pod  # idempotent


@pytest.mark.parametrize("level", [None, "privileged", "baseline"])
def test_a_consumer_in_another_namespace_without_the_csi_plugin_is_not_injected(level: str | None) -> None:
    """A hostPath install cannot hand a key to another namespace: injecting would seal with the public
    key, which any consumer of the pool can forge. Skipped, counted with the reason."""
    labels = {"apps": {"team": "a", **({injection.PSS_ENFORCE_LABEL: level} if level else {})}}
    # Even a pod that claims to be injected already (the annotations written by hand).
    forged = {names.INJECTED_ANNOTATION: "{}", names.CONFIG_HASH_ANNOTATION: "x"}
    for body in (_cross(), _cross(**forged)):
        result = inject(body, pools(pool_body(namespaceSelector=SELECTING)), labels)
        assert not result.injected
        assert result.skip_reason == "no-payload-key"
        assert "CSI" in result.detail
        assert "llm" in result.detail
        annotations = result.pod["metadata"]["annotations"]
        assert annotations[names.SKIP_REASON_ANNOTATION] == "no-payload-key"
        assert names.INJECTED_ANNOTATION not in annotations
        assert result.pod["spec"] == body["spec"]


def test_the_skip_is_counted_by_reason() -> None:
    from kvfabric.operator.status import consumer_counts

    skipped = inject(_cross(), pools(pool_body(namespaceSelector=SELECTING)), TEAM_A).pod
    counts = consumer_counts([skipped], "h")
    assert counts["skipped_by_reason"] == {"no-payload-key": 1}


# What a hostile pod may write before the webhook sees it, to widen the key it gets.
_TAMPERING: dict[str, Any] = {
    "scope-env": lambda c, s: c.setdefault("env", []).append({"name": "KVFABRIC_KEY_SCOPE", "value": "*"}),
    "other-scope-env": lambda c, s: c.setdefault("env", []).insert(
        0, {"name": "KVFABRIC_KEY_SCOPE", "value": "llm"}
    ),
    "key-env": lambda c, s: c.setdefault("env", []).append(
        {"name": "KVFABRIC_PAYLOAD_KEY", "value": "guess"}
    ),
    "key-file-env": lambda c, s: c.setdefault("env", []).append(
        {"name": "KVFABRIC_PAYLOAD_KEY_FILE", "value": "/tmp/mine.key"}
    ),
    "key-volume": lambda c, s: s.setdefault("volumes", []).append(
        {
            "name": KEY_VOLUME,
            "csi": {
                "driver": CSI,
                "readOnly": True,
                "volumeAttributes": {"pool": "pool-a", "namespace": "llm", "content": "root", "scope": "*"},
            },
        }
    ),
    "key-mount-elsewhere": lambda c, s: (
        s.setdefault("volumes", []).append({"name": "mine", "emptyDir": {}}),
        c.setdefault("volumeMounts", []).append({"name": "mine", "mountPath": KEY_MOUNT}),
    ),
}


@settings(max_examples=60, deadline=None)
@given(
    tamper=st.sets(st.sampled_from(sorted(_TAMPERING))),
    cross=st.booleans(),
    shared=st.booleans(),
    forged_annotations=st.booleans(),
)
def test_what_a_pod_writes_itself_never_changes_the_key_it_is_given(
    tamper: set[str], cross: bool, shared: bool, forged_annotations: bool
) -> None:
    """The webhook owns the key variables, volume and mount: the result is the same as for an honest
    pod, whatever the pod wrote (the CSI plugin, not the webhook, decides which key is in the file)."""
    consumers: dict[str, Any] = {"namespaceSelector": SELECTING}
    if shared:
        consumers["keySpace"] = "Shared"
    targets = pools(pool_body(**consumers))
    labels = {"apps": {"team": "a"}, "llm": {}}
    honest = _cross() if cross else pod()
    expected = inject(honest, targets, labels, csi_driver=CSI)
    assert expected.injected
    hostile = copy.deepcopy(honest)
    container, spec = hostile["spec"]["containers"][0], hostile["spec"]
    for name in sorted(tamper):
        _TAMPERING[name](container, spec)
    if forged_annotations:  # the webhook's reinvocation shortcut
        hostile["metadata"]["annotations"].update(
            {
                names.INJECTED_ANNOTATION: "{}",
                names.CONFIG_HASH_ANNOTATION: targets[("llm", "pool-a")].connection.config_hash,
            }
        )
    result = inject(hostile, targets, labels, csi_driver=CSI)
    assert result.injected
    got = result.pod["spec"]
    # The same entries (each once), wherever the pod had put its own.
    key_env = sorted(_key_vars(got["containers"][0]), key=lambda e: str(e["name"]))
    assert key_env == sorted(_key_vars(expected.pod["spec"]["containers"][0]), key=lambda e: str(e["name"]))
    assert [v for v in got["volumes"] if v["name"] == KEY_VOLUME] == [
        v for v in expected.pod["spec"]["volumes"] if v["name"] == KEY_VOLUME
    ]
    mounts = got["containers"][0].get("volumeMounts") or []
    key_mounts = [m for m in mounts if m["name"] == KEY_VOLUME or m["mountPath"] == KEY_MOUNT]
    assert key_mounts == ([{"name": KEY_VOLUME, "mountPath": KEY_MOUNT, "readOnly": True}] if cross else [])
    assert inject(result.pod, targets, labels, csi_driver=CSI).pod == result.pod  # idempotent


# ------------------------------------------------------------------------------------ routing events


def _events_of(container: dict[str, Any]) -> dict[str, Any]:
    args = container["args"]
    return json.loads(args[args.index("--kv-events-config") + 1])  # type: ignore[no-any-return]


def test_routing_events_inject_vllms_publisher_with_the_pod_ip_topic_and_llmds_label() -> None:
    engine = {
        "name": "vllm",
        "image": "vllm/vllm-openai:v0.11.0",
        "args": ["meta-llama/Llama-3.1-8B", "--served-model-name", "llama", "--port", "8080"],
    }
    result = inject(pod([engine]), pools(pool_body(routingEvents={})), {})
    container = result.pod["spec"]["containers"][0]
    assert _events_of(container) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5556",
        "replay_endpoint": "tcp://*:5557",
        "topic": "kv@$(POD_IP):8080@llama",
    }
    # $(POD_IP) is expanded by the kubelet from the pod's IP.
    assert container["env"][0] == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert result.pod["metadata"]["labels"]["llm-d.ai/inference-serving"] == "true"
    detail = json.loads(result.pod["metadata"]["annotations"][names.INJECTED_ANNOTATION])
    assert detail["kvEvents"] == ["vllm:kv-events"]
    # Idempotent, as every injection is (the API server may reinvoke the webhook).
    assert inject(result.pod, pools(pool_body(routingEvents={})), {}).pod == result.pod


@pytest.mark.parametrize(
    ("container", "spec", "topic"),
    [
        ({"command": ["vllm", "serve", "org/model", "--port", "9000"]}, {}, "kv@$(POD_IP):9000@org/model"),
        (
            {"command": ["python", "-m", "vllm.entrypoints.openai.api_server", "--model=m"]},
            {},
            "kv@$(POD_IP):8000@m",
        ),
        (
            {"args": ["org/model"]},
            {"modelName": "served", "port": 6000, "replayPort": 6001},
            "kv@$(POD_IP):8000@served",
        ),
    ],
)
def test_routing_events_find_the_model_name_requests_carry(
    container: dict[str, Any], spec: dict[str, Any], topic: str
) -> None:
    engine = {"name": "vllm", "image": "vllm/vllm-openai:v0.11.0", **container}
    result = inject(pod([engine]), pools(pool_body(routingEvents=spec)), {})
    assert _events_of(result.pod["spec"]["containers"][0])["topic"] == topic


def test_routing_events_append_to_a_shell_script_and_keep_a_config_the_pod_set() -> None:
    script = {
        "name": "vllm",
        "image": "vllm/vllm-openai",
        "command": ["sh", "-c", "vllm serve m --port 8000"],
    }
    result = inject(pod([script]), pools(pool_body(routingEvents={})), {})
    line = result.pod["spec"]["containers"][0]["command"][2]
    assert line.startswith("vllm serve m --port 8000 ")
    assert "--kv-events-config '{" in line
    own = {
        "name": "vllm",
        "image": "vllm/vllm-openai",
        "args": ["m", "--kv-events-config", '{"publisher":"null"}'],
    }
    result = inject(pod([own]), pools(pool_body(routingEvents={})), {})
    args = result.pod["spec"]["containers"][0]["args"]
    assert args[:3] == own["args"]
    assert args.count("--kv-events-config") == 1
    assert json.loads(result.pod["metadata"]["annotations"][names.INJECTED_ANNOTATION])["kvEvents"] == [
        "vllm:user-set"
    ]


def test_without_routing_events_nothing_is_published_and_no_label_is_added() -> None:
    engine = {"name": "vllm", "image": "vllm/vllm-openai", "args": ["m"]}
    result = inject(pod([engine]), POOLS, {})
    assert "--kv-events-config" not in result.pod["spec"]["containers"][0]["args"]
    assert "llm-d.ai/inference-serving" not in result.pod["metadata"]["labels"]
    no_label = inject(pod([engine]), pools(pool_body(routingEvents={"llmdLabel": False})), {})
    assert "llm-d.ai/inference-serving" not in no_label.pod["metadata"]["labels"]


def test_routing_events_ports_must_differ() -> None:
    from kvfabric.operator.api.v1alpha1 import RoutingEvents

    with pytest.raises(ValueError, match="replayPort must differ"):
        RoutingEvents(port=5556, replay_port=5556)
