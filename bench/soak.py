"""Lane `soak`: N zero-delay Turns on 2 workers (8 parallel clients, each in its own session).
Measured: the workers' RSS after the first 10% of Turns and at the end (growth), throughput, and
that no Turn was lost or duplicated, checked in the API's answers and in the database.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from typing import Any

from bench import stack as fleet_stack
from bench.harness import Receipt, goal, summary


def worker_rss(st: fleet_stack.Stack) -> int:
    """The worker processes' own RSS (not their sandboxes, which come and go per Turn)."""
    return fleet_stack.rss_bytes([proc.pid for proc in st.workers])


def run(
    *, quick: bool = False, turns: int | None = None, workers: int = 2, parallel: int = 8
) -> dict[str, Any]:
    turns = turns or (50 if quick else 2000)
    receipt = Receipt("soak", {"turns": turns, "workers": workers, "parallel_clients": parallel,
                               "script": "plain cell, llm_query, SUBMIT; delay 0"})  # fmt: skip
    marks: dict[str, int] = {}
    lock = threading.Lock()
    tenth = max(1, turns // 10)

    with fleet_stack.stack(script=fleet_stack.three_step_script()) as st:
        st.start(workers=workers)
        st.wait_workers_ready(workers)
        marks["start"] = worker_rss(st)

        def on_done(count: int) -> None:
            if count == tenth:
                with lock:
                    marks["after_first_10pct"] = worker_rss(st)

        started = time.perf_counter()
        results = fleet_stack.run_turns(st, turns, parallel, on_done)
        elapsed = time.perf_counter() - started
        marks["end"] = worker_rss(st)
        with sqlite3.connect(st.root / "fleet.db") as db:
            runs = dict(db.execute("SELECT id, status FROM runs").fetchall())
            per_run = db.execute(
                "SELECT run_id, count(*) FROM turns GROUP BY run_id HAVING count(*) != 2"
            ).fetchall()
    run_ids = [r.run_id for r in results]
    finished = [r for r in results if r.finished]
    lost = [rid for rid in run_ids if rid is None or runs.get(rid) != "completed"]
    named = {rid for rid in run_ids if rid is not None}
    # A run id answered twice, a Run no answer named, a Run whose history is not one user + one assistant.
    duplicated = len(run_ids) - len(set(run_ids)) + len(set(runs) - named) + len(per_run)
    at_tenth = marks.get("after_first_10pct", marks["start"])
    growth = (marks["end"] - at_tenth) / at_tenth if at_tenth else None
    receipt.figures = {
        "turns_posted": turns,
        "streams_finished": len(finished),
        "runs_in_db": len(runs),
        "runs_completed_in_db": sum(1 for status in runs.values() if status == "completed"),
        "lost": len(lost),
        "duplicated": duplicated,
        "turns_per_s": round(len(results) / elapsed, 3),
        "turn_latency": summary([r.end_s for r in results]),
        "worker_rss_mb": {key: round(value / 2**20, 1) for key, value in marks.items()},
        "rss_growth_after_first_10pct": round(growth, 4) if growth is not None else None,
    }
    receipt.goals = [
        goal("rss_growth", "worker RSS growth < 10% after the first 10% of Turns",
             receipt.figures["rss_growth_after_first_10pct"], growth is not None and growth < 0.10),
        goal("no_loss", "zero lost or duplicated Turns",
             {"lost": receipt.figures["lost"], "duplicated": duplicated},
             receipt.figures["lost"] == 0 and duplicated == 0),
    ]  # fmt: skip
    receipt.notes.append(
        "duplicated counts repeated run ids in the answers, Runs in the DB that no answer "
        "named, and Runs whose committed history is not exactly one user + one assistant message"
    )
    return receipt.written()
