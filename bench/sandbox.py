"""Lane `sandbox`: the local sandbox against dspy's LocalInterpreter (the baseline), same run.

- `cell`: a trivial cell's round trip (`print(x)`), warm REPL vs LocalInterpreter's subprocess.
- `tool_call`: a cell that calls a host tool once (as `llm_query` does), both sides.
- `lease_from_pool`: acquiring a lease whose warm REPL is waiting, plus its first cell.
- `lease_cold`: a lease for a workspace with no warm REPL, plus its first cell.
- `pipe_round_trip`: one byte to a plain Python process and back over pipes, measured in the same
  rounds: the price of one process boundary crossed both ways, which a fleet cell pays once more
  than LocalInterpreter's (host ↔ supervisor ↔ interpreter, against host ↔ subprocess).
- `turn`: the `turn` lane's whole 3-iteration program in-process (dspy.RLM, fleet's signature and
  scripted engine), once on a bwrap REPL leased from the warm pool (acquire, cells, release), once
  on dspy's LocalInterpreter: the sandbox's share of a Turn.
- `python_packages`: the cells' packages (bench/sandbox_python.py): the REPL's start with them
  mounted vs without, and a cold and a preloaded `import pandas`.

Every fleet side runs as the shipped profile does, with its packages (sandbox.python) mounted.

Samples of the two sides are interleaved, so machine noise hits both alike. p50/p95/p99, the
machine load and the receipt come from bench.harness.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dspy.primitives.local_interpreter import LocalInterpreter

from bench import sandbox_python
from bench.harness import Receipt, compared, goal, summary, timed
from fleet_worker.sandbox.local import LocalSandboxProvider
from fleet_worker.sandbox.process import descendants


def echo(text: str) -> str:
    return text


class FleetRepl:
    """dspy's CodeInterpreter protocol over a fleet REPL session: what the worker's
    SandboxInterpreter does, without the Turn's observer (no events, no budget)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.tools: dict[str, Any] = {}
        self.output_fields: list[dict[str, Any]] | None = None

    def start(self) -> None:
        self.session.start()

    def shutdown(self) -> None:
        self.session.shutdown()

    def execute(self, code: str, variables: dict[str, Any] | None = None) -> Any:
        from dspy.primitives.code_interpreter import FinalOutput

        fields = [f["name"] for f in self.output_fields] if self.output_fields else None
        result = self.session.execute(code, variables or {}, self.tools, fields)
        if result.error is not None:
            raise RuntimeError(f"{result.error.type}: {result.error.message}")
        return FinalOutput(result.final) if result.final is not None else result.stdout


ECHO = "import os\nwhile chunk := os.read(0, 64):\n    os.write(1, chunk)"


class PipeEcho:
    """A plain Python process that writes back each byte it reads: one boundary, both ways."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", ECHO], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, bufsize=0)  # fmt: skip
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.to_echo, self.from_echo = self.proc.stdin.fileno(), self.proc.stdout.fileno()

    def round_trip(self) -> None:
        os.write(self.to_echo, b"x")
        os.read(self.from_echo, 64)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def cpu_ns(pids: list[int]) -> int:
    """CPU time the scheduler charged these processes' main threads so far (ns; a process that
    ended counts nothing)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
    return total


def cell_cpu(session: Any, baseline: LocalInterpreter, blocks: int) -> dict[str, Any]:
    """CPU per `print(x)` cell, summed over every process of each side (this one's threads, and
    the REPL's supervisor and interpreter, or LocalInterpreter's subprocess), in alternating
    blocks of 50 cells. Latency is CPU plus waiting on a noisy host; the CPU account moves
    far less from run to run, so it shows a change in the cell's own work that p50 hides."""
    repl = {session.pid} | descendants(session.pid) if session.pid is not None else set()
    process = getattr(baseline, "_process", None)  # dspy's own handle on its subprocess
    theirs = [process.pid] if process is not None else []
    here = {"fleet": 0, "local": 0}  # this process, every thread
    there = {"fleet": 0, "local": 0}  # the REPL's processes, or the subprocess
    cells = 50
    for index in range(blocks * 2):
        side = ("fleet", "local")[(index + index // 2) % 2]  # ABBA...: neither side always first
        pids = sorted(repl) if side == "fleet" else theirs
        ours, others = time.process_time_ns(), cpu_ns(pids)
        for _ in range(cells):
            if side == "fleet":
                session.execute("print(x)", {}, {}, None)
            else:
                baseline.execute("print(x)")
        here[side] += time.process_time_ns() - ours
        there[side] += cpu_ns(pids) - others

    def per_cell(ns: int) -> float:
        return round(ns / (blocks * cells) / 1000, 1)

    fleet_us, local_us = per_cell(here["fleet"] + there["fleet"]), per_cell(here["local"] + there["local"])
    return {
        "fleet_us": fleet_us,
        "local_us": local_us,
        "ratio": round(fleet_us / local_us, 3),
        "fleet_host_us": per_cell(here["fleet"]),
        "fleet_repl_us": per_cell(there["fleet"]),  # bwrap, the supervisor and the interpreter
        "local_host_us": per_cell(here["local"]),
        "local_subprocess_us": per_cell(there["local"]),
    }


def turns(provider: LocalSandboxProvider, rounds: int, warmup: int) -> dict[str, Any]:
    """The same in-process Turn on a pooled bwrap REPL and on LocalInterpreter, interleaved."""
    from bench import stack as fleet_stack
    from bench.harness import interleave
    from bench.turn import baseline_turn

    script = Path(tempfile.mkdtemp(prefix="fleet-bench-script-")) / "script.jsonl"
    script.write_text(fleet_stack.three_step_script())

    def on_bwrap() -> float:
        started = time.perf_counter()
        lease = provider.acquire("turns", "bench")
        try:
            baseline_turn(script, lambda: FleetRepl(lease.interpreter_factory()))
        finally:
            lease.release()
        return time.perf_counter() - started

    try:
        sides = {"bwrap": on_bwrap, "local": lambda: baseline_turn(script)}
        samples = interleave(sides, warmup=warmup, repeats=rounds)
    finally:
        shutil.rmtree(script.parent, ignore_errors=True)
    return compared(samples["bwrap"], samples["local"])


def run(*, quick: bool = False) -> dict[str, Any]:
    rounds = 50 if quick else 500
    receipt = Receipt(
        "sandbox",
        {"rounds": rounds, "lease_rounds": 10 if quick else 40, "turn_rounds": 10 if quick else 60},
        baseline="dspy LocalInterpreter",
    )
    root = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    root.chmod(0o711)
    provider = sandbox_python.shipped_provider(root)
    baseline = LocalInterpreter(tools={"echo": echo})
    pooled: dict[str, Any] = {}
    echo_process = PipeEcho()
    try:
        baseline.start()
        lease = provider.acquire("ws", "bench")
        session = lease.interpreter_factory()
        tools = {"echo": echo}
        session.execute("x = 1", {}, tools, None)
        baseline.execute("x = 1")
        ours: dict[str, list[float]] = {"cell": [], "tool_call": []}
        theirs: dict[str, list[float]] = {"cell": [], "tool_call": []}
        hops: list[float] = []
        for _ in range(rounds):
            hops.append(timed(echo_process.round_trip))
            ours["cell"].append(timed(lambda: session.execute("print(x)", {}, tools, None)))
            theirs["cell"].append(timed(lambda: baseline.execute("print(x)")))
            ours["tool_call"].append(timed(lambda: session.execute("echo('hi')", {}, tools, None)))
            theirs["tool_call"].append(timed(lambda: baseline.execute("echo('hi')")))
        receipt.figures["cell_cpu"] = cell_cpu(session, baseline, 2 if quick else 10)
        lease.release()
        pooled, cold = leases(provider, root, 10 if quick else 40)
        receipt.figures["turn"] = turns(provider, 10 if quick else 60, 2 if quick else 5)
        receipt.ratios["turn"] = {k: v for k, v in receipt.figures["turn"].items() if k.startswith("ratio")}
        receipt.parameters["sandbox_mode"] = provider.mode
        for name in ("cell", "tool_call"):
            receipt.figures[name] = compared(ours[name], theirs[name])
            receipt.ratios[name] = {k: v for k, v in receipt.figures[name].items() if k.startswith("ratio")}
        receipt.figures["pipe_round_trip"] = summary(hops)
        receipt.figures.update(lease_from_pool=pooled, lease_cold=cold)
        packages_goal = sandbox_python.measured(receipt, root / "python", 10 if quick else 30)
    finally:
        echo_process.close()
        baseline.shutdown()
        provider.close()
        shutil.rmtree(root, ignore_errors=True)
    cell_ratio = receipt.ratios["cell"]["ratio_p50"]
    cell, hop = receipt.figures["cell"], receipt.figures["pipe_round_trip"]["p50_ms"]
    without_supervisor = round((cell["subject"]["p50_ms"] - hop) / cell["baseline"]["p50_ms"], 3)
    receipt.figures["cell_ratio_less_one_boundary"] = without_supervisor
    cpu = receipt.figures["cell_cpu"]
    receipt.notes.append(
        f"cell_cpu: {cpu['fleet_us']} us of CPU per cell on fleet's side ({cpu['fleet_host_us']} in "
        f"this process, {cpu['fleet_repl_us']} in bwrap, the supervisor and the interpreter), "
        f"{cpu['local_us']} us on LocalInterpreter's ({cpu['local_host_us']} here, "
        f"{cpu['local_subprocess_us']} in its subprocess): {cpu['ratio']} x, in alternating blocks."
    )
    receipt.notes.append(
        f"cell: a fleet cell crosses two process boundaries each way (host -> supervisor -> "
        f"interpreter and back), LocalInterpreter's one (host -> subprocess); the supervisor is the "
        f"isolation (the cell cannot write frames to the host; it kills what a cell leaves behind). "
        f"One boundary both ways costs {hop} ms p50 here (pipe_round_trip, same rounds), so without "
        f"it a fleet cell would be {without_supervisor} x LocalInterpreter's."
    )
    lease_p50 = pooled["acquire"]["p50_ms"]

    turn_ratio = receipt.ratios["turn"]["ratio_p50"]
    receipt.goals = [
        goal("cell", "cell round trip ≤ 1.0 x LocalInterpreter (p50)", cell_ratio, cell_ratio <= 1.0),
        goal("lease", "lease acquire ≤ 10 ms p50 from the warm pool", lease_p50, lease_p50 <= 10),
        packages_goal,
        goal(
            "turn_on_bwrap",
            "a Turn on bwrap ≤ 1.1 x the same Turn on LocalInterpreter in-process (p50)",
            turn_ratio,
            turn_ratio <= 1.1,
        ),
    ]
    return receipt.written()


def leases(provider: LocalSandboxProvider, root: Path, rounds: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Acquire + first cell: the same workspace again (its warm REPL is waiting) vs new ones."""
    acquire_warm: list[float] = []
    first_warm: list[float] = []
    acquire_cold: list[float] = []
    first_cold: list[float] = []
    for index in range(rounds):
        for warm in (True, False):
            workspace = "again" if warm else f"new-{index}"
            started = time.perf_counter()
            lease = provider.acquire(workspace, "bench")
            session = lease.interpreter_factory()
            (acquire_warm if warm else acquire_cold).append(time.perf_counter() - started)
            (first_warm if warm else first_cold).append(
                timed(functools.partial(session.execute, "y = 2", {}, {}, None))
            )
            lease.release()
            time.sleep(0.2)  # the pool restarts a REPL for this workspace in the background
    return (
        {"acquire": summary(acquire_warm), "first_cell": summary(first_warm)},
        {"acquire": summary(acquire_cold), "first_cell": summary(first_cold)},
    )
