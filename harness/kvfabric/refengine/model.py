"""A Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache.

Weights are drawn from a seeded generator, so two processes with the same :class:`ModelConfig` hold
bit-identical weights (the "model revision" of the namespace is the seed). Everything is fp32 on CPU.

The KV cache of each layer is one tensor in vLLM 0.33's logical layout
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` (K and V concatenated on the last
dimension), so the connector's gather/scatter code is the code that runs against vLLM.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name

# Query rows per attention call for suffix prefills: bounds the [rows, keys] mask to ~64 MiB at 32k.
_QUERY_CHUNK = 2048
# Rank of the toy LoRA adapters.
_LORA_RANK = 4


@dataclass(frozen=True)
class ModelConfig:
    """Shape and seed of the reference model."""

    vocab_size: int = 2048
    hidden: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    ffn: int = 384
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    seed: int = 0
    name: str = "kvfabric/ref-llama"

    @property
    def revision(self) -> str:
        """The model revision: weights are a pure function of the seed and the shape."""
        return f"seed-{self.seed}"

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers (fp32)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    def as_dict(self) -> dict[str, object]:
        """Plain-dict form (for logs and JSON)."""
        return asdict(self)


class LayerHooks(Protocol):
    """The per-layer connector calls vLLM makes around attention."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for ``layer_name``'s KV (called on entry to its attention)."""
        ...

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: object = None) -> None:
        """Save ``layer_name``'s KV (called on exit of its attention)."""
        ...


class _NoHooks:
    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: object = None) -> None:
        pass


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class RefModel:
    """The decoder weights and its paged-KV forward pass."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = c = config
        if c.num_heads % c.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        g = torch.Generator().manual_seed(c.seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(shape[0])

        self.embed = torch.randn(c.vocab_size, c.hidden, generator=g)
        self.layers = []
        for _ in range(c.num_layers):
            self.layers.append(
                {
                    "attn_norm": 1.0 + 0.1 * torch.randn(c.hidden, generator=g),
                    "wq": w(c.hidden, c.num_heads * c.head_dim),
                    "wk": w(c.hidden, c.num_kv_heads * c.head_dim),
                    "wv": w(c.hidden, c.num_kv_heads * c.head_dim),
                    "wo": w(c.num_heads * c.head_dim, c.hidden),
                    "mlp_norm": 1.0 + 0.1 * torch.randn(c.hidden, generator=g),
                    "w_gate": w(c.hidden, c.ffn),
                    "w_up": w(c.hidden, c.ffn),
                    "w_down": w(c.ffn, c.hidden),
                }
            )
        self.final_norm = torch.ones(c.hidden)
        self.lm_head = w(c.hidden, c.vocab_size)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        self._inv_freq = inv
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(c.num_layers)]
        self._lora: dict[str, list[dict[str, torch.Tensor]]] = {}

    def lora_weights(self, name: str) -> list[dict[str, torch.Tensor]]:
        """A toy LoRA adapter: per layer, low-rank deltas of the K and V projections.

        Seeded from the adapter's name, so two processes hold the same adapter; it changes every
        K and V, which is what makes an adapter part of a chunk's identity.
        """
        if name not in self._lora:
            c = self.config
            seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
            g = torch.Generator().manual_seed(seed)
            kv = c.num_kv_heads * c.head_dim
            self._lora[name] = [
                {
                    p: torch.randn(c.hidden, _LORA_RANK, generator=g)
                    @ torch.randn(_LORA_RANK, kv, generator=g)
                    / (c.hidden * _LORA_RANK) ** 0.5
                    for p in ("wk", "wv")
                }
                for _ in range(c.num_layers)
            ]
        return self._lora[name]

    def new_kv_caches(
        self, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32
    ) -> dict[str, torch.Tensor]:
        """Allocate the paged KV cache: one ``[blocks, kv_heads, block_size, 2*head_dim]`` per layer.

        ``dtype`` is the KV-cache dtype (compute stays fp32): a bfloat16 cache holds other bytes,
        so it is another namespace.
        """
        c = self.config
        return {
            name: torch.zeros(num_blocks, c.num_kv_heads, block_size, 2 * c.head_dim, dtype=dtype)
            for name in self.layer_names
        }

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, D]; rotate-half convention (Llama / HF).
        freqs = positions.to(torch.float64)[:, None] * self._inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    @torch.inference_mode()
    def forward(
        self,
        token_ids: Sequence[int],
        start: int,
        block_table: Sequence[int],
        kv_caches: dict[str, torch.Tensor],
        hooks: LayerHooks | None = None,
        *,
        lora: str | None = None,
    ) -> torch.Tensor:
        """Run tokens at positions ``start..start+len(token_ids)`` and return the last position's logits.

        Positions ``< start`` must already be in ``kv_caches`` (computed earlier or loaded by the
        connector). The new tokens' K and V are written into their slots first, then attention
        reads every position ``<= its own`` back from the paged cache.
        """
        c = self.config
        hk = hooks or _NoHooks()
        n_new = len(token_ids)
        end = start + n_new
        some_layer = kv_caches[self.layer_names[0]]
        block_size = some_layer.shape[2]
        positions = torch.arange(start, end)
        slot_block = torch.as_tensor(list(block_table), dtype=torch.long)[positions // block_size]
        slot_off = positions % block_size
        n_blocks = -(-end // block_size)
        table = torch.as_tensor(list(block_table[:n_blocks]), dtype=torch.long)
        h = self.embed[torch.as_tensor(list(token_ids), dtype=torch.long)]
        deltas = self.lora_weights(lora) if lora is not None else None
        for i, (name, p) in enumerate(zip(self.layer_names, self.layers, strict=True)):
            wk, wv = p["wk"], p["wv"]
            if deltas is not None:
                wk, wv = wk + deltas[i]["wk"], wv + deltas[i]["wv"]
            hk.wait_for_layer_load(name)
            kv = kv_caches[name]
            x = _rms_norm(h, p["attn_norm"], c.rms_eps)
            q = self._rope((x @ p["wq"]).view(n_new, c.num_heads, c.head_dim), positions)
            k = self._rope((x @ wk).view(n_new, c.num_kv_heads, c.head_dim), positions)
            v = (x @ wv).view(n_new, c.num_kv_heads, c.head_dim)
            kv[slot_block, :, slot_off] = torch.cat([k, v], dim=-1).to(kv.dtype)
            # Every key comes back out of the paged cache, loaded or computed alike.
            ctx = kv.index_select(0, table).permute(1, 0, 2, 3).reshape(c.num_kv_heads, -1, 2 * c.head_dim)
            ctx = ctx.to(torch.float32)
            keys, values = ctx[:, :end, : c.head_dim], ctx[:, :end, c.head_dim :]
            attn = self._attention(q.transpose(0, 1), keys, values, start)
            h = h + attn.transpose(0, 1).reshape(n_new, -1) @ p["wo"]
            hk.save_kv_layer(name, kv, None)
            x = _rms_norm(h, p["mlp_norm"], c.rms_eps)
            h = h + (F.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]
        last = _rms_norm(h[-1:], self.final_norm, c.rms_eps)
        return (last @ self.lm_head)[0]

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        # q: [H, T, D]; k, v: [Hkv, start+T, D]. Query row i sits at position start+i.
        n_new = q.shape[1]
        if start == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out = []
        for s in range(0, n_new, _QUERY_CHUNK):
            e = min(n_new, s + _QUERY_CHUNK)
            total = start + e
            mask = torch.ones(e - s, total, dtype=torch.bool).tril(diagonal=start + s)
            out.append(
                F.scaled_dot_product_attention(
                    q[:, s:e], k[:, :total], v[:, :total], attn_mask=mask, enable_gqa=True
                )
            )
        return torch.cat(out, dim=1)
