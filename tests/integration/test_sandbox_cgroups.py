"""A REPL's cgroups hold every process of its sandbox, from the first one bwrap starts: real bwrap,
real cgroups (skipped where the worker cannot create them: not root, or a read-only cgroupfs)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from fleet_worker.sandbox.boundary import Caps
from fleet_worker.sandbox.cgroups import Cgroups, Limits
from fleet_worker.sandbox.jail import LocalSandboxConfig
from fleet_worker.sandbox.local import LocalSandboxProvider
from fleet_worker.sandbox.process import descendants


def test_every_process_of_a_repl_is_in_each_of_its_cgroups(traversable_dir: Path) -> None:
    cfg = LocalSandboxConfig(pool_size=0, cell_timeout_seconds=20.0)
    probe = Cgroups.detect(Limits(memory_bytes=cfg.memory_mb * 2**20, pids=cfg.max_processes, cpus=cfg.cpus))
    if not probe.bases:
        pytest.skip(f"no cgroups here: {probe.reason}")
    provider = LocalSandboxProvider(cfg, caps=Caps(), workspaces=traversable_dir)
    lease = provider.acquire("ws", "run-cgroups")
    try:
        session = lease.interpreter_factory()
        session.start()
        repl = session._repl
        assert repl is not None and repl.cgroup is not None and repl.supervisor is not None
        # A cell that runs a process of its own, which we look for while the cell runs.
        code = "import os\nos.system('sleep 5')"
        cell = threading.Thread(target=session.execute, args=(code, {}, {}, None))
        cell.start()
        deadline = time.monotonic() + 20
        while len(tree := descendants(repl.proc.pid)) < 4:  # bwrap's child, the interpreter, sh, sleep
            assert time.monotonic() < deadline, f"the cell's process never appeared: {tree}"
            time.sleep(0.02)
        assert repl.supervisor in tree
        for directory in repl.cgroup.dirs:
            members = {int(pid) for pid in (directory / "cgroup.procs").read_text().split()}
            assert tree | {repl.proc.pid} <= members, f"{directory} misses {tree - members}"
        session.interrupt()
        cell.join(20)
    finally:
        lease.release()
        provider.close()
