"""Abuse of one REPL from inside it, on real bwrap: what the cell tries, and how it is contained.

Each test attacks from the cell and checks both the containment and that the REPL (or its
replacement) works for the next cell."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet_worker.sandbox.boundary import Caps, CellResult
from fleet_worker.sandbox.errors import CellCrashed, CellTimeout
from fleet_worker.sandbox.jail import LocalSandboxConfig
from fleet_worker.sandbox.local import LocalSandboxLease, LocalSandboxProvider
from fleet_worker.sandbox.session import ReplSession


@pytest.fixture
def open_session(traversable_dir: Path) -> Iterator[Callable[..., ReplSession]]:
    leases: list[LocalSandboxLease] = []

    def open_session(max_output_chars: int = 10_000, **settings: Any) -> ReplSession:
        cfg = LocalSandboxConfig(**{"cell_timeout_seconds": 20.0, **settings})
        provider = LocalSandboxProvider(cfg, caps=Caps(max_output_chars=max_output_chars))
        lease = provider.acquire(traversable_dir / "ws", "run-abuse")
        leases.append(lease)
        return lease.new_session()

    yield open_session
    for lease in leases:
        lease.release()


@pytest.fixture
def session(open_session: Callable[..., ReplSession]) -> ReplSession:
    return open_session()


def run(session: ReplSession, code: str, **tools: Callable[..., Any]) -> CellResult:
    return session.execute(code, {}, tools, None)


def test_frames_cannot_be_forged_from_a_cell(session: ReplSession) -> None:
    """The host channel lives only in the supervisor, which no other process may open through
    /proc. A cell can write to its own fds: 1 and 2 are the output (shown as text), and its socket
    to the supervisor speaks only the narrow protocol, whose frames the supervisor rebuilds: a
    result a cell claims there ends the cell as SUBMIT would, and nothing else passes (no output
    of its own, no fields the protocol lacks, no second result)."""
    forge = r"""
import json, os, struct
payload = json.dumps(
    {"op": "result", "id": 1, "final": {"answer": "forged"}, "stdout": "INJECTED", "truncated": True}
).encode()
frame = struct.pack(">I", len(payload)) + payload
reached = []
for fd in range(3, 64):  # 0-2: stdin (/dev/null) and the output pipe
    try:
        os.write(fd, frame)
        reached.append(fd)
    except OSError:
        pass
opened = []
for pid in os.listdir('/proc'):
    if pid.isdigit():
        for fd in range(0, 16):
            try:
                with open(f'/proc/{pid}/fd/{fd}', 'wb') as f:
                    f.write(frame)
                opened.append((int(pid), fd))
            except OSError:
                pass
print('reached', reached, 'opened', [p for p in opened if p[0] != os.getpid()])
"""
    result = run(session, forge)
    assert result.error is None
    # The claimed result ended the cell, as SUBMIT(answer="forged") would have, and carried
    # nothing more: the output is what the host read from the pipe, not the frame's "stdout".
    assert result.final == {"answer": "forged"} and "INJECTED" not in result.stdout
    assert result.stdout.startswith("reached [") and "opened []" in result.stdout
    assert result.truncated is False
    next_cell = run(session, "print('next')")  # the cell's real result, arriving late, is refused
    assert next_cell.error is not None and "protocol" in next_cell.error.message
    assert run(session, "print('after')").stdout == "after\n"


def test_a_cell_that_times_out_keeps_what_it_printed(open_session: Callable[..., ReplSession]) -> None:
    session = open_session(cell_timeout_seconds=2.0)
    with pytest.raises(CellTimeout) as raised:
        run(session, "import time\nprint('before the hang', flush=True)\nwhile True:\n    pass")
    assert raised.value.stdout == "before the hang\n"
    assert run(session, "print('fresh')").stdout == "fresh\n"


def test_background_processes_die_with_their_cell(session: ReplSession) -> None:
    started = run(
        session,
        "import subprocess, os\n"
        "p = subprocess.Popen(['sh', '-c', 'while true; do :; done'], start_new_session=True)\n"
        "d = subprocess.Popen(['sh', '-c', '(sleep 1000 &) ; exit 0'])\n"
        "d.wait()\n"
        "print(p.pid)",
    )
    spinner = int(started.stdout)
    survivors = run(  # zombies do not count: they run nothing (their parent's Popen reaps them)
        session,
        "import os\n"
        "live = [p for p in os.listdir('/proc') if p.isdigit()\n"
        "        and open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0] != 'Z']\n"
        "names = [open(f'/proc/{p}/comm').read().strip() for p in live]\n"
        "print(sorted(n for n in names if n in ('sh', 'sleep')))",
    )
    assert survivors.stdout == "[]\n", f"left behind: {survivors.stdout} (spinner {spinner})"


def test_a_stopped_interpreter_is_noticed_in_seconds(session: ReplSession) -> None:
    run(session, "x = 1")
    started = time.monotonic()
    result = run(session, "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)")
    assert time.monotonic() - started < 5  # not the 20 s cell timeout
    assert result.error is not None and "stopped" in result.error.message
    assert run(session, "print('x' in globals())").stdout == "False\n"  # a fresh interpreter


def test_a_stopped_supervisor_is_noticed_in_seconds(session: ReplSession) -> None:
    started = time.monotonic()
    with pytest.raises(CellCrashed, match="stopped"):
        run(session, "import os, signal, time\nos.kill(os.getppid(), signal.SIGSTOP)\ntime.sleep(30)")
    assert time.monotonic() - started < 5
    assert run(session, "print('back')").stdout == "back\n"


def test_killing_the_supervisor_is_a_cell_error_and_the_repl_comes_back(session: ReplSession) -> None:
    with pytest.raises(CellCrashed, match="restarted"):
        run(session, "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nimport time\ntime.sleep(5)")
    assert run(session, "print('back')").stdout == "back\n"


def test_an_interpreter_that_exits_is_replaced(session: ReplSession) -> None:
    result = run(session, "import os\nprint('bye', flush=True)\nos._exit(7)")
    assert result.error is not None and "exited with status 7" in result.error.message
    assert result.stdout == "bye\n"
    assert run(session, "print('again')").stdout == "again\n"


def test_lone_surrogates_in_output_do_not_break_anything(session: ReplSession) -> None:
    result = run(session, "print('a\\ud800b')\nimport os\nos.write(1, b'\\xff\\xfe\\n')")
    assert result.error is None
    result.stdout.encode("utf-8")  # valid UTF-8, whatever the cell wrote
    assert result.stdout.startswith("a\\ud800b\n")
