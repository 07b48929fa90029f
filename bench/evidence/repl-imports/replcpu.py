"""CPU and wall time of cold REPL starts, as measured for this folder's README.

Run from the checkout: `uv run python bench/evidence/repl-imports/replcpu.py` (needs bwrap).
"""

from __future__ import annotations

import resource
import shutil
import tempfile
import time
from pathlib import Path

from fleet_worker.sandbox.boundary import Caps
from fleet_worker.sandbox.jail import LocalSandboxConfig
from fleet_worker.sandbox.local import LocalSandboxProvider

REPLS = 20


def cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    root = Path(tempfile.mkdtemp())
    root.chmod(0o711)
    provider = LocalSandboxProvider(LocalSandboxConfig(pool_size=0), caps=Caps(), workspaces=root)
    try:
        for mode in ("start", "start+cell", "start+3cells"):
            children, own = cpu(resource.RUSAGE_CHILDREN), cpu(resource.RUSAGE_SELF)
            started = time.perf_counter()
            for index in range(REPLS):
                lease = provider.acquire(f"w-{mode}-{index}", "bench")
                session = lease.interpreter_factory()
                if mode != "start":
                    session.execute("x = 21 * 2\nprint(x)", {}, {}, None)
                if mode == "start+3cells":
                    session.execute("print(x)", {}, {}, None)
                    session.execute("y = x", {}, {}, None)
                lease.release()
            print(
                mode,
                "children ms", round((cpu(resource.RUSAGE_CHILDREN) - children) / REPLS * 1000, 1),
                "self ms", round((cpu(resource.RUSAGE_SELF) - own) / REPLS * 1000, 1),
                "wall", round((time.perf_counter() - started) / REPLS * 1000, 1),
            )  # fmt: skip
    finally:
        provider.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
