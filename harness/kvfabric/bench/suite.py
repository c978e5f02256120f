"""``kvfabric bench suite``: every benchmark row of the performance table, ``--runs`` times, with spread.

Runs the benchmarks in a fixed order (``storage``, ``ttft``, ``vllm``, ``chat`` = ``vllm --chat``,
``operator`` = ``operator --scale``), ``--runs`` times (default 3), each as its own subprocess of
this CLI with ``--json``: a crash of one loses only that run (its stderr is kept), and one past
``--timeout`` is interrupted (SIGINT, so it stops what it started) and counts as failed. Every run's
stdout and stderr are written to ``--out`` (default ``bench-results/suite-<UTC time>/``, gitignored),
with ``suite.json`` (the runs' wall time, load average at start and end, exit status, and memcpy
GB/s where the storage bench reports it) and ``table.md``, the markdown table it also prints:

one line per target of the performance table: each run's value (``median (min-max)`` over that
run's rounds), the spread across runs (min-max of the judged value: the median, or the worst round
for a "never" goal), the goal, and whether it was met in all runs, some or none. Each row is found
by its ``measure`` in the ``targets`` of its benchmark's JSON (:mod:`kvfabric.bench.report`), so a
goal lives in its benchmark, never here.

The table builder (:func:`build_rows`, :func:`markdown`) is pure: it takes the loaded JSON
documents (``None`` for a failed run) and can be rerun over a results directory with ``--from DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BENCHES",
    "DEFAULT_ARGS",
    "ROWS",
    "Row",
    "RowResult",
    "build_rows",
    "configure",
    "find_targets",
    "markdown",
    "run",
]

# name -> the `kvfabric bench` arguments it runs (before --json and the size flags). Fixed order.
BENCHES: dict[str, tuple[str, ...]] = {
    "storage": ("storage",),
    "ttft": ("ttft",),
    "vllm": ("vllm",),
    "chat": ("vllm", "--chat"),
    "operator": ("operator", "--scale"),
}

# The sizes one suite run uses by default, chosen so that one run of all five takes <= 15 minutes
# on the 2-core development machine (docs/performance.md, "The benchmarks", gives each one's time).
DEFAULT_ARGS: dict[str, tuple[str, ...]] = {
    "storage": ("--quick",),
    "ttft": ("--quick",),
    "vllm": ("--quick", "--lengths", "2048,8192,16384"),
    "chat": (),
    "operator": ("--quick",),
}


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the table: a target of one benchmark, found by its measure (and label, if given)."""

    name: str
    bench: str | None
    """Which entry of :data:`BENCHES` reports it; None: no benchmark measures it."""
    measure: str = ""
    """Regular expression the verdict's ``measure`` must match in full."""
    label: str | None = None
    """Regular expression searched in the verdict's label, where the measure alone is ambiguous."""


ROWS: tuple[Row, ...] = (
    Row("shm load / memcpy", "storage", "shm_load_over_memcpy"),
    Row("shm store / memcpy", "storage", "shm_store_over_memcpy"),
    Row("disk-tier cold load / raw O_DIRECT read", "storage", "disk_tier_over_raw"),
    Row("object-tier cold load / raw ranged GET", "storage", "object_tier_over_raw"),
    Row("restore efficiency (>= 16k, effective / raw)", "ttft", "restore_efficiency"),
    Row("hung server: ms added, every request", "ttft", "hung_server_added_ms"),
    Row("hung server: ms added, first request", "ttft", "hung_server_first_request_ms"),
    Row("real vLLM: kvfabric hit / vLLM's own hit, 2k", "vllm", "kvfabric_vs_vllm_warm_2048"),
    Row("real vLLM: kvfabric hit / vLLM's own hit, 8k", "vllm", "kvfabric_vs_vllm_warm_8192"),
    Row("real vLLM: kvfabric hit / vLLM's own hit, 16k", "vllm", "kvfabric_vs_vllm_warm_16384"),
    Row("chat rounds >= 2: speed-up at p50", "chat", "chat_rounds_2_plus_speedup_p50"),
    Row("chat: outputs identical (fraction)", "chat", "chat_outputs_identical_fraction"),
    Row("chat round 1: p90 with kvfabric / alone", "chat", "chat_round_1_p90_ratio"),
    Row("fresh engine, first request (4k miss that stores): TTFT overhead", "ttft", "first_request_overhead"),
    Row("... its connector time / TTFT without kvfabric", "ttft", "first_request_connector_share"),
    Row("lookup: client CPU per 128-key local lookup (us)", "storage", "lookup_local_c1_client_cpu_us"),
    Row("lookup p99 at <= cores clients (ms)", "storage", r"lookup_best_c\d+_p99_ms", r"<= \d+ cores"),
    Row("lookup p99 at 32 clients (ms)", "storage", "lookup_best_c32_p99_ms", r"^lookup p99, 32 closed-loop"),
    Row("operator: all pools Ready (s)", "operator", "all_ready_s"),
    Row("operator: webhook p99 during the storm (ms)", "operator", "webhook_p99_ms"),
    Row("operator: RSS after Ready (MB)", "operator", "operator_after_ready"),
    Row("operator: peak RSS (MB)", "operator", "operator"),
)


def find_targets(doc: Mapping[str, Any] | None) -> dict[str, dict[str, Any]] | None:
    """The ``targets`` of a benchmark's JSON document (top level, or one level down: operator's ``scale``)."""
    if doc is None:
        return None
    if isinstance(doc.get("targets"), dict):
        return dict(doc["targets"])
    for value in doc.values():
        if isinstance(value, dict) and isinstance(value.get("targets"), dict):
            return dict(value["targets"])
    return None


def _verdict(row: Row, targets: Mapping[str, Mapping[str, Any]]) -> tuple[str, Mapping[str, Any]] | None:
    """The label and verdict of the target ``row`` names, or None."""
    for label, v in targets.items():
        if not re.fullmatch(row.measure, str(v.get("measure", ""))):
            continue
        if row.label is None or re.search(row.label, label):
            return label, v
    return None


@dataclass(frozen=True, slots=True)
class RowResult:
    """One row's outcome over the runs."""

    name: str
    cells: tuple[str, ...]
    """Per run: ``median (min-max)``, ``not measured`` or ``run failed``."""
    across: str
    """Min-max of the judged value across the runs that measured it ("" if none did)."""
    goal: str
    met: str
    """``all N/N``, ``some k/N``, ``none 0/N``, ``-`` (no goal), or why there is no verdict."""


def _judged(v: Mapping[str, Any]) -> float:
    """The value a verdict was judged on: the median, or the worst round for a "(worst round)" goal."""
    val = v["value"]
    if "worst round" not in str(v.get("goal", "")):
        return float(val["median"])
    return float(val["min"] if str(v["goal"]).startswith(">=") else val["max"])


def _fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def _cell(val: Mapping[str, Any]) -> str:
    med, lo, hi = float(val["median"]), float(val["min"]), float(val["max"])
    if int(val.get("rounds", 1)) <= 1 or lo == hi:
        return _fmt(med)
    return f"{_fmt(med)} ({_fmt(lo)}-{_fmt(hi)})"


def build_rows(
    docs: Mapping[str, Sequence[Mapping[str, Any] | None]], runs: int, rows: Sequence[Row] = ROWS
) -> list[RowResult]:
    """The table over every run's JSON document per bench (``None``: that run failed; absent: not run)."""
    out: list[RowResult] = []
    for row in rows:
        if row.bench is None:
            out.append(RowResult(row.name, ("",) * runs, "", "", "not measured by a bench"))
            continue
        if row.bench not in docs:
            out.append(RowResult(row.name, ("not run",) * runs, "", "", "not run"))
            continue
        runs_docs = list(docs[row.bench])[:runs]
        runs_docs += [None] * (runs - len(runs_docs))
        cells: list[str] = []
        judged: list[float] = []
        verdicts: list[Mapping[str, Any] | None] = []
        labels: list[str] = []
        goal = ""
        for doc in runs_docs:
            targets = find_targets(doc)
            if targets is None:
                cells.append("run failed")
                verdicts.append(None)
                continue
            found = _verdict(row, targets)
            v = None if found is None else found[1]
            if found is not None:
                labels.append(found[0])
            verdicts.append(v)
            if v is None or v.get("value") is None:
                cells.append("not measured")
                goal = goal or ("" if v is None else str(v.get("goal", "")))
                continue
            goal = goal or str(v.get("goal", ""))
            cells.append(_cell(v["value"]))
            judged.append(_judged(v))
        across = f"{_fmt(min(judged))}-{_fmt(max(judged))}" if judged else ""
        failed = cells.count("run failed")
        # A benchmark that says it ran below the goal's scale (operator --scale --quick) says so here too.
        reduced = any(label.endswith("(reduced scale)") for label in labels)
        name = row.name + (" (reduced scale)" if reduced else "")
        out.append(RowResult(name, tuple(cells), across, goal, _met(verdicts, goal, failed)))
    return out


def _met(verdicts: Sequence[Mapping[str, Any] | None], goal: str, failed: int) -> str:
    """``all``/``some``/``none`` with the count; a failed run is a run that did not meet the goal."""
    n = len(verdicts)
    if goal == "reported":
        return "-"
    if not failed and all(v is None or v.get("met") is None for v in verdicts):
        return "not measured"
    met = sum(1 for v in verdicts if v is not None and v.get("met") is True)
    word = "all" if met == n else ("none" if met == 0 else "some")
    return f"{word} {met}/{n}"


def markdown(rows: Sequence[RowResult], runs: int) -> str:
    """The rows as a markdown table."""
    head = ["target", *(f"run {i + 1}" for i in range(runs)), "across runs", "goal", "met"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([r.name, *r.cells, r.across, r.goal, r.met]) + " |")
    return "\n".join(lines)


def parse_output(stdout: str) -> dict[str, Any] | None:
    """The benchmark's JSON document from its stdout: the whole text, else the last line with targets."""
    try:
        doc = json.loads(stdout)
        if isinstance(doc, dict):
            return doc
    except json.JSONDecodeError:
        pass
    for raw in reversed(stdout.splitlines()):
        line = raw.strip()
        if not line.startswith("{"):
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(doc, dict) and find_targets(doc) is not None:
            return doc
    return None


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the suite's options (``--help`` shows this module's description)."""
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--runs", type=int, default=3, help="full runs of every benchmark (default 3)")
    parser.add_argument(
        "--only",
        default=",".join(BENCHES),
        help=f"comma-separated subset, run in the fixed order (default {','.join(BENCHES)})",
    )
    parser.add_argument("--quick", action="store_true", help="pass --quick to every benchmark (a smoke run)")
    parser.add_argument(
        "--args",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="replace one benchmark's default size flags, e.g. "
        "--args 'operator=--nodes 1000 --scale-pools 100'"
        " (defaults: " + "; ".join(f"{k}: {' '.join(v) or 'none'}" for k, v in DEFAULT_ARGS.items()) + ")",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="results directory (default bench-results/suite-<UTC time>/)"
    )
    parser.add_argument(
        "--timeout", type=float, default=1800, help="seconds one benchmark run may take (default 1800)"
    )
    parser.add_argument(
        "--from",
        dest="from_dir",
        type=Path,
        default=None,
        help="run nothing: rebuild the table from a results directory written earlier",
    )


def _command(name: str, args: argparse.Namespace) -> list[str]:
    extra: list[str] = list(DEFAULT_ARGS[name])
    for spec in args.args:
        key, _, value = spec.partition("=")
        if key == name:
            extra = shlex.split(value)
    if args.quick and "--quick" not in extra:
        extra.append("--quick")
    return [sys.executable, "-m", "kvfabric.cli", "bench", *BENCHES[name], "--json", *extra]


def _memcpy_gbps(doc: Mapping[str, Any] | None) -> float | None:
    spreads = (doc or {}).get("spread") or {}
    value = spreads.get("memcpy_gbps")
    return float(value["median"]) if isinstance(value, dict) else None


def _load_docs(out: Path, names: Sequence[str], runs: int) -> dict[str, list[dict[str, Any] | None]]:
    """Every run's document from a results directory; a run ``suite.json`` records as failed is None."""
    failed: set[tuple[int, str]] = set()
    if (out / "suite.json").exists():
        records = json.loads((out / "suite.json").read_text()).get("runs", [])
        failed = {(int(r["run"]), str(r["bench"])) for r in records if r.get("rc") != 0}
    docs: dict[str, list[dict[str, Any] | None]] = {}
    for name in names:
        found = [(i, out / f"run{i}-{name}.json") for i in range(1, runs + 1)]
        if not any(p.exists() for _, p in found):
            continue
        docs[name] = [
            parse_output(p.read_text()) if p.exists() and (i, name) not in failed else None for i, p in found
        ]
    return docs


def run(args: argparse.Namespace) -> int:
    """Run the suite (or rebuild its table with ``--from``) and print the markdown table."""
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        print(f"--only: unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHES)}",
              file=sys.stderr)  # fmt: skip
        return 2
    for spec in args.args:
        if spec.partition("=")[0] not in BENCHES:
            print(
                f"--args {spec!r}: expected NAME=ARGS with NAME one of {', '.join(BENCHES)}", file=sys.stderr
            )
            return 2
    if args.runs < 1:
        print("--runs: must be at least 1", file=sys.stderr)
        return 2
    names = [n for n in BENCHES if n in names]  # the fixed order
    if args.from_dir is not None:
        table = markdown(build_rows(_load_docs(args.from_dir, names, args.runs), args.runs), args.runs)
        print(table)
        if (args.from_dir / "suite.json").exists():
            print("\n" + runs_table(json.loads((args.from_dir / "suite.json").read_text()).get("runs", [])))
        return 0
    out = args.out or Path("bench-results") / time.strftime("suite-%Y%m%d-%H%M%S", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    docs: dict[str, list[dict[str, Any] | None]] = {n: [] for n in names}
    for i in range(1, args.runs + 1):
        for name in names:
            cmd = _command(name, args)
            load_start = os.getloadavg()
            t0 = time.monotonic()
            print(f"run {i}/{args.runs}: {shlex.join(cmd[1:])}", file=sys.stderr, flush=True)
            rc, stdout, stderr = run_one(cmd, args.timeout)
            wall = time.monotonic() - t0
            (out / f"run{i}-{name}.json").write_text(stdout)
            (out / f"run{i}-{name}.stderr").write_text(stderr)
            doc = parse_output(stdout) if rc == 0 else None
            docs[name].append(doc)
            record = {
                "run": i,
                "bench": name,
                "command": cmd[1:],
                "rc": rc,
                "wall_s": round(wall, 1),
                "load_start": [round(x, 2) for x in load_start],
                "load_end": [round(x, 2) for x in os.getloadavg()],
                "memcpy_gbps": _memcpy_gbps(doc),
            }
            records.append(record)
            print(json.dumps(record), file=sys.stderr, flush=True)
            (out / "suite.json").write_text(json.dumps({"runs": records}, indent=2))
    table = markdown(build_rows(docs, args.runs), args.runs)
    (out / "table.md").write_text(table + "\n\n" + runs_table(records) + "\n")
    print(table)
    print("\n" + runs_table(records))
    print(f"\nresults: {out}")
    return 0 if all(r["rc"] == 0 for r in records) else 1


# How long a benchmark interrupted at its timeout may take to clean up (stop vLLM, take a cluster down).
CLEANUP_S = 120.0


def run_one(cmd: Sequence[str], timeout: float) -> tuple[int, str, str]:
    """Run one benchmark in its own process group: exit status, stdout, stderr.

    Past ``timeout`` the whole group gets SIGINT, so the benchmark's ``finally`` blocks stop the
    servers and clusters it started (a plain kill would leave them running), then SIGKILL after
    :data:`CLEANUP_S`. A timed-out run exits -1 with a line saying so at the end of its stderr.
    """
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_default_sigint,  # noqa: PLW1509 - only a signal disposition, before exec
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        stdout, stderr = _interrupt(proc)
    except KeyboardInterrupt:
        # The group does not get the terminal's ^C (its own session): pass it on, then stop.
        _interrupt(proc)
        raise
    return -1, stdout, stderr + f"\nkvfabric bench suite: timed out after {timeout:g} s\n"


def _default_sigint() -> None:
    """In the child, before exec: SIGINT back to its default disposition.

    A suite started in the background (``nohup ... &``, a CI job) has SIGINT ignored, which its
    children inherit, and Python then installs no KeyboardInterrupt handler: the interrupt meant to
    let a timed-out benchmark clean up would do nothing until the SIGKILL.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGINT to the process group, SIGKILL if it is still there after :data:`CLEANUP_S`; its output."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        return proc.communicate(timeout=CLEANUP_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()


def runs_table(records: Sequence[Mapping[str, Any]]) -> str:
    """Each benchmark run's exit status, wall time, load average (1 min) at start and end, memcpy GB/s."""
    lines = ["| run | bench | rc | wall s | load start-end | memcpy GB/s |", "|---|---|---|---|---|---|"]
    for r in records:
        memcpy = "" if r.get("memcpy_gbps") is None else f"{r['memcpy_gbps']:.2f}"
        lines.append(
            f"| {r['run']} | {r['bench']} | {r['rc']} | {r['wall_s']} | "
            f"{r['load_start'][0]}-{r['load_end'][0]} | {memcpy} |"
        )
    return "\n".join(lines)
