"""Hostile object-store tiers and shared claim templates are rejected at admission, naming the field.

Each bad value is sent to the real API server with the generated CRD (``--dry-run=server``) and to the
pydantic models (what the reconciler and the webhook parse): both refuse it with a message naming the
field, and both accept the good values. Bucket names are also generated (hypothesis) and judged
against the S3 naming rules written out independently below.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfabric.localcluster.testing import ClusterHandle
from kvfabric.operator.api.v1alpha1 import KVCachePool

_OBJ = "spec.tiers.objectStore"
_CLAIM = "spec.tiers.shared.claimTemplate"

OBJECT_STORE: dict[str, Any] = {
    "endpoint": "https://s3.example.com",
    "bucket": "kv-cache",
    "capacity": "10Ti",
    "credentials": {"secretName": "s3-keys"},
    "ca": {"configMapName": "s3-ca"},
}


def pool(name: str = "pool-a", **object_store: Any) -> dict[str, Any]:
    obj = {**copy.deepcopy(OBJECT_STORE), **object_store}
    return {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name},
        "spec": {"image": {"tag": "v0.2.0"}, "tiers": {"memory": {"size": "1Gi"}, "objectStore": obj}},
    }


def shared(access_modes: list[str]) -> dict[str, Any]:
    doc = pool()
    doc["spec"]["tiers"] = {
        "memory": {"size": "1Gi"},
        "shared": {"claimTemplate": {"size": "10Gi", "accessModes": access_modes}, "capacity": "1Gi"},
    }
    return doc


def _no_ca(doc: dict[str, Any]) -> dict[str, Any]:
    doc["spec"]["tiers"]["objectStore"].pop("ca", None)
    return doc


# (case id, pool, the field's path: the API server's and the model's message must contain it)
INVALID: list[tuple[str, dict[str, Any], str]] = [
    # Endpoint: scheme, credentials, host[:port] only.
    ("endpoint-ftp", pool(endpoint="ftp://s3.example.com"), f"{_OBJ}.endpoint"),
    ("endpoint-upper-scheme", pool(endpoint="HTTPS://s3.example.com"), f"{_OBJ}.endpoint"),
    ("endpoint-no-scheme", pool(endpoint="s3.example.com"), f"{_OBJ}.endpoint"),
    ("endpoint-scheme-only", pool(endpoint="https://"), f"{_OBJ}.endpoint"),
    ("endpoint-user-password", pool(endpoint="https://AKIA:secret@s3.example.com"), f"{_OBJ}.endpoint"),
    ("endpoint-user-only", pool(endpoint="https://AKIA@s3.example.com"), f"{_OBJ}.endpoint"),
    (
        "endpoint-http-credentials",
        _no_ca(pool(endpoint="http://minio:minio123@minio.storage:9000")),
        f"{_OBJ}.endpoint",
    ),
    ("endpoint-path", pool(endpoint="https://s3.example.com/kv-cache"), f"{_OBJ}.endpoint"),
    ("endpoint-query", pool(endpoint="https://s3.example.com?x-id=1"), f"{_OBJ}.endpoint"),
    ("endpoint-fragment", pool(endpoint="https://s3.example.com#x"), f"{_OBJ}.endpoint"),
    ("endpoint-port-zero", pool(endpoint="https://s3.example.com:0"), f"{_OBJ}.endpoint"),
    ("endpoint-port-too-big", pool(endpoint="https://s3.example.com:65536"), f"{_OBJ}.endpoint"),
    ("endpoint-empty-port", pool(endpoint="https://s3.example.com:"), f"{_OBJ}.endpoint"),
    ("endpoint-empty-label", pool(endpoint="https://s3..example.com"), f"{_OBJ}.endpoint"),
    ("endpoint-label-dash", pool(endpoint="https://-s3.example.com"), f"{_OBJ}.endpoint"),
    ("endpoint-underscore", pool(endpoint="https://s3_store.example.com"), f"{_OBJ}.endpoint"),
    ("endpoint-space", pool(endpoint="https://s3 .example.com"), f"{_OBJ}.endpoint"),
    ("endpoint-newline", pool(endpoint="https://s3.example.com\n"), f"{_OBJ}.endpoint"),
    ("endpoint-ipv6-unbracketed", pool(endpoint="https://fd00::1"), f"{_OBJ}.endpoint"),
    # Bucket: the S3 naming rules.
    ("bucket-too-short", pool(bucket="kv"), f"{_OBJ}.bucket"),
    ("bucket-too-long", pool(bucket="k" * 64), f"{_OBJ}.bucket"),
    ("bucket-upper-case", pool(bucket="Kv-Cache"), f"{_OBJ}.bucket"),
    ("bucket-underscore", pool(bucket="kv_cache"), f"{_OBJ}.bucket"),
    ("bucket-leading-dash", pool(bucket="-kvcache"), f"{_OBJ}.bucket"),
    ("bucket-trailing-dot", pool(bucket="kvcache."), f"{_OBJ}.bucket"),
    ("bucket-two-dots", pool(bucket="kv..cache"), f"{_OBJ}.bucket"),
    ("bucket-dot-dash", pool(bucket="kv.-cache"), f"{_OBJ}.bucket"),
    ("bucket-dash-dot", pool(bucket="kv-.cache"), f"{_OBJ}.bucket"),
    ("bucket-ip-address", pool(bucket="192.168.5.4"), f"{_OBJ}.bucket"),
    ("bucket-prefix-xn", pool(bucket="xn--kvcache"), f"{_OBJ}.bucket"),
    ("bucket-prefix-sthree", pool(bucket="sthree-kvcache"), f"{_OBJ}.bucket"),
    ("bucket-prefix-sthree-configurator", pool(bucket="sthree-configurator"), f"{_OBJ}.bucket"),
    ("bucket-prefix-demo", pool(bucket="amzn-s3-demo-kv"), f"{_OBJ}.bucket"),
    ("bucket-suffix-s3alias", pool(bucket="kvcache-s3alias"), f"{_OBJ}.bucket"),
    ("bucket-suffix-ol-s3", pool(bucket="kvcache--ol-s3"), f"{_OBJ}.bucket"),
    ("bucket-suffix-mrap", pool(bucket="kvcache.mrap"), f"{_OBJ}.bucket"),
    ("bucket-suffix-x-s3", pool(bucket="kvcache--x-s3"), f"{_OBJ}.bucket"),
    ("bucket-suffix-table-s3", pool(bucket="kvcache--table-s3"), f"{_OBJ}.bucket"),
    (
        "bucket-dots-virtual-hosted-https",
        pool(bucket="kv.cache", pathStyle=False),
        f"{_OBJ}.bucket",
    ),
    # Capacity: whole bytes within bounds.
    ("capacity-milli", pool(capacity="100m"), f"{_OBJ}.capacity"),
    ("capacity-fraction", pool(capacity="0.5"), f"{_OBJ}.capacity"),
    ("capacity-1e400", pool(capacity="1e400"), f"{_OBJ}.capacity"),
    ("capacity-negative", pool(capacity="-1Gi"), f"{_OBJ}.capacity"),
    ("capacity-zero", pool(capacity="0"), f"{_OBJ}.capacity"),
    ("capacity-dots", pool(capacity="1.2.3"), f"{_OBJ}.capacity"),
    ("capacity-above-maximum", pool(capacity="2Pi"), f"{_OBJ}.capacity"),
    ("capacity-words", pool(capacity="lots"), f"{_OBJ}.capacity"),
    ("capacity-fractional-binary", pool(capacity="0.1Gi"), f"{_OBJ}.capacity"),
    # The Secret (and ConfigMap) it references, and the keys that become file names.
    ("secret-name-space", pool(credentials={"secretName": "s3 keys"}), f"{_OBJ}.credentials.secretName"),
    ("secret-name-upper", pool(credentials={"secretName": "S3-Keys"}), f"{_OBJ}.credentials.secretName"),
    ("secret-name-traversal", pool(credentials={"secretName": "../x"}), f"{_OBJ}.credentials.secretName"),
    ("secret-name-empty", pool(credentials={"secretName": ""}), f"{_OBJ}.credentials.secretName"),
    (
        "secret-key-dotdot",
        pool(credentials={"secretName": "s3-keys", "accessKeyIdKey": ".."}),
        f"{_OBJ}.credentials.accessKeyIdKey",
    ),
    (
        "secret-key-slash",
        pool(credentials={"secretName": "s3-keys", "secretAccessKeyKey": "../../token"}),
        f"{_OBJ}.credentials.secretAccessKeyKey",
    ),
    (
        "secret-keys-equal",
        pool(credentials={"secretName": "s3-keys", "accessKeyIdKey": "k", "secretAccessKeyKey": "k"}),
        f"{_OBJ}.credentials.secretAccessKeyKey",
    ),
    ("ca-name-space", pool(ca={"configMapName": "my ca"}), f"{_OBJ}.ca.configMapName"),
    ("ca-key-traversal", pool(ca={"configMapName": "s3-ca", "key": "../ca.crt"}), f"{_OBJ}.ca.key"),
    ("region-slash", pool(region="us/east-1"), f"{_OBJ}.region"),
    ("region-space", pool(region="us east 1"), f"{_OBJ}.region"),
    # A shared claim every node mounts needs ReadWriteMany.
    ("claim-read-write-once", shared(["ReadWriteOnce"]), f"{_CLAIM}.accessModes"),
    ("claim-read-write-once-pod", shared(["ReadWriteOncePod"]), f"{_CLAIM}.accessModes"),
    ("claim-read-only-many", shared(["ReadOnlyMany"]), f"{_CLAIM}.accessModes"),
    ("claim-rwo-and-rox", shared(["ReadWriteOnce", "ReadOnlyMany"]), f"{_CLAIM}.accessModes"),
]

VALID: list[tuple[str, dict[str, Any]]] = [
    ("aws", pool(endpoint="https://s3.us-east-1.amazonaws.com")),
    ("trailing-slash", pool(endpoint="https://s3.example.com/")),
    ("minio-http", _no_ca(pool(endpoint="http://minio.storage:9000"))),
    ("ipv4-port", _no_ca(pool(endpoint="http://10.0.0.5:9000"))),
    ("ipv6-port", pool(endpoint="https://[fd00::1]:9000")),
    ("top-port", _no_ca(pool(endpoint="http://minio:65535"))),
    ("dotted-bucket-path-style", pool(bucket="kv.cache.example")),
    (
        "dotted-bucket-virtual-hosted-http",
        _no_ca(pool(endpoint="http://minio:9000", bucket="kv.cache", pathStyle=False)),
    ),
    ("shortest-bucket", pool(bucket="a1b")),
    ("longest-bucket", pool(bucket="k" * 63)),
    ("digit-bucket", pool(bucket="123")),
    ("xn-inside-bucket", pool(bucket="kv-xn--cache")),
    ("capacity-largest", pool(capacity="1Pi")),
    # Whole values the API server's isInteger() calls fractional (its parser keeps them as decimals).
    ("capacity-100Ti", pool(capacity="100Ti")),
    ("capacity-binary-with-point", pool(capacity="1.5Gi")),
    ("capacity-exponent-with-point", pool(capacity="1.5e9")),
    ("capacity-small", pool(capacity="1Mi")),
    ("region-auto", pool(region="auto")),
    (
        "secret-keys",
        pool(credentials={"secretName": "s3-keys", "accessKeyIdKey": ".id", "secretAccessKeyKey": "key_2"}),
    ),
    ("claim-rwx", shared(["ReadWriteMany"])),
    ("claim-rwx-and-rwo", shared(["ReadWriteOnce", "ReadWriteMany"])),
]


def _dry_run(cluster: ClusterHandle, namespace: str, doc: dict[str, Any]) -> tuple[int, str]:
    result = cluster.kubectl(
        "create", "-n", namespace, "--dry-run=server", "-f", "-", input=json.dumps(doc), check=False
    )
    return result.returncode, result.stderr


@pytest.mark.cluster
@pytest.mark.parametrize(("case", "doc", "field"), INVALID, ids=[c[0] for c in INVALID])
def test_the_api_server_rejects_naming_the_field(
    cluster: ClusterHandle, crd: None, namespace: str, case: str, doc: dict[str, Any], field: str
) -> None:
    code, stderr = _dry_run(cluster, namespace, doc)
    assert code != 0, f"{case} was admitted"
    assert field in stderr, stderr


@pytest.mark.parametrize(("case", "doc", "field"), INVALID, ids=[c[0] for c in INVALID])
def test_the_models_reject_naming_the_field(case: str, doc: dict[str, Any], field: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        KVCachePool.model_validate(doc)
    assert field in str(info.value), f"{case}: {info.value}"


@pytest.mark.cluster
def test_the_api_server_admits_the_good_values(cluster: ClusterHandle, crd: None, namespace: str) -> None:
    docs = [{**doc, "metadata": {"name": f"ok-{i}"}} for i, (_, doc) in enumerate(VALID)]
    code, stderr = _dry_run(cluster, namespace, {"apiVersion": "v1", "kind": "List", "items": docs})
    assert code == 0, stderr


@pytest.mark.parametrize(("case", "doc"), VALID, ids=[c[0] for c in VALID])
def test_the_models_accept_the_good_values(case: str, doc: dict[str, Any]) -> None:
    KVCachePool.model_validate(doc)


def test_the_credentials_message_does_not_echo_the_endpoint() -> None:
    """The CEL message names the field and the remedy; the key pair is not repeated in it."""
    with pytest.raises(pydantic.ValidationError) as info:
        KVCachePool.model_validate(pool(endpoint="https://AKIA:secret@s3.example.com"))
    first = info.value.errors()[0]
    assert "must not embed credentials" in first["msg"]
    assert "secret" not in first["msg"].replace("Secret", "")


# --- bucket names against the S3 rules, written out here independently of the models ---------------


def s3_accepts(name: str) -> bool:
    """The S3 general-purpose bucket naming rules, plus DNS labels (virtual-hosted requests)."""
    allowed = set("abcdefghijklmnopqrstuvwxyz0123456789.-")
    if not 3 <= len(name) <= 63 or not set(name) <= allowed:
        return False
    if not (name[0].isalnum() and name[-1].isalnum()):
        return False
    labels = name.split(".")
    if any(not label or label[0] == "-" or label[-1] == "-" for label in labels):
        return False  # '..', '.-', '-.'
    if len(labels) == 4 and all(label.isdigit() for label in labels):
        return False  # formatted as an IPv4 address
    if name.startswith(("xn--", "sthree-", "amzn-s3-demo-")):
        return False
    return not name.endswith(("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3"))


_CHARS = "abcz019.-A_ \n"
bucket_names = st.one_of(
    st.text(alphabet=_CHARS, min_size=0, max_size=70),
    st.from_regex(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", fullmatch=True),
    st.lists(st.integers(0, 999).map(str), min_size=3, max_size=5).map(".".join),
    st.tuples(
        st.sampled_from(["", "xn--", "sthree-", "amzn-s3-demo-", "xn-", "sthree", "a."]),
        st.from_regex(r"[a-z0-9]{1,20}", fullmatch=True),
        st.sampled_from(["", "-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3", "s3alias", "-mrap"]),
    ).map("".join),
)


@settings(max_examples=600, deadline=None)
@given(name=bucket_names)
def test_the_model_accepts_exactly_the_s3_bucket_names(name: str) -> None:
    if s3_accepts(name):
        KVCachePool.model_validate(pool(bucket=name))
    else:
        with pytest.raises(pydantic.ValidationError, match=r"spec\.tiers\.objectStore\.bucket"):
            KVCachePool.model_validate(pool(bucket=name))


_INVALID_NAME = re.compile(r'"(b-[0-9]+)" is invalid')


@pytest.mark.cluster
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(names=st.lists(bucket_names, min_size=40, max_size=40))
def test_the_api_server_admits_exactly_the_s3_bucket_names(
    cluster: ClusterHandle, crd: None, namespace: str, names: list[str]
) -> None:
    """One dry-run create of 40 pools per example; each pool's outcome must match the S3 rules."""
    docs = [pool(f"b-{i}", bucket=name) for i, name in enumerate(names)]
    _, stderr = _dry_run(cluster, namespace, {"apiVersion": "v1", "kind": "List", "items": docs})
    rejected = set(_INVALID_NAME.findall(stderr))
    for i, name in enumerate(names):
        assert (f"b-{i}" not in rejected) == s3_accepts(name), (name, stderr)
    for line in stderr.splitlines():
        if "is invalid" in line:
            assert "spec.tiers.objectStore.bucket" in line, line
