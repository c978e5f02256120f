"""``kvfabric bench NAME``: dispatch to one benchmark module per name.

Each benchmark is a module ``kvfabric.bench.<name>`` exposing ``configure(parser)`` and ``run(args) -> int``
(stdlib-only imports at module level, like every subcommand). To add one, create the module and add a
line to :data:`BENCHMARKS`; a listed module that is not installed in this image is simply not offered.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Protocol, cast

# Shown by `kvfabric --help`; this module is registered under the kvfabric.commands entry points.
SUMMARY = "run a benchmark (storage, ttft, operator, visibility, routing, vllm, suite) and print ratios"

__all__ = ["BENCHMARKS", "configure", "run"]

# name -> (module, one-line summary). Order is the order shown by --help.
BENCHMARKS: dict[str, tuple[str, str]] = {
    # Cache-server storage paths: memcpy, shm, disk, gRPC, Redis baseline, lookup latency.
    "storage": ("kvfabric.bench.storage", "cache-server data paths against memcpy, raw disk and Redis"),
    # Plug-in point for the connector/reference-engine engineer: module kvfabric.bench.ttft.
    "ttft": ("kvfabric.bench.ttft", "time to first token with and without the cache (reference engine)"),
    # The performance issue's GPU check (needs a CUDA device; exits 2 without one).
    "gpu": ("kvfabric.bench.gpu", "restore bandwidth host->device and TTFT on a GPU (needs CUDA)"),
    # Plug-in point for the operator engineer: module kvfabric.bench.operator.
    "operator": ("kvfabric.bench.operator", "operator reconcile and webhook latency on the local cluster"),
    # Two real cache servers on one volume: the cross-node visibility delay (issue 11.8).
    "visibility": (
        "kvfabric.bench.visibility",
        "how soon a chunk stored on one node is a hit on another node (shared volume)",
    ),
    # Two real cache servers, four engines' event paths, models of llm-d's and Dynamo's indexes.
    "routing": (
        "kvfabric.bench.routing",
        "how exactly a router's index follows the fabric under churn (KV events from the residency feed)",
    ),
    # Real vLLM (CPU) from the pinned environment scripts/vllm-env.sh builds.
    "vllm": (
        "kvfabric.bench.vllm",
        "TTFT inside real vLLM: cold, vLLM's own prefix cache, kvfabric after restart",
    ),
    # Every row of the performance table: the benchmarks above, --runs times, one markdown table.
    "suite": (
        "kvfabric.bench.suite",
        "run storage, ttft, vllm, vllm --chat and operator --scale N times; one table with spread",
    ),
}


class _Benchmark(Protocol):
    def configure(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _load(module_name: str) -> _Benchmark | None:
    try:
        return cast(_Benchmark, importlib.import_module(module_name))
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            return None  # not written yet, or not installed in this image
        raise


def configure(parser: argparse.ArgumentParser) -> None:
    """Add one sub-parser per available benchmark."""
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, (module_name, summary) in BENCHMARKS.items():
        module = _load(module_name)
        if module is None:
            continue
        child = sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".")
        module.configure(child)
        child.set_defaults(_bench_module=module)


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark."""
    module = cast(_Benchmark, args._bench_module)
    return module.run(args)
