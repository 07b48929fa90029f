"""Lane `turn`: POST → `[DONE]` of a 3-iteration zero-delay scripted Turn (plain cell, llm_query,
SUBMIT) through a real stack, and the time to the first SSE byte.

Baseline (the floor): the same `dspy.RLM` program, same signature, same scripted LM lines, run
in-process with dspy's `LocalInterpreter`. The first byte has a floor of its own: a POST to
`bench/first_byte_floor.py` (one SQLite commit, one Redis round trip, no fleet). Subject and
baseline samples alternate (ABBA).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import first_byte_floor
from bench import stack as fleet_stack
from bench.harness import REPO, Receipt, compared, goal, interleave, ratios, summary

SCRIPT = fleet_stack.three_step_script()


def local_interpreter() -> Any:
    """dspy's LocalInterpreter, given `history` as plain JSON (it refuses a dspy.History object;
    fleet's sandbox hands the REPL the same `{"messages": [...]}` form)."""
    import dspy
    from dspy.primitives.local_interpreter import LocalInterpreter

    class JsonLocalInterpreter(LocalInterpreter):  # type: ignore[misc]
        def execute(self, code: str, variables: dict[str, Any] | None = None) -> Any:
            plain = {
                key: value.model_dump() if isinstance(value, dspy.History) else value
                for key, value in (variables or {}).items()
            }
            return super().execute(code, plain)

    return JsonLocalInterpreter()


def baseline_turn(script_path: Path, interpreter_factory: Callable[[], Any] = local_interpreter) -> float:
    """One in-process Turn: fleet's signature and scripted engine, dspy's RLM, and (by default)
    dspy's LocalInterpreter; the `sandbox` lane passes fleet's bwrap REPL instead."""
    import dspy

    from fleet_worker.dspy_adapter import ScriptedEngine, TurnSignature
    from fleet_worker.lm.script import load_script

    started = time.perf_counter()
    cursor = load_script(script_path, "bench").cursor()
    stop = threading.Event()
    root = dspy.LM("scripted/bench", engine=ScriptedEngine(cursor, "root", "scripted/bench", stop),
                   cache=False, num_retries=0)  # fmt: skip
    sub = dspy.LM("scripted/bench", engine=ScriptedEngine(cursor, "sub", "scripted/bench", stop),
                  cache=False, num_retries=0)  # fmt: skip
    program = dspy.RLM(TurnSignature, max_iters=12, max_llm_calls=30, max_output_chars=10000, sub_lm=sub)
    with dspy.context(lm=root, track_usage=True, trace=[], disable_history=True):
        prediction = program(
            request="bench",
            history=dspy.History(messages=[]),
            skills=[],
            attachments=[],
            interpreter_factory=interpreter_factory,
        )
    elapsed = time.perf_counter() - started
    if str(prediction.answer) != "forty-two 42":
        raise RuntimeError(f"the baseline Turn answered {prediction.answer!r}")
    return elapsed


def parse_server_timing(value: str | None) -> list[tuple[str, float]]:
    """`claim;dur=2.1, enqueue;dur=0.4` as [(name, seconds)]."""
    found = []
    for metric in (value or "").split(","):
        name, _, duration = metric.strip().partition(";dur=")
        if name and duration:
            found.append((name, float(duration) / 1000))
    return found


def aiosqlite_hops(count: int) -> list[float]:
    """One hop to aiosqlite's thread and back (a cursor made and closed), as the gateway's every
    statement makes several: measured in this run, beside the Turns."""
    import asyncio

    import aiosqlite

    async def measure() -> list[float]:
        samples = []
        async with aiosqlite.connect(":memory:") as connection:
            for _ in range(count):
                started = time.perf_counter()
                cursor = await connection.cursor()
                samples.append(time.perf_counter() - started)
                await cursor.close()
        return samples[count // 10 :]

    return asyncio.run(measure())


def first_byte_note(figures: dict[str, Any]) -> str:
    timing, hop = figures["first_byte_server_timing"], figures["aiosqlite_hop"]
    claim, enqueue = timing.get("claim", {}).get("p50_ms"), timing.get("enqueue", {}).get("p50_ms")
    return (
        f"first_byte: of its p50 of {figures['first_byte'].get('p50_ms')} ms, the gateway reports "
        f"{claim} ms claiming the Turn in SQLite and {enqueue} ms queueing it in Redis (Server-Timing, "
        f"p50). The claim is one read, two INSERTs and the commit, run whole in one hop to the SQLite "
        f"engine's twin thread (ADR 0020), so most of it is SQLAlchemy's own work, the "
        f"commit and waiting for a core: each POST arrives as the worker releases the previous "
        f"Turn's REPL and starts the next one (the pool's), on the same 2 cores. For scale, one hop "
        f"to aiosqlite's thread and back (the gateway's other reads) takes {hop.get('p50_ms')} ms "
        "here (aiosqlite_hop). The rest of the first byte is HTTP parsing, routing and the response "
        "start"
    )


def run(*, quick: bool = False, repeats: int | None = None, warmup: int | None = None) -> dict[str, Any]:
    repeats = repeats if repeats is not None else (10 if quick else 60)
    warmup = warmup if warmup is not None else (2 if quick else 5)
    receipt = Receipt(
        "turn",
        {"repeats": repeats, "warmup": warmup, "script": "plain cell, llm_query, SUBMIT; delay 0",
         "workers": 1, "worker_concurrency": 4},
        baseline="the same dspy.RLM program in-process with dspy LocalInterpreter (the floor)",
    )  # fmt: skip
    first_bytes: dict[str, list[float]] = {"new_session": [], "same_session": []}
    server_timing: dict[str, list[float]] = {"claim": [], "enqueue": []}
    with fleet_stack.stack(script=SCRIPT) as st:
        st.start(workers=1)
        st.wait_workers_ready(1)
        session_for = fleet_stack.sessions_by_kind(st.url)

        def subject(kind: str) -> Callable[[], float]:
            def one() -> float:
                result = fleet_stack.post_turn(st.port, session_for(kind))
                if not result.finished:
                    raise RuntimeError(f"the Turn did not finish: {result.raw[-600:]!r}\n{st.logs()}")
                first_bytes[kind].append(result.first_byte_s)
                for name, seconds in parse_server_timing(fleet_stack.header(result.raw, "server-timing")):
                    server_timing.setdefault(name, []).append(seconds)
                return result.end_s

            return one

        floor_port = fleet_stack.free_port()
        floor_app = first_byte_floor.start(
            st.redis_url, st.root / "floor.db", floor_port, REPO, st.root / "logs" / "floor.log"
        )

        def first_byte_floor_post() -> float:
            result = fleet_stack.read_stream(floor_port, "POST", "/turns", b'{"text": "bench"}')
            if result.status != 200:
                raise RuntimeError(f"the first-byte floor app answered {result.raw[:300]!r}")
            return result.first_byte_s

        try:
            samples = interleave(
                {
                    # In this order (ABBA) the floor app's POST follows a fleet Turn's end in half
                    # the rounds (fleet's own POSTs, in three of four), the in-process floor's in
                    # the others: it meets the worker's clean-up after `[DONE]` too.
                    "new_session": subject("new_session"),
                    "same_session": subject("same_session"),
                    "first_byte_floor": first_byte_floor_post,
                    "floor": lambda: baseline_turn(st.script_path),
                },
                warmup=warmup,
                repeats=repeats,
            )
        finally:
            fleet_stack.stop_group(floor_app)
    # The warm-up samples of the first-byte lists are dropped with the rest of the warm-up.
    bytes_new, bytes_same = first_bytes["new_session"][warmup:], first_bytes["same_session"][warmup:]
    new = compared(samples["new_session"], samples["floor"])
    same = compared(samples["same_session"], samples["floor"])
    first_byte = summary(bytes_new + bytes_same)
    byte_floor = summary(samples["first_byte_floor"])
    # p50 only: the floor has one sample per round, fleet two (p99 of 60 is the maximum).
    byte_floor_ratio = {"ratio_p50": ratios(first_byte, byte_floor)["ratio_p50"]}
    receipt.figures = {
        "end_to_end_new_session": new,
        "end_to_end_same_session": same,
        "first_byte": first_byte,
        "first_byte_new_session": summary(bytes_new),
        "first_byte_same_session": summary(bytes_same),
        # The same POST's floor on this machine (bench/first_byte_floor.py): Litestar on Granian, one
        # SQLite commit in a thread and one Redis round trip, then the stream.
        "first_byte_floor": byte_floor,
        "first_byte_vs_floor": byte_floor_ratio,
        # The gateway's own account of the time before the first byte (its Server-Timing header),
        # without the warm-up Turns (two per round: a new session's and the running one's).
        "first_byte_server_timing": {name: summary(ms[warmup * 2 :]) for name, ms in server_timing.items()},
        "aiosqlite_hop": summary(aiosqlite_hops(500)),
        "overhead_p50_ms": {
            "new_session": round(new["subject"]["p50_ms"] - new["baseline"]["p50_ms"], 3),
            "same_session": round(same["subject"]["p50_ms"] - same["baseline"]["p50_ms"], 3),
        },
    }
    receipt.ratios = {
        "new_session_vs_floor": {k: v for k, v in new.items() if k.startswith("ratio")},
        "same_session_vs_floor": {k: v for k, v in same.items() if k.startswith("ratio")},
        "first_byte_vs_floor": receipt.figures["first_byte_vs_floor"],
    }
    floor = new["baseline"]["p50_ms"]
    limit = round(1.3 * floor + 20, 3)
    receipt.goals = [
        goal("end_to_end_same_session", "p50 ≤ 1.3 x floor + 20 ms (a Turn in a running conversation)",
             {"p50_ms": same["subject"]["p50_ms"], "limit_ms": limit}, same["subject"]["p50_ms"] <= limit),
        goal("end_to_end_new_session", "p50 ≤ 1.3 x floor + 20 ms (a session's first Turn)",
             {"p50_ms": new["subject"]["p50_ms"], "limit_ms": limit}, new["subject"]["p50_ms"] <= limit),
        goal("first_byte", "p50 ≤ 3 ms", {"p50_ms": first_byte.get("p50_ms")},
             first_byte.get("p50_ms", 1e9) <= 3.0,
             f"the first-byte floor (no fleet: Litestar on Granian, one SQLite commit, one Redis round "
             f"trip) answered in {byte_floor.get('p50_ms')} ms p50 in this run; fleet took "
             f"{byte_floor_ratio.get('ratio_p50')} x that"),
    ]  # fmt: skip
    receipt.notes.append(first_byte_note(receipt.figures))
    receipt.notes.append(
        "first_byte: from just before the POST is written on a raw socket to the first response "
        "byte (headers), over both kinds of Turn. new_session: each sample a session's first Turn; "
        "same_session: every sample in one session, whose workspace has a warm REPL waiting (the pool "
        "starts it when the previous Turn releases the workspace). A session's first Turn starts its "
        "REPL when its lease is made, so the spawn (bwrap, then Python's start-up in the jail: ~35 ms "
        "here) overlaps the program's setup and, with a provider LM, its first LM call; with the "
        "zero-delay scripted lines there is nothing to hide it behind."
    )
    return receipt.written()
