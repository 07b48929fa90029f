"""Lane `scale`: Turn throughput with 1, 2 and 4 worker processes, a 200 ms scripted LM delay on
every line, and as many parallel Turns (each in its own session) as there are slots
(workers x worker.concurrency), times `waves`. Baseline: 1 worker, measured in the same run;
the worker counts are interleaved round by round (1, 2, 4, then 4, 2, 1, …).

Then one worker at `worker.concurrency` 1, 2, 4, 8 (`fleet worker --concurrency`), same Turns,
same interleaving: throughput against concurrency 1, and the worker's CPU (its process tree,
sandboxes included) in cores, which says where "up to its CPU" ends.
"""

from __future__ import annotations

import os
import time
from statistics import mean
from typing import Any

from bench import stack as fleet_stack
from bench.harness import Receipt, goal

CONCURRENCY = 4
CONCURRENCY_LEVELS = (1, 2, 4, 8)
LINEAR_EFFICIENCY = 0.9  # throughput at c slots ≥ 0.9 x c x throughput at 1 slot counts as linear
CPU_BOUND_CORES = 0.8  # a worker busier than this is at its CPU (the 2 cores host the rest too)


def measure(st: fleet_stack.Stack, slots: int, waves: int) -> tuple[float, float, float, float]:
    """Turns per second with `slots` parallel clients, each worker's CPU in cores meanwhile, the
    whole machine's (every process: workers, gateway, Redis, the clients), and the fraction of
    50 ms intervals in which the machine had no core to spare."""
    fleet_stack.run_turns(st, slots, slots)  # warm-up: every slot once
    tree = [pid for proc in st.workers for pid in fleet_stack.process_tree(proc.pid)]
    cpu_before, started = fleet_stack.cpu_seconds(tree), time.perf_counter()
    with fleet_stack.MachineSampler() as machine:
        results = fleet_stack.run_turns(st, slots * waves, slots)
    elapsed = time.perf_counter() - started
    tree = [pid for proc in st.workers for pid in fleet_stack.process_tree(proc.pid)]
    cores = max(0.0, fleet_stack.cpu_seconds(tree) - cpu_before) / elapsed / max(1, len(st.workers))
    failed = [r for r in results if not r.finished]
    if failed:
        raise RuntimeError(f"{len(failed)} Turns did not finish: {failed[0].raw[-400:]!r}")
    return len(results) / elapsed, cores, machine.mean_cores, machine.saturated_fraction(os.cpu_count() or 1)


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
    throughput: dict[int, list[float]] = {count: [] for count in counts}
    by_concurrency: dict[int, list[float]] = {level: [] for level in levels}
    cpu_cores: dict[int, list[float]] = {level: [] for level in levels}
    machine: dict[int, list[float]] = {count: [] for count in counts}
    worker_cores: dict[int, list[float]] = {count: [] for count in counts}
    saturated: dict[int, list[float]] = {count: [] for count in counts}
    with fleet_stack.stack(script=fleet_stack.three_step_script(delay_s), concurrency=CONCURRENCY) as st:
        st.start(workers=0)
        for index in range(rounds):
            for count in counts if index % 2 == 0 else tuple(reversed(counts)):
                st.stop_workers()
                st.start_workers(count)
                st.wait_workers_ready(count)
                turns_per_s, cores, busy, full = measure(st, count * CONCURRENCY, waves)
                throughput[count].append(turns_per_s)
                saturated[count].append(full)
                worker_cores[count].append(cores)
                machine[count].append(busy)
        for index in range(rounds):
            for level in levels if index % 2 == 0 else tuple(reversed(levels)):
                st.stop_workers()
                st.start_workers(1, concurrency=level)
                st.wait_workers_ready(1)
                turns_per_s, cores, _busy, _full = measure(st, level, waves)
                by_concurrency[level].append(turns_per_s)
                cpu_cores[level].append(cores)
        st.stop_workers()
    base = min(counts)
    base_mean = sum(throughput[base]) / len(throughput[base])
    receipt.figures = {
        f"workers_{count}": {
            "turns_per_s": [round(value, 3) for value in values],
            "mean_turns_per_s": round(sum(values) / len(values), 3),
            "parallel_turns": count * CONCURRENCY,
            "cpu_cores_per_worker": round(mean(worker_cores[count]), 3),
            "worker_cpu_ms_per_turn": round(mean(worker_cores[count]) * count / mean(values) * 1000, 1),
            "machine_busy_cores": round(mean(machine[count]), 3),
            "machine_saturated_fraction": round(mean(saturated[count]), 3),
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
    one_slot = mean(by_concurrency[1])
    linear: dict[str, Any] = {}
    for level in levels:
        ratio = mean(by_concurrency[level]) / one_slot
        receipt.figures[f"concurrency_{level}"] = {
            "turns_per_s": [round(value, 3) for value in by_concurrency[level]],
            "mean_turns_per_s": round(mean(by_concurrency[level]), 3),
            "worker_cpu_cores": round(mean(cpu_cores[level]), 3),
        }
        receipt.ratios[f"concurrency_{level}_vs_1"] = round(ratio, 3)
        linear[str(level)] = {
            "efficiency": round(ratio / level, 3),
            "cpu_bound": mean(cpu_cores[level]) >= CPU_BOUND_CORES,
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
    cores = os.cpu_count() or 1
    if two is not None and two < 1.9 and 2 in machine:
        receipt.notes.append(
            f"two_workers: with 2 workers the machine was {mean(machine[2]):.2f} of its {cores} cores busy "
            f"on average (1 worker: {mean(machine[base]):.2f}), and every core was busy in "
            f"{mean(saturated[2]):.0%} of its 50 ms intervals (1 worker: {mean(saturated[base]):.0%}). "
            f"The {2 * CONCURRENCY} clients start their Turns together and the scripted delays are "
            "equal, so the Turns' CPU work (worker_cpu_ms_per_turn: the REPL's start, the program's "
            "setup, the commits; and the gateway's and Redis's share) arrives in bursts that queue "
            "for the 2 cores the workers share with the gateway, Redis and the clients"
        )
    receipt.notes.append(
        "concurrency levels: one worker process started with `fleet worker --concurrency c`, c "
        "parallel clients; worker_cpu_cores counts the worker and its sandboxes"
    )
    return receipt.written()
