"""The consumer-environment contract: the ``KVFABRIC_*`` variables the operator injects into a pod.

Defined once, here, in a package with no dependencies, so that the operator (which writes them) and the
connector's ``ConnectorSettings`` (which reads them) cannot drift apart: the operator builds the
environment with :meth:`ConsumerEnvironment.to_env`; ``ConnectorSettings`` reads variables named
``ENV_PREFIX + <field name upper-cased>``; ``tests/operator/test_operator_consumer_env.py`` renders a
pool, injects a pod and parses the pod's environment with ``ConnectorSettings`` again.

Import-linter keeps this module free of every other kvfabric module (but the contract's own).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from kvfabric.contract.consumer_keys import KEY_FILE_NAME, scope_for

ENV_PREFIX: Final = "KVFABRIC_"

KEY_SCHEME: Final = "scoped-v1"
"""How consumers' payload keys are derived (``kvfabric.contract.consumer_keys``), part of the config
hash: a consumer injected under another scheme is stale."""

KEY_VOLUME_CONTENT: Final = "payload-key"
"""``volumeAttributes.content`` of the CSI inline volume that carries a consumer's scope key (the
socket volume has no ``content``); the node plugin writes :data:`KEY_FILE_NAME` into it."""
KEY_MOUNT_PATH: Final = "/var/run/kvfabric/key"
"""Where the webhook mounts that volume (read-only) in a consumer's containers."""
KEY_FILE_PATH: Final = f"{KEY_MOUNT_PATH}/{KEY_FILE_NAME}"
"""The value of ``KVFABRIC_PAYLOAD_KEY_FILE``: the scope key the plugin published."""
CONSUMER_KEYS_SECRET: Final = "kvfabric-consumer-keys"  # noqa: S105 - a Secret's name, not a secret
"""The Secret, in the operator's (and the CSI node plugin's) namespace, holding every pool's consumer
root (``encode_key(consumer_root(P))``) under :func:`consumer_keys_entry`: the operator writes it,
the plugin may get it and nothing else."""


def consumer_keys_entry(pool_namespace: str, pool: str) -> str:
    """The data key of a pool's consumer root in :data:`CONSUMER_KEYS_SECRET` (``<namespace>.<pool>``)."""
    return f"{pool_namespace}.{pool}"


class ConsumerVar(StrEnum):
    """Every variable the operator may inject; each names a ``ConnectorSettings`` field."""

    POOL = "KVFABRIC_POOL"
    SOCKET = "KVFABRIC_SOCKET"
    REMOTE = "KVFABRIC_REMOTE"
    CHUNK_TOKENS = "KVFABRIC_CHUNK_TOKENS"
    TENANT = "KVFABRIC_TENANT"
    LOOKUP_DEADLINE_MS = "KVFABRIC_LOOKUP_DEADLINE_MS"
    LOAD_DEADLINE_MS = "KVFABRIC_LOAD_DEADLINE_MS"
    STORE_DEADLINE_MS = "KVFABRIC_STORE_DEADLINE_MS"
    LOAD_ASYNC = "KVFABRIC_LOAD_ASYNC"
    LOCAL_INDEX = "KVFABRIC_LOCAL_INDEX"
    COST_MODEL = "KVFABRIC_COST_MODEL"
    CONFIG_HASH = "KVFABRIC_CONFIG_HASH"
    # Credentials: from the pool's Secret (secretKeyRef) or its Secret volume, never values in the
    # pod spec, and outside the hash (docs/security.md).
    PAYLOAD_KEY = "KVFABRIC_PAYLOAD_KEY"
    # The consumer's key scope (its namespace, or ``*`` for a pool whose consumers share one key
    # space): a plain value, outside the hash (it differs per consumer namespace, the hash is the
    # pool's). With PAYLOAD_KEY the connector derives its scope key itself.
    KEY_SCOPE = "KVFABRIC_KEY_SCOPE"
    # Consumers of another namespace than the pool's: the scope key itself, as a file the CSI node
    # plugin publishes (KEY_FILE_PATH); outside the hash like the other credentials.
    PAYLOAD_KEY_FILE = "KVFABRIC_PAYLOAD_KEY_FILE"
    TOKEN_FILE = "KVFABRIC_TOKEN_FILE"  # noqa: S105 - a variable name, not a secret
    TLS_CA = "KVFABRIC_TLS_CA"
    TLS_CERT = "KVFABRIC_TLS_CERT"
    TLS_KEY = "KVFABRIC_TLS_KEY"

    @property
    def field(self) -> str:
        """The settings field this variable sets (``KVFABRIC_LOAD_ASYNC`` -> ``load_async``)."""
        return self.value[len(ENV_PREFIX) :].lower()


def _flag(value: bool | None) -> str | None:
    """A boolean variable's value (``true``/``false``), or ``None`` (not injected) for ``None``."""
    return None if value is None else str(value).lower()


@dataclass(frozen=True)
class ConsumerEnvironment:
    """The values injected into a consumer; ``None`` means "not injected" (the connector's default)."""

    pool: str
    socket: str
    remote: str | None
    chunk_tokens: int
    tenant: str | None = None
    lookup_deadline_ms: int | None = None
    load_deadline_ms: int | None = None
    store_deadline_ms: int | None = None
    load_async: bool | None = None
    local_index: bool | None = None
    cost_model: bool | None = None
    shared_key_space: bool = False
    """The pool's consumer namespaces share one key space (``spec.consumers.keySpace: Shared``). Not a
    variable of its own (``KVFABRIC_KEY_SCOPE`` is set per pod: its namespace, or the shared scope),
    but part of the hash: consumers injected before the pool changed its key space are stale."""

    def to_env(self) -> dict[str, str]:
        """Return the variables without the hash, in a fixed order (the hash is over this mapping)."""
        values: list[tuple[ConsumerVar, str | int | None]] = [
            (ConsumerVar.POOL, self.pool),
            (ConsumerVar.SOCKET, self.socket),
            (ConsumerVar.REMOTE, self.remote),
            (ConsumerVar.CHUNK_TOKENS, self.chunk_tokens),
            # An empty tenant is the default tenant: not injected, so it does not change the hash.
            (ConsumerVar.TENANT, self.tenant or None),
            (ConsumerVar.LOOKUP_DEADLINE_MS, self.lookup_deadline_ms),
            (ConsumerVar.LOAD_DEADLINE_MS, self.load_deadline_ms),
            (ConsumerVar.STORE_DEADLINE_MS, self.store_deadline_ms),
            (ConsumerVar.LOAD_ASYNC, _flag(self.load_async)),
            (ConsumerVar.LOCAL_INDEX, _flag(self.local_index)),
            (ConsumerVar.COST_MODEL, _flag(self.cost_model)),
        ]
        return {var.value: str(value) for var, value in values if value is not None}

    @property
    def config_hash(self) -> str:
        """A short stable digest of :meth:`to_env` and the key scheme: another hash is stale.

        The key scheme is in it so that every consumer injected before key scopes existed (those of
        other namespaces sealed with the public key) is counted stale once, and restarted by whoever
        watches ``status.consumers.stale``.
        """
        hashed = self.to_env()
        hashed[ConsumerVar.KEY_SCOPE.value] = (
            f"{KEY_SCHEME}:{'shared' if self.shared_key_space else 'namespace'}"
        )
        return hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).hexdigest()[:16]

    def to_env_with_hash(self) -> dict[str, str]:
        """Return :meth:`to_env` plus ``KVFABRIC_CONFIG_HASH``."""
        return {**self.to_env(), ConsumerVar.CONFIG_HASH.value: self.config_hash}


def key_env(consumer_namespace: str, pool_namespace: str, *, shared: bool) -> dict[str, str]:
    """The key variables of a consumer in ``consumer_namespace`` (outside the hash: per namespace).

    Every consumer gets its scope (:func:`~kvfabric.contract.consumer_keys.scope_for`), which the
    connector names in its namespace digest. A consumer of another namespace than the pool's also
    gets the path of the key file the CSI node plugin publishes (it cannot read the pool's Secret);
    one of the pool's own namespace reads the pool secret (``KVFABRIC_PAYLOAD_KEY``, a
    ``secretKeyRef``) and derives its scope key itself.
    """
    env = {ConsumerVar.KEY_SCOPE.value: scope_for(consumer_namespace, shared=shared)}
    if consumer_namespace != pool_namespace:
        env[ConsumerVar.PAYLOAD_KEY_FILE.value] = KEY_FILE_PATH
    return env
