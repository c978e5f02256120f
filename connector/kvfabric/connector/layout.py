"""Chunk payloads: the byte format of one chunk, and gather/scatter against a paged KV cache.

A chunk payload is a fixed 128-byte header followed by the body. The body holds, for every layer in
registration order, the chunk's blocks of that layer's KV tensor exactly as the engine stores them
(vLLM 0.33 logical layout ``[blocks, kv_heads, block_size, head_k + head_v]``), i.e. a contiguous
``[layers, blocks, kv_heads, block_size, head_k + head_v]`` array. The cache server treats it as
opaque bytes; the header exists so that the connector can check, end to end, that a payload is the
chunk it asked for (namespace and key), of the expected shape, and authentic before a single byte
of it reaches the KV cache: the header ends with a keyed BLAKE3 MAC (the pool's secret key) over
the header fields and the body, so whoever can reach the cache server but lacks the key cannot
forge a payload that verifies, nor move a genuine one to another key or namespace.

The gather/scatter helpers index the block dimension of each layer tensor, so they work for any
stride permutation of that logical view (vLLM's LBHNC, LBNHC, ... physical orders) and for the
legacy FlashAttention shape ``[2, blocks, block_size, kv_heads, head]`` (block dimension 1).
"""

from __future__ import annotations

import hmac
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import torch

from kvfabric.connector.keys import PAYLOAD_FORMAT_VERSION

MAGIC = b"KVFC"
FORMAT_VERSION = PAYLOAD_FORMAT_VERSION
HEADER_SIZE = 128
# magic, version, flags, namespace, key, num_tokens, num_layers, body_len; then the 32-byte MAC.
_FIELDS = struct.Struct("<4sHH32s32sIIQ")
_MAC_SIZE = 32
MAC_KEY_SIZE = 32
# The key of payloads sealed without a configured pool key (tests, tools, a connector outside a
# pool): the MAC then detects corruption but not forgery. The operator injects a per-pool key.
PUBLIC_KEY = bytes(MAC_KEY_SIZE)
# Bodies at least this large are hashed by several threads (BLAKE3's tree mode; same digest).
_PARALLEL_BYTES = 4 << 20


class PayloadError(ValueError):
    """A payload failed verification; ``reason`` is ``corrupt`` or ``namespace-mismatch``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def block_dim_of(tensor: torch.Tensor) -> int:
    """Return the block dimension of a per-layer KV tensor (0 for vLLM >= 0.33, 1 for legacy FA)."""
    if tensor.dim() == 5 and tensor.shape[0] == 2:
        return 1
    return 0


def block_size_of(tensor: torch.Tensor) -> int:
    """Return the tokens per block of a per-layer KV tensor.

    Dimension 2 in both vLLM 0.33's ``[B, H, N, C]`` and the legacy ``[2, B, N, H, D]``; dimension 1
    in the legacy MLA ``[B, N, C]``.
    """
    if tensor.dim() == 3:
        return int(tensor.shape[1])
    return int(tensor.shape[2]) if tensor.dim() > 3 else 0


def in_blocks_of(tensor: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """``tensor`` viewed in blocks of ``block_size`` tokens, or None if it cannot be.

    vLLM splits a group's blocks into smaller *kernel blocks* when its attention backend needs them
    (``[num_blocks * k, H, block_size / k, C]``); block ``b`` is then kernel blocks ``b*k .. b*k+k-1``,
    so the view ``[num_blocks, k, H, block_size / k, C]`` indexes whole blocks on dimension 0.
    """
    if block_dim_of(tensor) != 0:
        return tensor if block_size_of(tensor) == block_size else None
    kernel = block_size_of(tensor)
    if kernel == block_size:
        return tensor
    if kernel <= 0 or block_size % kernel or tensor.shape[0] % (block_size // kernel):
        return None
    k = block_size // kernel
    return tensor.view(tensor.shape[0] // k, k, *tensor.shape[1:])


@dataclass(frozen=True)
class LayerGeometry:
    """Shape facts about one registered layer tensor."""

    name: str
    block_dim: int
    block_shape: tuple[int, ...]
    """Shape of ``tensor.select(block_dim, i)`` (one block)."""
    dtype: torch.dtype

    @property
    def block_numel(self) -> int:
        """Elements of one block of this layer."""
        n = 1
        for s in self.block_shape:
            n *= s
        return n

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of this layer."""
        return self.block_numel * self.dtype.itemsize


@dataclass(frozen=True)
class ChunkGeometry:
    """Byte geometry of a chunk payload for a set of registered layers."""

    layers: tuple[LayerGeometry, ...]
    blocks_per_chunk: int
    block_size: int

    @classmethod
    def from_kv_caches(
        cls, kv_caches: dict[str, torch.Tensor], *, block_size: int, chunk_tokens: int
    ) -> ChunkGeometry:
        """Describe the payload for ``kv_caches`` (layer name -> tensor, in forward order)."""
        if chunk_tokens % block_size:
            raise ValueError(f"chunk_tokens {chunk_tokens} is not a multiple of block_size {block_size}")
        layers = []
        for name, t in kv_caches.items():
            bd = block_dim_of(t)
            shape = list(t.shape)
            del shape[bd]
            layers.append(LayerGeometry(name, bd, tuple(shape), t.dtype))
        return cls(tuple(layers), chunk_tokens // block_size, block_size)

    @property
    def layer_bytes(self) -> list[int]:
        """Bytes of one chunk of each layer."""
        return [g.block_bytes * self.blocks_per_chunk for g in self.layers]

    @property
    def body_bytes(self) -> int:
        """Bytes of a chunk's body (all layers)."""
        return sum(self.layer_bytes)

    @property
    def payload_bytes(self) -> int:
        """Bytes of a whole payload (header + body)."""
        return HEADER_SIZE + self.body_bytes

    @property
    def chunk_tokens(self) -> int:
        """Tokens per chunk."""
        return self.blocks_per_chunk * self.block_size

    def layer_view(self, payload: bytearray | memoryview, layer: int, first_block: int = 0) -> torch.Tensor:
        """Return a tensor view of ``layer``'s blocks ``first_block..`` inside ``payload``'s body.

        The view has shape ``[blocks, *block_shape]`` and shares memory with ``payload``.
        """
        g = self.layers[layer]
        offset = HEADER_SIZE + sum(self.layer_bytes[:layer]) + first_block * g.block_bytes
        count = (self.blocks_per_chunk - first_block) * g.block_numel
        flat = torch.frombuffer(payload, dtype=g.dtype, count=count, offset=offset)
        return flat.view(self.blocks_per_chunk - first_block, *g.block_shape)

    def new_payload(self) -> bytearray:
        """Allocate a zeroed payload buffer."""
        return bytearray(self.payload_bytes)


# torch.frombuffer of a read-only buffer (a lent, sealed mapping) warns that torch has no read-only
# tensors; those tensors are only ever read. Installed once, at import: catch_warnings() per call is
# not thread-safe (background loads scatter beside the engine thread).
warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)


def _index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(block_ids), dtype=torch.long, device=device)


def gather_layer(
    geometry: ChunkGeometry,
    layer: int,
    kv_layer: torch.Tensor,
    block_ids: Sequence[int],
    payload: bytearray | memoryview,
) -> None:
    """Copy ``block_ids`` (one whole chunk) of ``kv_layer`` into ``payload``'s slot for ``layer``."""
    g = geometry.layers[layer]
    if len(block_ids) != geometry.blocks_per_chunk:
        raise ValueError(f"a chunk has {geometry.blocks_per_chunk} blocks, got {len(block_ids)}")
    dst = geometry.layer_view(payload, layer)
    index = _index(block_ids, kv_layer.device)
    if g.block_dim == 0 and kv_layer.device.type == "cpu" and kv_layer.dtype == dst.dtype:
        # One copy, straight into the payload (index_select + copy_ would make two).
        torch.index_select(kv_layer, 0, index, out=dst)
        return
    src = kv_layer.index_select(g.block_dim, index)
    if g.block_dim != 0:
        src = src.movedim(g.block_dim, 0)
    dst.copy_(src)


def scatter_layer(
    geometry: ChunkGeometry,
    layer: int,
    payload: bytearray | memoryview,
    kv_layer: torch.Tensor,
    block_ids: Sequence[int],
    *,
    first_block: int = 0,
) -> None:
    """Copy blocks ``first_block..`` of ``layer`` from ``payload`` into ``block_ids`` of ``kv_layer``."""
    g = geometry.layers[layer]
    if len(block_ids) != geometry.blocks_per_chunk - first_block:
        raise ValueError("block_ids do not match the chunk's remaining blocks")
    src = geometry.layer_view(payload, layer, first_block).to(kv_layer.device, non_blocking=True)
    kv_layer.index_copy_(g.block_dim, _index(block_ids, kv_layer.device), src.movedim(0, g.block_dim))


def _chunks_view(
    geometry: ChunkGeometry, layer: int, staging: bytearray | memoryview, n: int
) -> torch.Tensor | None:
    """Strided view of ``layer`` in ``n`` back-to-back payloads, or None if alignment forbids it."""
    g = geometry.layers[layer]
    item = g.dtype.itemsize
    offset = HEADER_SIZE + sum(geometry.layer_bytes[:layer])
    if g.block_dim != 0 or offset % item or geometry.payload_bytes % item:
        return None
    flat = torch.frombuffer(staging, dtype=g.dtype, count=n * geometry.payload_bytes // item)
    inner = torch.empty(g.block_shape, device="meta").stride()
    return flat.as_strided(
        (n, geometry.blocks_per_chunk, *g.block_shape),
        (geometry.payload_bytes // item, g.block_numel, *inner),
        offset // item,
    )


def gather_chunks(
    geometry: ChunkGeometry,
    layer: int,
    kv_layer: torch.Tensor,
    block_ids: Sequence[Sequence[int]],
    staging: bytearray | memoryview,
) -> None:
    """Copy ``layer`` of the chunks held in ``block_ids`` into back-to-back payloads in ``staging``.

    Two tensor operations per layer whatever the number of chunks (the per-chunk form spends more
    time in Python than copying).
    """
    n = len(block_ids)
    if n == 0:
        return
    view = _chunks_view(geometry, layer, staging, n)
    if view is None:
        for i, ids in enumerate(block_ids):
            part = memoryview(staging)[i * geometry.payload_bytes :][: geometry.payload_bytes]
            gather_layer(geometry, layer, kv_layer, ids, part)
        return
    index = torch.as_tensor([b for ids in block_ids for b in ids], dtype=torch.long, device=kv_layer.device)
    view.copy_(kv_layer.index_select(0, index).view(view.shape))


def scatter_chunks(
    geometry: ChunkGeometry,
    layer: int,
    staging: bytearray | memoryview,
    kv_layer: torch.Tensor,
    block_ids: Sequence[Sequence[int]],
) -> None:
    """Copy ``layer`` of the first ``len(block_ids)`` whole payloads in ``staging`` into ``kv_layer``.

    ``staging`` holds payloads back to back (``geometry.payload_bytes`` each). One indexed copy per
    layer instead of one per chunk: the source is a strided view that skips the headers and the
    other layers, so nothing is copied twice.
    """
    n = len(block_ids)
    if n == 0:
        return
    src = _chunks_view(geometry, layer, staging, n)
    if src is None:
        for i, ids in enumerate(block_ids):  # unusual layouts: one copy per chunk
            scatter_layer(
                geometry,
                layer,
                memoryview(staging)[i * geometry.payload_bytes :][: geometry.payload_bytes],
                kv_layer,
                ids,
            )
        return
    index = torch.as_tensor([list(ids) for ids in block_ids], dtype=torch.long, device=kv_layer.device)
    kv_layer.index_put_((index,), src.to(kv_layer.device, non_blocking=True))


def scatter_payload(
    geometry: ChunkGeometry,
    kv_layers: Sequence[torch.Tensor],
    payload: bytearray | memoryview,
    block_ids: Sequence[int],
    *,
    first_block: int = 0,
) -> None:
    """Copy every layer of one payload (blocks ``first_block..``) into ``block_ids`` of its KV tensor.

    For a payload that is not in a staging buffer with others (a lent mapping): one tensor over the
    payload and one index tensor for all layers, since building them per layer (as
    :func:`scatter_layer` does) costs about as much as the copy it saves (docs/performance.md).
    ``payload`` may be read-only: it is only read.
    """
    if len(block_ids) != geometry.blocks_per_chunk - first_block:
        raise ValueError("block_ids do not match the chunk's remaining blocks")
    if not block_ids:
        return
    whole = torch.frombuffer(payload, dtype=torch.uint8)  # may be read-only: see the filter above
    index: torch.Tensor | None = None
    offset = HEADER_SIZE
    for layer, (g, kv, size) in enumerate(zip(geometry.layers, kv_layers, geometry.layer_bytes, strict=True)):
        start = offset + first_block * g.block_bytes
        offset += size
        if start % g.dtype.itemsize:
            scatter_layer(geometry, layer, payload, kv, block_ids, first_block=first_block)
            continue
        if index is None or index.device != kv.device:
            index = torch.as_tensor(list(block_ids), dtype=torch.long, device=kv.device)
        src = whole[start:offset].view(g.dtype).view(-1, *g.block_shape).to(kv.device, non_blocking=True)
        if g.block_dim == 0:
            kv.index_put_((index,), src)
        else:
            kv.index_copy_(g.block_dim, index, src.movedim(0, g.block_dim))


def _mac(fields: bytes, body: memoryview, mac_key: bytes) -> bytes:
    if len(mac_key) != MAC_KEY_SIZE:
        raise ValueError(f"the payload MAC key must be {MAC_KEY_SIZE} bytes")
    threads = blake3.blake3.AUTO if len(body) >= _PARALLEL_BYTES else 1
    h = blake3.blake3(fields, key=mac_key, max_threads=threads)
    h.update(body)
    return h.digest()


def seal(
    payload: bytearray | memoryview,
    *,
    namespace: str,
    key: str,
    num_tokens: int,
    num_layers: int,
    mac_key: bytes = PUBLIC_KEY,
) -> None:
    """Write the header of ``payload`` (whose body is already filled), MAC'd with ``mac_key``."""
    body = memoryview(payload)[HEADER_SIZE:]
    fields = _FIELDS.pack(
        MAGIC,
        FORMAT_VERSION,
        0,
        bytes.fromhex(namespace),
        bytes.fromhex(key),
        num_tokens,
        num_layers,
        len(body),
    )
    header = fields + _mac(fields, body, mac_key)
    payload[: len(header)] = header
    payload[len(header) : HEADER_SIZE] = bytes(HEADER_SIZE - len(header))


def verify(
    payload: bytearray | memoryview,
    *,
    namespace: str,
    key: str,
    num_tokens: int,
    num_layers: int,
    mac_key: bytes = PUBLIC_KEY,
) -> None:
    """Raise :class:`PayloadError` unless ``payload`` is the authentic chunk ``key`` of ``namespace``."""
    view = memoryview(payload)
    if len(view) < HEADER_SIZE:
        raise PayloadError("corrupt", "payload shorter than its header")
    fields = bytes(view[: _FIELDS.size])
    magic, version, _flags, ns, k, tokens, layers, body_len = _FIELDS.unpack(fields)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise PayloadError("corrupt", "bad magic or format version")
    if ns != bytes.fromhex(namespace):
        raise PayloadError("namespace-mismatch", "payload belongs to another namespace")
    if k != bytes.fromhex(key):
        raise PayloadError("corrupt", "payload belongs to another key")
    if tokens != num_tokens or layers != num_layers or body_len != len(view) - HEADER_SIZE:
        raise PayloadError("corrupt", "payload shape does not match this engine")
    want = view[_FIELDS.size : _FIELDS.size + _MAC_SIZE]
    if any(view[_FIELDS.size + _MAC_SIZE : HEADER_SIZE]):
        raise PayloadError("corrupt", "non-zero header padding")
    if not hmac.compare_digest(_mac(fields, view[HEADER_SIZE:], mac_key), want):
        raise PayloadError(
            "corrupt", "payload checksum (keyed MAC) mismatch: corrupt, or not sealed with this pool's key"
        )


def key_id(mac_key: bytes) -> str:
    """A public fingerprint of ``mac_key`` (part of the namespace, so a new key starts a fresh key space)."""
    if mac_key == PUBLIC_KEY:
        return ""
    return blake3.blake3(b"kvfabric payload key id", key=mac_key).hexdigest()[:16]
