"""The `sandbox` lane's part on the cells' packages (sandbox.python): what mounting them costs a
REPL's start, and what `import pandas` costs a cell, cold and preloaded.

- `repl_start`: a new REPL (bwrap, supervisor, interpreter) to the end of its first trivial cell,
  with the shipped packages mounted vs with the standard library only, interleaved.
- `import_pandas_cold`: the first cell of a new REPL being `import pandas` (what a Turn's first
  data cell pays with no preload).
- `import_pandas_preloaded`: the same cell in a REPL started with `preload = ["pandas"]` that sat
  idle as a warm REPL does between Runs (one second here), so the import was done before it.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from bench.harness import Receipt, compared, goal, interleave, summary, timed
from fleet_shared.config_file import DEFAULT_SANDBOX_PACKAGES
from fleet_worker.sandbox.boundary import Caps
from fleet_worker.sandbox.jail import LocalSandboxConfig, resolve_python
from fleet_worker.sandbox.local import LocalSandboxProvider
from fleet_worker.sandbox.python_env import PythonEnvironment, ensure_environment

IMPORT = "import pandas"
WARM_IDLE_SECONDS = 1.0  # a warm REPL waits this long, at least, before its Run's first cell


def shipped_packages() -> PythonEnvironment:
    built = ensure_environment(DEFAULT_SANDBOX_PACKAGES, resolve_python(LocalSandboxConfig()))
    assert built is not None
    return built


def shipped_provider(root: Path) -> LocalSandboxProvider:
    """The lane's provider: four warm REPLs, and the shipped packages mounted as a worker would."""
    cfg = LocalSandboxConfig(pool_size=4, python_site=str(shipped_packages().site))
    return LocalSandboxProvider(cfg, caps=Caps(), workspaces=root)


def first_cell(provider: LocalSandboxProvider, workspace: str, code: str, idle: float = 0.0) -> float:
    """A new lease and its REPL, then (after `idle` seconds) one cell: the cell's time, or with
    idle 0 the lease, the REPL's start and the cell together."""
    started = time.perf_counter()
    lease = provider.acquire(workspace, "bench")
    try:
        session = lease.interpreter_factory()
        session.start()
        if idle:
            time.sleep(idle)
            return timed(lambda: session.execute(code, {}, {}, None))
        session.execute(code, {}, {}, None)
        return time.perf_counter() - started
    finally:
        lease.release()


def run(root: Path, rounds: int) -> dict[str, Any]:
    built = shipped_packages()
    bare = LocalSandboxConfig(pool_size=0)
    mounted = dataclasses.replace(bare, python_site=str(built.site))
    preloaded = dataclasses.replace(mounted, preload=("pandas",))
    providers: dict[str, LocalSandboxProvider] = {}
    for name, cfg in (("bare", bare), ("mounted", mounted), ("preloaded", preloaded)):
        (root / name).mkdir(mode=0o711)
        providers[name] = LocalSandboxProvider(cfg, caps=Caps(), workspaces=root / name)
    try:
        starts = interleave(
            {
                "mounted": lambda: first_cell(providers["mounted"], "start", "x = 1"),
                "bare": lambda: first_cell(providers["bare"], "start", "x = 1"),
            },
            warmup=2,
            repeats=rounds,
        )
        cold = [first_cell(providers["mounted"], "cold", IMPORT) for _ in range(rounds)]
        warm = [
            first_cell(providers["preloaded"], "warm", IMPORT, idle=WARM_IDLE_SECONDS)
            for _ in range(max(3, rounds // 3))
        ]
    finally:
        for provider in providers.values():
            provider.close()
    return {
        "packages": list(built.installed),
        "repl_start": compared(starts["mounted"], starts["bare"]),
        "import_pandas_cold": summary(cold),
        "import_pandas_preloaded": summary(warm),
    }


def measured(receipt: Receipt, root: Path, rounds: int) -> dict[str, Any]:
    """Measure into `receipt` (figures, ratio, a note); the lane's goal on the REPL's start."""
    root.mkdir(mode=0o711)
    python = run(root, rounds)
    receipt.figures["python_packages"] = python
    ratios = {k: v for k, v in python["repl_start"].items() if k.startswith("ratio")}
    receipt.ratios["repl_start_with_packages"] = ratios
    receipt.notes.append(
        f"python_packages: a new REPL and its first cell take {ratios['ratio_p50']} x as long with "
        f"the packages mounted; `import pandas` as a new REPL's first cell takes "
        f"{python['import_pandas_cold']['p50_ms']} ms p50, and "
        f"{python['import_pandas_preloaded']['p50_ms']} ms in a REPL that preloaded it."
    )
    return goal(
        "repl_start_with_packages",
        "a new REPL's start with the packages mounted ≤ 1.1 x without them (p50)",
        ratios["ratio_p50"],
        ratios["ratio_p50"] <= 1.1,
    )
