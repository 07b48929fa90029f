"""`python -m bench report`: the latest receipt of each lane as Markdown (figures, ratios, goals
met or missed), written to bench/receipts/REPORT.md, and a PNG plot when matplotlib imports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import latest_receipts

MARK = {True: "met", False: "MISSED", None: "not measured"}


def flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """`a.b.p50_ms = 1.2` rows of a nested figures block (lists of dicts keyed by position)."""
    if isinstance(value, dict):
        rows: list[tuple[str, Any]] = []
        for key, inner in value.items():
            rows += flatten(inner, f"{prefix}.{key}" if prefix else str(key))
        return rows
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        rows = []
        for index, inner in enumerate(value):
            label = inner.get("streams", index) if isinstance(inner, dict) else index
            rows += flatten({k: v for k, v in inner.items()}, f"{prefix}[{label}]")
        return rows
    return [(prefix, value)]


KEEP = ("p50_ms", "p95_ms", "p99_ms", "n", "held", "delivered", "ratio", "per_s", "cpu_us", "rss",
        "lost", "duplicated", "growth", "accuracy", "usd", "overhead")  # fmt: skip


def rounded(value: Any) -> Any:
    """Three significant figures for a float (never fewer digits than its integer part)."""
    if isinstance(value, float):
        return float(f"{value:.3g}") if abs(value) < 1000 else round(value)
    return value


def describe_measured(value: Any) -> str:
    """A goal's measured value in words: rounded numbers, `key value` pairs, no JSON."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        shown = rounded(value)
        return str(int(shown)) if float(shown).is_integer() else str(shown)
    if isinstance(value, dict):
        return ", ".join(
            f"{key}: ({describe_measured(inner)})"
            if isinstance(inner, dict)
            else f"{key} {describe_measured(inner)}"
            for key, inner in value.items()
        )
    return str(value)


def load_of(machine: dict[str, Any]) -> tuple[float | None, float | None]:
    before, after = machine.get("load_before") or [None], machine.get("load_after") or [None]
    return before[0], after[0]


def loaded_host(machine: dict[str, Any]) -> str | None:
    """A note when the host ran more than its cores' worth of work: the figures are suspect."""
    cores = machine.get("cpu_count")
    loads = [load for load in load_of(machine) if isinstance(load, (int, float))]
    if not cores or not loads or max(loads) <= cores:
        return None
    load = describe_measured(float(max(loads)))
    return f"loaded host: a load of {load} on {cores} cores, so these figures are suspect"


def goals_table(body: dict[str, Any]) -> str:
    """What a lane prints when it ends: its goals (goal, measured, met) and its receipt's path."""
    rows = [("goal", "measured", "met")]
    rows += [
        (g["goal"], describe_measured(g.get("measured")), MARK[g.get("met")]) for g in body.get("goals", [])
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(2)]
    lines = [f"{goal:<{widths[0]}}  {measured:<{widths[1]}}  {met}" for goal, measured, met in rows]
    if note := loaded_host(body.get("machine", {})):
        lines.append(note)
    return "\n".join([*lines, f"receipt: {body.get('receipt_path')}"])


def lane_markdown(path: Path, body: dict[str, Any]) -> str:
    git = body.get("git", {})
    machine = body.get("machine", {})
    before, after = (describe_measured(load) for load in load_of(machine))
    lines = [
        f"## {body['lane']}",
        "",
        f"`{path.name}` · {body.get('at')} · git {str(git.get('sha'))[:10]}"
        f"{' (dirty)' if git.get('dirty') else ''} · {machine.get('cpu_count')} cores, "
        f"{machine.get('memory_total_mb')} MB, Python {machine.get('python')} · load {before} → {after}",
        "",
    ]
    if note := loaded_host(machine):
        lines += [f"**{note}**", ""]
    if body.get("skipped"):
        return "\n".join([*lines, f"_{body['skipped']}_", ""])
    if body.get("baseline"):
        lines += [f"Baseline: {body['baseline']}", ""]
    lines += ["| goal | target | measured | |", "|---|---|---|---|"]
    for entry in body.get("goals", []):
        measured = describe_measured(entry.get("measured"))
        lines.append(f"| {entry['goal']} | {entry['target']} | {measured} | {MARK[entry.get('met')]} |")
    lines += ["", "| figure | value |", "|---|---|"]
    for key, value in flatten(body.get("figures", {})):
        if any(part in key for part in KEEP) and not isinstance(value, list):
            lines.append(f"| {key} | {describe_measured(value)} |")
    for note in body.get("notes", []):
        lines.append(f"\n- {note}")
    return "\n".join([*lines, ""])


GOAL_COLOURS = {True: "tab:green", False: "tab:red", None: "tab:gray"}


def figure(latest: dict[str, tuple[Path, dict[str, Any]]]) -> Any:
    """Two panels: each measured ratio (subject / baseline, 1.0 marked), and each goal as a
    marker coloured by met, missed or not measured. None without matplotlib or anything to show."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels, values = [], []
    goals: list[tuple[str, bool | None]] = []
    for lane, (_, body) in latest.items():
        for key, value in flatten(body.get("ratios", {})):
            if isinstance(value, (int, float)):
                labels.append(f"{lane}: {key}")
                values.append(value)
        goals += [(f"{lane}: {g['goal']}", g.get("met")) for g in body.get("goals", [])]
    if not values and not goals:
        return None
    rows = max(len(values), 1) + max(len(goals), 1)
    fig, (ratios, met) = plt.subplots(
        2, 1, figsize=(9, 0.3 * rows + 2.5), height_ratios=[max(len(values), 1), max(len(goals), 1)]
    )
    fig.suptitle("fleet bench: the latest receipt of each lane")
    ratios.barh(labels, values)
    ratios.axvline(1.0, color="black", linewidth=1)
    ratios.set_xlabel("subject / baseline (lower is better for latency, higher for throughput)")
    ratios.invert_yaxis()
    names = [name for name, _ in goals]
    met.scatter([1] * len(goals), names, c=[GOAL_COLOURS[state] for _, state in goals], s=60)
    met.set_xticks([])
    met.set_xlabel("goals: green met, red missed, grey not measured")
    met.invert_yaxis()
    fig.tight_layout()
    return fig


def plot(latest: dict[str, tuple[Path, dict[str, Any]]], out: Path) -> str:
    """The figure as a PNG. Returns a status line."""
    fig = figure(latest)
    if fig is None:
        return "no plot: matplotlib is not importable, or the receipts hold no ratio or goal"
    import matplotlib.pyplot as plt

    fig.savefig(out, dpi=110)
    plt.close(fig)
    return f"plot: {out.name}"


def write_report(directory: Path | None = None) -> tuple[str, list[Path]]:
    directory = directory or harness.RECEIPTS
    latest = latest_receipts(directory)
    parts = ["# fleet bench: latest receipts", ""]
    if not latest:
        parts.append("No receipts yet: run `just bench --quick`.")
    png = directory / "report.png"
    status = plot(latest, png) if latest else "no plot: no receipts"
    parts += [f"_{status}_", ""]
    parts += [lane_markdown(path, body) for lane, (path, body) in latest.items()]
    markdown = "\n".join(parts)
    directory.mkdir(parents=True, exist_ok=True)
    md_path = directory / "REPORT.md"
    md_path.write_text(markdown)
    written = [md_path] + ([png] if png.exists() and status.startswith("plot") else [])
    return markdown, written
