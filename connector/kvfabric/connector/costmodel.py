"""Load or recompute, by measured cost: the connector's decision model (pure, no I/O, no clock).

A hit is only worth loading when restoring its KV is faster than recomputing it. Both costs depend
on the machine, the model and the prompt, so the model learns them from what the connector sees:

* **prefill**: each engine step's forward time against its work. Computing ``t`` tokens after ``s``
  tokens of context costs ``C(s, t) = alpha*t + beta*t*(s + t/2) + gamma`` (linear layers plus
  attention over the context plus a per-step constant). ``alpha, beta, gamma`` are a least-squares
  fit over a sliding window of steps; a step reports ``tokens = sum t`` and
  ``attention = sum t*(s + t/2)`` over its requests, so batched steps fit the same model.
* **restore**: each load's bytes and seconds, per tier: ``R = overhead + bytes / bandwidth``, fitted
  per tier over a sliding window.

Loading the first ``h`` tokens of a prompt saves ``C(0, n) - C(h, n - h) = alpha*h + beta*h^2/2``
(``gamma`` is paid either way) and costs ``R(h)``. :meth:`CostModel.plan` picks the number of chunks
with the largest expected gain, or none ("skipped: recompute faster"). Until a cost has been measured
the model loads everything (today's behaviour) and so measures it; and it keeps measuring a tier it
has stopped loading from, by loading anyway every ``explore_every``-th time it would skip (a tier
that got faster is noticed).

Deadlines follow from the same numbers: a lookup may cost a small fraction of the prefill it could
save (``lookup_deadline``), and a load no more than the time it is expected to save
(``load_deadline``), so a hung server costs a request a few milliseconds, not a fixed deadline.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["CostModel", "Plan", "PrefillSample", "RestoreSample", "least_squares"]


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One engine step: its computed tokens, attention work and forward seconds (restore excluded)."""

    tokens: int
    attention: float
    """``sum t*(s + t/2)`` over the step's requests (``t`` computed after ``s`` tokens of context)."""
    seconds: float

    @classmethod
    def single(cls, start: int, tokens: int, seconds: float) -> PrefillSample:
        """A step that computed ``tokens`` of one request after ``start`` tokens of context."""
        return cls(tokens, tokens * (start + tokens / 2), seconds)


@dataclass(frozen=True, slots=True)
class RestoreSample:
    """One load: bytes restored from ``tier`` (the slowest tier among its chunks) and its seconds."""

    tier: str
    nbytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Plan:
    """What to load of a hit: the leading ``chunks`` (0: recompute everything)."""

    chunks: int
    reason: str | None
    """None: load (or nothing was found); ``"recompute_faster"``: a hit was skipped."""
    expected_saved_s: float | None = None
    expected_restore_s: float | None = None
    explore: bool = False
    """Loaded although the model expects recompute to win: to keep measuring the tier."""


def least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float] | None:
    """Solve ``min |A x - y|`` by the normal equations (tiny systems); None if singular.

    Columns are scaled to unit maximum first: token counts, attention work (tokens squared) and the
    constant differ by eight orders of magnitude, which the normal equations would square.
    """
    if not rows:
        return None
    k = len(rows[0])
    norms = [max(abs(r[i]) for r in rows) or 1.0 for i in range(k)]
    a = [[r[i] / norms[i] for i in range(k)] for r in rows]
    ata = [[sum(r[i] * r[j] for r in a) for j in range(k)] for i in range(k)]
    aty = [sum(r[i] * y for r, y in zip(a, ys, strict=True)) for i in range(k)]
    # Gauss-Jordan elimination with partial pivoting on the augmented matrix.
    m = [[*ata[i], aty[i]] for i in range(k)]
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) <= 1e-10 * len(rows):
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(k):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, k + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][k] / m[i][i] / norms[i] for i in range(k)]


@dataclass
class _Prefill:
    window: int
    samples: deque[PrefillSample] = field(init=False)
    alpha: float | None = None
    beta: float = 0.0
    gamma: float = 0.0

    def __post_init__(self) -> None:
        self.samples = deque(maxlen=self.window)

    def add(self, s: PrefillSample) -> None:
        if s.tokens <= 0 or not s.seconds > 0 or not math.isfinite(s.seconds):
            return
        self.samples.append(s)
        self._fit()

    def _fit(self) -> None:
        xs = list(self.samples)
        ys = [s.seconds for s in xs]
        # The full model needs varied steps; fall back to fewer terms, keeping every coefficient >= 0
        # (a negative one is noise, and would make long prompts look free to recompute).
        for cols in ((0, 1, 2), (0, 1), (0, 2), (0,)):
            if len({s.tokens for s in xs}) < len(cols):
                continue
            rows = [[(s.tokens, s.attention, 1.0)[c] for c in cols] for s in xs]
            sol = least_squares(rows, ys)
            if sol is None or any(v < 0 for v in sol) or sol[0] <= 0:
                continue
            coef = dict(zip(cols, sol, strict=True))
            self.alpha, self.beta, self.gamma = coef[0], coef.get(1, 0.0), coef.get(2, 0.0)
            return
        total_t = sum(s.tokens for s in xs)
        self.alpha, self.beta, self.gamma = sum(ys) / total_t, 0.0, 0.0

    def saved(self, start: int, end: int) -> float | None:
        """Seconds of prefill that loading tokens [start, end) saves (None until measured)."""
        if self.alpha is None or end <= start:
            return None if self.alpha is None else 0.0
        # C(0, end) - C(0, start) ignoring gamma: alpha*(end-start) + beta*(end^2 - start^2)/2.
        return self.alpha * (end - start) + self.beta * (end * end - start * start) / 2

    def seconds(self, start: int, tokens: int) -> float | None:
        """Expected forward seconds for ``tokens`` computed after ``start`` tokens of context."""
        if self.alpha is None:
            return None
        return self.alpha * tokens + self.beta * tokens * (start + tokens / 2) + self.gamma


@dataclass
class _Restore:
    window: int
    samples: deque[RestoreSample] = field(init=False)
    overhead: float = 0.0
    seconds_per_byte: float | None = None

    def __post_init__(self) -> None:
        self.samples = deque(maxlen=self.window)

    def add(self, s: RestoreSample) -> None:
        if s.nbytes <= 0 or not s.seconds > 0 or not math.isfinite(s.seconds):
            return
        self.samples.append(s)
        xs = list(self.samples)
        if len({s.nbytes for s in xs}) >= 2:
            sol = least_squares([[s.nbytes, 1.0] for s in xs], [s.seconds for s in xs])
            if sol is not None and sol[0] > 0 and sol[1] >= 0:
                self.seconds_per_byte, self.overhead = sol
                return
        # One size only (or a noisy fit): all of it is bandwidth; pessimistic for smaller loads.
        self.seconds_per_byte = sum(s.seconds for s in xs) / sum(s.nbytes for s in xs)
        self.overhead = 0.0


class CostModel:
    """Learns prefill and restore costs from samples and plans each load; see the module docstring."""

    def __init__(
        self,
        *,
        chunk_tokens: int,
        window: int = 64,
        explore_every: int = 16,
        lookup_fraction: float = 0.1,
        min_deadline_s: float = 0.005,
    ) -> None:
        """``lookup_fraction``: the share of the expected prefill time a lookup may take."""
        self.chunk_tokens = chunk_tokens
        self.window = window
        self.explore_every = explore_every
        self.lookup_fraction = lookup_fraction
        self.min_deadline_s = min_deadline_s
        self.chunk_bytes: int | None = None
        self._prefill = _Prefill(window)
        self._restore: dict[str, _Restore] = {}
        self._skips: dict[str, int] = {}

    # --- learning ------------------------------------------------------------------------------------

    def observe_prefill(self, sample: PrefillSample) -> None:
        """Record one engine step's forward time."""
        self._prefill.add(sample)

    def observe_restore(self, sample: RestoreSample, chunks: int) -> None:
        """Record one load of ``chunks`` chunks."""
        if chunks > 0 and sample.nbytes > 0:
            self.chunk_bytes = sample.nbytes // chunks
        self._restore.setdefault(sample.tier, _Restore(self.window)).add(sample)

    # --- predictions ---------------------------------------------------------------------------------

    def prefill_seconds(self, start: int, tokens: int) -> float | None:
        """Expected forward seconds of ``tokens`` after ``start`` tokens of context (None: unmeasured)."""
        return self._prefill.seconds(start, tokens)

    def restore_seconds(self, tiers: Sequence[str]) -> float | None:
        """Expected seconds to restore one chunk from each of ``tiers`` in one load (None: unmeasured)."""
        if not tiers:
            return 0.0
        if self.chunk_bytes is None:
            return None
        total, overhead = 0.0, 0.0
        for tier in tiers:
            r = self._restore.get(tier)
            if r is None or r.seconds_per_byte is None:
                return None
            total += self.chunk_bytes * r.seconds_per_byte
            overhead = max(overhead, r.overhead)
        return overhead + total

    def plan(self, tiers: Sequence[str], *, computed: int = 0) -> Plan:
        """How many of the leading matched chunks (their tiers in ``tiers``) to load.

        ``computed`` tokens are already in the engine (its own prefix cache): loading them saves
        nothing, so only chunks beyond them count.
        """
        if not tiers:
            return Plan(0, None)
        c = self.chunk_tokens
        first = computed // c  # chunks before this one are already in the engine
        if first >= len(tiers):
            # No whole chunk beyond the engine's own prefix: nothing to weigh (what is left of the hit
            # is part of a chunk, which a hybrid model's lookup may still load). Never a skip.
            return Plan(len(tiers), None)
        best_k, best_gain = 0, 0.0
        best_saved = best_restore = 0.0
        measured = True
        for k in range(first + 1, len(tiers) + 1):
            saved = self._prefill.saved(computed, k * c)
            restore = self.restore_seconds(tiers[first:k])
            if saved is None or restore is None:
                measured = False
                break
            gain = saved - restore
            if gain > best_gain:
                best_k, best_gain, best_saved, best_restore = k, gain, saved, restore
        if not measured:
            return Plan(len(tiers), None)  # unmeasured: load, and so measure
        if best_k == 0:
            slowest = max(tiers[first:] or tiers, key=_tier_rank)
            n = self._skips.get(slowest, 0) + 1
            self._skips[slowest] = n
            if self.explore_every and n % self.explore_every == 0:
                return Plan(len(tiers), None, explore=True)
            return Plan(0, "recompute_faster")
        return Plan(best_k, None, best_saved, best_restore)

    def tail_worth_loading(
        self, start: int, tokens: int, tier: str, *, alone: bool, computed: int = 0
    ) -> bool:
        """Whether restoring ``tokens`` tokens of tail blocks after ``start`` beats recomputing them.

        ``tier``: the slowest of the tail's blocks; ``alone``: no chunk is loaded with them, so the
        load's fixed cost is theirs. Unmeasured: True (load, and so measure), as for chunks.
        """
        begin, end = max(start, computed), start + tokens
        if end <= begin:
            return True  # nothing beyond the engine's own prefix: nothing to weigh, never a skip
        saved = self._prefill.saved(begin, end)
        r = self._restore.get(tier)
        if saved is None or r is None or r.seconds_per_byte is None or self.chunk_bytes is None:
            return True
        restore = (
            r.overhead if alone else 0.0
        ) + self.chunk_bytes * tokens / self.chunk_tokens * r.seconds_per_byte
        return saved > restore

    def lookup_deadline(self, prompt_tokens: int, ceiling_s: float) -> float:
        """A lookup may take ``lookup_fraction`` of the prompt's expected prefill, within bounds."""
        expected = self._prefill.seconds(0, prompt_tokens)
        if expected is None:
            return ceiling_s
        return min(ceiling_s, max(self.min_deadline_s, self.lookup_fraction * expected))

    def load_deadline(self, plan: Plan, ceiling_s: float) -> float:
        """A load may take about the prefill it is expected to save, within bounds.

        Past that, recomputing would have been faster; but a load that is merely slower than
        expected is still cheaper to finish than to abandon, so it gets at least twice its expected
        time. A hung server thus costs a request about the prefill of its prefix, not a fixed deadline.
        """
        if plan.expected_saved_s is None:
            return ceiling_s
        budget = max(plan.expected_saved_s, 2 * (plan.expected_restore_s or 0.0))
        return min(ceiling_s, max(self.min_deadline_s, budget))


_TIER_RANK = {"dram": 0, "local_disk": 1, "shared": 2}


def _tier_rank(tier: str) -> int:
    return _TIER_RANK.get(tier, 3)
