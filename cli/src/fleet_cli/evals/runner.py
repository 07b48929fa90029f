"""Run a dataset's rows as Turns, at most `concurrency` at once, and write the receipt: each row's
answer, score, iterations, LM calls, tokens, cost, time and failure code; totals with p50/p95;
and what was run (the dataset's hash, the git sha, the profile, the program and skill versions)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx

from fleet_cli.evals.dataset import Dataset, Metric, Row, metric_of
from fleet_cli.evals.gateway import Gateway, TurnRefused
from fleet_cli.evals.metrics import Judge, score
from fleet_cli.evals.stats import percentile

RECEIPT_KIND = "fleet-eval/1"
CHECKOUT = Path(__file__).resolve().parents[4]


@dataclass
class RowResult:
    id: str
    status: str  # the Run's: completed, failed, cancelled; `refused` when no Run was made
    score: float | None
    metric: str
    detail: str
    answer: str
    iterations: int | None
    lm_calls: int | None
    input_tokens: int | None
    output_tokens: int | None
    cost_usd: float | None
    seconds: float | None
    failure_code: str | None
    run_id: str | None
    session_id: str | None
    program_version: str | None
    model: str | None


@dataclass(frozen=True)
class Target:
    url: str
    token: str | None
    profile: str | None  # the embedded stack's, or what the caller says a deployment runs
    label: str  # embedded, or the deployment's URL


def usage_totals(usage: dict[str, Any] | None) -> tuple[int | None, int, int, int]:
    """(iterations, LM calls, input tokens, output tokens) of a Run's usage."""
    models = (usage or {}).get("observed_lm_usage", {}).values()
    return (
        (usage or {}).get("iterations"),
        sum(int(m.get("calls", 0)) for m in models),
        sum(int(m.get("prompt_tokens", 0)) for m in models),
        sum(int(m.get("completion_tokens", 0)) for m in models),
    )


def run_row(  # noqa: PLR0917 - the pool submits it with its arguments in order
    gateway: Gateway,
    dataset: Dataset,
    row: Row,
    default: Metric,
    judge: Judge | None,
    program_version: str | None = None,
) -> RowResult:
    metric = metric_of(row, default)
    try:
        answered = gateway.answer(dataset, row, dataset.path.stem, program_version)
    except TurnRefused as exc:  # recorded, and the run goes on: it scores 0 as a failed Run does
        return unanswered(row, metric, "refused", str(exc))
    except (httpx.HTTPError, OSError, ValueError, KeyError) as exc:  # the gateway or the network
        return unanswered(row, metric, "error", f"{type(exc).__name__}: {exc}")
    run = answered.run
    iterations, calls, tokens_in, tokens_out = usage_totals(run.get("usage"))
    if run.get("status") == "completed":
        try:
            scored = score(metric, row, answered.answer, judge, dataset.path.parent)
        except Exception as exc:  # a hook or the judge failed on this row: said, not fatal
            scored_value, detail = None, f"{type(exc).__name__}: {exc}"[:500]
        else:
            scored_value, detail = scored.value, scored.detail
    else:
        scored_value, detail = 0.0, f"the Run ended {run.get('status')}"
    return RowResult(
        id=row.id,
        status=str(run.get("status")),
        score=scored_value,
        metric=metric.name,
        detail=detail,
        answer=answered.answer,
        iterations=iterations,
        lm_calls=calls,
        input_tokens=tokens_in,
        output_tokens=tokens_out,
        cost_usd=(run.get("usage") or {}).get("cost_usd"),
        seconds=round(answered.seconds, 3),
        failure_code=run.get("failure_code"),
        run_id=answered.run_id,
        session_id=answered.session_id,
        program_version=run.get("program_version_id"),
        model=run.get("model"),
    )


def unanswered(row: Row, metric: Metric, status: str, detail: str) -> RowResult:
    """A row no Run answered: 0 when it would have been scored, like a Run that failed."""
    value = 0.0 if scorable(row, metric) else None
    return RowResult(row.id, status, value, metric.name, detail[:500], "", None, None, None, None,
                     None, None, status, None, None, None, None)  # fmt: skip


def scorable(row: Row, metric: Metric) -> bool:
    return row.expected is not None or metric.name == "judge" or ":" in metric.name or bool(metric.pattern)


class Progress:
    """One line on stderr, rewritten as rows finish (a line per row when stderr is no terminal)."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.scores = total, 0, []  # type: ignore[var-annotated]
        self.lock = threading.Lock()
        self.tty = sys.stderr.isatty()

    def row_done(self, result: RowResult) -> None:
        with self.lock:
            self.done += 1
            if result.score is not None:
                self.scores.append(result.score)
            mean = f"{sum(self.scores) / len(self.scores):.3f}" if self.scores else "-"
            width = 30
            filled = width * self.done // self.total
            bar = "#" * filled + "." * (width - filled)
            line = (
                f"[{bar}] {self.done}/{self.total} rows, mean score {mean}, last {result.id}: {result.status}"
            )
            sys.stderr.write(f"\r{line[:120]:<120}" if self.tty else f"{line}\n")
            if self.tty and self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def run_dataset(
    dataset: Dataset,
    target: Target,
    *,
    concurrency: int,
    default_metric: Metric,
    judge: Judge | None = None,
    turn_timeout: float = 900.0,
    on_row: Callable[[RowResult], None] | None = None,
    program_version: str | None = None,
) -> dict[str, Any]:
    """Run every row and return the receipt (not yet written). Ctrl-C stops it: no new row
    starts, and the receipt holds the rows that ended, marked `interrupted` (a Run still in
    flight is left to finish). TurnRefused when the gateway refuses the caller before any row."""
    gateway = Gateway(target.url, target.token, turn_timeout, connections=concurrency + 4)
    started_at = datetime.now(UTC)
    started = time.perf_counter()
    done: dict[str, RowResult] = {}
    interrupted = False
    try:
        gateway.check_access()
        skills = gateway.skills()
        pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="fleet-eval")
        futures = {
            pool.submit(run_row, gateway, dataset, row, default_metric, judge, program_version): row.id
            for row in dataset.rows
        }
        try:
            for future in as_completed(futures):
                done[futures[future]] = result = future.result()
                if on_row is not None:
                    on_row(result)
        except KeyboardInterrupt:
            interrupted = True
            pool.shutdown(wait=False, cancel_futures=True)
        else:
            pool.shutdown()
    finally:
        gateway.close()
    results = [done[row.id] for row in dataset.rows if row.id in done]  # the dataset's order
    return {
        "kind": RECEIPT_KIND,
        "dataset": {"path": str(dataset.path), "sha256": dataset.sha256, "rows": len(dataset.rows)},
        "target": {"url": target.label, "profile": target.profile},
        "fleet": {"version": version("fleet-cli"), "git_sha": git_sha()},
        "program_versions": sorted({r.program_version for r in results if r.program_version}),
        "models": sorted({r.model for r in results if r.model}),
        "skills": skills,
        "metric": default_metric.name,
        "concurrency": concurrency,
        "started_at": started_at.isoformat(),
        "wall_seconds": round(time.perf_counter() - started, 3),
        "interrupted": interrupted,
        "rows": [asdict(r) for r in results],
        "totals": totals(results),
    }


def totals(results: list[RowResult]) -> dict[str, Any]:
    scored = [r.score for r in results if r.score is not None]
    seconds = [r.seconds for r in results if r.seconds is not None]
    costs = [r.cost_usd for r in results if r.cost_usd is not None]

    def total(name: str) -> int:
        return sum(getattr(r, name) or 0 for r in results)

    return {
        "rows": len(results),
        "scored": len(scored),
        "accuracy": round(sum(scored) / len(scored), 4) if scored else None,
        "refused": sum(1 for r in results if r.status in ("refused", "error")),
        "completed": sum(1 for r in results if r.status == "completed"),
        "failed": sum(1 for r in results if r.status != "completed"),
        "cost_usd": round(sum(costs), 6) if costs else None,
        "usd_per_query": round(sum(costs) / len(results), 6) if costs else None,
        "lm_calls": total("lm_calls"),
        "input_tokens": total("input_tokens"),
        "output_tokens": total("output_tokens"),
        "iterations_mean": round(total("iterations") / len(results), 2) if results else None,
        "seconds_p50": percentile(seconds, 0.50),
        "seconds_p95": percentile(seconds, 0.95),
    }


def git_sha() -> str | None:
    """The checkout fleet runs from, when it is one (an installed fleet has none)."""
    if not (CHECKOUT / "cli" / "src" / "fleet_cli").is_dir():
        return None
    try:
        done = subprocess.run(
            ["git", "-C", str(CHECKOUT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def write_receipt(receipt: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(receipt, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
