"""Connector settings: one documented object, read from the environment the operator injects.

Sources, highest priority first:

1. explicit keyword arguments (the vLLM connector passes ``kv_connector_extra_config`` here);
2. environment variables ``KVFABRIC_<FIELD>`` (what the operator's webhook injects);
3. a JSON or YAML file whose path is in ``KVFABRIC_SETTINGS_FILE``;
4. the defaults below.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, PrivateAttr, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from kvfabric.connector import payloadkey
from kvfabric.connector.payloadkey import PayloadKey
from kvfabric.contract.consumer_env import ENV_PREFIX
from kvfabric.contract.consumer_keys import SHARED_SCOPE

SETTINGS_FILE_ENV = f"{ENV_PREFIX}SETTINGS_FILE"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class _FileSource(PydanticBaseSettingsSource):
    """Read settings from the JSON/YAML file named by ``KVFABRIC_SETTINGS_FILE`` (if set)."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)
        self._values = self._read()

    @staticmethod
    def _read() -> dict[str, Any]:
        path = os.environ.get(SETTINGS_FILE_ENV)
        if not path:
            return {}
        text = Path(path).read_text(encoding="utf-8")
        # YAML is a superset of JSON, but json gives better errors for .json files.
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: settings file must hold a mapping, got {type(data).__name__}")
        # Accept both ``chunk_tokens`` and ``KVFABRIC_CHUNK_TOKENS`` spellings in the file.
        out: dict[str, Any] = {}
        for key, value in data.items():
            name = str(key)
            if name.upper().startswith(ENV_PREFIX):
                name = name[len(ENV_PREFIX) :]
            out[name.lower()] = value
        return out

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return {k: v for k, v in self._values.items() if k in self.settings_cls.model_fields}


class ConnectorSettings(BaseSettings):
    """How the connector reaches the cache server and how long it may wait for it.

    Every deadline bounds how much a request can be delayed by the cache: when it expires the
    connector gives up and the engine recomputes. A dead cache costs at most the deadlines, never a
    failed request.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    socket: str | None = None
    """Unix socket of the node-local cache server (``/run/kvfabric/cache.sock`` or ``unix:///...``).
    Bulk bytes then travel through shared memory (see ``shared_memory``)."""
    shared_memory: bool = True
    """With ``socket``: payloads move as sealed memfds the server hands out on its block socket
    (``<socket>.blocks``), one copy and no shared directory; False streams them over the socket."""
    remote: str | None = None
    """Optional ``host:port`` of a cache server reached over TCP when the socket is unusable."""
    token: str | None = None
    """Bearer token for the TCP listener (the Unix socket needs none)."""
    token_file: str | None = None
    """A file holding the bearer token instead (what the webhook injects: a projected Secret volume).
    Re-read when it changes, like the TLS files, so a rotated token applies without a restart."""
    tls_ca: str | None = None
    """CA bundle (path) to verify the TCP listener's certificate; plaintext when unset."""
    payload_key: str | None = Field(default=None, repr=False)
    """The pool's payload secret (the operator injects it from the pool's Secret into consumers of
    the pool's own namespace): chunks are sealed and verified with a keyed MAC whose key is derived
    from it and ``key_scope`` (``kvfabric.connector.payloadkey``). Without any key the MAC key is
    public, which detects corruption but not forgery."""
    payload_key_file: str | None = None
    """A file holding this consumer's scope key (64 hex characters), which the CSI node plugin
    publishes for pods of another namespace than the pool's. Read once; wins over ``payload_key``.
    A file that is missing, unreadable or malformed turns the cache off for the process (every
    request recomputes, one error logged), never the public key."""
    key_scope: str | None = None
    """This consumer's key scope: its Kubernetes namespace, or ``*`` when the pool's consumer
    namespaces share one key space. Part of the namespace digest; with ``payload_key`` it selects the
    scope key. Unset with ``payload_key``: the old, unscoped key (pods injected before scopes)."""
    tls_cert: str | None = None
    """Client certificate (PEM path) for a TCP listener that requires mutual TLS."""
    tls_key: str | None = None
    """Private key (PEM path) of ``tls_cert``."""
    chunk_tokens: int = Field(default=256, gt=0)
    """Tokens per chunk; must be a multiple of the engine's block size."""
    tenant: str = ""
    """Tenant name; part of the namespace, so tenants never share chunks."""
    model_revision: str = ""
    """Model revision to put in the namespace when the engine does not know it (vLLM: ``--revision``)."""
    lookup_deadline_ms: int = Field(default=100, gt=0)
    """Deadline of the scheduler-side prefix lookup. On expiry the request is a miss."""
    load_deadline_ms: int = Field(default=2000, gt=0)
    """Deadline of loading the hit chunks of one request; on expiry the engine recomputes them."""
    store_deadline_ms: int = Field(default=5000, gt=0)
    """Deadline of one background store; stores never block a request."""
    min_hit_tokens: int = Field(default=0, ge=0)
    """Hits shorter than this are reported as misses: for short prefixes the fixed cost of a load
    exceeds the prefill it saves (about 1-2k tokens on an H100)."""
    cost_model: bool = False
    """Opt-in (docs/performance.md, "Defaults"): load a hit only where restoring it is expected to
    beat recomputing it, by the prefill and restore costs measured as the engine runs (until both
    are measured, every hit is loaded); lookup and load deadlines then follow the expected prefill
    time (``lookup_deadline_ms`` and ``load_deadline_ms`` stay the ceilings). Skipped hits are
    counted as ``miss.recompute-faster``. False: load every hit, with the fixed deadlines."""
    tail: bool = True
    """No lost tail: store each prompt's partial last chunk, cut to whole engine blocks, as tail blocks
    (``keys.tail_keys``) and load the longest stored tail after the whole chunks, so the next round of
    a chat reuses everything the engine's block size allows; false: whole chunks only."""
    load_async: bool = False
    """Load hits in the background (vLLM: ``load_async=True``): the request waits for its KV while the
    engine keeps stepping the others, instead of the whole step waiting for the load; failed chunks
    are still recomputed. False: loads are synchronous (the step that computes the rest of the
    prompt waits for them)."""
    local_index: bool = True
    """Same node: answer lookups from the index the cache server publishes in shared memory (no call
    per lookup; a hung or dead server is "unavailable" in microseconds, and loads in flight notice it
    too); remote endpoints always use the RPC. The lookups answered this way are reported to the
    server in batches, so its lookup metrics and the pool's hit rate count them. False: every lookup
    is an RPC."""
    reply_floor_ms: float = Field(default=25.0, gt=0, le=500)
    """Same node, published index: the shortest wait for the server's first reply to a load before the
    load is given up (the request recomputes) and the server is suspect until its heartbeat says
    slow or hung; the wait is ``max(this, 4 x the client's recent p98 reply)``. Lower: a hung server
    costs less; higher: fewer false suspicions on a machine whose live server is sometimes that
    late (docs/connector.md, "Resilience")."""
    shm_mapping_cache_mb: int = Field(default=512, ge=0)
    """Same node, shared memory: keep the read-only mappings of loaded blocks across loads, up to this
    many MiB, so a hot prefix loaded again is one memcpy instead of a mapping built and torn down per
    block (about 3x the copy). The server holds those blocks in its DRAM budget until released, so
    memory use stays counted (docs/performance.md); keep it at most the server's
    ``shm.hold_bytes_per_client`` (1 GiB by default). 0: map every block afresh."""
    retries: int = Field(default=1, ge=0, le=5)
    """Extra attempts after an ``unavailable`` error, within the same deadline."""
    breaker_failures: int = Field(default=3, ge=1)
    """Consecutive timeouts/unavailable errors that open the circuit breaker of one endpoint."""
    breaker_cooldown_ms: int = Field(default=1000, gt=0)
    """How long an open breaker fails fast before one probe call is let through (a restarted server
    is used again this soon after it is back)."""
    breaker_max_cooldown_ms: int = Field(default=8000, gt=0)
    """Each failed probe doubles the cooldown up to this, so a server that stays hung costs one
    probe's deadline this often at most; a probe that succeeds resets it."""
    store_queue_bytes: int = Field(default=1 << 30, gt=0)
    """Host memory for saves: staging of this step's saves, of stores queued or running, and buffers
    kept for reuse. A save is reserved against it before its staging is allocated; one that does not
    fit is dropped (a future recompute), so a hung server holds the engine's save memory to this."""
    save_staging_warm_tokens: int = Field(default=8192, ge=0)
    """KV of this many tokens (rounded down to whole chunks, at most half of ``store_queue_bytes``) gets
    a save staging buffer when the engine registers its KV cache (start-up; its pages faulted in,
    about 0.3 s per GiB): the engine's first requests copy their saves into it instead of paying a
    page fault per 4 KiB on their step. 0: none (each first save allocates its own)."""
    enabled: bool = True
    """Kill switch: when false the connector reports no hits and stores nothing."""
    pool: str = ""
    """Name of the KVCachePool (informational; used in logs and metrics)."""
    config_hash: str = ""
    """Hash of the injected configuration (informational; lets the pool count stale pods)."""

    _key: tuple[tuple[str | None, str | None, str | None], PayloadKey] | None = PrivateAttr(default=None)

    @field_validator("socket")
    @classmethod
    def _strip_scheme(cls, value: str | None) -> str | None:
        if value and value.startswith("unix://"):
            value = value[len("unix://") :]
        if value and not value.startswith("/"):
            raise ValueError("socket must be an absolute path")
        return value or None

    @field_validator("key_scope")
    @classmethod
    def _check_key_scope(cls, value: str | None) -> str | None:
        if value and value != SHARED_SCOPE and not _DNS_LABEL.fullmatch(value):
            raise ValueError(f"key_scope must be a namespace name (a DNS label) or {SHARED_SCOPE!r}")
        return value or None

    @field_validator("remote")
    @classmethod
    def _check_remote(cls, value: str | None) -> str | None:
        if not value:
            return None
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError("remote must be host:port")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Explicit arguments > environment > settings file > defaults (no dotenv, no secrets dir)."""
        return (init_settings, env_settings, _FileSource(settings_cls))

    @classmethod
    def load(cls, overrides: dict[str, Any] | None = None) -> ConnectorSettings:
        """Build settings from the sources above; ``overrides`` (e.g. vLLM extra config) win.

        Keys in ``overrides`` may be spelled ``chunk_tokens`` or ``KVFABRIC_CHUNK_TOKENS``; unknown
        keys are ignored so that one extra-config dict can carry options for other components.
        """
        clean: dict[str, Any] = {}
        for key, value in (overrides or {}).items():
            name = key[len(ENV_PREFIX) :] if key.upper().startswith(ENV_PREFIX) else key
            if name.lower() in cls.model_fields:
                clean[name.lower()] = value
        return cls(**clean)

    @property
    def key(self) -> PayloadKey:
        """The payload key (:func:`kvfabric.connector.payloadkey.resolve`), resolved once per object.

        A key file is read once.
        """
        source = (self.payload_key, self.payload_key_file, self.key_scope)
        if self._key is None or self._key[0] != source:  # (a model_copy may have changed them)
            self._key = (source, payloadkey.resolve(*source))
        return self._key[1]

    @property
    def mac_key(self) -> bytes:
        """The 32-byte payload MAC key (see :attr:`key`).

        Never the public key when a key file is configured, even an unusable one.
        """
        return self.key.mac_key

    @property
    def configured(self) -> bool:
        """Whether any cache server is configured, and the configured payload key is usable."""
        return self.enabled and (self.socket is not None or self.remote is not None) and self.key.usable
