"""Chunk payloads: gather/scatter round trips for vLLM layouts, batched scatter, header checks."""

from __future__ import annotations

import pytest
import torch

from kvfabric.connector import layout

NS, KEY = "1" * 64, "2" * 64


def caches(
    shape: tuple[int, ...], layers: int = 3, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"l{i}": torch.randn(*shape, generator=g).to(dtype) for i in range(layers)}


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((10, 2, 4, 16), torch.float32),  # vLLM 0.33 logical [B, H, N, 2D]
        ((10, 2, 4, 16), torch.bfloat16),
        ((2, 10, 4, 2, 8), torch.float32),  # legacy FlashAttention [2, B, N, H, D]
    ],
)
def test_gather_then_scatter_round_trips(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    src = caches(shape, dtype=dtype)
    geo = layout.ChunkGeometry.from_kv_caches(src, block_size=4, chunk_tokens=8)
    assert geo.blocks_per_chunk == 2
    payload = geo.new_payload()
    for i, t in enumerate(src.values()):
        layout.gather_layer(geo, i, t, [7, 3], payload)
    layout.seal(payload, namespace=NS, key=KEY, num_tokens=8, num_layers=3)
    layout.verify(payload, namespace=NS, key=KEY, num_tokens=8, num_layers=3)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    for i, t in enumerate(dst.values()):
        layout.scatter_layer(geo, i, payload, t, [1, 5])
    bd = layout.block_dim_of(next(iter(src.values())))
    for k in src:
        assert torch.equal(dst[k].select(bd, 1), src[k].select(bd, 7))
        assert torch.equal(dst[k].select(bd, 5), src[k].select(bd, 3))
        assert torch.count_nonzero(dst[k].select(bd, 0)) == 0


def test_batched_scatter_equals_per_chunk_scatter() -> None:
    src = caches((20, 2, 4, 16))
    geo = layout.ChunkGeometry.from_kv_caches(src, block_size=4, chunk_tokens=8)
    chunks = [[0, 1], [2, 3], [4, 5]]
    staging = bytearray(len(chunks) * geo.payload_bytes)
    for c, ids in enumerate(chunks):
        view = memoryview(staging)[c * geo.payload_bytes : (c + 1) * geo.payload_bytes]
        for i, t in enumerate(src.values()):
            layout.gather_layer(geo, i, t, ids, view)
    targets = [[9, 8], [15, 10], [19, 11]]
    a = {k: torch.zeros_like(v) for k, v in src.items()}
    b = {k: torch.zeros_like(v) for k, v in src.items()}
    for i, t in enumerate(a.values()):
        layout.scatter_chunks(geo, i, staging, t, targets)
    for i, t in enumerate(b.values()):
        for c, ids in enumerate(targets):
            layout.scatter_layer(geo, i, memoryview(staging)[c * geo.payload_bytes :], t, ids)
    for k in src:
        assert torch.equal(a[k], b[k])
        assert torch.equal(a[k][9], src[k][0])
        assert torch.equal(a[k][11], src[k][5])


def test_partial_first_chunk() -> None:
    src = caches((6, 2, 4, 16), layers=1)
    geo = layout.ChunkGeometry.from_kv_caches(src, block_size=4, chunk_tokens=12)
    payload = geo.new_payload()
    layout.gather_layer(geo, 0, src["l0"], [0, 1, 2], payload)
    dst = torch.zeros_like(src["l0"])
    layout.scatter_layer(geo, 0, payload, dst, [4, 5], first_block=1)
    assert torch.equal(dst[4], src["l0"][1])
    assert torch.equal(dst[5], src["l0"][2])


def test_verify_rejects_damage_and_foreign_payloads() -> None:
    src = caches((4, 2, 4, 16), layers=1)
    geo = layout.ChunkGeometry.from_kv_caches(src, block_size=4, chunk_tokens=4)
    payload = geo.new_payload()
    layout.gather_layer(geo, 0, src["l0"], [2], payload)
    layout.seal(payload, namespace=NS, key=KEY, num_tokens=4, num_layers=1)
    cases = {
        "namespace-mismatch": {"namespace": "3" * 64, "key": KEY, "num_tokens": 4, "num_layers": 1},
        "corrupt": {"namespace": NS, "key": "4" * 64, "num_tokens": 4, "num_layers": 1},
    }
    for reason, kwargs in cases.items():
        with pytest.raises(layout.PayloadError) as err:
            layout.verify(payload, **kwargs)  # type: ignore[arg-type]
        assert err.value.reason == reason
    with pytest.raises(layout.PayloadError, match="shape"):
        layout.verify(payload, namespace=NS, key=KEY, num_tokens=8, num_layers=1)
    damaged = bytearray(payload)
    damaged[-1] ^= 1
    with pytest.raises(layout.PayloadError, match="checksum"):
        layout.verify(damaged, namespace=NS, key=KEY, num_tokens=4, num_layers=1)
    with pytest.raises(layout.PayloadError, match="shorter"):
        layout.verify(payload[:10], namespace=NS, key=KEY, num_tokens=4, num_layers=1)


def test_batched_gather_equals_per_chunk_gather() -> None:
    src = caches((20, 2, 4, 16))
    geo = layout.ChunkGeometry.from_kv_caches(src, block_size=4, chunk_tokens=8)
    chunks = [[3, 1], [0, 7], [12, 19]]
    a = bytearray(len(chunks) * geo.payload_bytes)
    b = bytearray(len(chunks) * geo.payload_bytes)
    for i, t in enumerate(src.values()):
        layout.gather_chunks(geo, i, t, chunks, a)
        for c, ids in enumerate(chunks):
            layout.gather_layer(
                geo, i, t, ids, memoryview(b)[c * geo.payload_bytes : (c + 1) * geo.payload_bytes]
            )
    assert a == b
    assert any(a)
