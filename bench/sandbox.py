"""Lane `sandbox`: the local sandbox against dspy's LocalInterpreter (the baseline), same run.

- `cell`: a trivial cell's round trip (`print(x)`), warm REPL vs LocalInterpreter's subprocess.
- `tool_call`: a cell that calls a host tool once (as `llm_query` does), both sides.
- `lease_from_pool`: acquiring a lease whose warm REPL is waiting, plus its first cell.
- `lease_cold`: a lease for a workspace with no warm REPL, plus its first cell.

Samples of the two sides are interleaved, so machine noise hits both alike.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dspy.primitives.local_interpreter import LocalInterpreter

from fleet_worker.sandbox.boundary import Caps
from fleet_worker.sandbox.jail import LocalSandboxConfig
from fleet_worker.sandbox.local import LocalSandboxProvider


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1000, 3),
        "p95_ms": round(ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))] * 1000, 3),
    }


def timed(call: Callable[[], Any]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def echo(text: str) -> str:
    return text


def run(*, quick: bool = False) -> dict[str, Any]:
    rounds = 50 if quick else 500
    root = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    root.chmod(0o711)
    provider = LocalSandboxProvider(LocalSandboxConfig(pool_size=4), caps=Caps(), workspaces=root)
    baseline = LocalInterpreter(tools={"echo": echo})
    try:
        baseline.start()
        lease = provider.acquire("ws", "bench")
        session = lease.interpreter_factory()
        tools = {"echo": echo}
        session.execute("x = 1", {}, tools, None)
        baseline.execute("x = 1")
        ours: dict[str, list[float]] = {"cell": [], "tool_call": []}
        theirs: dict[str, list[float]] = {"cell": [], "tool_call": []}
        for _ in range(rounds):
            ours["cell"].append(timed(lambda: session.execute("print(x)", {}, tools, None)))
            theirs["cell"].append(timed(lambda: baseline.execute("print(x)")))
            ours["tool_call"].append(timed(lambda: session.execute("echo('hi')", {}, tools, None)))
            theirs["tool_call"].append(timed(lambda: baseline.execute("echo('hi')")))
        lease.release()
        pooled, cold = leases(provider, root, 10 if quick else 40)
        result: dict[str, Any] = {"sandbox_mode": provider.mode, "baseline": "dspy LocalInterpreter"}
        for name in ("cell", "tool_call"):
            mine, base = summary(ours[name]), summary(theirs[name])
            result[name] = {
                "fleet": mine,
                "baseline": base,
                "ratio_p50": round(mine["p50_ms"] / base["p50_ms"], 2),
            }
        result["lease_from_pool"] = pooled
        result["lease_cold"] = cold
        return result
    finally:
        baseline.shutdown()
        provider.close()
        shutil.rmtree(root, ignore_errors=True)


def leases(provider: LocalSandboxProvider, root: Path, rounds: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Acquire + first cell: the same workspace again (its warm REPL is waiting) vs new ones."""
    acquire_warm, first_warm, acquire_cold, first_cold = [], [], [], []
    for index in range(rounds):
        for warm in (True, False):
            workspace = "again" if warm else f"new-{index}"
            started = time.perf_counter()
            lease = provider.acquire(workspace, "bench")
            session = lease.interpreter_factory()
            (acquire_warm if warm else acquire_cold).append(time.perf_counter() - started)
            (first_warm if warm else first_cold).append(
                timed(lambda s=session: s.execute("y = 2", {}, {}, None))
            )
            lease.release()
            time.sleep(0.2)  # the pool restarts a REPL for this workspace in the background
    return (
        {"acquire": summary(acquire_warm), "first_cell": summary(first_warm)},
        {"acquire": summary(acquire_cold), "first_cell": summary(first_cold)},
    )
