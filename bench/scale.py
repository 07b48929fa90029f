"""Lane `scale`: Turn throughput with 1, 2 and 4 worker processes, a 200 ms scripted LM delay on
every line, and as many parallel Turns (each in its own session) as there are slots
(workers x worker.concurrency), times `waves`. Baseline: 1 worker, measured in the same run;
the worker counts are interleaved round by round (1, 2, 4, then 4, 2, 1, …).
"""

from __future__ import annotations

import time
from typing import Any

from bench import stack as fleet_stack
from bench.harness import Receipt, goal

CONCURRENCY = 4


def run(
    *, quick: bool = False, workers: tuple[int, ...] | None = None, rounds: int | None = None,
    waves: int | None = None, delay_s: float = 0.2,
) -> dict[str, Any]:  # fmt: skip
    counts = workers or (1, 2, 4)
    rounds = rounds or (1 if quick else 3)
    waves = waves or (2 if quick else 4)
    receipt = Receipt(
        "scale",
        {"workers": list(counts), "rounds": rounds, "waves": waves, "lm_delay_s": delay_s,
         "worker_concurrency": CONCURRENCY, "script": "plain cell, llm_query, SUBMIT; 4 LM lines"},
        baseline=f"{min(counts)} worker(s), same run",
    )  # fmt: skip
    throughput: dict[int, list[float]] = {count: [] for count in counts}
    with fleet_stack.stack(script=fleet_stack.three_step_script(delay_s), concurrency=CONCURRENCY) as st:
        st.start(workers=0)
        for index in range(rounds):
            for count in counts if index % 2 == 0 else tuple(reversed(counts)):
                st.stop_workers()
                st.start_workers(count)
                st.wait_workers_ready(count)
                slots = count * CONCURRENCY
                fleet_stack.run_turns(st, slots, slots)  # warm-up: every slot once
                started = time.perf_counter()
                results = fleet_stack.run_turns(st, slots * waves, slots)
                elapsed = time.perf_counter() - started
                failed = [r for r in results if b'"finishReason":"stop"' not in r.raw]
                if failed:
                    raise RuntimeError(f"{len(failed)} Turns did not finish: {failed[0].raw[-400:]!r}")
                throughput[count].append(len(results) / elapsed)
        st.stop_workers()
    base = min(counts)
    base_mean = sum(throughput[base]) / len(throughput[base])
    receipt.figures = {
        f"workers_{count}": {
            "turns_per_s": [round(value, 3) for value in values],
            "mean_turns_per_s": round(sum(values) / len(values), 3),
            "parallel_turns": count * CONCURRENCY,
        }
        for count, values in throughput.items()
    }
    receipt.ratios = {
        f"throughput_{count}_vs_{base}": round(sum(v) / len(v) / base_mean, 3)
        for count, v in throughput.items()
    }
    floor_s = 4 * delay_s
    receipt.figures["ideal_turns_per_s_per_slot"] = round(1 / floor_s, 3)
    two = receipt.ratios.get(f"throughput_2_vs_{base}")
    receipt.goals = [
        goal("two_workers", "2 workers ≥ 1.9 x 1 worker", two,
             two >= 1.9 if two is not None and base == 1 else None),
        goal("concurrency_linear", "throughput grows linearly with worker.concurrency up to the CPU",
             None, None, "not measured: this lane varies worker processes, not worker.concurrency"),
    ]  # fmt: skip
    body, path = receipt.write()
    body["receipt_path"] = str(path)
    return body
