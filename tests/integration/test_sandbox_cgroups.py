"""A REPL's cgroups hold every process of its sandbox, from the first one bwrap starts: real bwrap,
real cgroups (skipped where the worker cannot create them: not root, or a read-only cgroupfs)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fleet_worker.sandbox.boundary import Caps
from fleet_worker.sandbox.cgroups import SANDBOX_CPU_SHARES, SANDBOX_CPU_WEIGHT, Cgroups, Limits
from fleet_worker.sandbox.errors import CellInterrupted
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
        outcome: list[BaseException] = []

        def run_cell() -> None:
            try:
                session.execute(code, {}, {}, None)
            except CellInterrupted as exc:  # what the interrupt below makes of it
                outcome.append(exc)

        cell = threading.Thread(target=run_cell)
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
        assert not cell.is_alive() and len(outcome) == 1
    finally:
        lease.release()
        provider.close()


SPIN_FOR_8_SECONDS = "import time\nend = time.monotonic() + 8\nwhile time.monotonic() < end: pass"


def cpu_seconds(pids: set[int]) -> float:
    """utime + stime of these processes, in seconds (the ones that exited count zero)."""
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def test_a_spinning_sandbox_yields_the_cpu_to_a_control_plane_process(traversable_dir: Path) -> None:
    """Sandbox code and a host process (standing for the worker or the gateway) both spin on one
    CPU: the host process gets most of it, because the sandboxes' base group weighs an eighth of
    a process. Measured as a ratio of CPU time over the same window, so other load on the machine
    weighs on both alike. Equal weights (the default) give a ratio near 1."""
    cfg = LocalSandboxConfig(pool_size=0, cell_timeout_seconds=30.0, cpus=2.0)  # no quota in the way
    probe = Cgroups.detect(Limits(memory_bytes=cfg.memory_mb * 2**20, pids=cfg.max_processes, cpus=cfg.cpus))
    if not probe.bases:
        pytest.skip(f"no cgroups here: {probe.reason}")
    weight_file = "cpu.shares" if probe.version == 1 else "cpu.weight"
    weights = [base / weight_file for base in probe.bases if (base / weight_file).exists()]
    assert [path.read_text().strip() for path in weights] == [
        str(SANDBOX_CPU_SHARES if probe.version == 1 else SANDBOX_CPU_WEIGHT)
    ]
    cpu = min(os.sched_getaffinity(0))
    provider = LocalSandboxProvider(cfg, caps=Caps(), workspaces=traversable_dir)
    lease = provider.acquire("ws", "run-cpu-weight")
    spinner = None
    try:
        session = lease.interpreter_factory()
        session.start()
        repl = session._repl
        assert repl is not None
        for pid in descendants(repl.proc.pid) | {repl.proc.pid}:
            os.sched_setaffinity(pid, {cpu})  # the cell's processes inherit it
        failures: list[BaseException] = []

        def run_cell() -> None:
            try:
                session.execute(SPIN_FOR_8_SECONDS, {}, {}, None)
            except BaseException as exc:
                failures.append(exc)

        cell = threading.Thread(target=run_cell)
        cell.start()
        pinned = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\n{SPIN_FOR_8_SECONDS}"
        spinner = subprocess.Popen([sys.executable, "-c", pinned])
        time.sleep(1.0)  # both are spinning
        sandbox_pids = descendants(repl.proc.pid)
        host_before, sandbox_before = cpu_seconds({spinner.pid}), cpu_seconds(sandbox_pids)
        time.sleep(2.0)
        host = cpu_seconds({spinner.pid}) - host_before
        sandboxed = cpu_seconds(sandbox_pids) - sandbox_before
        assert not failures, failures
        if host < 0.5:  # other work took the core: this window cannot compare the two
            pytest.skip(f"the pinned core was busy with other work (host process: {host:.2f} s of 2)")
        assert sandboxed > 0.05, f"the sandbox's cell did not spin ({sandboxed:.2f} s): nothing compared"
        assert host > 3 * sandboxed, f"host {host:.2f} s against sandbox {sandboxed:.2f} s of CPU"
        session.interrupt()
        cell.join(20)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
        lease.release()
        provider.close()
