"""Payload keys per consumer namespace: every namespace that consumes a pool has a key space of its own.

A pool has one secret (its ``payload-key`` Secret, in the pool's namespace). Consumers never seal with
it directly: each consumer namespace gets a *scope key* derived from it, and seals, verifies and
names its chunks with that key (its fingerprint is part of the namespace digest). A pod in namespace
C therefore cannot compute the chunk keys of namespace B, and a chunk it seals never verifies for B:
a forged or foreign chunk is a miss, never a wrong answer.

- ``root = HMAC-SHA256(pool secret, "kvfabric consumer root v1")`` — what the operator hands the CSI
  node plugin (never the pool secret itself);
- ``scope key = HMAC-SHA256(root, "kvfabric consumer scope v1" NUL scope)`` — what a consumer
  uses, where ``scope`` is the consumer's Kubernetes namespace, or :data:`SHARED_SCOPE` when the pool
  explicitly shares one key space between all its consumer namespaces.

Consumers in the pool's own namespace read the pool secret and derive their scope key themselves;
consumers elsewhere get only their scope key, as a file the CSI node plugin publishes for their pod
(the kubelet, not the pod, tells the plugin the pod's namespace).

Pure functions; import-linter keeps this module free of every other kvfabric module.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Final

SHARED_SCOPE: Final = "*"
"""The scope of a pool whose consumer namespaces share one key space (``spec.consumers.keySpace: Shared``)."""

KEY_FILE_NAME: Final = "payload.key"
"""The file, in the key volume the CSI plugin publishes, that holds the consumer's scope key (hex)."""

_ROOT_LABEL: Final = b"kvfabric consumer root v1"
_SCOPE_LABEL: Final = b"kvfabric consumer scope v1\0"
_HEX_KEY = re.compile(r"[0-9a-f]{64}")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def consumer_root(pool_secret: str) -> bytes:
    """The 32-byte root every scope key of a pool is derived from (from the pool's payload secret)."""
    if not pool_secret:
        raise ValueError("the pool's payload secret is empty")
    return hmac.new(pool_secret.encode(), _ROOT_LABEL, hashlib.sha256).digest()


def scope_for(consumer_namespace: str, *, shared: bool) -> str:
    """The key scope of a consumer in ``consumer_namespace``: its namespace, or the shared scope."""
    if not _DNS_LABEL.fullmatch(consumer_namespace):
        raise ValueError(f"consumer namespace {consumer_namespace!r} is not a DNS label")
    return SHARED_SCOPE if shared else consumer_namespace


def scope_key(root: bytes, scope: str) -> bytes:
    """The 32-byte payload key of ``scope`` (a namespace name or :data:`SHARED_SCOPE`)."""
    if len(root) != 32:
        raise ValueError(f"a consumer root is 32 bytes, not {len(root)}")
    if scope != SHARED_SCOPE and not _DNS_LABEL.fullmatch(scope):
        raise ValueError(f"key scope {scope!r} is neither a DNS label nor {SHARED_SCOPE!r}")
    return hmac.new(root, _SCOPE_LABEL + scope.encode(), hashlib.sha256).digest()


def encode_key(key: bytes) -> str:
    """The text form of a root or scope key (64 lower-case hex characters, as files and Secrets hold it)."""
    if len(key) != 32:
        raise ValueError(f"a key is 32 bytes, not {len(key)}")
    return key.hex()


def decode_key(text: str) -> bytes:
    """Parse :func:`encode_key`'s form (surrounding whitespace allowed); ``ValueError`` otherwise."""
    stripped = text.strip()
    if not _HEX_KEY.fullmatch(stripped):
        raise ValueError("a key file holds 64 lower-case hex characters")
    return bytes.fromhex(stripped)
