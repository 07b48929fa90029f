"""What a sandbox leaves on the host, and what of the host it can see (issue #29, items 4 to 6),
each against the real bwrap jail: links planted in the workspace, host paths and pids in the
jail's mount table, what /usr/local shows, and the REPL's own leaks (closed stdio, zombies, a
process the memory limit killed)."""

from __future__ import annotations

import ast
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet_shared.confined import MAX_DEPTH
from fleet_worker.sandbox.boundary import Caps, CellResult
from fleet_worker.sandbox.jail import LocalSandboxConfig, python_mount, resolve_python, usr_local
from fleet_worker.sandbox.lease import LocalSandboxLease
from fleet_worker.sandbox.local import LocalSandboxProvider
from fleet_worker.sandbox.session import ReplSession
from fleet_worker.sandbox.volumes import WorkspaceVolumes

REPO = Path(__file__).resolve().parents[2]
WORKSPACE = "ws-leaks"
# Plain folders (a non-root worker's way), and a root worker's volumes where this host has them.
FOLDER_KINDS = [
    pytest.param(False, id="folder"),
    pytest.param(
        True,
        id="volume",
        marks=pytest.mark.skipif(not WorkspaceVolumes.available(), reason="needs root, mkfs.ext4 and mount"),
    ),
]


class Sandboxes:
    """Providers placed in a data dir of their own, as a worker places them."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.providers: list[LocalSandboxProvider] = []
        self.leases: list[LocalSandboxLease] = []

    def lease(self, **settings: Any) -> LocalSandboxLease:
        cfg = LocalSandboxConfig(**{"cell_timeout_seconds": 30.0, "workspace_mb": 64, **settings})
        provider = LocalSandboxProvider(cfg, caps=Caps(max_output_chars=20_000))
        provider.place_workspaces(self.data_dir / "workspaces", self.data_dir / "relocated")
        self.providers.append(provider)
        lease = provider.acquire(WORKSPACE, "run-leaks")
        self.leases.append(lease)
        return lease

    def close(self) -> None:
        for lease in self.leases:
            lease.release()
        for provider in self.providers:
            provider.close()


@pytest.fixture
def sandboxes(traversable_dir: Path) -> Iterator[Sandboxes]:
    made = Sandboxes(traversable_dir / "data")
    yield made
    made.close()


def run(session: ReplSession, code: str) -> CellResult:
    return session.execute(code, {}, {}, None)


def planted_on_host(root: Path) -> list[str]:
    """Every link, device, fifo and socket under `root`, found without following any."""
    found = []
    for folder, dirs, names in os.walk(root):
        for name in dirs + names:
            mode = os.lstat(os.path.join(folder, name)).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                found.append(os.path.relpath(os.path.join(folder, name), root))
    return sorted(found)


PLANT = f"""
import os, socket
art = '/workspace/artifacts'
os.symlink('/etc/shadow', art + '/shadow_link')
os.symlink('/usr', art + '/host_folder')
os.symlink('../memory', art + '/inside_link')
os.mkdir(art + '/nested')
os.symlink('/etc/passwd', art + '/nested/passwd_link')
os.mkfifo(art + '/nested/fifo')
listener = socket.socket(socket.AF_UNIX)
listener.bind(art + '/nested/socket')
os.mkdir(art + '/locked')
os.symlink('/etc', art + '/locked/etc_link')
os.chmod(art + '/locked', 0)
path = art + '/deep'
for _ in range({MAX_DEPTH + 6}):
    path += '/d'
os.makedirs(path)
os.symlink('/etc/shadow', path + '/deep_link')
open(art + '/kept.txt', 'w').write('kept')
print(sorted(os.listdir(art)))
"""


@pytest.mark.parametrize("volumes", FOLDER_KINDS)
def test_a_runs_links_devices_and_fifos_are_gone_from_the_host_when_it_ends(
    sandboxes: Sandboxes, volumes: bool
) -> None:
    lease = sandboxes.lease(workspace_volumes=volumes)
    result = run(lease.interpreter_factory(), PLANT)
    assert "shadow_link" in result.stdout  # (the deep tree is over the budget: the cell is told)
    assert planted_on_host(lease.workspace)  # planted, and on the host while the Run lasts

    lease.release()

    assert planted_on_host(lease.workspace) == []
    artifacts = lease.workspace / "artifacts"
    assert (artifacts / "kept.txt").read_text() == "kept"  # the Run's files stay
    assert (artifacts / "locked").is_dir()  # a folder the sandbox locked is reachable again
    deepest = max(len(Path(folder).relative_to(lease.workspace).parts) for folder, *_ in os.walk(artifacts))
    assert deepest <= MAX_DEPTH  # what the walk would not reach is gone, with the link inside


MOUNT_TABLE = """
import os
print(open('/proc/self/mountinfo').read())
print('USR_LOCAL', sorted(
    os.path.join(folder, name)
    for folder, dirs, names in os.walk('/usr/local')
    for name in dirs + names
))
"""


def path_fields(mountinfo: str) -> list[str]:
    """Each mount's root, mount point and source: where a host path or a pid would show."""
    fields = []
    for line in mountinfo.splitlines():
        before, _dash, after = line.partition(" - ")
        words = before.split()
        if len(words) >= 5:
            fields += [words[3], words[4], *after.split()[1:2]]
    return fields


def needed_from_usr_local() -> list[str]:
    """What the jail binds of /usr/local for this host's sandbox interpreter."""
    executable, _prefix = python_mount(resolve_python(LocalSandboxConfig()))
    argv = usr_local(executable)
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == "--ro-bind"]


@pytest.mark.parametrize("volumes", FOLDER_KINDS)
def test_the_jail_shows_no_host_path_no_worker_pid_and_nothing_of_usr_local(
    sandboxes: Sandboxes, volumes: bool
) -> None:
    lease = sandboxes.lease(workspace_volumes=volumes)
    result = run(lease.interpreter_factory(), MOUNT_TABLE)
    assert result.error is None, result.error
    mountinfo, _, listing = result.stdout.partition("USR_LOCAL")
    assert " /workspace " in mountinfo and " /opt/fleet/" in mountinfo  # the table is the jail's

    hidden = [REPO, Path(tempfile.gettempdir()) / "fleet-repl-"]
    if volumes:  # a plain folder is bound as it is: its path shows (docs/security.md)
        hidden += [sandboxes.data_dir, lease.workspace]
    for host_path in hidden:
        assert str(host_path) not in mountinfo
    pid = str(os.getpid())
    assert [field for field in path_fields(mountinfo) if pid in re.split(r"[^0-9]+", field)] == []

    needed = needed_from_usr_local()
    shown = ast.literal_eval(listing.strip())
    assert [
        path
        for path in shown
        if not any(
            path == bound or path.startswith(f"{bound}/") or bound.startswith(f"{path}/") for bound in needed
        )
    ] == []
    assert needed or shown == []  # an interpreter from elsewhere: /usr/local is empty


def test_a_cell_that_closes_its_stdio_leaves_the_next_one_able_to_print(sandboxes: Sandboxes) -> None:
    session = sandboxes.lease().interpreter_factory()
    closing = "import os, sys\nkept = 41\nprint('before', flush=True)\nfor fd in (0, 1, 2):\n    os.close(fd)"
    first = run(session, closing)
    assert first.error is None and first.stdout == "before\n"
    printing = "print('after', kept + 1)\nprint('on stderr', file=sys.stderr)\nprint(repr(sys.stdin.read()))"

    second = run(session, printing)  # EBADF, before the REPL restored its fds

    assert second.error is None, second.error
    assert second.stdout.splitlines() == ["after 42", "on stderr", "''"]  # the same REPL, its state kept
    assert run(session, "sys.stdout.close()\nsys.stderr.close()").error is None
    assert run(session, printing).stdout.splitlines() == ["after 42", "on stderr", "''"]


def zombies_and_forks(count: int) -> str:
    """A cell that forks `count` children which end at once and are never waited for, returns
    once every one is a zombie, and says how many zombies there were before it forked."""
    return f"""
import os, time
def state(pid):
    try:
        return open(f'/proc/{{pid}}/stat').read().rsplit(')', 1)[1].split()[0]
    except OSError:
        return '?'
before = sum(1 for entry in os.listdir('/proc') if entry.isdigit() and state(entry) == 'Z')
forked = [os.fork() or os._exit(0) for _ in range({count})]
deadline = time.monotonic() + 10
while any(state(pid) != 'Z' for pid in forked) and time.monotonic() < deadline:
    time.sleep(0.01)
print('zombies before', before, 'forked', len(forked))
"""


def test_children_a_cell_never_waited_for_do_not_pile_up_against_max_processes(sandboxes: Sandboxes) -> None:
    session = sandboxes.lease(max_processes=14).interpreter_factory()
    outputs = []
    for _ in range(3):  # 8 zombies left by each cell would take the third past 14 processes
        result = run(session, zombies_and_forks(8))
        assert result.error is None, result.error
        outputs.append(result.stdout.strip())
    assert outputs == ["zombies before 0 forked 8"] * 3


MEMORY_MB = 96
# A child that takes more memory than the REPL has left while /tmp (charged to the REPL) holds
# most of it: the memory limit kills the child, the largest process.
HOG = "b = bytearray(56 * 2**20)\nb[::4096] = b'y' * (len(b) // 4096)\nimport time\ntime.sleep(60)"
FILL_TMP = "with open('/tmp/fill', 'wb') as out:\n    for _ in range(48):\n        out.write(b'x' * 2**20)\n"


def test_a_child_the_memory_limit_killed_is_named_in_the_cells_output(sandboxes: Sandboxes) -> None:
    lease = sandboxes.lease(memory_mb=MEMORY_MB)
    session = lease.interpreter_factory()
    session.start()
    repl = session._repl
    if repl is None or repl.cgroup is None:
        pytest.skip("needs a memory cgroup for the REPL (a root worker with writable cgroups)")

    waited = run(
        session,
        f"import subprocess, sys\n{FILL_TMP}"
        f"child = subprocess.Popen([sys.executable, '-c', {HOG!r}])\n"
        "child.wait()\nprint('pid', child.pid, 'status', child.returncode)",
    )
    assert waited.error is None, waited.error
    pid = waited.stdout.split()[1]
    assert f"pid {pid} status -9" in waited.stdout
    assert f"[process {pid} killed: memory limit]" in waited.stdout

    # Forked and never waited for: the REPL reaps it at the cell's end, and names it.
    unwaited = run(
        session,
        "import os, time\nos.remove('/tmp/fill')\n" + FILL_TMP + "pid = os.fork()\n"
        f"if pid == 0:\n    exec({HOG!r})\n    os._exit(0)\n"
        "deadline = time.monotonic() + 20\n"
        "while time.monotonic() < deadline:\n"
        "    try:\n        gone = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0] == 'Z'\n"
        "    except OSError:\n        gone = True\n"
        "    if gone:\n        break\n    time.sleep(0.01)\n"
        "print('pid', pid)",
    )
    assert unwaited.error is None, unwaited.error
    pid = unwaited.stdout.split()[1]
    assert f"[process {pid} killed: memory limit]" in unwaited.stdout

    quiet = run(
        session,
        "import os, signal, subprocess\nchild = subprocess.Popen(['sleep', '30'])\n"
        "os.kill(child.pid, signal.SIGKILL)\nchild.wait()\nos.remove('/tmp/fill')",
    )
    assert "killed: memory limit" not in quiet.stdout  # a kill of the cell's own is not the limit's
