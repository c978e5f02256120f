"""Chunking of token ids, chained chunk keys and the compatibility namespace (DESIGN.md section 3).

Everything here is a pure function of its arguments. Keys must be identical in every process and on
every host, so nothing depends on Python's ``hash()``, on ``PYTHONHASHSEED``, on dict order or on the
platform's byte order: token ids are encoded as fixed-width little-endian integers and the
namespace is hashed from a canonical JSON document with sorted keys.

- ``key_{-1} = H(namespace)``, where a consumer with a scope key chains from a keyed digest of the
  namespace instead (:func:`chain_namespace`)
- ``key_i = H(key_{i-1} || token_ids_i || extra_i)`` where ``token_ids_i`` is the i-th whole chunk
  and ``extra_i`` the canonical encoding of the request's other inputs that reach chunk ``i``
  (:func:`chunk_extras`: multimodal items, ``cache_salt``, prompt embeddings, the LoRA adapter),
  empty for a plain text request. ``token_ids_i`` has a fixed length (``chunk_tokens`` is in the
  namespace), so the boundary between tokens and extras is unambiguous.

``H`` is SHA-256 (32 bytes, lower-case hex on the wire and on disk).

A chunk that is not whole (the tail of a prompt) is cached as *tail blocks*, one engine block each,
keyed in their own domain (:func:`tail_keys`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvfabric.contract import namespace as nscontract

# The version lives with the digest in kvfabric.contract.namespace (the cache server verifies with it).
KEY_SCHEME_VERSION = nscontract.KEY_SCHEME_VERSION

PAYLOAD_FORMAT_VERSION = 2
"""Version of the chunk payload format (``kvfabric.connector.layout``): header and body layout."""

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# Token ids are encoded as unsigned 32-bit little-endian integers: every tokenizer in use has far
# fewer than 2**32 entries, and a fixed width makes the byte string unambiguous.
_TOKEN_MAX = 2**32 - 1


def is_hex64(value: str) -> bool:
    """Return whether ``value`` is a 64-character lower-case hex string (a key or a namespace)."""
    return _HEX64.fullmatch(value) is not None


@dataclass(frozen=True)
class NamespaceSpec:
    """Everything that changes the bytes of a KV chunk. Two engines share chunks iff these are equal.

    The fields are hashed in canonical form by :meth:`digest`; adding a field changes every digest,
    which is intended (old chunks simply become misses).
    """

    model_id: str
    """Model name or path as the engine loaded it, e.g. ``meta-llama/Llama-3.1-8B``."""
    model_revision: str
    """Model revision (commit hash or tag); weights with another revision produce other KV."""
    kv_dtype: str
    """Dtype or quantization of the KV cache, e.g. ``bfloat16``, ``float32``, ``fp8_e4m3``."""
    num_layers: int
    """Number of attention layers whose KV is in a chunk payload."""
    num_kv_heads: int
    """KV heads held by this rank."""
    head_dim: int
    """Size of one head (K and V each)."""
    block_size: int
    """Tokens per KV-cache block of the engine (a chunk is a whole number of blocks)."""
    chunk_tokens: int
    """Tokens per chunk."""
    layout: str = "kvfabric.chunk.v2/LBHNC"
    """Byte layout of the chunk payload (see ``kvfabric.connector.layout``)."""
    tp_size: int = 1
    """Tensor-parallel size; each rank stores its own slice until a rank-independent layout exists."""
    tp_rank: int = 0
    """Tensor-parallel rank of this worker."""
    lora: str = ""
    """An engine-wide LoRA adapter, empty for none. (vLLM's adapters are per request: they go into
    the key chain, see :class:`RequestInputs`, so one engine serves many adapters.)"""
    tenant: str = ""
    """Tenant: chunks of different tenants never mix, even for identical prompts."""
    payload_key_id: str = ""
    """Fingerprint of the payload MAC key (``layout.key_id``): chunks sealed under another key,
    e.g. before a rotation, are never even looked up, so they cannot shadow fresh stores."""
    key_scope: str = ""
    """The payload key's scope (``kvfabric.contract.consumer_keys``): the consumer's Kubernetes
    namespace, ``*`` for a pool whose consumer namespaces share one key space, empty without one. The
    key (so ``payload_key_id``) already differs per scope; this names the scope in the clear."""
    device_type: str = ""
    """Device type of the KV cache as the engine reports it (vLLM: ``cuda``, ``cpu``, ``xpu``...)."""
    attn_backend: str = ""
    """Attention backend that writes the KV cache, as the engine reports it (vLLM: ``FLASH_ATTN``,
    ``CPU_ATTN``...; ``auto:...`` names the platform whose automatic choice it is). Backends pack
    a block's interior differently: the same shape can hold other bytes."""
    kv_layout: str = ""
    """KV-cache layout as the engine reports it (vLLM 0.33: ``cache_config.kv_cache_layout``,
    e.g. ``LBHNC``; older: ``NHD``/``HND``)."""
    payload_format: int = PAYLOAD_FORMAT_VERSION
    """kvfabric's chunk payload format version."""
    groups: str = ""
    """The canonical group plan of a hybrid or sliding-window model
    (:meth:`kvfabric.connector.groups.GroupPlan.document`: per kind its spec, window or attention
    chunk, block size, page bytes and layers), empty for one full-attention group. A model served
    with and without vLLM's hybrid KV cache manager keeps other blocks, so lands in another
    namespace. ``block_size`` is then the scheduler block (the groups' least common multiple)."""

    def __post_init__(self) -> None:
        if self.chunk_tokens <= 0 or self.block_size <= 0 or self.chunk_tokens % self.block_size:
            raise ValueError(
                f"chunk_tokens ({self.chunk_tokens}) must be a positive multiple of block_size "
                f"({self.block_size})"
            )
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")

    def document(self) -> dict[str, str | int]:
        """The description that :meth:`digest` hashes (what the connector tells its cache server).

        An empty ``key_scope`` is left out, so an unscoped consumer keeps the digest it had before
        key scopes existed (and shares its chunks with consumers not yet upgraded); so is an empty
        ``groups`` (a model with one full-attention group keeps its namespace and keys).
        """
        doc: dict[str, str | int] = {"scheme": KEY_SCHEME_VERSION, **asdict(self)}
        if not self.key_scope:
            del doc["key_scope"]
        if not self.groups:  # one full-attention group: the digest it always had
            del doc["groups"]
        return doc

    def canonical(self) -> bytes:
        """Return the canonical byte encoding that :meth:`digest` hashes."""
        return nscontract.canonical(self.document())

    def digest(self) -> str:
        """Return the namespace: SHA-256 of :meth:`canonical`, 64 lower-case hex characters.

        The same function the cache server verifies a description with
        (:func:`kvfabric.contract.namespace.namespace_digest`).
        """
        return nscontract.namespace_digest(self.document())


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Encode token ids as fixed-width unsigned 32-bit little-endian integers.

    Raises ``ValueError`` for ids outside ``[0, 2**32)``, which no tokenizer produces: failing loudly
    is better than silently aliasing two prompts.
    """
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as exc:
        bad = next((t for t in token_ids if not 0 <= t <= _TOKEN_MAX), None)
        raise ValueError(f"token id {bad!r} cannot be encoded as uint32") from exc


def num_whole_chunks(num_tokens: int, chunk_tokens: int) -> int:
    """Return how many whole chunks ``num_tokens`` tokens contain (stores cache only whole chunks)."""
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    return max(num_tokens, 0) // chunk_tokens


def num_loadable_chunks(num_prompt_tokens: int, chunk_tokens: int) -> int:
    """Return how many leading chunks of a prompt may be *loaded*.

    At least one prompt token is always recomputed, because the engine needs a forward pass over
    it to produce the first output's logits; so a prompt of exactly ``k * chunk_tokens`` tokens can
    load at most ``k - 1`` chunks.
    """
    return num_whole_chunks(num_prompt_tokens - 1, chunk_tokens)


def chunk_token_ids(token_ids: Sequence[int], chunk_tokens: int) -> list[Sequence[int]]:
    """Split ``token_ids`` into whole chunks of ``chunk_tokens``; a partial tail is dropped."""
    n = num_whole_chunks(len(token_ids), chunk_tokens)
    return [token_ids[i * chunk_tokens : (i + 1) * chunk_tokens] for i in range(n)]


@dataclass(frozen=True)
class MultiModalSpan:
    """One multimodal item of a prompt: its content hash and the placeholder tokens it fills."""

    identifier: str
    """The item's content hash as the engine computes it (vLLM: ``mm_feature.identifier``)."""
    offset: int
    """Index of its first placeholder token in the prompt."""
    length: int
    """Number of placeholder tokens."""


@dataclass(frozen=True)
class RequestInputs:
    """A request's inputs, besides its token ids, that change its KV (vLLM's block-hash extra keys).

    Placeholder tokens look the same for every image, a LoRA adapter changes every K and V, a
    ``cache_salt`` isolates users from each other, and a prompt given as embeddings has no
    meaningful token ids at all: each of these must be in the keys, or two requests that differ
    would share chunks.
    """

    mm: tuple[MultiModalSpan, ...] = ()
    """Multimodal items, sorted by offset."""
    cache_salt: str | None = None
    """The request's ``cache_salt``."""
    lora: tuple[str, ...] | None = None
    """Identity of the LoRA adapter (vLLM: name, id and path), ``None`` for the base model."""
    prompt_embeds: memoryview | None = None
    """The prompt embeddings as bytes, one row of ``prompt_embeds_row_bytes`` per token."""
    prompt_embeds_row_bytes: int = 0

    @property
    def plain(self) -> bool:
        """True for a plain token-id prompt (no extras: the keys are the plain chain)."""
        return not self.mm and self.cache_salt is None and self.lora is None and self.prompt_embeds is None


def _encode_extra(items: list[list[object]]) -> bytes:
    if not items:
        return b""
    return json.dumps(items, separators=(",", ":"), ensure_ascii=True).encode()


def chunk_extras(inputs: RequestInputs, chunk_tokens: int, num_chunks: int) -> list[bytes]:
    """Return ``extra_i`` for chunks ``0..num_chunks-1``, following vLLM's block-hash extra keys.

    Like vLLM's ``generate_block_hash_extra_keys`` (v0.33, per block; here per chunk): the LoRA
    adapter goes into every chunk; a multimodal item goes into every chunk its placeholder span
    overlaps, with its offset relative to the chunk's start (the same item at another position is
    another key); ``cache_salt`` goes into the first chunk only (the chain carries it into every
    later key); prompt embeddings go in as the SHA-256 of the chunk's rows.
    """
    return [span_extra(inputs, i * chunk_tokens, (i + 1) * chunk_tokens) for i in range(num_chunks)]


def span_extra(inputs: RequestInputs, start: int, end: int) -> bytes:
    """Return the canonical encoding of the ``inputs`` that reach tokens ``[start, end)``.

    The rule of :func:`chunk_extras` for any span (a chunk, or one tail block): the LoRA adapter
    always; each multimodal item the span overlaps, with its offset relative to ``start``;
    ``cache_salt`` when the span starts the prompt; the SHA-256 of the span's embedding rows.
    """
    items: list[list[object]] = []
    if inputs.lora is not None:
        items.append(["lora", *inputs.lora])
    for span in inputs.mm:
        if span.offset < end and start < span.offset + span.length:
            items.append(["mm", span.identifier, span.offset - start])
    if inputs.cache_salt is not None and start == 0:
        items.append(["salt", inputs.cache_salt])
    if inputs.prompt_embeds is not None:
        row = inputs.prompt_embeds_row_bytes
        rows = inputs.prompt_embeds[start * row : end * row]
        items.append(["embeds", hashlib.sha256(rows).hexdigest()])
    return _encode_extra(items)


def extend_chunk_keys(
    namespace: str,
    token_ids: Sequence[int],
    chunk_tokens: int,
    keys: Sequence[str],
    *,
    inputs: RequestInputs | None = None,
) -> list[str]:
    """Return ``keys`` (the leading chunk keys of ``token_ids``) extended to all its whole chunks.

    Equal to ``chunk_keys(namespace, token_ids, chunk_tokens, inputs=inputs)`` when ``keys`` is a
    prefix of it, at the cost of hashing only the new chunks (tokens that arrive as the engine
    generates them).
    """
    n = num_whole_chunks(len(token_ids), chunk_tokens)
    out = list(keys)
    if n <= len(out):
        return out
    prev = bytes.fromhex(out[-1]) if out else root_key(namespace)
    plain = inputs is None or inputs.plain
    for i in range(len(out), n):
        start, end = i * chunk_tokens, (i + 1) * chunk_tokens
        h = hashlib.sha256(prev)
        h.update(encode_tokens(token_ids[start:end]))
        if not plain:
            assert inputs is not None
            h.update(span_extra(inputs, start, end))
        prev = h.digest()
        out.append(prev.hex())
    return out


def chunk_keys(
    namespace: str,
    token_ids: Sequence[int],
    chunk_tokens: int,
    *,
    max_chunks: int | None = None,
    inputs: RequestInputs | None = None,
) -> list[str]:
    """Return the chained keys of the whole chunks of ``token_ids`` under ``namespace``.

    Key ``i`` commits to the namespace, to every token of chunks ``0..i`` and to the request's
    ``inputs`` that reach them, so equal keys mean equal prefixes (up to SHA-256 collisions) and a
    lookup of the leading keys finds the longest stored prefix. ``max_chunks`` stops early (no need
    to hash chunks that could never be used).
    """
    if not is_hex64(namespace):
        raise ValueError("namespace must be 64 lower-case hex characters")
    n = num_whole_chunks(len(token_ids), chunk_tokens)
    if max_chunks is not None:
        n = min(n, max(max_chunks, 0))
    extras = chunk_extras(inputs, chunk_tokens, n) if inputs is not None and not inputs.plain else None
    prev = hashlib.sha256(bytes.fromhex(namespace)).digest()
    keys: list[str] = []
    for i in range(n):
        h = hashlib.sha256(prev)
        h.update(encode_tokens(token_ids[i * chunk_tokens : (i + 1) * chunk_tokens]))
        if extras is not None:
            h.update(extras[i])
        prev = h.digest()
        keys.append(prev.hex())
    return keys


TAIL_DOMAIN = hashlib.sha256(b"kvfabric tail block v1").digest()
"""Prefix of every tail-block preimage. A whole chunk's preimage starts with its parent key (a
SHA-256 output), so a tail key could only equal a chunk key if SHA-256 collided or some key were
this fixed digest: tails and chunks live in separate key domains."""


_CHAIN_LABEL = b"kvfabric chain root v1\0"


def chain_namespace(namespace: str, chain_key: bytes | None) -> str:
    """The namespace the chunk keys chain from: ``namespace``, or a keyed digest of it.

    With a consumer's scope key the chain starts at ``HMAC-SHA256(chain_key, label || namespace)``.
    The namespace digest travels to the cache server (descriptions, lookups, tables) and into its
    logs; with a keyed chain, knowing it is not enough to compute a consumer namespace's chunk keys for
    a guessed prompt, so nobody without the key can look up or load that namespace's prefixes.
    """
    if not is_hex64(namespace):
        raise ValueError("namespace must be 64 lower-case hex characters")
    if chain_key is None:
        return namespace
    return hmac.new(chain_key, _CHAIN_LABEL + bytes.fromhex(namespace), hashlib.sha256).hexdigest()


def root_key(namespace: str) -> bytes:
    """Return ``key_{-1} = H(namespace)``, the parent of chunk 0 (and of chunk 0's tail blocks)."""
    if not is_hex64(namespace):
        raise ValueError("namespace must be 64 lower-case hex characters")
    return hashlib.sha256(bytes.fromhex(namespace)).digest()


def tail_keys(
    namespace: str,
    token_ids: Sequence[int],
    chunk_tokens: int,
    block_size: int,
    *,
    chunk: int,
    parent: str | None,
    max_blocks: int | None = None,
    inputs: RequestInputs | None = None,
) -> list[str]:
    """Return the keys of the tail blocks of chunk ``chunk``: the partial chunk, block by block.

    A chunk that is not whole is cached as a chain of single-block *tail blocks*:
    ``tail_1 = H(TAIL_DOMAIN || parent || 1 || tokens of block 1 || extra_1)`` and
    ``tail_j = H(TAIL_DOMAIN || tail_{j-1} || j || tokens of block j || extra_j)``, where ``parent``
    is the key of chunk ``chunk - 1`` (``None`` for chunk 0: ``H(namespace)``), ``j`` a ``uint32``
    (the tail's length in blocks) and ``extra_j`` the inputs that reach block ``j``
    (:func:`span_extra`). Tail key ``j`` therefore commits to the whole prefix before the chunk and
    to exactly the ``j * block_size`` token ids of the tail, so a tail of another length, of other
    tokens or behind another prefix is another key, and the domain tag keeps every tail key apart
    from every chunk key. Because they chain, one prefix lookup of ``tail_1..tail_B`` finds the
    longest stored tail of at most ``B`` blocks.

    At most ``chunk_tokens // block_size - 1`` keys (a tail is shorter than its chunk: a chunk with
    all its blocks is cached whole), and no more than the tokens present cover, nor ``max_blocks``.
    """
    if chunk_tokens <= 0 or block_size <= 0 or chunk_tokens % block_size:
        raise ValueError("chunk_tokens must be a positive multiple of block_size")
    begin = chunk * chunk_tokens
    n = min(chunk_tokens // block_size - 1, max(len(token_ids) - begin, 0) // block_size)
    if max_blocks is not None:
        n = min(n, max(max_blocks, 0))
    if parent is None:
        if chunk != 0:
            raise ValueError("only chunk 0 has no parent key")
        prev = root_key(namespace)
    else:
        if not is_hex64(parent):
            raise ValueError("parent must be a key (64 lower-case hex characters)")
        prev = bytes.fromhex(parent)
    plain = inputs is None or inputs.plain
    keys: list[str] = []
    for j in range(1, n + 1):
        start, end = begin + (j - 1) * block_size, begin + j * block_size
        h = hashlib.sha256(TAIL_DOMAIN)
        h.update(prev)
        h.update(struct.pack("<I", j))
        h.update(encode_tokens(token_ids[start:end]))
        if not plain:
            assert inputs is not None
            h.update(span_extra(inputs, start, end))
        prev = h.digest()
        keys.append(prev.hex())
    return keys
