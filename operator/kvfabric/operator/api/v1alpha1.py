"""``kvfabric.io/v1alpha1`` ``KVCachePool``: the pydantic models that are the CRD's single source of truth.

``python -m kvfabric.operator.crdgen`` turns these models into ``crds/kvfabric.io_kvcachepools.yaml``;
a test regenerates the file in memory and fails when it drifts. Field descriptions become the CRD's
documentation (``kubectl explain kvcachepool.spec``), defaults become schema defaults applied by the API
server, and the ``x-kubernetes-validations`` (CEL) rules attached here are what rejects contradictory
pools at admission with a message that names the field.

Every string carries ``maxLength`` and every list ``maxItems``: without them the API server's CEL cost
estimator assumes unbounded inputs and refuses the CRD.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Final

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from kvfabric.operator.api import grammar, objectstore
from kvfabric.operator.quantity import parse_quantity

GROUP: Final = "kvfabric.io"
VERSION: Final = "v1alpha1"
KIND: Final = "KVCachePool"
PLURAL: Final = "kvcachepools"
SINGULAR: Final = "kvcachepool"
SHORT_NAMES: Final = ("kvp",)
API_VERSION: Final = f"{GROUP}/{VERSION}"

# The opt-in label consumer pods carry; its value is the pool's name.
POOL_LABEL: Final = "kvfabric.io/pool"

# A Kubernetes resource quantity ("64Gi", "500M", "1.5Ti"). Validated by pattern; parsed to bytes by
# kvfabric.operator.quantity. Kept a string (not int-or-string) so CEL's quantity() can compare them.
QUANTITY_PATTERN: Final = r"^([+]?[0-9.]+)([eE][-+]?[0-9]{1,2}|[numkMGTPE]i?|Ki)?$"


def _cel(
    rule: str, message: str, *, field_path: str | None = None, reason: str | None = None
) -> dict[str, str]:
    rule_dict = {"rule": rule, "message": message}
    if field_path is not None:
        rule_dict["fieldPath"] = field_path
    if reason is not None:
        rule_dict["reason"] = reason
    return rule_dict


def _validations(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


# Schema default of a nested object: the API server then applies each field's own default.
_OBJECT_DEFAULT: Final[dict[str, Any]] = {"default": {}}

Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN, max_length=32)]
# Whole-byte sizes; each field adds grammar.byte_rules(<its path>, <its bounds>) as CEL.
MemorySize = Annotated[
    str,
    Field(pattern=grammar.BYTES_PATTERN, max_length=32),
    AfterValidator(grammar.whole_bytes(grammar.MEMORY_BOUNDS)),
]
DiskSize = Annotated[
    str,
    Field(pattern=grammar.BYTES_PATTERN, max_length=32),
    AfterValidator(grammar.whole_bytes(grammar.DISK_BOUNDS)),
]
LabelValue = Annotated[str, Field(max_length=63, pattern=grammar.LABEL_VALUE_PATTERN)]
LabelKey = Annotated[
    str,
    Field(min_length=1, max_length=grammar.LABEL_KEY_MAX, pattern=grammar.LABEL_KEY_PATTERN),
    AfterValidator(grammar.check_label_key),
]
DnsSubdomain = Annotated[str, Field(min_length=1, max_length=253, pattern=grammar.DNS_SUBDOMAIN_PATTERN)]


class _Model(BaseModel):
    """Base: camelCase on the wire, snake_case in Python, unknown fields rejected."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class PullPolicy(StrEnum):
    """Image pull policy of the cache-server container."""

    IF_NOT_PRESENT = "IfNotPresent"
    ALWAYS = "Always"
    NEVER = "Never"


class ImageSpec(_Model):
    """The cache-server image. The tag is required and must be pinned."""

    repository: str = Field(
        default="ghcr.io/kvfabric/kvfabric",
        min_length=1,
        max_length=255,
        pattern=grammar.IMAGE_REPOSITORY_PATTERN,
        description="Image repository, without tag or digest: lower-case [registry[:port]/]path "
        "(the distribution reference grammar).",
    )
    tag: str = Field(
        min_length=1,
        max_length=128,
        pattern=rf"^{grammar.IMAGE_TAG}({grammar.IMAGE_DIGEST})?$",
        description="Pinned image tag (optionally followed by @sha256:digest). 'latest' is rejected: a "
        "floating tag makes rollouts unreproducible and hides which cache server runs where.",
        json_schema_extra=_validations(
            _cel(
                "self != 'latest' && !self.startsWith('latest@')",
                "spec.image.tag must be a pinned version, not 'latest'",
            )
        ),
    )
    pull_policy: PullPolicy = Field(default=PullPolicy.IF_NOT_PRESENT, description="Image pull policy.")


class TolerationOperator(StrEnum):
    """Toleration operator."""

    EXISTS = "Exists"
    EQUAL = "Equal"


class TaintEffect(StrEnum):
    """Taint effect a toleration matches."""

    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class Toleration(_Model):
    """A toleration, as in a pod spec (without tolerationSeconds)."""

    key: LabelKey | None = Field(default=None, description="Taint key; empty matches all keys.")
    operator: TolerationOperator = Field(default=TolerationOperator.EQUAL, description="Exists or Equal.")
    value: LabelValue | None = Field(default=None, description="Taint value for operator Equal.")
    effect: TaintEffect | None = Field(default=None, description="Taint effect; empty matches all effects.")

    model_config = ConfigDict(
        json_schema_extra=_validations(
            _cel(
                "self.operator != 'Exists' || !has(self.value) || self.value == ''",
                "spec.placement.tolerations: a toleration with operator Exists must not set a value",
            )
        )
    )


def _default_tolerations() -> list[Toleration]:
    return [
        Toleration(key="nvidia.com/gpu", operator=TolerationOperator.EXISTS, effect=TaintEffect.NO_SCHEDULE)
    ]


def _default_node_selector() -> dict[str, Any]:
    return {"nvidia.com/gpu.present": "true"}


class Placement(_Model):
    """Which nodes run a cache server."""

    node_selector: Annotated[dict[str, LabelValue], AfterValidator(grammar.check_label_keys)] = Field(
        default_factory=_default_node_selector,
        max_length=16,
        description="Node labels a node must carry to run a cache server (default: GPU nodes).",
        json_schema_extra={
            "maxProperties": 16,
            "default": dict(_default_node_selector()),
            **_validations(*grammar.label_key_rules("spec.placement.nodeSelector")),
        },
    )
    tolerations: list[Toleration] = Field(
        default_factory=_default_tolerations,
        max_length=16,
        description="Tolerations of the cache-server pods (default: the nvidia.com/gpu taint).",
        json_schema_extra={
            "default": [
                t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in _default_tolerations()
            ]
        },
    )
    opt_out_node_label: str = Field(
        default="kvfabric.io/deploy",
        min_length=1,
        max_length=253,
        pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
        description="Nodes labelled '<this key>=false' never run a cache server of this pool.",
    )
    priority_class_name: DnsSubdomain | None = Field(
        default=None, description="Priority class of the cache-server pods."
    )


class MemoryTier(_Model):
    """The DRAM tier (sealed memfds the cache server hands to same-node consumers)."""

    size: MemorySize = Field(
        description=f"DRAM capacity of each node's cache server, e.g. 64Gi (whole bytes, "
        f"{grammar.MEMORY_BOUNDS[0]} to {grammar.MEMORY_BOUNDS[1]}).",
        json_schema_extra=_validations(
            _cel(
                "isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))",
                "spec.tiers.memory.size must be a positive quantity such as 64Gi",
            ),
            *grammar.byte_rules("spec.tiers.memory.size", grammar.MEMORY_BOUNDS),
        ),
    )


class Watermarks(_Model):
    """Eviction watermarks as fractions of capacity: evict from ``high`` down to ``low``."""

    high: float = Field(default=0.9, ge=0.01, le=1.0, description="Start evicting above this fill ratio.")
    low: float = Field(default=0.75, ge=0.01, le=1.0, description="Stop evicting below this fill ratio.")

    model_config = ConfigDict(
        json_schema_extra=_validations(
            _cel(
                "self.low < self.high", "watermarks.low must be lower than watermarks.high", field_path=".low"
            )
        )
    )


_FORBIDDEN_HOST_PATHS: Final = (
    "/proc",
    "/sys",
    "/dev",
    "/etc",
    "/boot",
    "/bin",
    "/sbin",
    "/lib",
    "/usr",
    "/root",
    "/var/lib/kubelet",
    "/var/lib/containerd",
    "/var/lib/docker",
    "/var/lib/etcd",
    "/var/lib/cni",
    "/var/log",
    "/var/run",
    "/run",
)
_FORBIDDEN_LIST: Final = "[" + ", ".join(f"'{p}'" for p in _FORBIDDEN_HOST_PATHS) + "]"


class HostPathSource(_Model):
    """A directory on the node (e.g. a local NVMe mount)."""

    path: str = Field(
        min_length=1,
        max_length=1024,
        pattern=grammar.HOST_PATH_PATTERN,
        description="Absolute directory on the node. '/' and system or kubelet directories are rejected. "
        "Immutable: moving it would orphan the cached blocks.",
        json_schema_extra=_validations(
            _cel("self.startsWith('/')", "spec.tiers.localDisk.hostPath.path must be an absolute path"),
            _cel(
                "!self.matches('^/+$')",
                "spec.tiers.localDisk.hostPath.path must not be the root directory '/'",
            ),
            _cel(
                "!self.contains('/../') && !self.endsWith('/..') && !self.contains('//')"
                " && !self.contains('/./') && !self.endsWith('/.')",
                "spec.tiers.localDisk.hostPath.path must be a normalised path without '.', '..' or '//'",
            ),
            _cel(
                # Ancestors count too: the cache server's init container chowns a directory below
                # this path, and '/var' would put every kubelet directory under the pool's control.
                f"!{_FORBIDDEN_LIST}.exists(p, self == p || self.startsWith(p + '/')"
                " || p.startsWith(self + '/') || p.startsWith(self) && self.endsWith('/'))",
                "spec.tiers.localDisk.hostPath.path must not be a system or kubelet directory or one of "
                f"their parents ({', '.join(_FORBIDDEN_HOST_PATHS)})",
            ),
            _cel(
                "!self.endsWith('/') && !self.contains(' /') && !self.endsWith(' ')",
                "spec.tiers.localDisk.hostPath.path must be normalised: no trailing '/' or spaces",
            ),
            _cel("self == oldSelf", "spec.tiers.localDisk.hostPath.path is immutable"),
        ),
    )

    @field_validator("path")
    @classmethod
    def _safe_path(cls, path: str) -> str:
        # The CEL rules above, for pools parsed by the reconciler and the webhook.
        segments = path.split("/")[1:]
        if (
            path == "/"
            or path.endswith(("/", " "))
            or "" in segments
            or any(s in (".", "..") for s in segments)
        ):
            raise ValueError(f"spec.tiers.localDisk.hostPath.path {path!r} is not a normalised absolute path")
        for system in _FORBIDDEN_HOST_PATHS:
            if path == system or path.startswith(system + "/") or system.startswith(path + "/"):
                raise ValueError(
                    f"spec.tiers.localDisk.hostPath.path must not be {system} or below or above it"
                )
        return path


class EmptyDirSource(_Model):
    """A pod-lifetime scratch volume (data is lost when the cache-server pod is replaced)."""

    size_limit: DiskSize | None = Field(
        default=None,
        description="emptyDir sizeLimit.",
        json_schema_extra=_validations(
            *grammar.byte_rules("spec.tiers.localDisk.emptyDir.sizeLimit", grammar.DISK_BOUNDS)
        ),
    )


class LocalDiskTier(_Model):
    """The node-local disk tier: exactly one of ``hostPath`` or ``emptyDir``."""

    host_path: HostPathSource | None = Field(default=None, description="Use a directory on the node.")
    empty_dir: EmptyDirSource | None = Field(default=None, description="Use an emptyDir volume.")
    capacity: DiskSize = Field(
        description="Bytes the cache server may use on this disk, e.g. 1400Gi.",
        json_schema_extra=_validations(
            *grammar.byte_rules("spec.tiers.localDisk.capacity", grammar.DISK_BOUNDS)
        ),
    )
    watermarks: Watermarks = Field(
        default_factory=Watermarks,
        # A full default: the CEL rule on Watermarks is checked against the default itself.
        json_schema_extra={"default": {"high": 0.9, "low": 0.75}},
        description="Eviction watermarks.",
    )

    model_config = ConfigDict(
        json_schema_extra=_validations(
            _cel(
                "has(self.hostPath) != has(self.emptyDir)",
                "spec.tiers.localDisk must set exactly one of hostPath or emptyDir",
            ),
            _cel(
                "!has(self.emptyDir) || !has(self.emptyDir.sizeLimit) || "
                "quantity(self.capacity).compareTo(quantity(self.emptyDir.sizeLimit)) <= 0",
                "spec.tiers.localDisk.capacity must not exceed emptyDir.sizeLimit",
                field_path=".capacity",
            ),
            _cel(
                "has(self.hostPath) == has(oldSelf.hostPath)",
                "spec.tiers.localDisk: the disk source (hostPath or emptyDir) is immutable",
            ),
        )
    )


class AccessMode(StrEnum):
    """PVC access mode."""

    READ_WRITE_MANY = "ReadWriteMany"
    READ_WRITE_ONCE = "ReadWriteOnce"
    READ_WRITE_ONCE_POD = "ReadWriteOncePod"
    READ_ONLY_MANY = "ReadOnlyMany"


# A claim without ReadWriteMany binds to a volume only one node can mount: the cache servers on every
# other node would stay ContainerCreating (or, with ReadWriteOncePod, one pod in all the pool).
_NEEDS_RWX: Final = (
    "spec.tiers.shared.claimTemplate.accessModes must include ReadWriteMany (every node's cache server "
    "mounts the claim)"
)


class ClaimTemplate(_Model):
    """A PersistentVolumeClaim the pool creates and owns (deleted with the pool)."""

    storage_class_name: DnsSubdomain | None = Field(
        default=None,
        description="Storage class (default: the cluster default). Immutable.",
        json_schema_extra=_validations(
            _cel("self == oldSelf", "spec.tiers.shared.claimTemplate.storageClassName is immutable")
        ),
    )
    size: DiskSize = Field(
        description="Requested size of the claim.",
        json_schema_extra=_validations(
            *grammar.byte_rules("spec.tiers.shared.claimTemplate.size", grammar.DISK_BOUNDS)
        ),
    )
    access_modes: list[AccessMode] = Field(
        default_factory=lambda: [AccessMode.READ_WRITE_MANY],
        min_length=1,
        max_length=4,
        description="Access modes; must include ReadWriteMany (the default): every node's cache "
        "server mounts the claim at once.",
        json_schema_extra={
            "default": [AccessMode.READ_WRITE_MANY.value],
            **_validations(_cel("'ReadWriteMany' in self", _NEEDS_RWX)),
        },
    )

    @field_validator("access_modes")
    @classmethod
    def _read_write_many(cls, modes: list[AccessMode]) -> list[AccessMode]:
        if AccessMode.READ_WRITE_MANY not in modes:
            raise ValueError(_NEEDS_RWX)
        return modes


class SharedTier(_Model):
    """A volume every node mounts, so a chunk stored on one node is a hit on another."""

    existing_claim: DnsSubdomain | None = Field(
        default=None,
        description="Name of an existing PVC in the pool's namespace. Immutable.",
        json_schema_extra=_validations(
            _cel("self == oldSelf", "spec.tiers.shared.existingClaim is immutable")
        ),
    )
    claim_template: ClaimTemplate | None = Field(default=None, description="A PVC the pool creates and owns.")
    capacity: DiskSize = Field(
        description="Bytes the pool may use on the shared volume.",
        json_schema_extra=_validations(
            *grammar.byte_rules("spec.tiers.shared.capacity", grammar.DISK_BOUNDS)
        ),
    )
    watermarks: Watermarks = Field(
        default_factory=Watermarks,
        # A full default: the CEL rule on Watermarks is checked against the default itself.
        json_schema_extra={"default": {"high": 0.9, "low": 0.75}},
        description="Eviction watermarks.",
    )

    model_config = ConfigDict(
        json_schema_extra=_validations(
            _cel(
                "has(self.existingClaim) != has(self.claimTemplate)",
                "spec.tiers.shared must set exactly one of existingClaim or claimTemplate",
            ),
            _cel(
                "has(self.existingClaim) == has(oldSelf.existingClaim)",
                "spec.tiers.shared: the volume source (existingClaim or claimTemplate) is immutable",
            ),
            _cel(
                "!has(self.claimTemplate) || "
                "quantity(self.capacity).compareTo(quantity(self.claimTemplate.size)) <= 0",
                "spec.tiers.shared.capacity must not exceed claimTemplate.size",
                field_path=".capacity",
            ),
        )
    )


SecretKey = Annotated[str, Field(min_length=1, max_length=253, pattern=objectstore.KEY_PATTERN)]

# Virtual-hosted requests put the bucket into the host name, where a '.' makes a name the endpoint's
# wildcard certificate (*.s3.example.com) does not cover: every request over https would fail.
_VIRTUAL_HOSTED_DOTS: Final = (
    "spec.tiers.objectStore.bucket must not contain '.' with pathStyle false over https (the "
    "endpoint's certificate does not cover bucket.host); use pathStyle true or a bucket without '.'"
)
_VIRTUAL_HOSTED_DOTS_CEL: Final = (
    "self.pathStyle || !self.endpoint.startsWith('https://') || !self.bucket.contains('.')"
)


class ObjectStoreCredentials(_Model):
    """A Secret in the pool's namespace holding the S3 access key pair (mounted read-only as files)."""

    secret_name: DnsSubdomain = Field(description="Name of the Secret in the pool's namespace.")
    access_key_id_key: SecretKey = Field(
        default="AWS_ACCESS_KEY_ID", description="Secret key of the access key id."
    )
    secret_access_key_key: SecretKey = Field(
        default="AWS_SECRET_ACCESS_KEY", description="Secret key of the secret access key."
    )

    model_config = ConfigDict(
        json_schema_extra=_validations(
            _cel(
                "self.accessKeyIdKey != self.secretAccessKeyKey",
                "spec.tiers.objectStore.credentials.secretAccessKeyKey must differ from accessKeyIdKey",
                field_path=".secretAccessKeyKey",
            )
        )
    )

    @model_validator(mode="after")
    def _distinct_keys(self) -> ObjectStoreCredentials:
        if self.access_key_id_key == self.secret_access_key_key:
            raise ValueError(
                "spec.tiers.objectStore.credentials.secretAccessKeyKey must differ from accessKeyIdKey"
            )
        return self


class ObjectStoreCA(_Model):
    """A ConfigMap in the pool's namespace holding the PEM CA bundle that signed the endpoint."""

    config_map_name: DnsSubdomain = Field(description="Name of the ConfigMap.")
    key: SecretKey = Field(default="ca.crt", description="Key of the PEM bundle.")


class ObjectStoreTier(_Model):
    """An S3-API object store below (or instead of) the shared volume: cross-node sharing without RWX."""

    endpoint: Annotated[
        str, AfterValidator(objectstore.checker(objectstore.ENDPOINT_PATH, objectstore.ENDPOINT_RULES))
    ] = Field(
        min_length=1,
        max_length=512,
        description="S3 endpoint URL, http(s)://host[:port], e.g. https://s3.us-east-1.amazonaws.com or "
        "http://minio.storage:9000. No path, query or fragment, and no credentials: those go in a "
        "Secret named by credentials.",
        json_schema_extra=_validations(
            *objectstore.cel_rules(objectstore.ENDPOINT_PATH, objectstore.ENDPOINT_RULES)
        ),
    )
    bucket: Annotated[
        str, AfterValidator(objectstore.checker(objectstore.BUCKET_PATH, objectstore.BUCKET_RULES))
    ] = Field(
        min_length=3,
        max_length=63,
        description="Bucket (must exist; the pool writes under its prefix only). An S3 bucket name: "
        "lower-case letters, digits, '.' and '-', each '.'-separated label a DNS label, not an IP "
        "address, no reserved prefix or suffix.",
        json_schema_extra=_validations(
            *objectstore.cel_rules(objectstore.BUCKET_PATH, objectstore.BUCKET_RULES)
        ),
    )
    prefix: str | None = Field(
        default=None,
        max_length=512,
        description="Key prefix of the pool's objects (default: kvfabric/<namespace>/<pool>). Pools "
        "that share a prefix share their cache.",
        json_schema_extra=_validations(
            _cel(
                "self.matches('^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$') && !self.split('/').exists(s, s == '.' "
                "|| s == '..')",
                "spec.tiers.objectStore.prefix must be '/'-separated segments of letters, digits, '.', '_' "
                "or '-', without '.' or '..' segments",
            )
        ),
    )
    region: str = Field(
        default="us-east-1",
        min_length=1,
        max_length=64,
        pattern=objectstore.REGION_PATTERN,
        description="Signing region (letters, digits, '-', '_', '.').",
    )
    path_style: bool = Field(
        default=True,
        description="Path-style requests (endpoint/bucket/key), which most S3-compatible servers need.",
    )
    credentials: ObjectStoreCredentials | None = Field(
        default=None,
        description="The access key pair; unset means the environment's (e.g. a workload identity).",
    )
    ca: ObjectStoreCA | None = Field(
        default=None, description="CA bundle for an https endpoint with a private CA."
    )
    capacity: DiskSize = Field(
        description=f"Bytes the pool may keep in the bucket, e.g. 10Ti (whole bytes, "
        f"{grammar.DISK_BOUNDS[0]} to {grammar.DISK_BOUNDS[1]}).",
        json_schema_extra=_validations(
            *grammar.byte_rules("spec.tiers.objectStore.capacity", grammar.DISK_BOUNDS)
        ),
    )
    watermarks: Watermarks = Field(
        default_factory=Watermarks,
        json_schema_extra={"default": {"high": 0.9, "low": 0.75}},
        description="Eviction watermarks.",
    )

    model_config = ConfigDict(
        json_schema_extra=_validations(
            _cel(
                "!has(self.ca) || self.endpoint.startsWith('https://')",
                "spec.tiers.objectStore.ca needs an https:// endpoint",
                field_path=".ca",
            ),
            _cel(
                _VIRTUAL_HOSTED_DOTS_CEL,
                _VIRTUAL_HOSTED_DOTS,
                field_path=".bucket",
            ),
        )
    )

    @model_validator(mode="after")
    def _tls_fits(self) -> ObjectStoreTier:
        https = self.endpoint.startswith("https://")
        if self.ca is not None and not https:
            raise ValueError("spec.tiers.objectStore.ca needs an https:// endpoint")
        if https and not self.path_style and "." in self.bucket:
            raise ValueError(_VIRTUAL_HOSTED_DOTS)
        return self


class Tiers(_Model):
    """The storage tiers of each cache server."""

    memory: MemoryTier = Field(description="Host DRAM tier; required.")
    local_disk: LocalDiskTier | None = Field(default=None, description="Optional node-local disk tier.")
    shared: SharedTier | None = Field(default=None, description="Optional shared (RWX) tier.")
    object_store: ObjectStoreTier | None = Field(
        default=None, description="Optional object-store (S3 API) tier shared by every node."
    )


class SelectorOperator(StrEnum):
    """Label-selector requirement operator."""

    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


class SelectorRequirement(_Model):
    """One label-selector requirement."""

    key: LabelKey = Field(description="Label key.")
    operator: SelectorOperator = Field(description="In, NotIn, Exists or DoesNotExist.")
    values: list[LabelValue] = Field(default_factory=list, max_length=64, description="Values for In/NotIn.")

    model_config = ConfigDict(
        json_schema_extra=_validations(
            _cel(
                "(self.operator in ['In', 'NotIn']) == (has(self.values) && size(self.values) > 0)",
                "selector matchExpressions: In/NotIn need values, Exists/DoesNotExist must not have values",
            )
        )
    )


class LabelSelector(_Model):
    """A Kubernetes label selector."""

    match_labels: Annotated[dict[str, LabelValue], AfterValidator(grammar.check_label_keys)] = Field(
        default_factory=dict,
        description="Labels that must match exactly.",
        json_schema_extra={
            "maxProperties": 32,
            **_validations(*grammar.label_key_rules("selector matchLabels")),
        },
    )
    match_expressions: list[SelectorRequirement] = Field(
        default_factory=list, max_length=16, description="Set-based requirements."
    )


class FailurePolicy(StrEnum):
    """What the API server does when the injection webhook is unreachable."""

    IGNORE = "Ignore"
    FAIL = "Fail"


class Deadlines(_Model):
    """Per-operation deadlines the connector enforces before falling back to recompute."""

    # Bounds: the scheduler blocks for at most the lookup deadline on every request, a load holds a
    # request's prefill, a store only a background slot. Production values are ~10-100 ms for lookups;
    # 2 s is the generous end (the demo's setting on a loaded 2-core CI machine).
    lookup_ms: int | None = Field(
        default=None,
        ge=1,
        le=2000,
        description="Lookup deadline (ms, 1 to 2000; default: the connector's, 100). A lookup blocks "
        "the scheduler.",
    )
    load_ms: int | None = Field(
        default=None,
        ge=1,
        le=30000,
        description="Load deadline (ms, 1 to 30000; default: the connector's, 2000): a load not done "
        "by then is recomputed.",
    )
    store_ms: int | None = Field(
        default=None,
        ge=1,
        le=60000,
        description="Store deadline (ms, 1 to 60000; default: the connector's, 5000). Stores run in the "
        "background.",
    )


class LoadMode(StrEnum):
    """How consumers load hits: the step waits for the load, or the request alone waits for it."""

    SYNCHRONOUS = "Synchronous"
    ASYNCHRONOUS = "Asynchronous"


class KeySpace(StrEnum):
    """Whether each consumer namespace of a pool seals and names its KV with a key of its own."""

    PER_NAMESPACE = "PerNamespace"
    SHARED = "Shared"


class RoutingEvents(_Model):
    """KV events for cache-aware routers (llm-d, Dynamo): vLLM's publisher, injected (docs/routing.md)."""

    port: int = Field(
        default=5556, ge=1024, le=65535, description="Port vLLM's ZMQ publisher binds in each engine pod."
    )
    replay_port: int = Field(
        default=5557,
        ge=1024,
        le=65535,
        description="Port of vLLM's replay socket (a router asks it for the events it missed).",
    )
    model_name: str | None = Field(
        default=None,
        max_length=256,
        pattern=r"^[^@\s]+$",
        description="Model name in the topic (kv@<pod IP>:<port>@<model>): the name requests carry. "
        "Default: the engine's --served-model-name, else its model argument.",
    )
    llmd_label: bool = Field(
        default=True,
        description="Label engine pods llm-d.ai/inference-serving=true (llm-d's default endpoint selector).",
    )

    model_config = ConfigDict(
        json_schema_extra=_validations(
            _cel(
                "self.port != self.replayPort",
                "spec.consumers.routingEvents.replayPort must differ from spec.consumers.routingEvents.port",
                field_path=".replayPort",
            ),
        )
    )

    @model_validator(mode="after")
    def _distinct_ports(self) -> RoutingEvents:
        if self.port == self.replay_port:
            raise ValueError(
                "spec.consumers.routingEvents.replayPort must differ from spec.consumers.routingEvents.port"
            )
        return self


class Consumers(_Model):
    """Which pods get the connector injected, and how."""

    pod_selector: LabelSelector | None = Field(
        default=None,
        description="Extra labels an opted-in pod must match (the opt-in label kvfabric.io/pool is always "
        "required).",
    )
    namespace_selector: LabelSelector | None = Field(
        default=None,
        description="Namespaces whose pods may use this pool (default: only the pool's namespace). A pod "
        "in another namespace names the pool with the annotation kvfabric.io/pool-namespace.",
    )
    key_space: KeySpace = Field(
        default=KeySpace.PER_NAMESPACE,
        description="PerNamespace (default): the consumers of each namespace seal, verify and name their "
        "KV with a payload key of their own, derived from the pool's secret for that namespace, so a pod "
        "of one consumer namespace can neither read another's cached prefixes nor plant KV that another "
        "accepts. Shared: every consumer namespace of the pool uses one key: they share cached prefixes "
        "and each trusts the KV every other stores, so choose it only for namespaces that trust each "
        "other (one team's).",
    )
    failure_policy: FailurePolicy = Field(
        default=FailurePolicy.IGNORE,
        description="Ignore (default): a consumer pod is admitted uninjected when the operator cannot be "
        "reached. Fail: its creation is refused instead. Applied by the webhook configuration the "
        "operator registers (the object selector matches the pool's name in every namespace).",
    )
    tenant: str | None = Field(
        default=None,
        max_length=128,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Tenant salt injected as KVFABRIC_TENANT (separates key spaces).",
    )
    deadlines: Deadlines | None = Field(default=None, description="Connector deadlines.")
    load_mode: LoadMode | None = Field(
        default=None,
        description="How hits are loaded (injected as KVFABRIC_LOAD_ASYNC; default: the connector's, "
        "Synchronous). Synchronous: the engine step that needs the KV waits for it (the hit's fastest "
        "time to first token). Asynchronous: only the request waits, while the engine keeps stepping "
        "the others (no decode stall beside a long hit; the hit itself costs about a step more).",
    )
    local_index: bool | None = Field(
        default=None,
        description="Answer same-node lookups from the index the node's cache server publishes in "
        "shared memory (injected as KVFABRIC_LOCAL_INDEX; default: the connector's, true): no call "
        "per lookup, and a hung server is detected from its heartbeat. false: every lookup is a call "
        "that waits up to the lookup deadline. Measured in docs/performance.md (Defaults).",
    )
    cost_model: bool | None = Field(
        default=None,
        description="Load a hit only where restoring it is expected to beat recomputing it, by the "
        "prefill and restore times the connector measures as it runs (injected as KVFABRIC_COST_MODEL; "
        "default: the connector's, false: every hit is loaded). Off by default until its decisions are "
        "shown no worse than loading every hit on a quiet machine and a GPU (docs/performance.md, "
        "Defaults).",
    )
    routing_events: RoutingEvents | None = Field(
        default=None,
        description="Set to publish KV events from every injected vLLM engine (vLLM's "
        "--kv-events-config: ZMQ publisher and replay socket), which then include what the engine's "
        "node cache holds in DRAM and on local NVMe, so llm-d's or Dynamo's router can route on it "
        "(docs/routing.md). A --kv-events-config the pod sets itself is kept.",
    )
    connector_image: str | None = Field(
        default=None,
        min_length=3,
        max_length=512,
        pattern=grammar.IMAGE_REFERENCE_PATTERN,
        description="Image of the connector payload that an init container copies into vLLM pods "
        "(default: the cache server's repository with the name 'connector' and the same tag). Pods whose "
        'image already contains kvfabric opt out with the annotation kvfabric.io/inject-payload: "false".',
        json_schema_extra=_validations(
            _cel(
                "self.contains('@') || (self.contains(':') && !self.endsWith(':latest'))",
                "spec.consumers.connectorImage must be pinned: a tag other than latest, or a digest",
            ),
        ),
    )


IntOrPercent = Annotated[
    int | str,
    Field(
        json_schema_extra={
            "x-kubernetes-int-or-string": True,
            "x-kubernetes-validations": [
                _cel(
                    "type(self) == int ? self >= 1 : string(self).matches('^[1-9][0-9]?%$|^100%$')",
                    "spec.updateStrategy.maxUnavailable must be a positive integer or a percentage "
                    "between 1% and 100%",
                )
            ],
        }
    ),
]


class UpdateStrategy(_Model):
    """How a configuration change rolls across nodes."""

    max_unavailable: IntOrPercent = Field(
        default=1,
        description="Nodes rolled at once (int or 'N%'). With handOver (the default) no cache server is "
        "down meanwhile: this many new servers start beside the old ones (the DaemonSet's maxSurge).",
    )
    hand_over: bool = Field(
        default=True,
        description="Roll a node by starting the new cache server beside the old one, which hands it its "
        "DRAM blocks over a node-local socket (no copy; the same memory) and is removed once the "
        "new one is ready: hit rates and TTFT stay as they were during a rollout. The node needs room "
        "for both pods' resource requests meanwhile (the memory itself is shared, not doubled). false: "
        "the old server stops first (maxUnavailable), and the new one starts with its disk tiers only.",
    )
    progress_deadline_seconds: int = Field(
        default=300,
        ge=30,
        le=86400,
        description="A rollout that makes no progress for this long is reported as "
        "Progressing=False (ProgressDeadlineExceeded) and Degraded=True.",
    )


class Resources(_Model):
    """Container resources; by default derived from the memory tier (requests = size + 1Gi)."""

    requests: Annotated[dict[str, Quantity], AfterValidator(grammar.check_resources)] = Field(
        default_factory=dict,
        description="Resource requests.",
        json_schema_extra={
            "maxProperties": 16,
            **_validations(*grammar.resource_rules("spec.resources.requests")),
        },
    )
    limits: Annotated[dict[str, Quantity], AfterValidator(grammar.check_resources)] = Field(
        default_factory=dict,
        description="Resource limits.",
        json_schema_extra={
            "maxProperties": 16,
            **_validations(*grammar.resource_rules("spec.resources.limits")),
        },
    )

    model_config = ConfigDict(
        json_schema_extra=_validations(
            _cel(
                "!has(self.requests) || !has(self.limits) || self.requests.all(k, !(k in self.limits) "
                "|| !isQuantity(self.requests[k]) || !isQuantity(self.limits[k]) "
                "|| quantity(self.requests[k]).compareTo(quantity(self.limits[k])) <= 0)",
                "spec.resources.requests must not exceed spec.resources.limits",
                field_path=".requests",
            )
        )
    )

    @model_validator(mode="after")
    def _requests_within_limits(self) -> Resources:
        for name, request in self.requests.items():
            limit = self.limits.get(name)
            if limit is not None and parse_quantity(request) > parse_quantity(limit):
                raise ValueError(
                    f"spec.resources.requests.{name} must not exceed spec.resources.limits.{name}"
                )
        return self


class NetworkPeer(_Model):
    """Pods allowed to reach a port (a NetworkPolicy peer: both selectors must match)."""

    namespace_selector: LabelSelector = Field(
        default_factory=LabelSelector,
        json_schema_extra=_OBJECT_DEFAULT,
        description="Namespaces of the allowed pods (default {}: every namespace).",
    )
    pod_selector: LabelSelector = Field(
        default_factory=lambda: LabelSelector(match_labels={"kvfabric.io/metrics-scraper": "true"}),
        json_schema_extra={"default": {"matchLabels": {"kvfabric.io/metrics-scraper": "true"}}},
        description="Labels of the allowed pods (default: kvfabric.io/metrics-scraper=true).",
    )


class Metrics(_Model):
    """Prometheus metrics of the cache servers."""

    enabled: bool = Field(default=True, description="Expose the metrics Service.")
    port: int = Field(default=9090, ge=1024, le=65535, description="Metrics/health port of the cache server.")
    scrapers: NetworkPeer = Field(
        default_factory=NetworkPeer,
        json_schema_extra=_OBJECT_DEFAULT,
        description="Who may reach the metrics port: the pool's NetworkPolicy admits only these pods "
        "(the kubelet's probes come from the node and are always allowed).",
    )


class TCPListener(_Model):
    """The cache server's TCP listener for peers and tools; off unless a pool asks for it."""

    enabled: bool = Field(
        default=False,
        description="Listen on TCP. When true the listener requires mutual TLS with certificates the "
        "operator issues for this pool (its own per-pool CA) and a per-pool bearer token; consumers "
        "in the pool's namespace get the client certificate and the token injected.",
    )
    certificate_validity_seconds: int = Field(
        default=30 * 86400,
        ge=600,
        le=366 * 86400,
        description="Validity of the server and client certificates; each is re-issued when less "
        "than a third of it is left (the CA lives ten times as long and is rotated the same way).",
    )


class Server(_Model):
    """Cache-server process settings."""

    port: int = Field(default=7070, ge=1024, le=65535, description="TCP port for peers and tools.")
    tcp: TCPListener = Field(
        default_factory=TCPListener,
        json_schema_extra=_OBJECT_DEFAULT,
        description="The TCP listener (off by default: engines on the node use the Unix socket).",
    )
    log_level: str = Field(
        default="info",
        pattern=r"^(debug|info|warning|error)$",
        max_length=16,
        description="Log level of the cache server.",
    )


class KVCachePoolSpec(_Model):
    """Desired state of a pool of per-node KV-cache servers."""

    image: ImageSpec = Field(description="Cache-server image (pinned tag).")
    placement: Placement = Field(
        default_factory=Placement, json_schema_extra=_OBJECT_DEFAULT, description="Node placement."
    )
    tiers: Tiers = Field(description="Storage tiers.")
    ttl_seconds: int = Field(
        default=86400, ge=60, le=31536000, description="Time-to-live of a stored chunk, in seconds."
    )
    chunk_tokens: int = Field(
        default=256,
        ge=16,
        le=8192,
        description="Tokens per cached chunk (a multiple of 16, the engine block size). Immutable: it "
        "defines the key space.",
        json_schema_extra=_validations(
            _cel("self % 16 == 0", "spec.chunkTokens must be a multiple of 16"),
            _cel("self == oldSelf", "spec.chunkTokens is immutable (it defines the key space)"),
        ),
    )
    consumers: Consumers = Field(
        default_factory=Consumers,
        json_schema_extra=_OBJECT_DEFAULT,
        description="Injection into consumer pods.",
    )
    update_strategy: UpdateStrategy = Field(
        default_factory=UpdateStrategy, json_schema_extra=_OBJECT_DEFAULT, description="Rollout strategy."
    )
    resources: Resources | None = Field(default=None, description="Container resources.")
    metrics: Metrics = Field(
        default_factory=Metrics, json_schema_extra=_OBJECT_DEFAULT, description="Metrics endpoint."
    )
    server: Server = Field(
        default_factory=Server,
        json_schema_extra=_OBJECT_DEFAULT,
        description="Cache-server process settings.",
    )

    model_config = ConfigDict(
        json_schema_extra=_validations(
            _cel(
                "!has(self.resources) || !has(self.resources.limits) "
                "|| !('memory' in self.resources.limits) "
                "|| quantity(self.resources.limits['memory'])"
                ".compareTo(quantity(self.tiers.memory.size)) >= 0",
                "spec.resources.limits.memory must be at least spec.tiers.memory.size",
                field_path=".resources.limits",
            ),
            _cel(
                "self.server.port != self.metrics.port",
                "spec.metrics.port must differ from spec.server.port (both listen in the same pod)",
                field_path=".metrics.port",
            ),
        )
    )

    @model_validator(mode="after")
    def _distinct_ports(self) -> KVCachePoolSpec:
        if self.server.port == self.metrics.port:
            raise ValueError(
                "spec.metrics.port must differ from spec.server.port (both listen in the same pod)"
            )
        return self


class ConditionStatus(StrEnum):
    """Condition status."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(_Model):
    """A status condition (metav1.Condition shape)."""

    type: str = Field(max_length=64, description="Ready, Progressing, Degraded, ConfigValid, ...")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(max_length=128, description="CamelCase reason.")
    message: str = Field(default="", max_length=4096, description="Human-readable detail.")
    observed_generation: int = Field(default=0, description="Pool generation this condition describes.")
    last_transition_time: str | None = Field(
        default=None,
        description="When status last changed (RFC 3339).",
        json_schema_extra={"format": "date-time"},
    )


class NodeCounts(_Model):
    """Cache-server counts over the selected nodes."""

    desired: int = Field(default=0, description="Nodes that should run a cache server.")
    ready: int = Field(default=0, description="Nodes whose cache server is ready (any revision).")
    updated: int = Field(default=0, description="Nodes running the current revision.")
    available: int = Field(default=0, description="Nodes whose current-revision server is available.")


class Connection(_Model):
    """What consumers use to reach the pool (also injected into their pods)."""

    socket: str = Field(default="", description="Node-local Unix socket path.")
    host_dir: str = Field(
        default="", description="hostPath directory holding the node's cache sockets (mounted read-only)."
    )
    remote: str = Field(default="", description="host:port of the node-local Service.")
    service: str = Field(default="", description="Node-local Service name.")
    metrics_service: str = Field(default="", description="Metrics Service name.")
    config_map: str = Field(default="", description="ConfigMap with the server configuration.")
    config_hash: str = Field(default="", description="Hash of the server configuration.")
    chunk_tokens: int = Field(default=0, description="Tokens per chunk.")


class ConsumerCounts(_Model):
    """Pods that opted in to this pool."""

    matched: int = Field(default=0, description="Pods labelled kvfabric.io/pool=<this pool>.")
    injected: int = Field(default=0, description="Pods injected with the current config hash.")
    stale: int = Field(default=0, description="Pods injected with an older config hash.")
    skipped: int = Field(default=0, description="Pods the webhook skipped (see their annotation).")
    skipped_by_reason: dict[str, int] = Field(
        default_factory=dict,
        description="Skipped pods by the reason in their kvfabric.io/skip-reason annotation "
        "(pod-security: their namespace forbids the hostPath of the node's socket).",
        json_schema_extra={"maxProperties": 16},
    )
    over_tcp: int = Field(
        default=0,
        description="Injected pods wired to the pool's TCP listener alone (no node socket: their "
        "namespace enforces Pod Security baseline or restricted).",
    )


class TierUsage(_Model):
    """Bytes one tier holds across the pool's cache servers, and the fullest node."""

    tier: str = Field(max_length=32, description="dram, local_disk, shared, ...")
    used_bytes: int = Field(default=0, description="Bytes used, summed over the nodes scraped.")
    capacity_bytes: int = Field(default=0, description="Capacity, summed over the nodes scraped.")
    worst_node: str = Field(default="", max_length=253, description="The node whose tier is the fullest.")
    worst_node_used: str = Field(default="", max_length=16, description="Its fill ratio, e.g. 93.0%.")


NamespaceField = Annotated[str, Field(max_length=512)]


class NamespaceInUse(_Model):
    """A compatibility namespace in use: engines share chunks only within one (fields say what it is)."""

    digest: str = Field(
        max_length=64,
        description="The namespace's label: 16 hex characters of a one-way hash of its digest (the "
        "digest itself names every chunk of the namespace and is never exported).",
    )
    fields: dict[str, NamespaceField] = Field(
        default_factory=dict,
        description="What it stands for: model, revision, dtype, kv_layout, device, attn_backend, "
        "block_size, chunk_tokens, tp_size, tp_rank... (never the tenant or the payload key's fingerprint).",
        json_schema_extra={"maxProperties": 32},
    )
    nodes: list[Annotated[str, Field(max_length=253)]] = Field(
        default_factory=list, max_length=16, description="Nodes whose cache server knows it (first 16)."
    )
    node_count: int = Field(default=0, description="How many nodes' cache servers know it.")
    lookup_hits: int = Field(default=0, description="Chunks found by lookups in this namespace.")
    lookup_misses: int = Field(default=0, description="Chunks looked up in this namespace and not found.")
    hit_rate: str = Field(
        default="n/a", max_length=16, description="lookupHits / (lookupHits + lookupMisses)."
    )
    stores: int = Field(default=0, description="Chunks stored in this namespace.")


class CacheInsight(_Model):
    """What the cache servers report, scraped at a bounded rate (at most once a minute per pool)."""

    scraped_at: str = Field(default="", max_length=64, description="When (RFC 3339).")
    nodes_scraped: int = Field(default=0, description="Cache servers that answered.")
    nodes_unreachable: int = Field(default=0, description="Ready cache servers that did not answer.")
    lookup_hits: int = Field(
        default=0, description="Chunks found by consumers' lookups (since server start)."
    )
    lookup_misses: int = Field(default=0, description="Chunks looked up and not found.")
    hit_rate: str = Field(
        default="n/a", max_length=16, description="lookupHits / (lookupHits + lookupMisses)."
    )
    load_misses_by_reason: dict[str, int] = Field(
        default_factory=dict,
        description="Loads that found no usable block, by reason (absent, corrupt, stale, io-error...).",
        json_schema_extra={"maxProperties": 16},
    )
    tiers: list[TierUsage] = Field(default_factory=list, max_length=8, description="Bytes per tier.")
    routing_subscribers: int = Field(
        default=0,
        description="Engines following their node's residency feed, summed over the nodes scraped: "
        "each one announces its node's tiers in its KV events (spec.consumers.routingEvents).",
    )
    routing_nodes: int = Field(
        default=0,
        description="Nodes scraped whose cache server at least one engine follows (routing events flow "
        "from them).",
    )
    namespaces_in_use: int = Field(
        default=0, description="Distinct compatibility namespaces the consumers described to the servers."
    )
    namespaces: list[NamespaceInUse] = Field(
        default_factory=list,
        max_length=16,
        description="The namespaces in use, most looked-up first (first 16; counters since each server "
        "learned the namespace).",
    )
    namespace_splits: list[Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=list,
        max_length=8,
        description="Models served under more than one namespace for the same tensor-parallel rank, "
        "and what differs: such consumers never share chunks (a silent 0 % hit rate between them).",
    )


class KVCachePoolStatus(_Model):
    """Observed state; written only by the operator."""

    observed_generation: int = Field(default=0, description="Generation last reconciled.")
    revision: str = Field(default="", description="Hash of the current server configuration.")
    node_summary: str = Field(default="", description="'ready/desired' for printing.")
    nodes: NodeCounts = Field(default_factory=NodeCounts, description="Node counts.")
    connection: Connection = Field(default_factory=Connection, description="Connection details.")
    consumers: ConsumerCounts = Field(default_factory=ConsumerCounts, description="Consumer counts.")
    cache: CacheInsight | None = Field(
        default=None, description="Hit rate, misses and bytes per tier, from the cache servers' metrics."
    )
    last_progress_time: str | None = Field(
        default=None,
        description="When the rollout last made progress (RFC 3339); compared with "
        "spec.updateStrategy.progressDeadlineSeconds.",
        json_schema_extra={"format": "date-time"},
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        description="Ready, Progressing, Degraded, ConfigValid, StorageReady, InjectionReady.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class KVCachePool(_Model):
    """A pool of per-node KV-cache servers and the consumers that use it."""

    api_version: str = Field(default=API_VERSION, description="kvfabric.io/v1alpha1")
    kind: str = Field(default=KIND, description="KVCachePool")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Standard object metadata.")
    spec: KVCachePoolSpec = Field(description="Desired state.")
    status: KVCachePoolStatus | None = Field(default=None, description="Observed state.")

    model_config = ConfigDict(extra="ignore")

    @property
    def name(self) -> str:
        """The pool's name."""
        return str(self.metadata.get("name", ""))

    @property
    def namespace(self) -> str:
        """The pool's namespace."""
        return str(self.metadata.get("namespace", ""))


# Rules on the object root: child objects are named after the pool, so its name must be a DNS-1035
# label short enough for "<name>-metrics" and the DaemonSet's pod names.
ROOT_VALIDATIONS: Final = [
    _cel(
        "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && self.metadata.name.size() <= 40",
        "metadata.name must be a DNS-1035 label of at most 40 characters (it names Services)",
    ),
]

PRINTER_COLUMNS: Final = [
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {
        "name": "Reason",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
        "priority": 1,
    },
    {"name": "Nodes", "type": "string", "jsonPath": ".status.nodeSummary", "description": "ready/desired"},
    {"name": "Consumers", "type": "integer", "jsonPath": ".status.consumers.injected"},
    {"name": "Revision", "type": "string", "jsonPath": ".status.revision", "priority": 1},
    {
        "name": "Hit Rate",
        "type": "string",
        "jsonPath": ".status.cache.hitRate",
        "priority": 1,
        "description": "lookup hit rate reported by the cache servers",
    },
    {
        "name": "Namespaces",
        "type": "integer",
        "jsonPath": ".status.cache.namespacesInUse",
        "priority": 1,
        "description": "compatibility namespaces the consumers use",
    },
    {
        "name": "Routing",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="RoutingEvents")].status',
        "priority": 1,
        "description": "whether engines announce the pool's tiers in their KV events (routingEvents)",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
