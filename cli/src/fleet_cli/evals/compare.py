"""`fleet eval compare A.json B.json`: B against A, row by row on the rows both ran, with a
paired significance test, and their cost and time side by side."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fleet_cli.evals.stats import paired_test

ALPHA = 0.05


class ReceiptError(ValueError):
    pass


def load_receipt(path: Path) -> dict[str, Any]:
    try:
        receipt: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ReceiptError(f"{path}: {exc}") from exc
    if not isinstance(receipt, dict) or not str(receipt.get("kind", "")).startswith("fleet-eval/"):
        raise ReceiptError(f"{path}: not a `fleet eval` receipt")
    rows = receipt.get("rows")
    if (
        not isinstance(rows, list)
        or not all(isinstance(r, dict) and {"id", "score", "status"} <= r.keys() for r in rows)
        or not isinstance(receipt.get("totals"), dict)
        or not isinstance(receipt.get("dataset"), dict)
    ):
        raise ReceiptError(f"{path}: a `fleet eval` receipt without its rows, totals or dataset")
    return receipt


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The comparison as data: the rows that changed, the test, and the totals of both."""
    rows_a = {r["id"]: r for r in a["rows"]}
    rows_b = {r["id"]: r for r in b["rows"]}
    shared = [i for i in rows_a if i in rows_b]
    pairs = [
        (rows_a[i]["score"], rows_b[i]["score"])
        for i in shared
        if rows_a[i]["score"] is not None and rows_b[i]["score"] is not None
    ]
    p_value, test = paired_test(pairs) if pairs else (None, "no row scored in both")
    changed = [
        {"id": i, "a": rows_a[i]["score"], "b": rows_b[i]["score"], "a_status": rows_a[i]["status"],
         "b_status": rows_b[i]["status"]}
        for i in shared
        if rows_a[i]["score"] != rows_b[i]["score"] or rows_a[i]["status"] != rows_b[i]["status"]
    ]  # fmt: skip
    mean_a = sum(x for x, _ in pairs) / len(pairs) if pairs else None
    mean_b = sum(y for _, y in pairs) / len(pairs) if pairs else None
    return {
        "paired_rows": len(pairs),
        "only_in_a": sorted(set(rows_a) - set(rows_b)),
        "only_in_b": sorted(set(rows_b) - set(rows_a)),
        "mean_a": mean_a,
        "mean_b": mean_b,
        "p_value": p_value,
        "test": test,
        "significant": p_value is not None and p_value < ALPHA,
        "changed": changed,
        "same_dataset": a["dataset"].get("sha256") == b["dataset"].get("sha256"),
        "totals": {"a": a["totals"], "b": b["totals"]},
    }


def render(result: dict[str, Any], name_a: str, name_b: str) -> str:
    lines = [f"A = {name_a}", f"B = {name_b}"]
    if not result["same_dataset"]:
        lines.append("note: the receipts ran different datasets (their sha256 differ); rows are paired by id")
    lines.append(f"{'row':<30} {'A':>6} {'B':>6}")
    for row in result["changed"]:
        a = "-" if row["a"] is None else f"{row['a']:.2f}"
        b = "-" if row["b"] is None else f"{row['b']:.2f}"
        lines.append(f"{row['id'][:30]:<30} {a:>6} {b:>6}  ({row['a_status']} -> {row['b_status']})")
    if not result["changed"]:
        lines.append("(no row changed)")
    for side in ("a", "b"):
        only = result[f"only_in_{side}"]
        if only:
            lines.append(f"only in {side.upper()}: {', '.join(only[:20])}{' ...' if len(only) > 20 else ''}")
    if result["mean_a"] is not None:
        mean_a, mean_b = result["mean_a"], result["mean_b"]
        lines.append(
            f"mean score on {result['paired_rows']} paired rows: A {mean_a:.4f}, B {mean_b:.4f} "
            f"(B - A = {mean_b - mean_a:+.4f})"
        )
    if result["p_value"] is not None:
        verdict = "significant" if result["significant"] else "not significant"
        lines.append(f"{result['test']}: p = {result['p_value']:.4g} ({verdict} at {ALPHA})")
    else:
        lines.append(result["test"])
    ta, tb = result["totals"]["a"], result["totals"]["b"]
    for key in ("usd_per_query", "seconds_p50", "seconds_p95", "lm_calls", "failed"):
        lines.append(f"{key:<14} A {fmt(ta.get(key))}  B {fmt(tb.get(key))}")
    return "\n".join(lines)


def fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
