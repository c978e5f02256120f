"""The benchmark command lines the README shows parse, and ``bench operator --quick`` shrinks its sizes."""

from __future__ import annotations

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
