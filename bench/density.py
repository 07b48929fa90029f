"""Lane `density`: how many concurrent Turns one worker holds at a realistic LM latency before
its p95 Turn time grows by 10%, and its memory per live Turn.

One worker (`worker.concurrency` = the highest level, so its slots and program threads never
queue a Turn) on the provider path, against the streaming fake provider (tests/support/
fake_provider.py, loopback) at a time to first token of 400 ms and 60 tokens/s. Each Turn is a
real one: a streamed root LM call, a cell in its sandbox, the answer, the commit. At each level
N, N clients each post Turns back to back in a session of their own (a first round, which makes
the sessions' workspaces, runs before and is not measured). The levels run up, then down again,
and each level's samples are pooled, so drift shows as spread rather than slope. The baseline is
level 1 in the same run; the knee is the last level, going up, before the first whose p95 is more
than 10% over it. A REPL serves one Run: the warm pool (`sandbox.local.pool_size`, default 4)
has REPLs ready for the first Turns of a burst, and past it each Turn starts its own, so the pool
size moves the knee as well as `worker.concurrency` and the CPU. Memory is the worker's process
tree (its REPLs included), sampled every 100 ms while a level runs, less the tree at rest just
before that level, per Turn in flight.
"""

from __future__ import annotations

import time
from statistics import mean
from typing import Any

from bench import stack as fleet_stack
from bench.first_token import REASONING, config_text
from bench.harness import Receipt, summary
from tests.support.fake_provider import serve_fake_provider

TTFT_S, TOKENS_PER_S = 0.4, 60
LEVELS = (1, 2, 4, 8, 16, 32)
QUICK_LEVELS = (1, 2, 4)
KNEE_GROWTH = 1.10  # p95 within 10% of one Turn alone
REPLY = (
    f"[[ ## reasoning ## ]]\n{REASONING}\n\n[[ ## code ## ]]\nanswer = str(6 * 7)\nSUBMIT(answer=answer)"
    "\n\n[[ ## completed ## ]]"
)
Results = list[fleet_stack.StreamResult]


class TreeSampler(fleet_stack.Sampler):
    """The RSS of a process and its descendants, every `interval` seconds, during the block."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        super().__init__(interval)
        self.pid = pid
        self.samples: list[int] = []

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(fleet_stack.rss_bytes(fleet_stack.process_tree(self.pid)))


def at_rest_bytes(pid: int, seconds: float = 1.0) -> int:
    with TreeSampler(pid) as sampler:
        time.sleep(seconds)
    return min(sampler.samples)


def clients_post(st: fleet_stack.Stack, sessions: list[str], turns_each: int) -> Results:
    """`turns_each` Turns per session on average, one client per session, each posting back to
    back; every Turn must finish."""
    results = fleet_stack.run_turns(st, len(sessions) * turns_each, len(sessions), sessions=sessions)
    failed = [r for r in results if not r.finished]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} Turns did not finish: {failed[0].raw[-400:]!r}")
    return results


def level(st: fleet_stack.Stack, clients: int, turns_each: int) -> tuple[list[float], float]:
    """Turn times (s) with `clients` sessions posting at once, and the worker tree's mean RSS
    meanwhile over its RSS at rest just before (bytes)."""
    sessions = [fleet_stack.new_session(st.url) for _ in range(clients)]
    clients_post(st, sessions, 1)  # a first round, not measured: the sessions' workspaces are made
    rest = at_rest_bytes(st.workers[0].pid)
    with TreeSampler(st.workers[0].pid) as sampler:
        results = clients_post(st, sessions, turns_each)
    busy = mean(sampler.samples) if sampler.samples else float(rest)
    return [r.end_s for r in results], busy - rest


def knee_of(levels: list[int], growth: dict[int, float]) -> int:
    """The last level, going up, before the first that grows past KNEE_GROWTH."""
    knee = levels[0]
    for n in levels:
        if growth[n] > KNEE_GROWTH:
            break
        knee = n
    return knee


def run(
    *, quick: bool = False, turns_each: int | None = None, levels: tuple[int, ...] | None = None
) -> dict[str, Any]:
    levels = tuple(sorted(levels or (QUICK_LEVELS if quick else LEVELS)))
    turns_each = turns_each if turns_each is not None else (2 if quick else 4)
    top = max(levels)
    receipt = Receipt(
        "density",
        {"levels": list(levels), "turns_per_client_per_pass": turns_each, "passes": "up, then down",
         "measured": "Turns in running conversations (a first round per level runs before, unmeasured)",
         "provider_ttft_s": TTFT_S, "provider_tokens_per_s": TOKENS_PER_S, "token": "4 characters",
         "reply_chars": len(REPLY), "lm_calls_per_turn": 1, "cells_per_turn": 1, "workers": 1,
         "worker_concurrency": top, "sandbox": "local (bubblewrap)",
         "provider": "the streaming fake provider (tests/support/fake_provider.py) on loopback"},
        baseline="level 1 (one Turn in flight), same run",
    )  # fmt: skip
    samples: dict[int, list[float]] = {n: [] for n in levels}
    memory: dict[int, list[float]] = {n: [] for n in levels}  # bytes over rest, per pass
    with serve_fake_provider() as provider:
        provider.ttft_s, provider.tokens_per_s = TTFT_S, TOKENS_PER_S
        provider.replies += [REPLY] * (2 * sum(n * (turns_each + 1) for n in levels) + 16)
        env = {
            "FLEET_LM_MODEL": "openai/bench-model",
            "FLEET_LM_API_KEY": "sk-bench",
            "FLEET_LM_BASE_URL": provider.url,
        }
        with fleet_stack.stack(config_text=config_text(), extra_env=env) as st:
            st.start_redis()
            st.migrate()
            st.start_gateway()
            st.wait_ready(need_worker=False)
            st.start_workers(1, concurrency=top)
            st.wait_ready()
            clients_post(st, [fleet_stack.new_session(st.url)], 2)  # the worker's first Turns
            rest = at_rest_bytes(st.workers[0].pid)
            for clients in [*levels, *reversed(levels)]:
                times, rss = level(st, clients, turns_each)
                samples[clients] += times
                memory[clients].append(rss)
    figures = {n: summary(samples[n]) for n in levels}
    base = figures[levels[0]]["p95_ms"]
    growth = {n: round(figures[n]["p95_ms"] / base, 3) for n in levels}
    knee = knee_of(list(levels), growth)
    per_turn = {n: round(mean(memory[n]) / n / 2**20, 1) for n in levels}
    receipt.figures = {
        "turn_time": {str(n): figures[n] for n in levels},
        "p95_over_one_turn": {str(n): growth[n] for n in levels},
        "knee_turns_in_flight": knee,
        "worker_tree_rss_at_rest_mb": round(rest / 2**20, 1),
        "worker_tree_rss_per_live_turn_mb": {str(n): per_turn[n] for n in levels},
    }
    receipt.notes.append(
        f"knee: the last level, going up, before the first whose p95 Turn time is over {KNEE_GROWTH:.2f}x "
        "that of one Turn alone. "
        "A Turn past `worker.concurrency` waits in the queue, so the knee is at most that setting; "
        "below it the bound is the worker's CPU (its event loop, program threads and sandboxes share "
        "the machine's cores with the gateway, Redis and the clients here)."
    )
    receipt.notes.append(
        "rss per live Turn: the worker's process tree, its REPLs included, averaged while the level "
        "ran, less the tree at rest just before it (warm pool refilled), over the Turns in flight. "
        "worker_tree_rss_at_rest_mb: the tree at rest after the worker's first Turns."
    )
    return receipt.written()
