"""One cgroup per REPL, where the host allows it: memory (tmpfs pages included), processes and CPU
are limited for the whole sandbox, not per process.

- cgroup v1 (memory, pids and cpu hierarchies, writable by a root worker) and cgroup v2 (the
  unified hierarchy, with the controllers delegated to the worker's cgroup) are supported.
- Sandbox cgroups live under the worker's own cgroup (`<own>/fleet-sandboxes/repl-<id>`), so a
  container's or a pod's limits still cover them.
- The sandboxes' base group weighs an eighth of one control-plane process in the CPU scheduler
  (SANDBOX_CPU_SHARES): when the CPUs are contended, the worker and a gateway beside it run
  first, so a REPL starting or a cell spinning never delays a POST's first byte or an SSE frame.
  The weight is relative and work-conserving: an idle host still gives sandboxes every cycle.
- Anywhere else (a non-root worker, a read-only cgroupfs) the mode is `none`: each process keeps
  its rlimits only, and the worker says so at startup and in /ready.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)
CONTROLLERS = ("memory", "pids", "cpu")
GROUP = "fleet-sandboxes"
LEAF = "fleet-worker"  # cgroup v2: where a worker moves its own processes
CPU_PERIOD_US = 100_000
# The base group's CPU weight: v1 cpu.shares (a process's default is 1024) and v2 cpu.weight
# (default 100), an eighth of a control-plane process's.
SANDBOX_CPU_SHARES = 128
SANDBOX_CPU_WEIGHT = 12


@dataclass(frozen=True)
class Limits:
    memory_bytes: int
    pids: int
    cpus: float


@dataclass(frozen=True)
class Cgroup:
    """One REPL's cgroup: a directory per hierarchy (v1) or a single one (v2)."""

    dirs: tuple[Path, ...]
    version: int

    @property
    def procs_files(self) -> tuple[Path, ...]:
        return tuple(d / "cgroup.procs" for d in self.dirs)

    @property
    def join_files(self) -> tuple[Path, ...]:
        """Where a single-threaded process writes `0` to move itself in. On v1 that is `tasks`:
        a thread moving itself skips the global lock a `cgroup.procs` write takes, which waits
        out an RCU grace period on every REPL start (ADR 0018). v2 has only
        `cgroup.procs` outside threaded mode."""
        name = "tasks" if self.version == 1 else "cgroup.procs"
        return tuple(d / name for d in self.dirs)

    def kill_all(self) -> None:
        """SIGKILL every process still in it (whatever escaped the process group)."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def pids(self) -> set[int]:
        found: set[int] = set()
        for procs in self.procs_files:
            with contextlib.suppress(OSError):
                found |= {int(line) for line in procs.read_text().split()}
        return found

    def oom_kills(self) -> int:
        """How many processes the memory limit has killed (0 when the kernel does not say)."""
        memory = self.dirs[0]
        events = memory / ("memory.oom_control" if self.version == 1 else "memory.events")
        with contextlib.suppress(OSError, ValueError):
            for line in events.read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        return 0

    def remove(self) -> None:
        """Kill what is left and remove the directories. The kernel lets go of a cgroup a moment
        after its last process exits: what is still busy after a few tries is retried in the
        background, so a slow exit costs neither the caller's time nor a leaked directory."""
        self.kill_all()
        if not self.try_rmdir(attempts=20, pause=0.0):
            threading.Thread(target=self.try_rmdir, args=(100, 0.05), daemon=True).start()

    def try_rmdir(self, attempts: int, pause: float) -> bool:
        left = list(self.dirs)
        for _ in range(attempts):
            for directory in list(left):
                try:
                    directory.rmdir()
                    left.remove(directory)
                except FileNotFoundError:
                    left.remove(directory)
                except OSError:
                    pass
            if not left:
                return True
            self.kill_all()
            if pause:
                time.sleep(pause)
            else:
                os.sched_yield()
        if pause:
            log.warning("sandbox.cgroup_not_removed", cgroups=[str(d) for d in left])
        return False


# A REPL group this old with no live owner is a crashed worker's leftover.
SWEEP_AFTER_SECONDS = 60.0


def owner_alive(name: str) -> bool:
    """Whether the worker that named this group `repl-<pid>-<id>` still runs (in our pid
    namespace; a neighbour in another one is protected by the age rule instead)."""
    parts = name.split("-")
    return len(parts) == 3 and parts[1].isdigit() and Path(f"/proc/{parts[1]}").exists()


class Cgroups:
    """Creates REPL cgroups, or knows it cannot (`mode == "none"`, with the reason)."""

    def __init__(self, bases: tuple[Path, ...], version: int, reason: str = "") -> None:
        self.bases = bases
        self.version = version
        self.reason = reason

    @property
    def mode(self) -> str:
        return f"cgroup-v{self.version}" if self.bases else "none"

    @classmethod
    def detect(cls, limits: Limits) -> Cgroups:
        """The worker's cgroups, set up now: on v2 this moves the worker's cgroup's processes into
        a leaf and enables the controllers; stale REPL groups are swept. Never for `fleet doctor`
        (see `prepared`)."""
        if os.geteuid() != 0:
            return cls((), 0, "the worker is not root")
        try:
            located = locate(cgroup_mounts(), own_paths())
            found = None if located is None else set_up(*located)
        except OSError as exc:
            return cls((), 0, f"cannot read this process's cgroups: {exc}")
        if found is None:
            return cls((), 0, "no writable memory, pids and cpu controllers")
        bases, version = found
        cgroups = cls(bases, version)
        cgroups.sweep()
        try:
            cgroups.create(limits).remove()  # prove it works before anyone relies on it
        except OSError as exc:
            return cls((), 0, f"cgroups are not writable here: {exc}")
        return cgroups

    @classmethod
    def prepared(cls, view: CgroupView) -> Cgroups:
        """Cgroups under a base a worker already set up, found without writing anything (no
        sweep, no probe group); mode `none`, with what is missing, when there is none."""
        if os.geteuid() != 0:
            return cls((), 0, "not root")
        if not view.prepared:
            return cls((), 0, f"no sandbox cgroup prepared by a worker ({view.needs or view.summary})")
        return cls(view.prepared, view.version)

    def sweep(self, now: float | None = None) -> None:
        """Remove REPL cgroups a crashed worker left behind. Only empty ones go (rmdir refuses
        a cgroup with processes), and never one whose worker is alive or that is younger than
        SWEEP_AFTER_SECONDS: a neighbour's group is empty between its mkdir and its REPL joining
        it, and removing it then failed that neighbour's REPL start (two workers starting at once)."""
        cutoff = (time.time() if now is None else now) - SWEEP_AFTER_SECONDS
        for base in self.bases:
            with contextlib.suppress(OSError):
                for stale in base.glob("repl-*"):
                    with contextlib.suppress(OSError):
                        if owner_alive(stale.name) or stale.stat().st_mtime > cutoff:
                            continue
                        stale.rmdir()

    def create(self, limits: Limits) -> Cgroup:
        name = f"repl-{os.getpid()}-{uuid.uuid4().hex[:12]}"  # the owner's pid: see sweep
        if self.version == 1:
            dirs = tuple(base / name for base in self.bases)
            for directory in dirs:
                directory.mkdir()
            memory, pids, cpu = dirs
            write(memory / "memory.limit_in_bytes", limits.memory_bytes)
            with contextlib.suppress(OSError):  # only with swap accounting
                write(memory / "memory.memsw.limit_in_bytes", limits.memory_bytes)
            write(pids / "pids.max", limits.pids)
            write(cpu / "cpu.cfs_period_us", CPU_PERIOD_US)
            write(cpu / "cpu.cfs_quota_us", int(limits.cpus * CPU_PERIOD_US))
            return Cgroup(dirs, 1)
        directory = self.bases[0] / name
        directory.mkdir()
        write(directory / "memory.max", limits.memory_bytes)
        with contextlib.suppress(OSError):
            write(directory / "memory.swap.max", 0)
        write(directory / "pids.max", limits.pids)
        write(directory / "cpu.max", f"{int(limits.cpus * CPU_PERIOD_US)} {CPU_PERIOD_US}")
        return Cgroup((directory,), 2)


def write(path: Path, value: object) -> None:
    path.write_text(f"{value}\n")


def weigh(path: Path, weight: int) -> None:
    """The sandboxes' CPU weight only orders who runs first: a host that refuses it keeps every
    limit, and says so."""
    try:
        write(path, weight)
    except OSError as exc:
        log.warning("sandbox.cpu_weight_not_set", path=str(path), error=str(exc))


def own_paths() -> dict[str, str]:
    """This process's cgroup per controller (`""` keys the v2 hierarchy)."""
    paths: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _id, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def cgroup_mounts() -> dict[str, Path]:
    """Mount point per v1 controller, and `""` for the v2 hierarchy, from mountinfo."""
    mounts: dict[str, Path] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(tail) < 3 or len(fields) < 5:
            continue
        fstype, options = tail[0], tail[2].split(",")
        if fstype == "cgroup2":
            mounts.setdefault("", Path(fields[4]))
        elif fstype == "cgroup":
            for controller in CONTROLLERS:
                if controller in options:
                    mounts.setdefault(controller, Path(fields[4]))
    return mounts


def locate(mounts: dict[str, Path], paths: dict[str, str]) -> tuple[int, dict[str, Path]] | None:
    """The hierarchy the worker uses (1 or 2) and this process's cgroup directory in it, per
    controller (v2: one directory, keyed `""`); None when neither has the three controllers."""
    if all(c in mounts and c in paths for c in CONTROLLERS):
        return 1, {c: mounts[c] / paths[c].lstrip("/") for c in CONTROLLERS}
    if "" in mounts and "" in paths and not any(c in mounts for c in CONTROLLERS):
        return 2, {"": mounts[""] / paths[""].lstrip("/")}
    return None


def set_up(version: int, own: dict[str, Path]) -> tuple[tuple[Path, ...], int] | None:
    """The worker's setup: the sandboxes' base group(s) under its own cgroup, created if missing."""
    if version == 1:
        return find_v1(own)
    return find_v2(own[""])


def find_v1(own: dict[str, Path]) -> tuple[tuple[Path, ...], int] | None:
    bases = []
    for controller in CONTROLLERS:
        base = own[controller] / GROUP
        if not base.parent.is_dir():
            return None
        base.mkdir(exist_ok=True)
        bases.append(base)
    weigh(bases[CONTROLLERS.index("cpu")] / "cpu.shares", SANDBOX_CPU_SHARES)
    return tuple(bases), 1


def find_v2(own: Path) -> tuple[tuple[Path, ...], int] | None:
    available = (own / "cgroup.controllers").read_text().split()
    if not all(c in available for c in CONTROLLERS):
        return None
    # v2 lets only leaf cgroups hold processes: move this worker into a leaf of its own first,
    # then hand the controllers down to the sandboxes' group.
    leaf = own / LEAF
    leaf.mkdir(exist_ok=True)
    for pid in (own / "cgroup.procs").read_text().split():
        with contextlib.suppress(OSError):
            write(leaf / "cgroup.procs", pid)
    enable = " ".join(f"+{c}" for c in CONTROLLERS)
    write(own / "cgroup.subtree_control", enable)
    base = own / GROUP
    base.mkdir(exist_ok=True)
    write(base / "cgroup.subtree_control", enable)
    weigh(base / "cpu.weight", SANDBOX_CPU_WEIGHT)
    return (base,), 2


@dataclass(frozen=True)
class CgroupView:
    """This process's cgroups as read, never written: for `fleet doctor`, which may run beside a
    live worker (`kubectl exec` into its pod) and must not change what the worker relies on."""

    version: int  # 1 or 2; 0 when neither hierarchy has the three controllers
    available: tuple[str, ...]  # of CONTROLLERS, enabled for this process's cgroup
    writable: tuple[str, ...]  # of those, where this process may create groups
    prepared: tuple[Path, ...] = ()  # the sandboxes' base group(s) a worker set up already
    needs: str = ""  # what the worker's setup would change here (empty once prepared)

    @property
    def summary(self) -> str:
        if not self.version:
            return "no cgroup hierarchy with memory, pids and cpu controllers"
        available = ", ".join(self.available) or "none"
        writable = ", ".join(self.writable) or "none"
        return f"cgroup v{self.version}: controllers {available} available, {writable} writable"


def inspect(mounts: dict[str, Path] | None = None, paths: dict[str, str] | None = None) -> CgroupView:
    """What Cgroups.detect would find, read-only (`mounts`/`paths` default to this process's)."""
    located = locate(cgroup_mounts() if mounts is None else mounts, own_paths() if paths is None else paths)
    if located is None:
        return CgroupView(0, (), ())
    version, own = located
    if version == 1:
        available = tuple(c for c in CONTROLLERS if own[c].is_dir())
        writable = tuple(c for c in available if os.access(own[c], os.W_OK))
        bases = tuple(own[c] / GROUP for c in CONTROLLERS)
        if all(base.is_dir() and os.access(base, os.W_OK) for base in bases):
            return CgroupView(1, available, writable, bases)
        needs = f"the worker creates {GROUP}/ in the memory, pids and cpu hierarchies"
        return CgroupView(1, available, writable, needs=needs)
    directory = own[""]
    listed = read_words(directory / "cgroup.controllers")
    available = tuple(c for c in CONTROLLERS if c in listed)
    may_write = os.access(directory / "cgroup.subtree_control", os.W_OK)
    writable = available if may_write else ()
    # A worker set up its own cgroup; a process exec'd into its container may sit in that leaf.
    owners = [directory, directory.parent] if directory.name == LEAF else [directory]
    for owner in owners:
        base = owner / GROUP
        if base.is_dir() and all(c in read_words(base / "cgroup.subtree_control") for c in CONTROLLERS):
            return CgroupView(2, available, writable, (base,))
    processes = len(read_words(directory / "cgroup.procs"))
    needs = (
        f"the worker moves the {processes} process(es) of {directory} into {LEAF}/ and enables "
        f"{', '.join(CONTROLLERS)} for its subgroups"
    )
    return CgroupView(2, available, writable, needs=needs)


def read_words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []
