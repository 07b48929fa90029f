"""The bench lanes still run end to end (tiny N, few samples). The receipts' shape is checked,
never their figures: goals are reported by the lanes, not asserted here."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench import (
    ab,
    density,
    fanout,
    harness,
    live,
    recovery,
    report,
    sandbox,
    scale,
    soak,
    stack,
    turn,
    workspace,
)
from tests.support.fake_provider import serve_fake_provider


@pytest.fixture(autouse=True)
def receipts_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Receipts go to a temp dir, not bench/receipts/."""
    monkeypatch.setattr(harness, "RECEIPTS", tmp_path)
    return tmp_path


def assert_receipt(body: dict[str, Any], lane: str) -> None:
    assert body["lane"] == lane
    assert Path(body["receipt_path"]).is_file()
    machine = body["machine"]
    assert machine["cpu_count"] and machine["memory_total_mb"] > 0 and machine["python"]
    assert len(machine["load_before"]) == len(machine["load_after"]) == 3
    assert "sha" in body["git"] and "dirty" in body["git"]
    assert body["parameters"]
    for entry in body["goals"]:
        assert set(entry) >= {"goal", "target", "measured", "met"}


def assert_both_sides(compared: dict[str, Any]) -> None:
    assert compared["subject"]["n"] == compared["baseline"]["n"] > 0
    for key in ("p50_ms", "p95_ms", "p99_ms"):
        assert compared["subject"][key] > 0 and compared["baseline"][key] > 0
    assert compared["ratio_p50"] > 0 and compared["ratio_p99"] > 0


def test_summary_reports_nearest_rank_percentiles() -> None:
    stats = harness.summary([i / 1000 for i in range(1, 101)])
    assert (stats["n"], stats["p50_ms"], stats["p95_ms"], stats["p99_ms"]) == (100, 50.0, 95.0, 99.0)


def test_interleave_alternates_the_sides_after_warmup() -> None:
    order: list[str] = []

    def side(name: str) -> Callable[[], float]:
        def call() -> float:
            order.append(name)
            return 0.001

        return call

    sides = {name: side(name) for name in ("a", "b")}
    samples = harness.interleave(sides, warmup=1, repeats=4)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert len(samples["a"]) == len(samples["b"]) == 4


def test_the_sandbox_lane_measures_both_sides() -> None:
    body = sandbox.run(quick=True)
    assert_receipt(body, "sandbox")
    for name in ("cell", "tool_call"):
        assert_both_sides(body["figures"][name])
    assert body["figures"]["lease_from_pool"]["acquire"]["n"] > 0
    assert body["parameters"]["sandbox_mode"]
    assert body["figures"]["pipe_round_trip"]["n"] == body["figures"]["cell"]["subject"]["n"]
    assert 0 < body["figures"]["cell_ratio_less_one_boundary"] < body["ratios"]["cell"]["ratio_p50"]
    assert_both_sides(body["figures"]["turn"])  # the same Turn on bwrap and on LocalInterpreter
    cpu = body["figures"]["cell_cpu"]  # every process of each side: none may be missed
    assert cpu["fleet_repl_us"] > 0 and cpu["local_subprocess_us"] > 0
    assert cpu["fleet_us"] == pytest.approx(cpu["fleet_host_us"] + cpu["fleet_repl_us"], abs=0.2)
    (turn_goal,) = [g for g in body["goals"] if g["goal"] == "turn_on_bwrap"]
    assert turn_goal["measured"] == body["ratios"]["turn"]["ratio_p50"]


def test_the_turn_lane_measures_fleet_and_the_in_process_floor() -> None:
    body = turn.run(quick=True, repeats=2, warmup=1)
    assert_receipt(body, "turn")
    assert_both_sides(body["figures"]["end_to_end_new_session"])
    assert_both_sides(body["figures"]["end_to_end_same_session"])
    assert body["figures"]["first_byte"]["n"] == 4  # two samples of each kind of Turn
    timing = body["figures"]["first_byte_server_timing"]
    assert timing["claim"]["n"] == timing["enqueue"]["n"] == 4 and timing["claim"]["p50_ms"] > 0
    assert body["figures"]["aiosqlite_hop"]["p50_ms"] > 0
    # The first byte's own floor (bench/first_byte_floor.py) answered in the same rounds.
    assert body["figures"]["first_byte_floor"]["n"] == 2 and body["figures"]["first_byte_floor"]["p50_ms"] > 0
    assert body["ratios"]["first_byte_vs_floor"]["ratio_p50"] > 0


def test_the_ab_comparison_runs_two_checkouts_side_by_side() -> None:
    """This checkout against itself (its own .venv as the other one): both stacks run Turns."""
    body = ab.run(harness.REPO, repeats=2, warmup=1)
    assert_receipt(body, "ab")
    for kind in ab.KINDS:
        assert_both_sides(body["figures"][f"first_byte_{kind}"])
        assert_both_sides(body["figures"][f"end_to_end_{kind}"])
    timing = body["figures"]["server_timing"]
    assert timing["this.claim"]["n"] == timing["base.claim"]["n"] == 4
    assert body["figures"]["base_sha"] == body["git"]["sha"]


def test_the_ab_paired_difference_is_the_median_of_each_rounds_difference() -> None:
    base = [0.050 + i / 1000 for i in range(20)]  # seconds; a drift both sides share
    mine = [b + 0.002 for b in base]
    mine[3] += 0.5  # one outlier moves the median of the differences no further than one rank
    diff = ab.paired_difference(mine, base)
    assert diff["n"] == 20 and diff["median_ms"] == pytest.approx(2.0)
    assert diff["ci95_ms"] == pytest.approx([2.0, 2.0])
    assert ab.median_interval(20) == (5, 14)  # ranks 6 and 15 of 20: the sign test's 95% interval
    assert ab.median_interval(5) == (None, 4)  # too few samples for one


def test_the_workspace_lane_measures_lease_starts_settlements_and_the_turn() -> None:
    body = workspace.run(quick=True, files=20, large_mib=1, rounds=1, base=harness.REPO, turn_repeats=1,
                         delay_s=0.05)  # fmt: skip
    assert_receipt(body, "workspace")
    shapes = body["parameters"]["shapes"]
    assert shapes["small"]["files"] == 20 and shapes["large"]["files"] == 21
    assert shapes["large"]["bytes"] - shapes["small"]["bytes"] == 2**20
    for shape in ("small", "large"):
        starts = body["figures"][f"lease_start_{shape}"]
        for state in workspace.STATES:
            assert starts[state]["n"] == 1 and starts[state]["p50_ms"] > 0
        assert set(starts["over_today_p50_ms"]) == {"warm", "restarted", "cold"}
    settled = body["figures"]["settlement"]
    assert {name: stats["n"] for name, stats in settled.items()} == {
        "unchanged_small": 1, "one_small_changed": 1, "unchanged_large": 1, "one_large_changed": 1,
        "walk_small": 1,
    }  # fmt: skip
    assert body["figures"]["store_get"]["n"] == 20 and settled["walk_small"]["p50_ms"] > 0
    # This checkout against itself: an empty workspace, then 20 files, at both LM latencies.
    for name in ("turn_empty_delay_0", "turn_files_20_delay_0", "turn_files_20_delay_0.05"):
        turns = body["figures"][name]
        assert_both_sides(turns["end_to_end_same_session"])
        assert turns["paired_diff_same_session"]["n"] == 1
    assert [g["goal"] for g in body["goals"]] == ["warm_turn", "warm_turn_files"]
    assert all(isinstance(g["met"], bool) for g in body["goals"])


def test_the_ab_order_never_posts_one_sides_kind_twice_in_a_row() -> None:
    """Back to back in one session, a Turn finds its REPL still starting: that side would look
    slower for the order's sake alone."""
    sequence = [step for index in range(6) for step in ab.paired_order(index)]
    assert all(before != after for before, after in itertools.pairwise(sequence))
    for index in range(6):
        assert sorted(ab.paired_order(index)) == sorted(
            (side, kind) for side in ("this", "base") for kind in ab.KINDS
        )
    assert ab.paired_order(0)[0][0] != ab.paired_order(1)[0][0]  # who goes first alternates


def test_the_ab_comparison_needs_the_other_checkouts_venv(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="uv sync"):
        ab.run(tmp_path, repeats=1, warmup=0)


def test_the_fanout_lane_measures_streams_raw_pubsub_the_relay_and_the_asgi_floor() -> None:
    body = fanout.run(quick=True, streams=(5,), events=5)
    assert_receipt(body, "fanout")
    (level,) = body["figures"]["levels"]
    assert level["server"] == "gateway"
    assert level["held"] == 5 and level["delivered"] == 25
    assert level["sse"]["n"] > 0 and level["raw"]["n"] == 5
    assert level["ratio_p99"] > 0 and level["rss_mb_held"] > 0
    assert level["serial_fanout_ms"] == pytest.approx(level["cpu_us_per_delivery"] * 5 / 1000, rel=0.01)
    assert level["write_floor_us"] > 0  # the same run's bare loopback send, beside the gateway's
    assert "vs" in next(g for g in body["goals"] if g["goal"] == "cpu_per_delivery")["note"]
    (relayed,) = body["figures"]["relay_levels"]  # the FastAPI + sse-starlette baseline
    assert relayed["server"] == "relay"
    assert relayed["held"] == 5 and relayed["delivered"] == 25 and relayed["completed"] == 5
    (floored,) = body["figures"]["asgi_floor_levels"]  # the bare ASGI server on Granian
    assert floored["server"] == "asgi_floor"
    assert floored["held"] == 5 and floored["delivered"] == 25 and floored["completed"] == 5
    assert level["asgi_floor_us"] == floored["cpu_us_per_delivery"]
    # At 25 deliveries either CPU figure may round to zero ticks: then there is no ratio.
    assert body["ratios"].get("cpu_vs_asgi_floor@5") == level["cpu_vs_asgi_floor"]


def test_the_scale_lane_compares_worker_counts() -> None:
    body = scale.run(quick=True, workers=(1, 2), rounds=1, waves=1, delay_s=0.05, concurrency=(1, 2))
    assert_receipt(body, "scale")
    assert body["figures"]["workers_1"]["mean_turns_per_s"] > 0
    assert 0 < body["figures"]["workers_1"]["machine_busy_cores"] <= body["machine"]["cpu_count"] + 0.1
    assert body["figures"]["workers_2"]["worker_cpu_ms_per_turn"] > 0
    assert 0 <= body["figures"]["workers_2"]["machine_saturated_fraction"] <= 1
    assert body["ratios"]["throughput_2_vs_1"] > 0
    assert body["ratios"]["concurrency_2_vs_1"] > 0
    level = body["figures"]["concurrency_2"]
    assert level["worker_cpu_cores"] > 0 and level["worker_cpu_ms_per_turn"] > 0
    assert 0 < level["machine_busy_cores"] <= body["machine"]["cpu_count"] + 0.1
    assert 0 <= level["machine_saturated_fraction"] <= 1


def test_the_density_lane_finds_a_knee_and_the_memory_per_turn() -> None:
    body = density.run(quick=True, levels=(1, 2), turns_each=1)
    assert_receipt(body, "density")
    figures = body["figures"]
    assert figures["turn_time"]["1"]["n"] == 2 and figures["turn_time"]["2"]["n"] == 4  # up, then down
    assert figures["p95_over_one_turn"]["1"] == 1.0 and figures["knee_turns_in_flight"] in (1, 2)
    assert figures["worker_tree_rss_at_rest_mb"] > 0
    assert set(figures["worker_tree_rss_per_live_turn_mb"]) == {"1", "2"}
    assert body["parameters"]["provider_ttft_s"] == 0.4


def test_the_recovery_lane_times_a_kill_and_a_cancel() -> None:
    body = recovery.run(quick=True, kills=1, cancels=1)
    assert_receipt(body, "recovery")
    assert body["figures"]["kill_to_stream_end"]["n"] == body["figures"]["cancel_to_abort"]["n"] == 1
    assert body["figures"]["outcomes"]["cancel"] == ["abort"]


def test_the_soak_lane_counts_turns_in_the_db() -> None:
    body = soak.run(quick=True, turns=6, parallel=3)
    assert_receipt(body, "soak")
    figures = body["figures"]
    assert figures["runs_in_db"] == 6 and figures["worker_rss_mb"]["end"] > 0
    assert isinstance(figures["lost"], int) and isinstance(figures["duplicated"], int)


def test_the_live_lane_skips_without_a_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEET_LM_MODEL", raising=False)
    body = live.run(quick=True)
    assert_receipt(body, "live")
    assert "FLEET_LM_MODEL" in body["skipped"]


# The root LM's one action for every niah row: find the fact in the attachment, submit it.
NIAH_SOLVER = (
    "[[ ## reasoning ## ]]\nSearch the attached document for the fact.\n\n[[ ## code ## ]]\n"
    "import glob, re\ntext = open(glob.glob('attachments/*.txt')[0]).read()\n"
    "found = re.search(r'The secret code for \\S+ is (\\d+)', text)\nSUBMIT(answer=found.group(1))\n\n"
    "[[ ## completed ## ]]"
)


def test_the_live_lane_scores_a_generated_dataset_on_an_openai_compatible_endpoint(
    receipts_in_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lane's whole path offline: a loopback OpenAI-compatible server stands in for the
    provider (its replies scripted), and the receipt has accuracy, $ per query and p50/p95."""
    with serve_fake_provider() as fake:
        fake.replies = [NIAH_SOLVER] * 4
        monkeypatch.setenv("FLEET_LM_MODEL", "openai/fake-model")
        monkeypatch.setenv("FLEET_LM_BASE_URL", fake.url)
        monkeypatch.setenv("FLEET_LM_API_KEY", "sk-fake")
        monkeypatch.setenv("FLEET_BENCH_PRICE_INPUT_PER_MTOK", "1")
        monkeypatch.setenv("FLEET_BENCH_PRICE_OUTPUT_PER_MTOK", "2")
        body = live.run(quick=True, dataset="niah", rows=2)
    assert_receipt(body, "live")
    niah = body["figures"]["niah"]
    assert niah["accuracy"] == 1.0 and niah["failed"] == 0
    assert niah["lm_calls"] == 2 and len(fake.requests) == 2  # one action per row
    # 11 prompt and 7 completion tokens a call (the fake's usage), at 1 and 2 USD per million.
    assert niah["usd_per_query"] == pytest.approx(11e-6 + 14e-6)
    assert 0 < niah["seconds_p50"] <= niah["seconds_p95"]
    kept = json.loads((receipts_in_tmp / niah["eval_receipt"]).read_text())
    assert [row["score"] for row in kept["rows"]] == [1.0, 1.0]
    assert kept["dataset"]["sha256"] == niah["dataset_sha256"]


def test_the_report_renders_the_latest_receipts(receipts_in_tmp: Path) -> None:
    harness.Receipt("demo", {"n": 1}, figures={"x": {"p50_ms": 1.0}}).write(receipts_in_tmp)
    markdown, written = report.write_report(receipts_in_tmp)
    assert "## demo" in markdown and "x.p50_ms" in markdown
    assert (receipts_in_tmp / "REPORT.md") in written
    assert written == [receipts_in_tmp / "REPORT.md"]  # no ratios in the receipt: nothing to plot
    harness.Receipt("demo", {"n": 1}, ratios={"x": {"ratio_p50": 1.2}}).write(receipts_in_tmp)
    _, written = report.write_report(receipts_in_tmp)
    png = receipts_in_tmp / "report.png"
    assert png in written and png.read_bytes().startswith(b"\x89PNG")


def test_the_fanout_notes_set_the_2000_stream_goal_against_the_floors() -> None:
    level = {"streams": 2000, "serial_fanout_ms": 22.6, "cpu_us_per_delivery": 11.3,
             "raw": {"n": 50, "p99_ms": 4.0}, "write_floor_us": 7.5, "asgi_floor_us": 9.1}  # fmt: skip
    floor = {"ratio_p99": 30.2, "sse": {"p99_ms": 120.8}, "cpu_us_per_delivery": 9.1}
    notes = fanout.serial_note({2000: level}, {2000: floor})
    assert "under 3.0 µs per delivery" in notes[0]  # 1.5 x 4 ms over 2,000 deliveries
    assert "takes 15.0 ms, against the 6.0 ms" in notes[1]  # 7.5 µs x 2,000
    assert "reached 30.2 x raw at 2,000 streams" in notes[2]
    assert fanout.floor_note([level]).endswith("2000: 11.3 vs 9.1 vs 7.5")
    assert fanout.serial_note({2000: {**level, "write_floor_us": None}}, {})[1:] == []


def test_throughput_counts_each_turn_by_its_share_of_the_window() -> None:
    def turn(start: float, seconds: float) -> Any:
        return stack.StreamResult(200, "run", start, 0.0, None, seconds, True, b"")

    # One client, Turns of 1 s back to back from t=0: one Turn per second, whatever the window.
    chain = [turn(float(t), 1.0) for t in range(10)]
    assert stack.turns_per_second(chain, 1.5, 4.0) == pytest.approx(1.0)
    # Turns partly inside the window count by their share: half of each here, over 2 s.
    assert stack.turns_per_second([turn(0.0, 2.0), turn(0.0, 4.0)], 1.0, 3.0) == pytest.approx(0.5)
