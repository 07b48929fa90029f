"""Lane `scale`: Turn throughput with 1, 2 and 4 worker processes, a 200 ms scripted LM delay on
every line, and as many clients as there are slots (workers x worker.concurrency), each posting
Turns back to back in a session of its own. Throughput is counted in a steady-state window,
`waves` Turn floors (4 x the delay) long, that opens one floor after the clients start and closes
before any stops: each Turn counts by the share of its duration inside the window. (Counting N
Turns over the time the last one took to finish charged higher concurrency for its ramp-down,
where the slowest client's last Turn runs alone.) Baseline: 1 worker, measured in the same run;
the worker counts are interleaved round by round (1, 2, 4, then 4, 2, 1, …).

Then one worker at `worker.concurrency` 1, 2, 4, 8 (`fleet worker --concurrency`), same Turns,
same interleaving: throughput against concurrency 1, and the worker's CPU (its process tree,
sandboxes included) in cores, which says where "up to its CPU" ends.
"""

from __future__ import annotations

import os
import time
from statistics import mean
from typing import Any, NamedTuple

from bench import stack as fleet_stack
from bench.harness import Receipt, goal

CONCURRENCY = 4
CONCURRENCY_LEVELS = (1, 2, 4, 8)
LINEAR_EFFICIENCY = 0.9  # throughput at c slots ≥ 0.9 x c x throughput at 1 slot counts as linear
CPU_BOUND_CORES = 0.8  # a worker busier than this is at its CPU (the 2 cores host the rest too)


class Measured(NamedTuple):
    turns_per_s: float  # in the steady-state window
    overall_turns_per_s: float  # all Turns over the whole loop, ramp-down included (for comparison)
    worker_cores: float
    machine_cores: float
    saturated: float


def measure(st: fleet_stack.Stack, slots: int, waves: int, floor_s: float) -> Measured:
    """Turns per second with `slots` parallel clients in a steady-state window (`waves` Turn
    floors long, after one floor of settling), each worker's CPU in cores meanwhile, the whole
    machine's (every process: workers, gateway, Redis, the clients), and the fraction of 50 ms
    intervals in which the machine had no core to spare."""
    fleet_stack.run_turns(st, slots, slots)  # warm-up: every slot once
    tree = [pid for proc in st.workers for pid in fleet_stack.process_tree(proc.pid)]
    cpu_before, started = fleet_stack.cpu_seconds(tree), time.perf_counter()
    window = (started + floor_s, started + floor_s + waves * floor_s)
    with fleet_stack.MachineSampler() as machine:
        results = fleet_stack.run_turns_for(st, slots, window[1] - started)
    elapsed = time.perf_counter() - started
    tree = [pid for proc in st.workers for pid in fleet_stack.process_tree(proc.pid)]
    cores = max(0.0, fleet_stack.cpu_seconds(tree) - cpu_before) / elapsed / max(1, len(st.workers))
    failed = [r for r in results if not r.finished]
    if failed:
        raise RuntimeError(f"{len(failed)} Turns did not finish: {failed[0].raw[-400:]!r}")
    return Measured(
        fleet_stack.turns_per_second(results, *window),
        len(results) / elapsed,
        cores,
        machine.mean_cores,
        machine.saturated_fraction(os.cpu_count() or 1),
    )


def workers_figures(count: int, runs: list[Measured]) -> dict[str, Any]:
    turns_per_s = mean(m.turns_per_s for m in runs)
    cores = mean(m.worker_cores for m in runs)
    return {
        "turns_per_s": [round(m.turns_per_s, 3) for m in runs],
        "mean_turns_per_s": round(turns_per_s, 3),
        "overall_turns_per_s": [round(m.overall_turns_per_s, 3) for m in runs],
        "parallel_turns": count * CONCURRENCY,
        "cpu_cores_per_worker": round(cores, 3),
        "worker_cpu_ms_per_turn": round(cores * count / turns_per_s * 1000, 1),
        "machine_busy_cores": round(mean(m.machine_cores for m in runs), 3),
        "machine_saturated_fraction": round(mean(m.saturated for m in runs), 3),
    }


def two_workers_note(two: list[Measured], base: list[Measured]) -> str:
    cores = os.cpu_count() or 1
    return (
        f"two_workers: with 2 workers the machine was {mean(m.machine_cores for m in two):.2f} of its "
        f"{cores} cores busy on average (1 worker: {mean(m.machine_cores for m in base):.2f}), and "
        f"every core was busy in {mean(m.saturated for m in two):.0%} of its 50 ms intervals (1 worker: "
        f"{mean(m.saturated for m in base):.0%}). "
        f"The {2 * CONCURRENCY} clients start their Turns together and the scripted delays are "
        "equal, so the Turns' CPU work (worker_cpu_ms_per_turn: the REPL's start, the program's "
        "setup, the commits; and the gateway's and Redis's share) arrives in bursts that queue "
        "for the 2 cores the workers share with the gateway, Redis and the clients"
    )


def run(
    *, quick: bool = False, workers: tuple[int, ...] | None = None, rounds: int | None = None,
    waves: int | None = None, delay_s: float = 0.2, concurrency: tuple[int, ...] | None = None,
) -> dict[str, Any]:  # fmt: skip
    counts = workers or (1, 2, 4)
    levels = concurrency or ((1, 4) if quick else CONCURRENCY_LEVELS)
    if 1 not in levels:
        raise ValueError("the concurrency levels must include 1, the baseline")
    rounds = rounds or (1 if quick else 3)
    waves = waves or (2 if quick else 4)
    receipt = Receipt(
        "scale",
        {"workers": list(counts), "rounds": rounds, "waves": waves, "lm_delay_s": delay_s,
         "worker_concurrency": CONCURRENCY, "concurrency_levels": list(levels),
         "script": "plain cell, llm_query, SUBMIT; 4 LM lines"},
        baseline=f"{min(counts)} worker(s), same run",
    )  # fmt: skip
    floor_s = 4 * delay_s  # a Turn's LM time: four scripted lines, each delayed
    by_count: dict[int, list[Measured]] = {count: [] for count in counts}
    by_level: dict[int, list[Measured]] = {level: [] for level in levels}
    with fleet_stack.stack(script=fleet_stack.three_step_script(delay_s), concurrency=CONCURRENCY) as st:
        st.start(workers=0)
        for index in range(rounds):
            for count in counts if index % 2 == 0 else tuple(reversed(counts)):
                st.stop_workers()
                st.start_workers(count)
                st.wait_workers_ready(count)
                by_count[count].append(measure(st, count * CONCURRENCY, waves, floor_s))
        for index in range(rounds):
            for level in levels if index % 2 == 0 else tuple(reversed(levels)):
                st.stop_workers()
                st.start_workers(1, concurrency=level)
                st.wait_workers_ready(1)
                by_level[level].append(measure(st, level, waves, floor_s))
        st.stop_workers()
    base = min(counts)
    base_mean = mean(m.turns_per_s for m in by_count[base])
    receipt.figures = {f"workers_{count}": workers_figures(count, runs) for count, runs in by_count.items()}
    receipt.ratios = {
        f"throughput_{count}_vs_{base}": round(mean(m.turns_per_s for m in runs) / base_mean, 3)
        for count, runs in by_count.items()
    }
    receipt.figures["ideal_turns_per_s_per_slot"] = round(1 / floor_s, 3)
    two = receipt.ratios.get(f"throughput_2_vs_{base}")
    one_slot = mean(m.turns_per_s for m in by_level[1])
    linear: dict[str, Any] = {}
    for level, runs in by_level.items():
        ratio = mean(m.turns_per_s for m in runs) / one_slot
        receipt.figures[f"concurrency_{level}"] = {
            "turns_per_s": [round(m.turns_per_s, 3) for m in runs],
            "mean_turns_per_s": round(mean(m.turns_per_s for m in runs), 3),
            "overall_turns_per_s": [round(m.overall_turns_per_s, 3) for m in runs],
            "worker_cpu_cores": round(mean(m.worker_cores for m in runs), 3),
            "worker_cpu_ms_per_turn": round(
                mean(m.worker_cores for m in runs) / mean(m.turns_per_s for m in runs) * 1000, 1
            ),
            "machine_busy_cores": round(mean(m.machine_cores for m in runs), 3),
            "machine_saturated_fraction": round(mean(m.saturated for m in runs), 3),
        }
        receipt.ratios[f"concurrency_{level}_vs_1"] = round(ratio, 3)
        linear[str(level)] = {
            "efficiency": round(ratio / level, 3),
            "cpu_bound": mean(m.worker_cores for m in runs) >= CPU_BOUND_CORES,
        }
    below_cpu = [entry for entry in linear.values() if not entry["cpu_bound"]]
    receipt.goals = [
        goal("two_workers", "2 workers ≥ 1.9 x 1 worker", two,
             two >= 1.9 if two is not None and base == 1 else None),
        goal("concurrency_linear",
             f"throughput at concurrency c ≥ {LINEAR_EFFICIENCY} x c x concurrency 1, at every c "
             f"where the worker uses < {CPU_BOUND_CORES} cores", linear,
             all(entry["efficiency"] >= LINEAR_EFFICIENCY for entry in below_cpu) if len(below_cpu) > 1
             else None),
    ]  # fmt: skip
    if two is not None and two < 1.9 and 2 in by_count:
        receipt.notes.append(two_workers_note(by_count[2], by_count[base]))
    receipt.notes.append(
        "concurrency levels: one worker process started with `fleet worker --concurrency c`, c "
        "parallel clients; worker_cpu_cores counts the worker and its sandboxes; overall_turns_per_s "
        "counts every Turn of the loop over its whole length, ramp-down included (for comparison "
        "with the window's figure; the goal uses the window's)"
    )
    return receipt.written()
