"""``kvfabric bench routing --quick`` runs end to end and reports every measurement (no thresholds)."""

from __future__ import annotations

import json

import pytest

from kvfabric.bench import routing
from kvfabric.cli.main import build_parser

pytestmark = [pytest.mark.process, pytest.mark.slow]


def test_bench_routing_quick_reports_every_measurement(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["bench", "routing", "--quick", "--json", "--seconds", "5"])
    assert routing.run(args) == 0
    everything = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # Every part runs by default: the churn, the routing effect, the event cost, the announcement.
    assert set(everything) == {"churn", "routing_effect", "event_cost_per_node", "startup_announcement"}
    result = everything["churn"]
    for key in ("precision_feed", "recall_feed", "precision_stores_only", "removal_to_router_ms"):
        assert result[key] is not None, key
    assert "dram_withdrawn_s" in result["cache_server_restart"]
    assert result["violations"]["double_stores"] == 0
    assert result["violations"]["removals_of_unheld"] == 0
    assert result["violations"]["clears"] == 0
