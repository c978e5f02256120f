"""The benchmark command lines the README shows parse, and ``bench operator --quick`` shrinks its sizes."""

from __future__ import annotations

from typing import Any

import pytest

from kvfabric.bench.operator import resolve_sizes
from kvfabric.cli.main import build_parser


@pytest.mark.parametrize("name", ["storage", "ttft", "operator"])
@pytest.mark.parametrize("flags", [[], ["--quick"], ["--json"], ["--quick", "--json"]])
def test_the_readme_bench_commands_parse(name: str, flags: list[str]) -> None:
    # README: `kvfabric bench storage|ttft|operator [--quick] [--json]`.
    args = build_parser().parse_args(["bench", name, *flags])
    assert args.quick is ("--quick" in flags)
    assert args.json is ("--json" in flags)


def test_bench_operator_quick_shrinks_only_the_sizes_left_unset() -> None:
    parser = build_parser()
    full = resolve_sizes(parser.parse_args(["bench", "operator"]))
    quick = resolve_sizes(parser.parse_args(["bench", "operator", "--quick", "--pods", "7"]))
    assert (full.pools, full.burst, full.pods) == (20, 50, 200)
    assert (full.nodes, full.scale_pools, full.consumer_pods) == (1000, 100, 5000)
    assert (quick.pools, quick.burst, quick.pods) == (5, 10, 7)
    assert (quick.nodes, quick.scale_pools, quick.consumer_pods) == (100, 10, 500)


def test_bench_operator_judges_the_scale_run_against_the_goals() -> None:
    from kvfabric.bench.operator import _histogram_delta, scale_verdicts

    run = {
        "nodes": 1000,
        "pools": 100,
        "all_ready_s": 28.0,
        "storm": {"consumer_pods": 5000, "injected_at_admission": 4999},
        "webhook_during_storm": {"n": 900, "p99_ms": 21.5},
        "operator_after_ready": {"rss_mb": 150.0, "peak_rss_mb": 150.0},
        "operator": {"rss_mb": 200.0, "peak_rss_mb": 260.0},
    }
    verdicts = scale_verdicts(run)
    met = {label: v["met"] for label, v in verdicts.items()}
    assert met == {
        "all pools Ready, 1000 nodes x 100 pools": True,
        "webhook p99 during the storm, 5000 pods": False,
        "pods injected at admission, 5000 pods": False,
        "RSS after Ready, MB": None,
        "peak RSS, MB": None,
    }
    assert verdicts["peak RSS, MB"]["value"]["median"] == 260.0
    small = scale_verdicts({**run, "nodes": 200, "pools": 20, "all_ready_s": float("nan")})
    assert small["all pools Ready, 200 nodes x 20 pools (reduced scale)"]["met"] is None  # never Ready
    # What the runtime probe recorded between two reads: counts differenced, the tail above 10 ms.
    before = {"le_ms": {"10": 5, "20": 1, "inf": 0}, "total_ms": 10.0, "max_ms": 12.0}
    after = {"le_ms": {"10": 9, "20": 3, "inf": 1}, "total_ms": 60.0, "max_ms": 80.0}
    assert _histogram_delta(before, after) == {
        "n": 7,
        "total_ms": 50.0,
        "max_ms_so_far": 80.0,
        ">10ms": 3,
        ">20ms": 1,
    }


def test_bench_operator_splits_the_time_to_ready_into_the_stages_the_api_server_recorded() -> None:
    from kvfabric.bench.operator import ready_timeline

    start = 1_800_000_000.0  # 2027-01-15T08:00:00Z

    def at(seconds: int) -> str:
        return f"2027-01-15T08:00:{seconds:02d}Z"

    def cond(kind: str, seconds: int | None, status: str = "True") -> dict[str, str]:
        return {
            "type": kind,
            "status": status,
            **({"lastTransitionTime": at(seconds)} if seconds is not None else {}),
        }

    daemonsets = [{"metadata": {"name": f"p{k}-cache", "creationTimestamp": at(1 + k)}} for k in range(2)]
    pods: list[dict[str, Any]] = [
        {
            "metadata": {
                "creationTimestamp": at(3 + k),
                "ownerReferences": [{"kind": "DaemonSet", "name": f"p{k}-cache"}],
            },
            "status": {"conditions": [cond("PodScheduled", 4 + k), cond("Ready", 10 + 5 * k)]},
        }
        for k in range(2)
    ]
    pools: list[dict[str, Any]] = [
        {"metadata": {"name": "p0"}, "status": {"conditions": [cond("Ready", 12)]}},
        {"metadata": {"name": "p1"}, "status": {"conditions": [cond("Ready", 21)]}},
    ]
    stray = {"metadata": {"creationTimestamp": at(59)}, "status": {"conditions": [cond("Ready", 59)]}}
    got = ready_timeline(start + 0.7, daemonsets, [*pods, stray], pools)
    assert got == {
        "daemonsets_created_s": 2.0,
        "cache_pods": 2,
        "cache_pods_created_s": 4.0,
        "cache_pods_scheduled_s": 5.0,
        "cache_pods_ready_s": 15.0,
        "pools_ready_s": 21.0,
        "pool_lag_s": {"p50": 2.0, "max": 6.0},
    }
    # A stage not done by every object has no time (not the time of those done).
    pools[1]["status"]["conditions"] = [cond("Ready", 21, status="False")]
    assert ready_timeline(start, daemonsets, pods, pools)["pools_ready_s"] is None
    # An unreadable stamp loses that stage's time, not the result.
    pods[0]["metadata"]["creationTimestamp"] = "yesterday"
    assert ready_timeline(start, daemonsets, pods, pools)["cache_pods_created_s"] is None
