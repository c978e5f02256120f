"""The payload MAC key a connector seals and verifies with, and the key scope it names.

Where the key comes from (``kvfabric.contract.consumer_keys`` has the derivations):

1. ``payload_key_file`` (a consumer of another namespace than its pool's): the file holds the scope
   key itself, published by the CSI node plugin for this pod's namespace; it is read once.
2. ``payload_key`` (the pool secret, in the pool's own namespace) and ``key_scope``: the scope key
   ``scope_key(consumer_root(P), scope)``.
3. ``payload_key`` alone (a pod injected before key scopes existed, or a hand-written config): the
   old derivation, ``sha256("kvfabric payload mac" NUL P)``, so nothing that works breaks.
4. no key and no scope (a hand-written config outside Kubernetes): the public all-zero key (damage
   is detected, forgery is not).

A scope without any key is a consumer the webhook wired (it names every consumer's scope) whose key
did not arrive: its pod started before the pool's Secret existed (the ``secretKeyRef`` is optional,
so that the pod starts at all), or the Secret under the pool's name is not the pool's. Such a
consumer never seals with the public key either: its key is unusable and the cache is off until the
pod restarts with its key (every request recomputes).

A configured key file that is missing, unreadable or malformed never falls back to the public key
(a consumer that silently sealed with it would share one key space with every other such consumer
of the pool): the key is then *unusable*, the connector turns the cache off for the process (every
request recomputes) and says so once, naming the file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Final

from kvfabric.contract.consumer_keys import consumer_root, decode_key, scope_key

log = logging.getLogger(__name__)

_LEGACY_LABEL: Final = b"kvfabric payload mac\0"
# layout.PUBLIC_KEY (not imported: settings, which imports this module, must load without torch).
PUBLIC_KEY: Final = bytes(32)
_MAX_KEY_FILE_BYTES: Final = 4096
# A key no other process has: what an unusable key's holder would seal with if anything bypassed
# the switched-off cache (nothing it writes verifies elsewhere, nothing it reads verifies here).
_PROCESS_KEY: Final = os.urandom(32)
_reported: set[str] = set()
_reported_lock = threading.Lock()


class PayloadKeyError(ValueError):
    """A configured payload key that cannot be used (the message names the file or the setting)."""


@dataclass(frozen=True)
class PayloadKey:
    """The resolved key: what to seal and verify with, and what the namespace says about it."""

    mac_key: bytes = field(repr=False)
    """The 32-byte MAC key (a process-local random key when :attr:`error` is set: never public)."""
    scope: str = ""
    """The key scope named in the namespace (``NamespaceSpec.key_scope``): the consumer namespace,
    ``*`` for a pool whose consumers share one key space, empty for the old derivation and none."""
    error: str | None = None
    """Why the configured key is unusable (the cache must then be off), or None."""
    keyed_chain: bool = False
    """Whether the chunk keys chain from a keyed digest of the namespace (``keys.chain_namespace``):
    for a scope key (from a key file, or the pool secret and a scope), not for the old unscoped key
    or none, whose chunk keys stay what they were."""

    @property
    def chain_key(self) -> bytes | None:
        """The key of the chunk-key chain (:attr:`keyed_chain`), or None for the public chain."""
        return self.mac_key if self.keyed_chain else None

    @property
    def usable(self) -> bool:
        """Whether chunks may be sealed and verified with this key (the cache may be used)."""
        return self.error is None


def legacy_mac_key(pool_secret: str) -> bytes:
    """The MAC key of a consumer configured with the pool secret and no scope (the old derivation)."""
    return hashlib.sha256(_LEGACY_LABEL + pool_secret.encode()).digest()


def derive(payload_key: str | None, key_scope: str | None) -> PayloadKey:
    """The key of a consumer given the pool secret and its scope (pure; no key file).

    ``ValueError`` for a scope that is neither a DNS label nor ``*``.
    """
    if not payload_key:
        if key_scope:
            # Wired with a scope, but the key is missing: the public key would put this consumer in
            # a key space anyone can compute and seal for. The cache is off instead.
            return PayloadKey(
                _PROCESS_KEY,
                scope=key_scope,
                error=f"key_scope {key_scope!r} is set but the pool's payload key is empty "
                "(KVFABRIC_PAYLOAD_KEY: the pool's Secret did not exist when the pod started, or is "
                "not the pool's); restart the pod once the pool is Ready",
            )
        # No key and no scope (a hand-written config): the public key, which detects damage, not
        # forgery.
        return PayloadKey(PUBLIC_KEY)
    if not key_scope:
        return PayloadKey(legacy_mac_key(payload_key))
    return PayloadKey(scope_key(consumer_root(payload_key), key_scope), scope=key_scope, keyed_chain=True)


def read_key_file(path: str) -> bytes:
    """The scope key in ``path`` (:func:`decode_key`'s form); :class:`PayloadKeyError` naming the file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise PayloadKeyError(f"payload key file {path} cannot be read: {exc.strerror or exc}") from None
    if len(raw) > _MAX_KEY_FILE_BYTES:
        raise PayloadKeyError(f"payload key file {path} is larger than {_MAX_KEY_FILE_BYTES} bytes")
    try:
        return decode_key(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise PayloadKeyError(
            f"payload key file {path} does not hold a key (64 lower-case hex characters)"
        ) from None


def resolve(payload_key: str | None, payload_key_file: str | None, key_scope: str | None) -> PayloadKey:
    """The key of a connector with these settings; an unusable key file is reported once per path.

    The key file wins over the pool secret: it is what the node plugin published for the namespace
    the kubelet says the pod is in.
    """
    if payload_key_file:
        try:
            return PayloadKey(read_key_file(payload_key_file), scope=key_scope or "", keyed_chain=True)
        except PayloadKeyError as exc:
            _report(payload_key_file, str(exc))
            return PayloadKey(_PROCESS_KEY, scope=key_scope or "", error=str(exc))
    key = derive(payload_key, key_scope)
    if key.error is not None:
        _report("KVFABRIC_PAYLOAD_KEY", key.error)
    return key


def _report(path: str, message: str) -> None:
    with _reported_lock:
        first = path not in _reported
        _reported.add(path)
    if first:
        log.error("kvfabric cache off for this process (every request recomputes): %s", message)
