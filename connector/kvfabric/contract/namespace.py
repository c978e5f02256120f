"""The compatibility namespace's digest and its readable description: one definition for every side.

The connector derives a namespace from a ``NamespaceSpec`` (``kvfabric.connector.keys``) as the
SHA-256 of a canonical JSON document; it tells its cache server that document once per connection
(the ``Describe`` RPC), so the server can export which namespaces are in use and the operator can
show them in the pool's status. The server checks that the document hashes to the namespace it
describes: a description it cannot verify is refused, so what the status shows is what the
engines really use. Connector and server both call :func:`namespace_digest` from here, so they
cannot disagree about the canonical form.

Import-linter keeps this module free of every other kvfabric module (the cache server imports it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Final

KEY_SCHEME_VERSION: Final = 1
"""Format version of the key derivation itself (the ``scheme`` member of every canonical document).
Bumping it changes every namespace, which is the safe way to retire chunks written by an
incompatible connector."""

MAX_SPEC_BYTES: Final = 4096
"""Largest accepted description (a real one is about 500 bytes)."""
MAX_FIELDS: Final = 32
MAX_VALUE_CHARS: Final = 512

SpecValue = str | int
"""A description's values are strings and integers only: both survive a JSON round trip exactly, so
the server re-derives the canonical bytes the connector hashed."""

READABLE_FIELDS: Final[dict[str, str]] = {
    "model_id": "model",
    "model_revision": "revision",
    "kv_dtype": "dtype",
    "layout": "payload_layout",
    "kv_layout": "kv_layout",
    "device_type": "device",
    "attn_backend": "attn_backend",
    "num_layers": "layers",
    "num_kv_heads": "kv_heads",
    "head_dim": "head_dim",
    "block_size": "block_size",
    "chunk_tokens": "chunk_tokens",
    "tp_size": "tp_size",
    "tp_rank": "tp_rank",
    "lora": "lora",
    "tenant": "tenant",
    "payload_key_id": "payload_key_id",
    "key_scope": "key_scope",
    "payload_format": "payload_format",
    "scheme": "scheme",
}
"""Description member -> the label it is exported under (``kvfabric_namespace_info``) and the key in
the pool's ``status.cache.namespaces[].fields``. Members not listed (a newer connector's) still count
in the digest; they are just not exported."""


class InvalidDescriptionError(ValueError):
    """A namespace description that is malformed or does not hash to its namespace."""


def canonical(doc: Mapping[str, SpecValue]) -> bytes:
    """The canonical bytes of a description: JSON, sorted keys, no spaces, ASCII only."""
    return json.dumps(dict(doc), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def namespace_digest(doc: Mapping[str, SpecValue]) -> str:
    """The namespace a description names: SHA-256 of :func:`canonical`, 64 lower-case hex characters."""
    return hashlib.sha256(canonical(doc)).hexdigest()


def parse_description(namespace: str, spec_json: str | bytes) -> dict[str, SpecValue]:
    """Parse and verify a description of ``namespace`` (:class:`InvalidDescriptionError` if it is not one).

    It must be a JSON object of at most :data:`MAX_FIELDS` members, each a string (at most
    :data:`MAX_VALUE_CHARS` characters, no control characters) or an integer, with ``scheme`` equal to
    :data:`KEY_SCHEME_VERSION`, and its digest must equal ``namespace``.
    """
    raw = spec_json.encode() if isinstance(spec_json, str) else bytes(spec_json)
    if len(raw) > MAX_SPEC_BYTES:
        raise InvalidDescriptionError(f"description of {len(raw)} bytes exceeds {MAX_SPEC_BYTES}")
    try:
        doc = json.loads(raw, parse_float=_no_float, parse_constant=_no_float)
    except (ValueError, RecursionError) as exc:
        raise InvalidDescriptionError(f"description is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidDescriptionError("description must be a JSON object")
    if len(doc) > MAX_FIELDS:
        raise InvalidDescriptionError(f"description has {len(doc)} members, at most {MAX_FIELDS}")
    out: dict[str, SpecValue] = {}
    for key, value in doc.items():
        if len(key) > 64 or not key.isascii() or not key.isidentifier():
            raise InvalidDescriptionError(f"member name {key[:64]!r} is not an identifier")
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise InvalidDescriptionError(f"member {key!r} must be a string or an integer")
        if isinstance(value, str) and (
            len(value) > MAX_VALUE_CHARS or any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value)
        ):
            raise InvalidDescriptionError(f"member {key!r} is too long or holds control characters")
        out[key] = value
    if out.get("scheme") != KEY_SCHEME_VERSION:
        raise InvalidDescriptionError(f"scheme must be {KEY_SCHEME_VERSION}, got {out.get('scheme')!r}")
    got = namespace_digest(out)
    if got != namespace:
        raise InvalidDescriptionError(
            f"description hashes to {got[:12]}..., not to the namespace {namespace[:12]}..."
        )
    return out


def _no_float(text: str) -> SpecValue:
    raise InvalidDescriptionError(f"{text} is not a string or an integer")


def readable(doc: Mapping[str, SpecValue]) -> dict[str, str]:
    """The exported fields of a verified description (:data:`READABLE_FIELDS`), values as strings."""
    return {label: str(doc[key]) for key, label in READABLE_FIELDS.items() if key in doc}
