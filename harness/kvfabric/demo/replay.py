"""The demo's body: deploy the sample pool and engines, replay the chat workload, report."""

from __future__ import annotations

import argparse
import contextlib
import random
import re
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvfabric.demo.fabric import SHARED_STORAGE_CLASS, Fabric, repo_root, running_fabric, wait_pool_ready
from kvfabric.demo.workloads import (
    engine_deployment,
    generate,
    object_store_secret,
    ready_pods,
    with_object_tier,
)
from kvfabric.localcluster.testing import wait_for
from kvfabric.testing.s3server import S3Server

Progress = Callable[[str], None]
NAMESPACE = "kvfabric-demo"
VOCAB = {"tiny": 512, "bench": 2048}  # the reference engine presets' vocabulary sizes


@dataclass
class Turn:
    """One request's outcome."""

    round: int
    user: int
    node: str
    prompt_tokens: int
    hit_tokens: int
    tier: str | None
    ttft_ms: float
    baseline_ttft_ms: float  # the same prompt on an engine without the cache


@dataclass
class Report:
    """Everything the demo prints at the end."""

    turns: list[Turn] = field(default_factory=list)


OBJECT_STORE_SECRET = "demo-s3-keys"  # noqa: S105 - the Secret's name, not a password


def sample_pool(object_store: S3Server | None = None) -> dict[str, Any]:
    """The repository's sample pool, with a shared tier on the demo's RWX volume added.

    With ``object_store``, nodes share through that S3 server's bucket instead (no shared volume).
    """
    path = repo_root() / "manifests" / "samples" / "kvfabric.io_v1alpha1_kvcachepool.yaml"
    pool: dict[str, Any] = yaml.safe_load(path.read_text())
    if object_store is not None:
        return with_object_tier(pool, object_store, OBJECT_STORE_SECRET, capacity="20Gi", local_disk=True)
    pool["spec"]["tiers"].setdefault(
        "shared",
        {
            "claimTemplate": {
                "storageClassName": SHARED_STORAGE_CLASS,
                "size": "20Gi",
                "accessModes": ["ReadWriteMany"],
            },
            "capacity": "20Gi",
        },
    )
    return pool


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) by linear interpolation; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def tier_bytes(fabric: Fabric, namespace: str, pool: str) -> dict[str, dict[str, float]]:
    """Bytes used per tier, per node, read from each cache server's Prometheus endpoint."""
    result: dict[str, dict[str, float]] = {}
    selector = f"app.kubernetes.io/name=kvfabric-cache,app.kubernetes.io/instance={pool}"
    for pod in ready_pods(fabric.cluster, namespace, selector):
        status, body = fabric.request(pod, 9090, "/metrics", timeout=5)
        if status != 200:
            continue
        per_tier: dict[str, float] = {}
        for line in body.splitlines():
            m = re.match(r'kvfabric_tier_used(?:_bytes)?\{[^}]*tier="([^"]+)"[^}]*\}\s+([0-9.e+]+)', line)
            if m:
                per_tier[m.group(1)] = per_tier.get(m.group(1), 0.0) + float(m.group(2))
        result[pod["spec"]["nodeName"]] = per_tier
    return result


def replay(fabric: Fabric, namespace: str, args: argparse.Namespace, progress: Progress) -> Report:
    """Send every user's rounds, alternating nodes, and collect the outcomes."""
    rng = random.Random(7)
    vocab = VOCAB.get(args.preset, 512)
    system = [rng.randrange(vocab) for _ in range(args.system_tokens)]
    histories: list[list[int]] = [[] for _ in range(args.users)]
    engines = {p["spec"]["nodeName"]: p for p in ready_pods(fabric.cluster, namespace, "app=engine")}
    baseline = ready_pods(fabric.cluster, namespace, "app=engine-nocache")[0]
    nodes = sorted(engines)
    report = Report()
    total = args.users * args.rounds
    done = 0
    for rnd in range(args.rounds):
        for user in range(args.users):
            histories[user] += [rng.randrange(vocab) for _ in range(args.turn_tokens)]
            prompt = system + histories[user]
            # Each round a user lands on the other node: its history is a hit only through the
            # shared volume; the system prompt is shared by everyone.
            node = nodes[(user + rnd) % len(nodes)]
            out = generate(fabric, engines[node], prompt, max_tokens=args.answer_tokens)
            cold = generate(fabric, baseline, prompt, max_tokens=args.answer_tokens)
            if cold["output_token_ids"] != out["output_token_ids"]:
                raise AssertionError(f"round {rnd + 1} user {user + 1}: output differs from recompute")
            histories[user] += out["output_token_ids"]
            report.turns.append(
                Turn(
                    rnd,
                    user,
                    node,
                    len(prompt),
                    out["hit_tokens"],
                    out["tier"],
                    out["ttft_ms"],
                    cold["ttft_ms"],
                )
            )
            done += 1
            progress(
                f"round {rnd + 1}/{args.rounds} user {user + 1}/{args.users} on {node}: "
                f"{len(prompt)} tokens, {out['hit_tokens']} from cache "
                f"({out['tier'] or 'miss: ' + str(out.get('fallback_reason') or 'not stored')}), "
                f"TTFT {out['ttft_ms']:.0f} ms (no cache: {cold['ttft_ms']:.0f} ms)  [{done}/{total}]"
            )
        # Give the background stores and the shared volume's journals a moment between rounds,
        # as think time between a user's messages would.
        time.sleep(1.5)
    return report


def print_report(report: Report, fabric: Fabric, namespace: str, pool: str) -> None:
    """The summary: hit rate per round, TTFT cold vs warm, bytes per tier, and the pool."""
    print("\n== hit rate per round ==")
    print(
        f"{'round':>5} {'requests':>8} {'prompt tok':>10} {'cached tok':>10} {'hit rate':>8} "
        f"{'TTFT p50 ms':>11}"
    )
    for rnd in sorted({t.round for t in report.turns}):
        turns = [t for t in report.turns if t.round == rnd]
        prompt = sum(t.prompt_tokens for t in turns)
        hits = sum(t.hit_tokens for t in turns)
        print(
            f"{rnd + 1:>5} {len(turns):>8} {prompt:>10} {hits:>10} {hits / prompt:>8.1%} "
            f"{statistics.median(t.ttft_ms for t in turns):>11.1f}"
        )
    cold = [t.baseline_ttft_ms for t in report.turns]
    warm = [t.ttft_ms for t in report.turns if t.hit_tokens > 0]
    print("\n== TTFT: cold (same prompts, engine without cache) vs warm (prefix loaded from kvfabric) ==")
    for label, values in (("cold", cold), ("warm", warm)):
        print(
            f"{label:>5}: n={len(values):<3} p50 {percentile(values, 0.5):8.1f} ms   "
            f"p99 {percentile(values, 0.99):8.1f} ms"
        )
    if cold and warm:
        print(
            f"speedup at p50: {percentile(cold, 0.5) / percentile(warm, 0.5):.2f}x; "
            "every output matched the recomputed one"
        )
    by_tier: dict[str, int] = {}
    for t in report.turns:
        if t.tier:
            by_tier[t.tier] = by_tier.get(t.tier, 0) + 1
    print(f"hits by source tier: {by_tier or 'none'}")
    print("\n== bytes per tier (cache servers' /metrics) ==")
    for node, tiers in sorted(tier_bytes(fabric, namespace, pool).items()):
        cells = "  ".join(f"{tier}={value / 2**20:.1f} MiB" for tier, value in sorted(tiers.items()))
        print(f"{node}: {cells or '(no tier metrics)'}")
    print("\n== kubectl get kvp ==")
    print(fabric.cluster.kubectl("get", "kvp", "-n", namespace).stdout)


def deploy_and_replay(
    fabric: Fabric, namespace: str, args: argparse.Namespace, progress: Progress
) -> tuple[Report, str]:
    """Apply the sample pool and the engines in ``namespace``, then replay; returns the report and pool."""
    cluster = fabric.cluster
    s3 = fabric.object_store if getattr(args, "object_store", False) else None
    if getattr(args, "object_store", False) and s3 is None:
        raise RuntimeError("--object-store needs a fabric started with its S3 server (object_store=True)")
    pool = sample_pool(s3)
    name = pool["metadata"]["name"]
    if s3 is not None:
        cluster.apply(object_store_secret(s3, OBJECT_STORE_SECRET), namespace=namespace)
        progress(
            f"applying the sample pool {name!r} (manifests/samples) with an object tier at {s3.endpoint}"
        )
    else:
        progress(f"applying the sample pool {name!r} (manifests/samples) with a shared tier")
    cluster.apply(pool, namespace=namespace)
    wait_pool_ready(cluster, namespace, name)
    progress("cache servers are Ready on every GPU node; deploying the reference engine (2 replicas)")
    cluster.apply(engine_deployment("engine", name, preset=args.preset), namespace=namespace)
    # The baseline: the same engine, not opted in, so it recomputes every prompt.
    cluster.apply(
        engine_deployment("engine-nocache", None, replicas=1, preset=args.preset), namespace=namespace
    )
    wait_for(
        lambda: (
            len(ready_pods(cluster, namespace, "app=engine")) == len(fabric.gpu_nodes)
            and ready_pods(cluster, namespace, "app=engine-nocache")
        ),
        timeout=240,
        message="engines Ready",
    )
    progress(f"replaying {args.users} users x {args.rounds} rounds")
    return replay(fabric, namespace, args, progress), name


def main(base: Path, args: argparse.Namespace, progress: Progress) -> int:
    """Bring the fabric up, deploy, replay, report, tear down (unless ``--keep``)."""
    start = time.monotonic()
    with running_fabric(
        base,
        progress=progress,
        object_store=getattr(args, "object_store", False),
        install=getattr(args, "install", "kustomize"),
    ) as fabric:
        cluster = fabric.cluster
        cluster.kubectl("create", "namespace", NAMESPACE, check=False)
        wait_for(
            lambda: cluster.kubectl("get", "sa", "default", "-n", NAMESPACE, check=False).returncode == 0,
            message="the demo namespace's default ServiceAccount",
        )
        report, pool = deploy_and_replay(fabric, NAMESPACE, args, progress)
        print_report(report, fabric, NAMESPACE, pool)
        progress(f"done in {time.monotonic() - start:.0f}s")
        if args.keep:
            progress(f"everything stays up; KUBECONFIG={cluster.kubeconfig}; press Ctrl-C to stop")
            with contextlib.suppress(KeyboardInterrupt):
                threading.Event().wait()
    return 0
