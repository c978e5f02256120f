"""The cache server's configuration: the schema of the ``config.yaml`` the operator renders.

The operator builds :class:`ServerConfig`, dumps it with ``model_dump(mode="json")`` into a ConfigMap
key ``config.yaml``, and the DaemonSet runs ``kvfabric cacheserver --config /etc/kvfabric/config.yaml``.
Byte sizes are plain integers here; the operator converts Kubernetes quantities before rendering.
Every model forbids unknown keys so that a typo in a ConfigMap fails loudly at start-up instead of
being ignored.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "DiskTierConfig",
    "DramTierConfig",
    "ExtraTierConfig",
    "HandoverConfig",
    "IoFaultsConfig",
    "LimitsConfig",
    "ListenConfig",
    "MetricsConfig",
    "ObjectStoreTierConfig",
    "ServerConfig",
    "ShmConfig",
    "TLSConfig",
    "TiersConfig",
    "apply_overrides",
]

MiB = 1 << 20
GiB = 1 << 30


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True)


class TLSConfig(_Model):
    """TLS material for the TCP listener (PEM files, typically mounted from a Secret).

    The files are read again whenever they change on disk (checked at every new connection), so a
    rotated Secret takes effect without a restart and established connections are not cut.
    """

    cert_file: Path = Field(description="PEM certificate chain presented by the TCP listener.")
    key_file: Path = Field(description="PEM private key matching cert_file.")
    client_ca_file: Path | None = Field(
        default=None,
        description="PEM CA bundle that client certificates must chain to; when set the listener "
        "requires a client certificate (mutual TLS) and refuses a handshake without a valid one.",
    )


class ListenConfig(_Model):
    """Where the server listens: a Unix socket for same-node engines, TCP for peers and tools."""

    unix_socket: Path = Field(
        description="Path of the Unix-domain socket that engines on this node connect to "
        "(the client target is 'unix://<this path>'). Same-node bulk bytes travel as memfd descriptors "
        "handed out on '<this path>.blocks'; the published index is served on '<this path>.index'."
    )
    tcp_host: str = Field(
        default="127.0.0.1",
        description="Address the TCP listener binds to. Any address other than loopback requires "
        "mutual TLS (tls.client_ca_file) and a token_file: nothing listens unauthenticated beyond "
        "the pod.",
    )
    tcp_port: int | None = Field(
        default=7070,
        ge=0,
        le=65535,
        description="TCP port for remote peers and tools (payloads streamed in gRPC messages); "
        "null disables TCP; 0 picks a free port (tests).",
    )
    tls: TLSConfig | None = Field(
        default=None, description="Serve TLS on the TCP listener when set; the Unix socket stays plain."
    )
    token_file: Path | None = Field(
        default=None,
        description="File holding a bearer token; when set every TCP call must send "
        "'authorization: Bearer <token>'. The Unix socket is protected by file permissions instead.",
    )

    @model_validator(mode="after")
    def _check_exposure(self) -> Self:
        if self.tcp_port is None or _is_loopback(self.tcp_host):
            return self
        if self.tls is None or self.tls.client_ca_file is None or self.token_file is None:
            raise ValueError(
                f"listen.tcp_host {self.tcp_host!r} is reachable from other hosts: it requires "
                "listen.tls with client_ca_file (mutual TLS) and listen.token_file"
            )
        return self


class ShmConfig(_Model):
    """Shared memory with same-node clients: sealed memfds handed out over the block socket."""

    dir: Path | None = Field(
        default=None,
        description="Deprecated and ignored: DRAM blocks and staging now live in memfds the server owns "
        "(no directory is shared with engine pods). Accepted so an older operator's configuration "
        "still starts.",
    )
    arena_bytes: int = Field(
        default=1 * GiB,
        gt=0,
        description="Budget in bytes for store staging slots handed to same-node clients; a store "
        "that does not fit is dropped (backpressure), never queued.",
    )
    prealloc_bytes: int = Field(
        default=64 * MiB,
        ge=0,
        description="Staging kept allocated ahead of stores (by a server thread, of the lengths recent "
        "stores asked for), so that ShmStoreBegin hands out pages that already exist instead of allocating "
        "them on the store's path. Charged to arena_bytes, at most a quarter of it, and only filled while "
        "that much more of the arena is free; memory the server holds while idle. 0: every begin allocates.",
    )
    slot_lease_seconds: float = Field(
        default=30.0,
        gt=0,
        description="A staging slot not committed within this time (e.g. its client died) is reclaimed.",
    )
    hold_bytes_per_client: int = Field(
        default=1 * GiB,
        ge=0,
        description="Bytes of loaded blocks one same-node client may hold, that is keep mapped across "
        "loads (a repeated load then copies at memory speed, with no mapping to build), over all of its "
        "block-socket connections (a client is the id it names itself by). Held blocks stay charged to "
        "the DRAM budget after an eviction until released, so the server never uses memory it does not "
        "count; eviction passes over held blocks (evicting one frees nothing) and all clients together "
        "hold at most half of the DRAM budget and half of its descriptor cap. A hold beyond a budget is "
        "refused: the client copies the block instead. 0: nothing is held (every load maps its blocks "
        "afresh).",
    )
    hold_blocks_per_client: int | None = Field(
        default=None,
        gt=0,
        description="Blocks one same-node client may hold (each keeps a descriptor of the server open), "
        "over all of its connections; default a quarter of what all clients together may hold (half the "
        "DRAM tier's descriptor cap), at least 1. Bounds holds of many tiny blocks, which bytes alone "
        "do not.",
    )
    max_block_connections: int = Field(
        default=1024,
        gt=0,
        description="Connections the block socket serves at once, all same-node clients together. One "
        "more closes the least recently active connection that holds nothing (its client reconnects on "
        "its next request) and is refused only when every connection has something at stake "
        "(CacheOverloaded at the client: a miss or a dropped store, never an error to inference); at "
        "most half of them may hold blocks. A connection silent for 1 s after its accept is closed. One "
        "loop thread serves every connection: no thread is started per connection.",
    )
    max_block_connections_per_client: int = Field(
        default=8,
        gt=0,
        description="Block-socket connections one same-node client (the id it names itself by) may have "
        "open at once; one more is refused. kvfabric's client keeps one per client object.",
    )


class HandoverConfig(_Model):
    """Handing DRAM to a successor on the same node (rollouts keep the cache warm)."""

    enabled: bool = Field(
        default=True,
        description="At start, take over the DRAM blocks of a server still running on this node's socket "
        "(a rolling update's old pod), and offer this server's to the next one. Off: every start is cold "
        "in DRAM (the disk tiers still survive).",
    )
    socket_dir: Path | None = Field(
        default=None,
        description="Directory of the hand-over socket; only cache servers may reach it, never a consumer "
        "(the operator uses a host directory it mounts into cache-server pods alone). Default: beside "
        "listen.unix_socket (for a server whose clients do not share its uid).",
    )
    timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        le=600,
        description="How long a successor waits for each hand-over message (the first waits for the "
        "predecessor's queued write-backs).",
    )
    successor_timeout_seconds: float = Field(
        default=600.0,
        gt=0,
        le=3600,
        description="How long a predecessor stays frozen while its successor scans its disks; past it, it "
        "thaws and serves on (the successor then exits and its restart tries again).",
    )
    freeze_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        le=600,
        description="How long a predecessor waits for its stores and write-backs in flight before it "
        "gives up a hand-over (and serves on).",
    )


class MetricsConfig(_Model):
    """The HTTP endpoint for Prometheus metrics and the pod's probes."""

    host: str = Field(default="0.0.0.0", description="Address the metrics/probe HTTP server binds to.")
    port: int | None = Field(
        default=9090,
        ge=0,
        le=65535,
        description="Port serving GET /metrics (Prometheus), /healthz and /readyz (200 while serving); "
        "null disables it; 0 picks a free port.",
    )
    residency_query: bool = Field(
        default=False,
        description="Also serve POST /query on this port: given a namespace digest and token ids, the tokens "
        "of their longest prefix resident per tier (docs/routing.md). Off by default: the port has no "
        "authentication, and the answer tells whoever knows a namespace digest whether a prompt was cached.",
    )


class DramTierConfig(_Model):
    """The DRAM tier (one sealed memfd per block, held by the server), evicted least-recently-used."""

    capacity_bytes: int = Field(gt=0, description="Byte budget of the DRAM tier.")
    high_watermark: float = Field(
        default=1.0, gt=0, le=1, description="Fraction of capacity_bytes at which eviction starts."
    )
    low_watermark: float = Field(
        default=0.9, gt=0, lt=1, description="Fraction of capacity_bytes eviction brings usage down to."
    )

    @model_validator(mode="after")
    def _check_watermarks(self) -> Self:
        _check_watermark_order(self.low_watermark, self.high_watermark)
        return self


class IoFaultsConfig(_Model):
    """Injected I/O faults, for tests only (a slow disk, a network filesystem answering ESTALE)."""

    write_delay_seconds: float = Field(
        default=0.0, ge=0, le=60, description="Sleep before each block write commits (its rename)."
    )
    rename_delay_seconds: float = Field(
        default=0.0,
        ge=0,
        le=60,
        description="Sleep inside each block write's commit, after its rename and before the index "
        "learns of it (a slow rename: a delete arriving meanwhile waits for the commit).",
    )
    read_error: Literal["ESTALE", "EIO", "ENOSPC"] | None = Field(
        default=None, description="Errno every block read of the tier raises."
    )
    read_delay_seconds: float = Field(
        default=0.0, ge=0, le=60, description="Sleep before each block read (a hung network filesystem)."
    )
    clock_skew_seconds: float = Field(
        default=0.0,
        ge=-1e9,
        le=1e9,
        description="On the shared tier: emulate a client-stamped filesystem on a machine whose clock is "
        "this far ahead — the server's clock and every timestamp it stamps on the volume are shifted.",
    )


class DiskTierConfig(_Model):
    """A directory tier of block files (local NVMe, or a shared volume several servers mount)."""

    path: Path = Field(description="Directory holding the tier's block files (created if missing).")
    capacity_bytes: int = Field(gt=0, description="Byte budget of the tier (block files incl. headers).")
    high_watermark: float = Field(
        default=0.9, gt=0, le=1, description="Fraction of capacity at which eviction starts."
    )
    low_watermark: float = Field(
        default=0.75, gt=0, lt=1, description="Fraction of capacity eviction brings usage down to."
    )
    min_free_fraction: float = Field(
        default=0.05,
        ge=0,
        lt=1,
        description="Never write when the filesystem itself has less than this fraction free, whatever "
        "the budget says (another tenant may share the disk).",
    )
    faults: IoFaultsConfig | None = Field(
        default=None, description="Test hook: injected I/O faults. Never set in production."
    )

    @model_validator(mode="after")
    def _check_watermarks(self) -> Self:
        _check_watermark_order(self.low_watermark, self.high_watermark)
        return self


class ExtraTierConfig(_Model):
    """A further tier below the built-in ones, built by a factory named in configuration.

    ``kind`` is ``package.module:callable``; the callable takes ``(TierContext, ExtraTierConfig)`` and
    returns a :class:`~kvfabric.cacheserver.engine.base.BackingTier` (see docs/cacheserver.md,
    "How to add a tier").
    """

    kind: str = Field(
        pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$",
        description="Factory of the tier, as 'package.module:callable'.",
    )
    capacity_bytes: int = Field(gt=0, description="Byte budget of the tier.")
    high_watermark: float = Field(default=0.9, gt=0, le=1, description="Fraction at which eviction starts.")
    low_watermark: float = Field(default=0.75, gt=0, lt=1, description="Fraction eviction brings usage to.")
    options: dict[str, Any] = Field(default_factory=dict, description="Passed to the factory as is.")

    @model_validator(mode="after")
    def _check_watermarks(self) -> Self:
        _check_watermark_order(self.low_watermark, self.high_watermark)
        return self


class ObjectStoreTierConfig(_Model):
    """An object-store tier speaking the S3 API, below (or instead of) the shared volume.

    One object per chunk under ``<prefix>/blocks/<namespace>/<bucket>/<key>``; servers learn each
    other's objects from journal segments under ``<prefix>/journal/`` (docs/cacheserver.md).
    """

    endpoint: str = Field(
        pattern=r"^https?://[^/\s]+/?$",
        description="S3 endpoint URL, e.g. 'https://s3.us-east-1.amazonaws.com' or 'http://minio.storage:9000'.",
    )
    bucket: str = Field(
        pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", description="Bucket holding the objects (must exist)."
    )
    prefix: str = Field(
        default="kvfabric",
        pattern=r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$",
        description="Key prefix of everything this pool writes (a pool per prefix).",
    )
    region: str = Field(default="us-east-1", min_length=1, description="Region used to sign requests.")
    path_style: bool = Field(
        default=True,
        description="Path-style requests (http://endpoint/bucket/key), which most S3-compatible servers "
        "need; false for virtual-hosted style (http://bucket.endpoint/key).",
    )
    access_key_id_file: Path | None = Field(
        default=None,
        description="File holding the access key id (a mounted Secret key); with secret_access_key_file. "
        "Both unset: the environment's AWS_* credentials.",
    )
    secret_access_key_file: Path | None = Field(
        default=None, description="File holding the secret access key (a mounted Secret key)."
    )
    ca_file: Path | None = Field(
        default=None, description="PEM CA bundle to verify the endpoint's TLS certificate (private CAs)."
    )
    capacity_bytes: int = Field(gt=0, description="Byte budget of the tier (objects incl. 4 KiB headers).")
    high_watermark: float = Field(
        default=0.9, gt=0, le=1, description="Fraction of capacity at which eviction starts."
    )
    low_watermark: float = Field(
        default=0.75, gt=0, lt=1, description="Fraction of capacity eviction brings usage down to."
    )
    checksum: Literal["sha256", "none"] = Field(
        default="sha256",
        description="S3 checksum header sent with every PUT (x-amz-checksum-sha256), verified by the "
        "server where it supports it; every read is verified with the block's own checksum regardless.",
    )
    part_bytes: int = Field(
        default=8 * MiB,
        ge=1 * MiB,
        description="Loads of larger objects are split into ranged GETs of this size, fetched in parallel.",
    )
    max_concurrent_gets: int = Field(default=16, gt=0, description="GET requests in flight at once.")
    max_concurrent_puts: int = Field(
        default=4, gt=0, description="PUT/COPY/DELETE requests in flight at once (write-back, refresh)."
    )
    max_pending_bytes: int = Field(
        default=512 * MiB,
        gt=0,
        description="Bytes waiting for write-back to the object store; beyond it a write-back is dropped "
        "and counted (the block stays in the tiers above).",
    )
    request_timeout_seconds: float = Field(
        default=10.0, gt=0, description="Timeout of one HTTP request (connect to last byte)."
    )
    connect_timeout_seconds: float = Field(default=2.0, gt=0, description="TCP/TLS connect timeout.")
    max_retries: int = Field(
        default=3,
        ge=0,
        le=10,
        description="Retries of a request that failed with 5xx (incl. 503 SlowDown), a timeout or a "
        "dropped connection, with exponential backoff and jitter.",
    )
    retry_timeout_seconds: float = Field(
        default=15.0, gt=0, description="No retry starts later than this after the first attempt."
    )
    failure_threshold: int = Field(
        default=3,
        gt=0,
        description="After this many consecutive failed requests the tier is skipped (lookups miss at "
        "once) for cooldown_seconds, so a dead or hung object store costs recomputes, not deadlines.",
    )
    cooldown_seconds: float = Field(default=5.0, gt=0, description="How long the tier is skipped.")
    journal_poll_seconds: float = Field(
        default=1.0, gt=0, description="How often other servers' journal segments are listed (one LIST)."
    )
    rescan_seconds: float = Field(
        default=600.0,
        gt=0,
        description="How often the index is rebuilt from a full listing (repairs missed journal entries).",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        _check_watermark_order(self.low_watermark, self.high_watermark)
        if any(seg in (".", "..") for seg in self.prefix.split("/")):
            raise ValueError(f"prefix ({self.prefix!r}) must not contain '.' or '..' segments")
        if (self.access_key_id_file is None) != (self.secret_access_key_file is None):
            raise ValueError("access_key_id_file and secret_access_key_file must be set together")
        return self


class TiersConfig(_Model):
    """The storage tiers, fastest first. DRAM is mandatory; the disk tiers are optional."""

    dram: DramTierConfig = Field(description="The DRAM tier.")
    local_disk: DiskTierConfig | None = Field(
        default=None, description="Node-local disk tier (LRU); null disables it."
    )
    shared: DiskTierConfig | None = Field(
        default=None,
        description="Shared-volume tier seen by several servers (evicted oldest bucket first); "
        "null disables it.",
    )
    object_store: ObjectStoreTierConfig | None = Field(
        default=None,
        description="Object-store (S3 API) tier below the disk tiers, shared by every server using the "
        "same bucket and prefix; null disables it.",
    )
    write_back: Literal["all", "none"] = Field(
        default="all",
        description="'all': every put is written back asynchronously to every lower tier; "
        "'none': keep puts in DRAM only.",
    )
    extra: list[ExtraTierConfig] = Field(
        default_factory=list,
        description="Further tiers below the shared volume, slowest last (e.g. an object store).",
    )

    @model_validator(mode="after")
    def _check_distinct_paths(self) -> Self:
        if self.local_disk is not None and self.shared is not None:
            a, b = self.local_disk.path.absolute(), self.shared.path.absolute()
            if a == b or a in b.parents or b in a.parents:
                raise ValueError(f"tiers.local_disk.path ({a}) and tiers.shared.path ({b}) must not overlap")
        return self


class LimitsConfig(_Model):
    """Request limits and backpressure."""

    max_payload_bytes: int = Field(
        default=128 * MiB, gt=0, description="Largest accepted chunk payload; larger is INVALID_ARGUMENT."
    )
    max_keys_per_request: int = Field(
        default=4096, gt=0, description="Most keys in one Lookup/Load/Store/Delete request."
    )
    max_concurrent_loads: int = Field(
        default=64, gt=0, description="Loads served at once; more wait for a slot until their deadline."
    )
    max_concurrent_stores: int = Field(
        default=8,
        gt=0,
        description="Stores accepted at once; a store beyond this is dropped and counted, never queued.",
    )
    store_queue_bytes: int = Field(
        default=2 * GiB,
        gt=0,
        description="Bytes of accepted puts waiting for write-back to the disk tiers; beyond it "
        "write-backs are dropped (the block stays in DRAM only).",
    )
    default_deadline_ms: int = Field(
        default=5000, gt=0, description="Deadline applied to a call whose client set none."
    )
    max_call_seconds: float = Field(
        default=60.0,
        gt=0,
        description="Server-side bound of a store stream, of a load stream (its writes included) and of "
        "any wait for a slot, whatever deadline the client asked for (or none): a trickling or stalled "
        "client cannot hold a slot longer.",
    )
    max_slots_per_peer: int | None = Field(
        default=None,
        gt=0,
        description="Load slots and store slots one client may hold at once: a TCP peer by its "
        "address, a Unix-socket client by the id kvfabric's client sends (kvfabric-client metadata; "
        "one without an id is capped only by the global limits). Default a quarter of each limit (at "
        "least 1), so a slow or stalled client cannot starve the others. Calls beyond it: loads "
        "RESOURCE_EXHAUSTED, stores dropped (docs/security.md, Starvation).",
    )
    max_resident_names_bytes: int = Field(
        default=256 * MiB,
        gt=0,
        description="Memory for the names (metadata) of resident chunks that the residency feed hands "
        "to same-node engines, restored ones included; beyond it the names attached longest ago are "
        "dropped (the chunk stays served, unannounced to routers until described again) and counted "
        'in kvfabric_residency_names_dropped{reason="memory_bound"}.',
    )
    io_threads: int = Field(default=4, gt=0, description="Threads doing disk I/O and checksums.")
    max_described_namespaces: int = Field(
        default=64,
        gt=0,
        le=4096,
        description="Namespace descriptions (Describe) kept and exported as kvfabric_namespace_info; "
        "beyond it the least recently used is forgotten (its client describes it again when told).",
    )


class ServerConfig(_Model):
    """Everything one cache server needs. The operator renders exactly this model."""

    server_id: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$",
        description="Name of this server on the shared volume (its journal and leases). "
        "Default: $NODE_NAME, else the hostname.",
    )
    listen: ListenConfig = Field(description="Listeners.")
    shm: ShmConfig = Field(
        default_factory=ShmConfig, description="Shared memory (store staging budget) for same-node clients."
    )
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Metrics and probes.")
    handover: HandoverConfig = Field(
        default_factory=HandoverConfig, description="Hand-over of DRAM between a server and its successor."
    )
    tiers: TiersConfig = Field(description="Storage tiers.")
    ttl_seconds: int = Field(
        default=86400, gt=0, description="Blocks not hit for about this long expire (whole buckets)."
    )
    bucket_seconds: int = Field(
        default=3600, gt=0, description="Width of one TTL bucket (directory) in seconds."
    )
    journal_poll_seconds: float = Field(
        default=0.25, gt=0, le=1, description="How often the other servers' journals are tailed."
    )
    janitor_interval_seconds: float = Field(
        default=5.0, gt=0, description="How often eviction, expiry and lease renewal run."
    )
    lease_seconds: float = Field(
        default=30.0,
        gt=0,
        description="A server whose lease on the shared volume is older than this is considered dead "
        "and loses its share of bucket expiry.",
    )
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Limits and backpressure.")

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field(
        default="INFO", description="Log level of the JSON logs on stderr."
    )

    @model_validator(mode="before")
    @classmethod
    def _upper_log_level(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("log_level"), str):
            data = {**data, "log_level": data["log_level"].upper()}
        return data

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.bucket_seconds > self.ttl_seconds:
            raise ValueError(
                f"bucket_seconds ({self.bucket_seconds}) must not exceed ttl_seconds ({self.ttl_seconds})"
            )
        if self.limits.max_payload_bytes > self.tiers.dram.capacity_bytes:
            raise ValueError(
                f"limits.max_payload_bytes ({self.limits.max_payload_bytes}) exceeds "
                f"tiers.dram.capacity_bytes ({self.tiers.dram.capacity_bytes}): no payload could be stored"
            )
        return self

    def resolved_server_id(self) -> str:
        """Return the server id: the configured one, else ``$NODE_NAME``, else the hostname."""
        sid = self.server_id or os.environ.get("NODE_NAME") or socket.gethostname()
        # Sanitize: the id becomes a file name on the shared volume.
        return "".join(c if c.isalnum() or c in "._-" else "_" for c in sid)[:200] or "server"

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> ServerConfig:
        """Load and validate a YAML file (the operator's ConfigMap key)."""
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a YAML mapping at the top level")
        return cls.model_validate(data)

    def to_yaml(self) -> str:
        """Render as YAML, as the operator writes it: only the fields that differ from their defaults.

        So a server of the previous release reads the configuration of a newer operator (or harness)
        as long as none of the newer fields is set: its model forbids fields it does not know.
        """
        return yaml.safe_dump(self.model_dump(mode="json", exclude_defaults=True), sort_keys=False)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_watermark_order(low: float, high: float) -> None:
    if not low < high:
        raise ValueError(f"low_watermark ({low}) must be below high_watermark ({high})")


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Return ``data`` with dotted-path ``overrides`` (``{"listen.tcp_port": 7071}``) applied.

    Used by the CLI: a flag such as ``--set tiers.dram.capacity_bytes=1073741824`` or a dedicated
    option overrides one leaf of the YAML before validation, so validation messages stay the same.
    """
    out: dict[str, Any] = _deep_copy(data)
    for dotted, value in overrides.items():
        node = out
        parts = dotted.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return out


def _deep_copy(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in d.items()}
