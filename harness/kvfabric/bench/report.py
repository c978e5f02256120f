"""What every benchmark prints: values with their spread over rounds, and each target, met or not.

A benchmark collects one sample per round for every measurement (a bandwidth, a ratio of two paths
measured in the same round, a latency percentile), and reports the median with the minimum and the
maximum, so a noisy run shows up as a wide spread rather than as a wrong number. Targets are judged
on the median; the printed table shows the spread next to it.

Standard library only (``kvfabric --help`` imports the benchmark modules).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Spread", "Target", "judge", "percentile", "spread", "summary", "table"]


@dataclass(frozen=True, slots=True)
class Spread:
    """Median, minimum and maximum of a measurement's per-round samples."""

    median: float
    min: float
    max: float
    rounds: int

    def as_dict(self) -> dict[str, float | int]:
        """JSON form."""
        return {"median": self.median, "min": self.min, "max": self.max, "rounds": self.rounds}

    def text(self, digits: int = 3) -> str:
        """``median (min-max)``; just the median when there was one round."""
        if self.rounds <= 1 or self.min == self.max:
            return f"{self.median:.{digits}f}"
        return f"{self.median:.{digits}f} ({self.min:.{digits}f}-{self.max:.{digits}f})"


def spread(samples: Iterable[float], digits: int = 4) -> Spread:
    """The spread of ``samples`` (at least one)."""
    xs = [float(x) for x in samples]
    if not xs:
        raise ValueError("spread() of no samples")
    return Spread(
        round(statistics.median(xs), digits), round(min(xs), digits), round(max(xs), digits), len(xs)
    )


def percentile(sorted_samples: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of already sorted samples, nearest rank (no interpolation)."""
    if not sorted_samples:
        raise ValueError("percentile() of no samples")
    rank = max(1, math.ceil(q * len(sorted_samples)))
    return sorted_samples[min(len(sorted_samples), rank) - 1]


def summary(
    samples: Iterable[float],
    qs: Sequence[float] = (0.9, 0.99),
    *,
    scale: float = 1.0,
    digits: int = 4,
    unit: str = "",
) -> dict[str, float]:
    """``n``, the median as ``p50``, each ``q`` of ``qs`` (nearest rank) and ``max``, times ``scale``.

    Keys end in ``unit`` (``p99_ms`` with ``scale=1000, unit="_ms"``); no samples: ``{"n": 0}``.
    """
    xs = sorted(samples)
    if not xs:
        return {"n": 0}
    out: dict[str, float] = {"n": len(xs), f"p50{unit}": round(statistics.median(xs) * scale, digits)}
    for q in qs:
        out[f"p{round(q * 100)}{unit}"] = round(percentile(xs, q) * scale, digits)
    out[f"max{unit}"] = round(xs[-1] * scale, digits)
    return out


@dataclass(frozen=True, slots=True)
class Target:
    """A goal of the performance issue: ``measure op threshold``, judged on the median."""

    label: str
    """What the row of the issue's table says (e.g. ``lookup p99, 32 clients x 128 keys``)."""
    measure: str
    """Key of the measurement in the benchmark's result."""
    op: Literal[">=", "<="]
    threshold: float
    unit: str = ""
    stat: Literal["median", "worst"] = "median"
    """Which statistic is judged: the median of the rounds, or (for "never" goals) the worst."""


def judge(targets: Sequence[Target], spreads: dict[str, Spread]) -> dict[str, dict[str, Any]]:
    """Verdict of each target: value (median and spread), goal and whether it is met (None: not measured)."""
    out: dict[str, dict[str, Any]] = {}
    for t in targets:
        s = spreads.get(t.measure)
        goal = f"{t.op} {t.threshold:g}{t.unit}"
        if s is None:
            out[t.label] = {"measure": t.measure, "value": None, "goal": goal, "met": None}
            continue
        x = s.median if t.stat == "median" else (s.min if t.op == ">=" else s.max)
        met = x >= t.threshold if t.op == ">=" else x <= t.threshold
        if t.stat != "median":
            goal += " (worst round)"
        out[t.label] = {"measure": t.measure, "value": s.as_dict(), "goal": goal, "met": met}
    return out


def table(verdicts: dict[str, dict[str, Any]]) -> str:
    """The verdicts as an aligned text table: target, median (min-max), goal, MET / MISSED."""
    rows = [("target", "median (min-max)", "goal", "")]
    for label, v in verdicts.items():
        val = v["value"]
        text = "not measured" if val is None else Spread(**val).text()
        mark = "-" if v["met"] is None else ("MET" if v["met"] else "MISSED")
        rows.append((label, text, v["goal"], mark))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip() for r in rows
    )
