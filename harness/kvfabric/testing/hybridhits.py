"""What kvfabric should hit, store and load for a hybrid-attention model: the design's table, pure.

The real-vLLM tests compare vLLM's ``num_cached_tokens`` and kvfabric's per-kind byte counters with
these predictions, so they are written from the design, independently of the connector's code.

Notation: chunk ``C`` tokens; the scheduler block ``S`` (the least common multiple of the groups'
block sizes; ``C`` is a multiple of it); a stored request computed the KV of ``K`` tokens, so it
stored its whole chunks ``[cC, (c+1)C)`` for ``c < K // C`` and, of its partial last chunk, the
whole ``S``-token tail units up to ``K // S * S``. Each unit is stored once per *kind* of layer:

- ``full``: every block of the unit;
- ``sliding_window`` (window ``w``, block ``B``): the unit's trailing ``min(units/B, cdiv(w-1, B))``
  blocks: every block a later boundary can still see;
- ``chunked_local`` (attention chunk ``A``): the part of the unit inside the attention chunk still
  open at the unit's end, ``[max(start, end // A * A), end)`` (nothing when ``A`` divides ``end``).

A hit at boundary ``H`` above the engine's own hit ``L`` needs, per kind, every unit overlapping
``[L, H)`` (full), ``[max(L, H-w+1), H)`` (window) or ``[max(L, H // A * A), H)`` (local); the hit is
the largest unit end ``H <= n - 1`` (``n`` the prompt's tokens: one token is always computed) whose
units are all present. It reads, per kind, the whole objects of those units (each object carries
its own MAC, so it is read and verified whole: :func:`read_bytes`) and writes only the blocks
vLLM's table keeps real at ``H`` (:func:`loaded_bytes`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

__all__ = [
    "Kind",
    "Unit",
    "loaded_bytes",
    "object_blocks",
    "object_bytes",
    "objects_read",
    "predicted_hit",
    "read_bytes",
    "stored_bytes",
    "stored_units",
]

FULL, WINDOW, LOCAL = "full", "sliding_window", "chunked_local"


@dataclass(frozen=True)
class Kind:
    """One kind of layer, as the connector's counters label it.

    Its name (``full``, ``sliding_window``, ``chunked_local``), block size, how many layers, the
    bytes of one layer's block (vLLM's page), and its window or attention chunk.
    """

    name: str
    block: int
    layers: int
    page_bytes: int
    window: int | None = None
    attention_chunk: int | None = None

    def needed_from(self, local: int, boundary: int) -> int:
        """The first token a hit at ``boundary`` (engine hit ``local``) must restore for this kind."""
        if self.name == WINDOW:
            assert self.window is not None
            return max(local, boundary - self.window + 1)
        if self.name == LOCAL:
            assert self.attention_chunk is not None
            return max(local, boundary // self.attention_chunk * self.attention_chunk)
        return local

    def kept_blocks(self, start: int, end: int, local: int = 0) -> int:
        """Blocks of ``[start, end)`` (block-aligned) this kind keeps real at boundary ``end``."""
        first = max(start, self.needed_from(local, end))
        return max(0, end - first // self.block * self.block) // self.block if end > first else 0


Unit = tuple[int, int]
"""A stored unit: ``(start, end)`` tokens (a whole chunk or one tail unit)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def stored_units(computed: int, chunk: int, step: int) -> list[Unit]:
    """The units a request that computed the KV of ``computed`` tokens stored (``step`` = S)."""
    whole = computed // chunk * chunk
    units = [(s, s + chunk) for s in range(0, whole, chunk)]
    units += [(s, s + step) for s in range(whole, computed // step * step, step)]
    return units


def predicted_hit(
    prompt_tokens: int,
    units: Sequence[Unit],
    kinds: Sequence[Kind],
    *,
    local: int = 0,
    missing: Collection[tuple[str, Unit]] = (),
) -> int:
    """Tokens vLLM reports cached (``local`` + kvfabric's hit) for a prompt of ``prompt_tokens``.

    ``units`` are the stored units of the prompt's prefix; ``missing`` names ``(kind, unit)`` objects
    deleted since. Returns ``local`` when no boundary above it can be restored.
    """
    present = {u for u in units}
    ends = sorted({e for _, e in units if local < e <= prompt_tokens - 1}, reverse=True)
    for boundary in ends:
        if all(_restorable(kind, local, boundary, present, missing) for kind in kinds):
            return boundary
    return local


def _restorable(
    kind: Kind, local: int, boundary: int, present: set[Unit], missing: Collection[tuple[str, Unit]]
) -> bool:
    first = kind.needed_from(local, boundary)
    if first >= boundary:
        return True
    covered = first
    for unit in sorted(present):
        s, e = unit
        if e <= first or s >= boundary:
            continue
        if s > covered or (kind.name, unit) in missing:
            return False
        covered = e
    return covered >= boundary


def object_blocks(unit: Unit, kind: Kind) -> int:
    """Blocks per layer ``kind``'s object of ``unit`` holds (0: no object is stored)."""
    s, e = unit
    if kind.name == WINDOW:
        assert kind.window is not None
        return min((e - s) // kind.block, _cdiv(kind.window - 1, kind.block))
    if kind.name == LOCAL:
        assert kind.attention_chunk is not None
        return (e - max(s, e // kind.attention_chunk * kind.attention_chunk)) // kind.block
    return (e - s) // kind.block


def object_bytes(unit: Unit, kind: Kind, header: int = 0) -> int:
    """The payload of ``kind``'s object of ``unit``: its blocks of every layer, plus ``header`` bytes."""
    blocks = object_blocks(unit, kind)
    return blocks * kind.layers * kind.page_bytes + header if blocks else 0


def stored_bytes(units: Sequence[Unit], kind: Kind, header: int = 0) -> int:
    """Bytes kvfabric stores of ``kind`` for ``units`` (``header``: per object, on top of the KV)."""
    return sum(object_bytes(u, kind, header) for u in units)


def objects_read(units: Sequence[Unit], local: int, hit: int, kind: Kind) -> list[Unit]:
    """The units whose ``kind`` object a hit from ``local`` to ``hit`` reads (whole: each has one MAC)."""
    if hit <= local:
        return []
    first = kind.needed_from(local, hit)
    return [u for u in units if u[1] > first and u[0] < hit and object_blocks(u, kind) > 0]


def read_bytes(units: Sequence[Unit], local: int, hit: int, kind: Kind, header: int = 0) -> int:
    """Bytes a hit moves from the cache server for ``kind``: the whole objects it reads."""
    return sum(object_bytes(u, kind, header) for u in objects_read(units, local, hit, kind))


def loaded_bytes(local: int, hit: int, kind: Kind) -> int:
    """The design's KV bytes written into vLLM for ``kind`` by a hit from ``local`` to ``hit``."""
    if hit <= local:
        return 0
    return kind.kept_blocks(local, hit, local) * kind.layers * kind.page_bytes
