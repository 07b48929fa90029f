"""Lane `recovery`: SIGKILL the worker mid-Turn → time until the stream ends (a sweep settles the
Run as `worker_lost`); cancel mid-Turn (PUT /cancellation) → time until the stream ends with
`abort`. No baseline: the figures are absolute, against their goals.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from bench import stack as fleet_stack
from bench.harness import Receipt, goal, summary

# The first cell finishes quickly; the second root line holds the Turn for a long LM "call".
SCRIPT = fleet_stack.script_lines(
    {"lm": "root", "reasoning": "Start.", "code": "print('working')"},
    {"lm": "root", "reasoning": "A long call.", "code": "print('still')", "delay_s": 60},
    {"lm": "root", "reasoning": "Done.", "code": "SUBMIT(answer='late')"},
)
MID_TURN = b"tool-output-available"  # the first cell's output: the Turn is in its second step


def one_turn(st: fleet_stack.Stack, action: str) -> tuple[float, fleet_stack.StreamResult]:
    """Start a Turn, wait until it is mid-Turn, do `action` (kill | cancel); seconds to stream end."""
    session = fleet_stack.new_session(st.url)
    mid_turn = threading.Event()
    holder: dict[str, Any] = {}

    def watch(raw: bytes) -> None:
        holder.setdefault("run_id", fleet_stack.header(raw, "x-fleet-run-id"))
        if MID_TURN in raw:
            mid_turn.set()

    def client() -> None:
        holder["result"] = fleet_stack.post_turn(st.port, session, on_data=watch, timeout=60)
        mid_turn.set()

    thread = threading.Thread(target=client)
    thread.start()
    if not mid_turn.wait(30) or "result" in holder:
        thread.join(60)
        raise RuntimeError(f"the Turn never got to its second step: {holder}\n{st.logs()}")
    time.sleep(0.2)  # inside the scripted LM's long delay
    acted = time.perf_counter()
    if action == "kill":
        worker = st.workers.pop()
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
    else:
        fleet_stack.http(st.url, "PUT", f"/api/runs/{holder['run_id']}/cancellation")
    thread.join(90)
    result: fleet_stack.StreamResult = holder["result"]
    return result.started + result.end_s - acted, result


def run(*, quick: bool = False, kills: int | None = None, cancels: int | None = None) -> dict[str, Any]:
    kills = kills if kills is not None else (3 if quick else 10)
    cancels = cancels if cancels is not None else (5 if quick else 20)
    receipt = Receipt("recovery", {"kills": kills, "cancels": cancels, "lease_seconds": 3, "workers": 1})
    killed: list[float] = []
    cancelled: list[float] = []
    outcomes = {"kill": [], "cancel": []}  # type: dict[str, list[str]]
    with fleet_stack.stack(script=SCRIPT) as st:
        st.start(workers=1)
        st.wait_workers_ready(1)
        for index in range(max(kills, cancels)):  # interleaved: cancel, kill, cancel, kill…
            if index < cancels:
                seconds, result = one_turn(st, "cancel")
                cancelled.append(seconds)
                outcomes["cancel"].append("abort" if result.aborted else "other")
            if index < kills:
                seconds, result = one_turn(st, "kill")
                killed.append(seconds)
                ended = "done" if result.done else "cut"
                outcomes["kill"].append(
                    f"{ended}:{'worker_lost' if b'worker_lost' in result.raw else 'other'}"
                )
                st.start_workers(1)
                st.wait_workers_ready(1)
    kill_summary, cancel_summary = summary(killed), summary(cancelled)
    receipt.figures = {
        "kill_to_stream_end": kill_summary,
        "cancel_to_abort": cancel_summary,
        "outcomes": outcomes,
    }
    receipt.goals = [
        goal("kill", "SIGKILL → stream end ≤ 5 s p95", kill_summary.get("p95_ms"),
             kill_summary.get("p95_ms", 1e12) <= 5000),
        goal("cancel", "cancel → abort ≤ 1 s p95", cancel_summary.get("p95_ms"),
             cancel_summary.get("p95_ms", 1e12) <= 1000),
    ]  # fmt: skip
    receipt.notes.append(
        "the worker's whole process group (its sandboxes too) gets the SIGKILL; a new "
        "worker is started after each kill, outside the timed part"
    )
    return receipt.written()
