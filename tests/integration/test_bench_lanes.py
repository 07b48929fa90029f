"""The bench lanes still run (a smoke run with few samples; their figures are not asserted)."""

from __future__ import annotations

from bench import sandbox


def test_the_sandbox_lane_measures_both_sides() -> None:
    receipt = sandbox.run(quick=True)
    for name in ("cell", "tool_call"):
        assert receipt[name]["fleet"]["n"] == receipt[name]["baseline"]["n"] > 0
        assert receipt[name]["ratio_p50"] > 0
    assert receipt["lease_from_pool"]["acquire"]["n"] > 0
    assert receipt["sandbox_mode"]
