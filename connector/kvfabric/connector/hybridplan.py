"""Which objects a hybrid model's hit needs, loads and saves (pure; the scheduler half does the I/O).

A request's tokens are cut into *spans*: whole chunks of ``C`` tokens and, inside the chunk that
is not whole, tail blocks of ``S`` tokens (the scheduler block). A boundary ``H`` (a multiple of
``S``) is covered by the spans ``0..H//C - 1`` (whole) and the tail blocks ``1..(H % C)//S`` of
chunk ``H//C``. Each span has one object per kind of the :class:`~kvfabric.connector.groups.GroupPlan`
(none where the kind stores no block of it, see :meth:`~kvfabric.connector.groups.Kind.stored_blocks`).

A hit at ``H`` over a local prefix ``L`` is usable only if every kind can be restored there:
:func:`needed_objects` lists the objects that takes; the scheduler picks the largest candidate
whose objects are all present (like vLLM's own coordinator, right to left: full
attention is prefix-closed, sliding windows and local chunks are not), and :func:`load_objects`
checks the hit against the engine's block tables, never writing block 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvfabric.connector.groups import GroupPlan, KindType

NULL_BLOCK = 0
"""vLLM's null block: the id of every position a group does not keep."""


@dataclass(frozen=True)
class Span:
    """A whole chunk (``tail == 0``) or tail block ``tail`` (1-based) of chunk ``chunk``."""

    chunk: int
    tail: int
    start: int
    end: int


def spans_to(hit: int, chunk_tokens: int, block: int) -> list[Span]:
    """The spans covering ``[0, hit)`` (``hit`` a multiple of ``block``)."""
    whole = hit // chunk_tokens
    spans = [Span(c, 0, c * chunk_tokens, (c + 1) * chunk_tokens) for c in range(whole)]
    base = whole * chunk_tokens
    for j in range(1, (hit - base) // block + 1):
        spans.append(Span(whole, j, base + (j - 1) * block, base + j * block))
    return spans


def candidates(local: int, ceiling: int, chunk_tokens: int, block: int, *, tails: bool) -> list[int]:
    """Boundaries a hit may end on, largest first: multiples of ``block`` in ``(local, ceiling]``.

    Without tails only chunk ends.
    """
    step = block if tails else chunk_tokens
    top = ceiling // step * step
    return [h for h in range(top, local, -step) if h > local]


@dataclass(frozen=True)
class Need:
    """One object a hit needs: span ``span`` of kind ``kind``; ``first`` is the first token written."""

    span: Span
    kind: int
    first: int


def needed_objects(plan: GroupPlan, hit: int, local: int, chunk_tokens: int, block: int) -> list[Need]:
    """The objects a hit at ``hit`` over a local prefix ``local`` reads, kind after kind.

    Kind-major, spans ascending within a kind: a failed object then leaves every earlier object of
    its kind placed, and every block from it on is reported failed (the engine recomputes from the
    earliest failed position).
    """
    spans = spans_to(hit, chunk_tokens, block)
    out: list[Need] = []
    for k, kind in enumerate(plan.kinds):
        first = kind.needed_start(hit, local)
        for span in spans:
            if span.end <= first:
                continue
            if kind.stored_blocks(span.start, span.end) == 0:
                continue
            out.append(Need(span, k, max(first, span.start)))
    return out


@dataclass(frozen=True)
class ObjectLoad:
    """One object to load: its span and kind, blocks it holds per group, blocks skipped, targets."""

    span: Span
    kind: int
    stored: int
    skip: int
    block_ids: tuple[int, ...]
    """Per group of the kind (in order), the ``stored - skip`` engine blocks written."""


def load_objects(
    plan: GroupPlan,
    hit: int,
    local: int,
    chunk_tokens: int,
    block: int,
    *,
    tables: Sequence[Sequence[int]],
) -> tuple[list[ObjectLoad], str | None]:
    """The objects to write for a hit at ``hit`` over ``local``, with their target blocks.

    ``tables`` is the request's block table per vLLM group, as allocated for the hit. Returns the
    loads, or an empty list and the reason when the table contradicts the plan: a position the hit
    must write holds the null block, or a non-null block in ``[local, hit)`` is not covered (its
    bytes would be garbage the engine later reads or hashes).
    """
    loads: list[ObjectLoad] = []
    for need in needed_objects(plan, hit, local, chunk_tokens, block):
        kind = plan.kinds[need.kind]
        b = kind.block_size
        stored_from = kind.stored_start(need.span.start, need.span.end)
        if need.first < stored_from or need.first % b:
            return [], f"kind {need.kind} needs token {need.first}, its object holds from {stored_from}"
        ids: list[int] = []
        for g in kind.groups:
            table = tables[g] if g < len(tables) else ()
            for pos in range(need.first // b, need.span.end // b):
                bid = table[pos] if pos < len(table) else NULL_BLOCK
                if bid == NULL_BLOCK:
                    return [], f"group {g} holds the null block at position {pos}, which the hit writes"
                ids.append(int(bid))
        stored = (need.span.end - stored_from) // b
        loads.append(ObjectLoad(need.span, need.kind, stored, (need.first - stored_from) // b, tuple(ids)))
    # Every non-null block of [local, hit) must be written by some object.
    for k, kind in enumerate(plan.kinds):
        b = kind.block_size
        first = kind.needed_start(hit, local)
        for g in kind.groups:
            table = tables[g] if g < len(tables) else ()
            for pos in range(local // b, min(first // b, len(table))):
                if table[pos] != NULL_BLOCK:
                    return (
                        [],
                        f"group {g} (kind {k}) has block {table[pos]} at position {pos}, no object covers it",
                    )
    return loads, None


@dataclass(frozen=True)
class ObjectSave:
    """One object to save: its span and kind, blocks per group, and the engine blocks read."""

    span: Span
    kind: int
    stored: int
    block_ids: tuple[int, ...]


def save_objects(
    plan: GroupPlan,
    spans: Sequence[Span],
    tables: Sequence[Sequence[int]],
    states: Mapping[tuple[int, int], int] | None = None,
) -> tuple[list[ObjectSave], int]:
    """The objects of ``spans`` (computed this step) to save, kind after kind, from ``tables``.

    Returns the saves and how many objects were dropped because a block they read is the null
    block or missing from the table (never stored: a later hit would load someone else's bytes).
    A state kind's object is the checkpoint the engine handed over for the span's end, ``states``
    ``(group, tokens) -> block``, read by exact block id; a span without one has none.
    """
    saves: list[ObjectSave] = []
    dropped = 0
    for k, kind in enumerate(plan.kinds):
        b = kind.block_size
        if kind.type is KindType.STATE:
            for span in spans:
                held = [(states or {}).get((g, span.end)) for g in kind.groups]
                if all(h is not None and h != NULL_BLOCK for h in held):
                    saves.append(ObjectSave(span, k, 1, tuple(int(h) for h in held if h is not None)))
            continue
        for span in spans:
            stored = kind.stored_blocks(span.start, span.end)
            if stored == 0:
                continue
            first = kind.stored_start(span.start, span.end) // b
            ids: list[int] = []
            for g in kind.groups:
                table = tables[g] if g < len(tables) else ()
                ids += [int(table[p]) if p < len(table) else NULL_BLOCK for p in range(first, first + stored)]
            if NULL_BLOCK in ids:
                dropped += 1
                continue
            saves.append(ObjectSave(span, k, stored, tuple(ids)))
    return saves, dropped
