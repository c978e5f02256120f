"""``kvfabric bench suite``: the table over N runs' JSON, and the goals the suite reads from each bench."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from kvfabric.bench.report import Target, judge, spread
from kvfabric.bench.suite import ROWS, Row, build_rows, find_targets, markdown, parse_output, run
from kvfabric.bench.ttft import hung_spreads
from kvfabric.bench.vllm import chat_verdicts, length_verdicts
from kvfabric.cli.main import build_parser


def _doc(*targets: tuple[Target, list[float]]) -> dict[str, Any]:
    """A benchmark's JSON document judging each target on the given per-round samples."""
    spreads = {t.measure: spread(xs) for t, xs in targets}
    return {
        "spread": {k: v.as_dict() for k, v in spreads.items()},
        "targets": judge([t for t, _ in targets], spreads),
    }


SHM = Target("shm load / memcpy", "shm_load_over_memcpy", ">=", 0.9)
ROW = Row("shm load / memcpy", "storage", "shm_load_over_memcpy")


def test_a_goal_met_in_two_of_three_runs_is_some_with_each_runs_spread_and_the_spread_across_runs() -> None:
    docs = {"storage": [_doc((SHM, [0.95, 0.9, 1.0])), _doc((SHM, [0.5, 0.4, 0.6])), _doc((SHM, [0.92]))]}
    [r] = build_rows(docs, 3, [ROW])
    assert r.cells == ("0.95 (0.9-1)", "0.5 (0.4-0.6)", "0.92")
    assert r.across == "0.5-0.95"  # min-max of the runs' medians
    assert r.goal == ">= 0.9"
    assert r.met == "some 2/3"


def test_all_and_none() -> None:
    met = {"storage": [_doc((SHM, [1.0]))] * 3}
    missed = {"storage": [_doc((SHM, [0.1]))] * 3}
    assert build_rows(met, 3, [ROW])[0].met == "all 3/3"
    assert build_rows(missed, 3, [ROW])[0].met == "none 0/3"


def test_a_failed_run_is_shown_and_counts_as_not_met() -> None:
    docs = {"storage": [_doc((SHM, [1.0])), None, _doc((SHM, [0.99]))]}
    [r] = build_rows(docs, 3, [ROW])
    assert r.cells == ("1", "run failed", "0.99")
    assert r.across == "0.99-1"
    assert r.met == "some 2/3"


def test_a_missing_benchmark_and_a_row_no_bench_measures() -> None:
    rows = [ROW, Row("demo: first request overhead", None)]
    results = build_rows({}, 3, rows)
    assert [(r.cells, r.met) for r in results] == [
        (("not run",) * 3, "not run"),
        (("",) * 3, "not measured by a bench"),
    ]
    table = markdown(results, 3)
    assert "| demo: first request overhead |  |  |  |  |  | not measured by a bench |" in table
    assert table.splitlines()[0] == "| target | run 1 | run 2 | run 3 | across runs | goal | met |"


def test_a_target_its_bench_did_not_measure_in_a_run() -> None:
    never = Target("hung", "hung_server_added_ms", "<=", 5.0, stat="worst")
    docs = {"ttft": [{"targets": judge([never], {})}, _doc((never, [1.0, 2.0]))]}
    [r] = build_rows(docs, 2, [Row("hung", "ttft", "hung_server_added_ms")])
    assert r.cells == ("not measured", "1.5 (1-2)")
    assert r.met == "some 1/2"


def test_a_never_goal_is_judged_and_spread_on_each_runs_worst_round() -> None:
    never = Target("hung server ms", "hung_server_added_ms", "<=", 5.0, stat="worst")
    # Every run's median meets the goal; runs 1 and 3 have a round over it.
    docs = {
        "ttft": [_doc((never, [1.0, 1.0, 400.0])), _doc((never, [1.0, 2.0, 3.0])), _doc((never, [1, 9, 1]))]
    }
    [r] = build_rows(docs, 3, [Row("hung", "ttft", "hung_server_added_ms")])
    assert r.goal == "<= 5 (worst round)"
    assert r.met == "some 1/3"
    assert r.across == "3-400"  # the worst rounds, not the medians (all 1-2)
    lower = Target("identical", "identical", ">=", 1.0, stat="worst")
    docs = {"chat": [_doc((lower, [1.0, 0.5])), _doc((lower, [1.0]))]}
    [r] = build_rows(docs, 2, [Row("identical", "chat", "identical")])
    assert (r.across, r.met) == ("0.5-1", "some 1/2")


def test_a_run_below_the_goals_scale_is_named_so() -> None:
    from kvfabric.bench.operator import scale_verdicts

    small = {
        "nodes": 100,
        "pools": 10,
        "all_ready_s": 7.4,
        "storm": {"consumer_pods": 500, "injected_at_admission": 500},
    }
    full = {
        **small,
        "nodes": 1000,
        "pools": 100,
        "storm": {"consumer_pods": 5000, "injected_at_admission": 5000},
    }
    rows = [Row("operator: all pools Ready (s)", "operator", "all_ready_s")]
    [r] = build_rows({"operator": [{"scale": {"targets": scale_verdicts(small)}}]}, 1, rows)
    assert (r.name, r.cells, r.met) == ("operator: all pools Ready (s) (reduced scale)", ("7.4",), "all 1/1")
    [r] = build_rows({"operator": [{"scale": {"targets": scale_verdicts(full)}}]}, 1, rows)
    assert r.name == "operator: all pools Ready (s)"


def test_a_reported_value_without_a_goal_has_no_verdict() -> None:
    docs = {
        "operator": [
            {
                "scale": {
                    "targets": {
                        "peak RSS, MB": {
                            "measure": "operator",
                            "value": spread([260.0]).as_dict(),
                            "goal": "reported",
                            "met": None,
                        }
                    }
                }
            }
        ]
    }
    [r] = build_rows(docs, 1, [Row("peak RSS", "operator", "operator")])
    assert (r.cells, r.goal, r.met) == (("260",), "reported", "-")


def test_a_parametric_label_picks_the_right_one_of_two_targets_with_similar_measures() -> None:
    top = Target("lookup p99, 32 closed-loop clients x 128 keys (ms)", "lookup_best_c32_p99_ms", "<=", 0.05)
    cores = Target(
        "lookup p99, 2 closed-loop clients (<= 2 cores) x 128 keys (ms)", "lookup_best_c2_p99_ms", "<=", 0.05
    )
    docs = {"storage": [_doc((top, [9.0]), (cores, [0.04]))]}
    rows = [r for r in ROWS if r.name.startswith("lookup p99")]
    assert [(r.cells, r.met) for r in build_rows(docs, 1, rows)] == [
        (("0.04",), "all 1/1"),
        (("9",), "none 0/1"),
    ]


def test_every_row_of_the_performance_table_is_there_in_order() -> None:
    names = [r.name for r in ROWS]
    assert len(names) == len(set(names)) == 22
    assert {r.bench for r in ROWS} == {"storage", "ttft", "vllm", "chat", "operator"}


def test_output_parsing_finds_the_document_of_each_bench_shape() -> None:
    one = {"bench": "storage", "targets": {}}
    assert parse_output(json.dumps(one) + "\n") == one  # storage: one line
    assert parse_output(json.dumps({"scale": {"targets": {}}}, indent=2)) == {"scale": {"targets": {}}}
    lines = [
        json.dumps({"event": "started"}),
        json.dumps({"bench": "vllm", "targets": {"x": {}}}),
        "not json",
    ]
    assert parse_output("\n".join(lines)) == {"bench": "vllm", "targets": {"x": {}}}  # vllm: many lines
    assert parse_output("Traceback ...\n") is None
    assert find_targets(None) is None
    assert find_targets({"targets": {"a": {}}}) == {"a": {}}


def test_the_table_is_rebuilt_from_a_results_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "run1-storage.json").write_text(json.dumps({"bench": "storage", **_doc((SHM, [1.0]))}))
    (tmp_path / "run2-storage.json").write_text("Traceback: the bench crashed\n")
    args = build_parser().parse_args(["bench", "suite", "--runs", "3", "--from", str(tmp_path)])
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "| shm load / memcpy | 1 | run failed | run failed | 1-1 | >= 0.9 | some 1/3 |" in out
    assert "| operator: all pools Ready (s) | not run | not run | not run |  |  | not run |" in out
    # A run that printed its document but then exited non-zero is a failed run, as when it ran.
    (tmp_path / "run3-storage.json").write_text(json.dumps(_doc((SHM, [1.0]))))
    record = {
        "run": 3,
        "bench": "storage",
        "rc": 1,
        "wall_s": 9.5,
        "load_start": [1, 1, 1],
        "load_end": [2, 1, 1],
    }
    (tmp_path / "suite.json").write_text(json.dumps({"runs": [{**record, "memcpy_gbps": None}]}))
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "| shm load / memcpy | 1 | run failed | run failed | 1-1 | >= 0.9 | some 1/3 |" in out
    assert "| 3 | storage | 1 | 9.5 | 1-2 |  |" in out  # the runs' table from suite.json


def test_bad_options_name_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert run(parser.parse_args(["bench", "suite", "--only", "storage,gpu"])) == 2
    assert "--only" in capsys.readouterr().err
    assert run(parser.parse_args(["bench", "suite", "--args", "vlm=--quick"])) == 2
    assert "--args" in capsys.readouterr().err
    assert run(parser.parse_args(["bench", "suite", "--runs", "0"])) == 2
    assert "--runs" in capsys.readouterr().err


def test_vllm_length_table_judges_each_prompts_hit_against_vllms_own_hit() -> None:
    warm = {2048: [0.10, 0.10, 0.10], 8192: [0.2, 0.2, 0.2]}
    hit = {2048: [0.11, 0.13, 0.30], 8192: [0.3, 0.3, 0.3]}
    doc = length_verdicts(warm, hit)
    assert doc["spread"]["kvfabric_vs_vllm_warm_2048"] == {"median": 1.3, "min": 1.1, "max": 3.0, "rounds": 3}
    met = {v["measure"]: v["met"] for v in doc["targets"].values()}
    assert met == {"kvfabric_vs_vllm_warm_2048": False, "kvfabric_vs_vllm_warm_8192": False}
    doc = length_verdicts(warm, {2048: [0.1, 0.11, 0.5], 8192: [0.2, 0.2, 0.2]})
    assert all(v["met"] for v in doc["targets"].values())


def test_vllm_chat_verdicts() -> None:
    first_alone = [0.1] * 9 + [0.2]
    doc = chat_verdicts(first_alone, [0.1] * 9 + [0.21], [0.3, 0.3], [0.1, 0.1], identical=23, outputs=24)
    t = {v["measure"]: v for v in doc["targets"].values()}
    assert t["chat_rounds_2_plus_speedup_p50"]["value"]["median"] == 3.0
    assert t["chat_rounds_2_plus_speedup_p50"]["met"] is True
    # p90 of ten samples (nearest rank) is the 9th: 0.1 both, so the 5 % slower max is not judged.
    assert t["chat_round_1_p90_ratio"]["value"]["median"] == 1.0
    assert t["chat_round_1_p90_ratio"]["met"] is True
    assert t["chat_outputs_identical_fraction"]["met"] is False  # 23 of 24: a "never" goal
    slow = chat_verdicts([0.1] * 10, [0.11] * 10, [0.3], [0.1], identical=24, outputs=24)
    assert {v["measure"]: v["met"] for v in slow["targets"].values()} == {
        "chat_rounds_2_plus_speedup_p50": True,
        "chat_outputs_identical_fraction": True,
        "chat_round_1_p90_ratio": False,
    }


def test_the_suite_parses_and_says_what_it_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "suite", "--help"])
    out = capsys.readouterr().out
    assert "--runs" in out
    assert "--only" in out
    assert "markdown table" in out


@pytest.mark.process
def test_a_crashing_benchmark_loses_only_its_own_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    from kvfabric.bench import suite

    doc = json.dumps(
        {"bench": "storage", **_doc((SHM, [0.95, 0.9])), "spread": {"memcpy_gbps": spread([7.5]).as_dict()}}
    )
    scripts = {
        "storage": f"print({json.dumps(doc)})",
        "ttft": "import sys; print('half a line', flush=True); sys.stderr.write('boom\\n'); sys.exit(3)",
    }
    monkeypatch.setattr(suite, "_command", lambda name, _args: [sys.executable, "-c", scripts[name]])
    args = build_parser().parse_args(
        ["bench", "suite", "--runs", "2", "--only", "ttft,storage", "--out", str(tmp_path)]
    )
    assert run(args) == 1  # one benchmark failed
    out = capsys.readouterr().out
    assert (
        "| shm load / memcpy | 0.925 (0.9-0.95) | 0.925 (0.9-0.95) | 0.925-0.925 | >= 0.9 | all 2/2 |" in out
    )
    assert (
        "| restore efficiency (>= 16k, effective / raw) | run failed | run failed |  |  | none 0/2 |" in out
    )
    records = json.loads((tmp_path / "suite.json").read_text())["runs"]
    # The fixed order (storage before ttft), whatever --only says; every run recorded.
    assert [(r["run"], r["bench"], r["rc"], r["memcpy_gbps"]) for r in records] == [
        (1, "storage", 0, 7.5),
        (1, "ttft", 3, None),
        (2, "storage", 0, 7.5),
        (2, "ttft", 3, None),
    ]
    assert all(len(r["load_start"]) == 3 and r["wall_s"] >= 0 for r in records)
    assert (tmp_path / "run2-ttft.stderr").read_text() == "boom\n"
    assert (tmp_path / "run1-ttft.json").read_text() == "half a line\n"
    assert (tmp_path / "table.md").read_text().startswith("| target | run 1 | run 2 |")
    assert "| 2 | ttft | 3 |" in (tmp_path / "table.md").read_text()


def test_each_benchmark_runs_with_its_default_sizes_unless_replaced() -> None:
    from kvfabric.bench.suite import _command

    parser = build_parser()
    plain = parser.parse_args(["bench", "suite"])
    assert _command("chat", plain)[-4:] == ["bench", "vllm", "--chat", "--json"]
    assert _command("operator", plain)[-4:] == ["operator", "--scale", "--json", "--quick"]
    replaced = parser.parse_args(["bench", "suite", "--args", "operator=", "--args", "vllm=--repeats 3"])
    assert _command("operator", replaced)[-3:] == ["operator", "--scale", "--json"]  # the full scale
    assert _command("vllm", replaced)[-4:] == ["vllm", "--json", "--repeats", "3"]
    quick = parser.parse_args(["bench", "suite", "--quick", "--args", "storage=--quick"])
    assert _command("chat", quick)[-2:] == ["--json", "--quick"]
    assert _command("storage", quick).count("--quick") == 1


def test_ttft_reports_the_hung_servers_first_request_apart_from_the_rest() -> None:
    s = hung_spreads([495.0, 1.0, 0.5, 0.6, 0.7], [])
    assert s["hung_server_first_request_ms"].median == 495.0
    assert (s["hung_server_added_ms"].median, s["hung_server_added_ms"].max) == (0.7, 495.0)
    assert "hung_server_added_ms_rpc" not in s
    assert hung_spreads([], []) == {}


@pytest.mark.process
def test_a_benchmark_past_its_timeout_is_interrupted_so_it_can_clean_up(tmp_path: Path) -> None:
    import sys

    from kvfabric.bench.suite import run_one

    marker = tmp_path / "cleaned-up"
    script = (
        "import sys, time\n"
        "print('started', flush=True)\n"
        "try:\n    time.sleep(60)\n"
        f"finally:\n    open({str(marker)!r}, 'w').write('yes')\n"
    )
    t0 = time.monotonic()
    rc, out, err = run_one([sys.executable, "-c", script], timeout=3)
    assert time.monotonic() - t0 < 30
    assert (rc, out) == (-1, "started\n")
    assert err.endswith("kvfabric bench suite: timed out after 3 s\n")
    assert marker.read_text() == "yes"  # its finally ran: SIGINT, not a kill
