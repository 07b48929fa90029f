"""What a bench run shows a person: a short goals table per lane, a report with rounded figures
that flags a loaded host, and a plot with a title, labels and a marker per goal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report import describe_measured, figure, goals_table, lane_markdown

RECEIPT: dict[str, Any] = {
    "lane": "turn",
    "at": "2026-12-04T21:00:00Z",
    "receipt_path": "/tmp/turn-1.json",
    "git": {"sha": "0123456789abcdef", "dirty": False},
    "machine": {
        "cpu_count": 2,
        "memory_total_mb": 24000,
        "python": "3.11",
        "load_before": [3.39111328125, 1, 1],
        "load_after": [1.5, 1, 1],
    },
    "figures": {"end_to_end_new_session": {"subject": {"p50_ms": 91.98765432, "n": 40}}},
    "ratios": {"new_session_vs_floor": {"ratio_p50": 1.4781}},
    "goals": [
        {
            "goal": "end_to_end",
            "target": "p50 ≤ 1.3 x floor + 20 ms",
            "measured": {"p50_ms": 85.349123, "limit_ms": 149.98},
            "met": True,
        },
        {"goal": "first_byte", "target": "p50 ≤ 3 ms", "measured": 5.76312, "met": False},
        {"goal": "live", "target": "reported", "measured": None, "met": None},
    ],
}


def test_measured_values_read_as_rounded_words_not_json() -> None:
    assert describe_measured(5.76312) == "5.76"
    assert describe_measured({"p50_ms": 85.349123, "limit_ms": 149.98}) == "p50_ms 85.3, limit_ms 150"
    assert (
        describe_measured({"1": {"efficiency": 0.9751, "cpu_bound": False}})
        == "1: (efficiency 0.975, cpu_bound no)"
    )
    assert describe_measured(None) == "—"
    assert describe_measured(2000) == "2000"


def test_a_lane_prints_its_goals_as_a_short_table_and_its_receipt_path() -> None:
    table = goals_table(RECEIPT)
    lines = table.splitlines()
    assert len(lines) <= 8
    assert lines[0].split() == ["goal", "measured", "met"]
    assert any(line.split()[:1] == ["first_byte"] and line.rstrip().endswith("MISSED") for line in lines)
    assert "{" not in table and "85.3" in table
    assert lines[-1] == "receipt: /tmp/turn-1.json"


def test_the_report_rounds_and_flags_a_host_busier_than_its_cores() -> None:
    markdown = lane_markdown(Path("turn-1.json"), RECEIPT)
    assert "3.39111328125" not in markdown and "load 3.39 → 1.5" in markdown
    assert "loaded host" in markdown
    assert '{"p50_ms"' not in markdown and "p50_ms 85.3, limit_ms 150" in markdown
    assert "| end_to_end_new_session.subject.p50_ms | 92 |" in markdown
    calm = {
        **RECEIPT,
        "machine": {**RECEIPT["machine"], "load_before": [0.4, 0, 0], "load_after": [0.5, 0, 0]},
    }
    assert "loaded host" not in lane_markdown(Path("turn-1.json"), calm)


def test_the_plot_has_a_title_axis_labels_and_a_marker_per_goal() -> None:
    fig = figure({"turn": (Path("turn-1.json"), RECEIPT)})
    assert fig is not None
    assert fig.get_suptitle()
    ratios, goals = fig.axes
    assert ratios.get_xlabel() and goals.get_xlabel()
    assert len(goals.collections[0].get_offsets()) == len(RECEIPT["goals"])
    shown = [label.get_text() for label in goals.get_yticklabels()]
    assert shown == ["turn: end_to_end", "turn: first_byte", "turn: live"]
