"""`python -m bench report`: the latest receipt of each lane as Markdown (figures, ratios, goals
met or missed), written to bench/receipts/REPORT.md, and a PNG plot when matplotlib imports."""

from __future__ import annotations

import json
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


def lane_markdown(path: Path, body: dict[str, Any]) -> str:
    git = body.get("git", {})
    machine = body.get("machine", {})
    lines = [
        f"## {body['lane']}",
        "",
        f"`{path.name}` · {body.get('at')} · git {str(git.get('sha'))[:10]}"
        f"{' (dirty)' if git.get('dirty') else ''} · {machine.get('cpu_count')} cores, "
        f"{machine.get('memory_total_mb')} MB, Python {machine.get('python')}"
        f" · load {machine.get('load_before', [None])[0]} → {machine.get('load_after', [None])[0]}",
        "",
    ]
    if body.get("skipped"):
        return "\n".join([*lines, f"_{body['skipped']}_", ""])
    if body.get("baseline"):
        lines += [f"Baseline: {body['baseline']}", ""]
    lines += ["| goal | target | measured | |", "|---|---|---|---|"]
    for entry in body.get("goals", []):
        measured = json.dumps(entry.get("measured"), ensure_ascii=False)
        lines.append(f"| {entry['goal']} | {entry['target']} | {measured} | {MARK[entry.get('met')]} |")
    lines += ["", "| figure | value |", "|---|---|"]
    for key, value in flatten(body.get("figures", {})):
        if any(part in key for part in KEEP) and not isinstance(value, list):
            lines.append(f"| {key} | {value} |")
    for note in body.get("notes", []):
        lines.append(f"\n- {note}")
    return "\n".join([*lines, ""])


def plot(latest: dict[str, tuple[Path, dict[str, Any]]], out: Path) -> str:
    """One bar per measured ratio (subject / baseline), with 1.0 marked. Returns a status line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not importable (install it to get bench/receipts/report.png)"
    labels, values = [], []
    for lane, (_, body) in latest.items():
        for key, value in flatten(body.get("ratios", {})):
            if isinstance(value, (int, float)):
                labels.append(f"{lane}: {key}")
                values.append(value)
    if not values:
        return "no plot: no ratios in the latest receipts"
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(values) + 1.5))
    ax.barh(labels, values)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("subject / baseline (lower is better for latency, higher for throughput)")
    ax.invert_yaxis()
    fig.tight_layout()
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
