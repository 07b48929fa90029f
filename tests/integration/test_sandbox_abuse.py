"""Abuse of one REPL from inside it, on real bwrap: what the cell tries, and how it is contained.

Each test attacks from the cell and checks both the containment and that the REPL (or its
replacement) works for the next cell."""

from __future__ import annotations

import errno
import os
import platform
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet_worker.sandbox.boundary import Caps, CellResult
from fleet_worker.sandbox.errors import CellCrashed, CellTimeout
from fleet_worker.sandbox.jail import LocalSandboxConfig
from fleet_worker.sandbox.lease import LocalSandboxLease
from fleet_worker.sandbox.local import LocalSandboxProvider
from fleet_worker.sandbox.process import children, process_state
from fleet_worker.sandbox.session import ReplSession


@pytest.fixture
def open_session(traversable_dir: Path) -> Iterator[Callable[..., ReplSession]]:
    leases: list[LocalSandboxLease] = []
    providers: list[LocalSandboxProvider] = []

    def open_session(max_output_chars: int = 10_000, **settings: Any) -> ReplSession:
        cfg = LocalSandboxConfig(**{"cell_timeout_seconds": 20.0, **settings})
        provider = LocalSandboxProvider(
            cfg, caps=Caps(max_output_chars=max_output_chars), workspaces=traversable_dir
        )
        lease = provider.acquire("ws", "run-abuse")
        leases.append(lease)
        providers.append(provider)
        return lease.interpreter_factory()

    yield open_session
    for lease in leases:
        lease.release()
    for provider in providers:  # its warm REPLs and its staged driver
        provider.close()


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
    assert result.truncated is False
    # The rest of the forging cell waited, stopped, for the next one; there it printed what it
    # reached, and its real result, arriving late, was refused.
    next_cell = run(session, "print('next')")
    assert next_cell.error is not None and "protocol" in next_cell.error.message
    printed = result.stdout + next_cell.stdout  # the print may straddle the stop
    assert printed.startswith("reached [") and "opened []" in printed
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


@pytest.mark.skipif(platform.machine() != "x86_64", reason="SYS_exit is 60 on x86_64 only")
def test_a_process_whose_main_thread_exited_is_killed_with_its_cell(session: ReplSession) -> None:
    # Its main thread gone, the process reads `Z` in /proc while its other thread carries on:
    # it must not pass for a harmless zombie.
    started = run(
        session,
        "import ctypes, os, threading, time\n"
        "if os.fork() == 0:\n"
        "    def tick():\n"
        "        while True:\n"
        "            with open('ticks', 'a') as f:\n"
        "                f.write('x')\n"
        "            time.sleep(0.01)\n"
        "    threading.Thread(target=tick).start()\n"
        "    time.sleep(0.1)\n"
        "    ctypes.CDLL(None).syscall(60, 0)  # SYS_exit: the main thread only\n"
        "time.sleep(0.3)\n"
        "print(os.path.getsize('ticks') > 0)",
    )
    assert started.stdout == "True\n", started
    grew = run(
        session,
        "import os, time\na = os.path.getsize('ticks')\ntime.sleep(0.3)\nprint(os.path.getsize('ticks') - a)",
    )
    assert grew.stdout == "0\n", f"a leftover kept writing: {grew.stdout}"


def test_a_stopped_interpreter_is_noticed_in_seconds(session: ReplSession) -> None:
    run(session, "x = 1")
    started = time.monotonic()
    result = run(session, "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)")
    assert time.monotonic() - started < 5  # not the 20 s cell timeout
    assert result.error is not None and "stopped" in result.error.message
    assert run(session, "print('x' in globals())").stdout == "False\n"  # a fresh interpreter


def test_the_supervisor_cannot_be_signalled(session: ReplSession) -> None:
    """The supervisor is the sandbox's pid 1: the kernel drops the signals a cell sends it."""
    run(session, "kept = 'state'")
    result = run(
        session,
        "import os, signal, time\n"
        "for number in (signal.SIGSTOP, signal.SIGTERM, signal.SIGKILL):\n"
        "    os.kill(os.getppid(), number)\n"
        "time.sleep(0.5)\n"
        "print(os.getppid(), open('/proc/1/stat').read().rsplit(')', 1)[1].split()[0])",
    )
    assert result.error is None
    assert result.stdout.split()[0] == "1" and result.stdout.split()[1] != "T"
    assert run(session, "print(kept)").stdout == "state\n"  # same supervisor, same interpreter


def test_a_repl_killed_under_a_cell_is_a_cell_error_and_comes_back(session: ReplSession) -> None:
    """The whole sandbox killed from outside mid-cell (as the OOM killer might): the cell
    fails with a clear error and the next cell gets a fresh REPL."""
    run(session, "x = 1")
    repl = session._repl
    assert repl is not None
    killer = threading.Timer(1.0, repl.proc.kill)  # bwrap: its pid namespace goes with it
    killer.start()
    try:
        with pytest.raises(CellCrashed, match="restarted"):
            run(session, "import time\ntime.sleep(10)")
    finally:
        killer.cancel()
    assert run(session, "print('back')").stdout == "back\n"


def test_an_interpreter_killed_between_cells_is_a_cell_error_not_a_crash(session: ReplSession) -> None:
    """The interpreter (not the supervisor) gone between two cells, as the OOM killer or the cell's
    own doing may leave it: the next cell is told its state was reset, and the same supervisor
    carries on with a fresh interpreter."""
    run(session, "x = 1")
    repl = session._repl
    assert repl is not None and repl.supervisor is not None
    interpreter = children(repl.supervisor)
    assert len(interpreter) == 1
    os.kill(interpreter[0], signal.SIGKILL)
    while process_state(interpreter[0]) not in ("Z", "?"):  # dead (a zombie until reaped)
        time.sleep(0.01)
    result = run(session, "print(x)")
    assert result.error is not None and "state was reset" in result.error.message
    assert session._repl is repl  # the same REPL: its supervisor did not crash
    assert run(session, "print('fresh')").stdout == "fresh\n"


def test_threads_a_cell_leaves_running_wait_for_the_next_cell(session: ReplSession) -> None:
    """Between cells the interpreter is stopped: a thread the cell left behind neither runs,
    nor writes to the workspace, nor prints into the next cell's output."""
    run(
        session,
        "import threading, time\n"
        "ticks = []\n"
        "def tick():\n"
        "    while True:\n"
        "        ticks.append(time.monotonic())\n"
        "        time.sleep(0.01)\n"
        "threading.Thread(target=tick, daemon=True).start()\n"
        "time.sleep(0.2)",
    )
    time.sleep(1.0)  # the pause under test: the thread must not tick through it
    result = run(
        session,
        "time.sleep(0.2)\n"
        "gaps = [b - a for a, b in zip(ticks, ticks[1:])]\n"
        "print(round(max(gaps), 1), len(ticks) > 20)",
    )
    assert result.error is None, result.error
    largest_gap, resumed = result.stdout.split()
    assert float(largest_gap) >= 0.8 and resumed == "True"  # it stopped, then ran again


SIGCONT_TIMER = """
import ctypes, os, signal, time
ran = []
signal.signal(signal.SIGCONT, lambda *_: ran.append(time.monotonic()))
libc = ctypes.CDLL(None, use_errno=True)

class SigEvent(ctypes.Structure):  # struct sigevent: value, signo, notify, then padding
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("pad", ctypes.c_byte * 48)]

event = SigEvent(None, signal.SIGCONT, 0)  # SIGEV_SIGNAL
timer = ctypes.c_void_p()
created = libc.timer_create(1, ctypes.byref(event), ctypes.byref(timer))  # CLOCK_MONOTONIC
if created == 0:
    due = (ctypes.c_long * 4)(0, 0, 0, 200_000_000)  # once, 0.2 s from now: between the cells
    libc.timer_settime(timer, 0, due, None)
armed = time.monotonic()
print(created, ctypes.get_errno())
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="struct sigevent laid out for x86_64")
def test_a_cell_cannot_have_itself_woken_between_cells(session: ReplSession) -> None:
    """SIGCONT from a POSIX timer would continue the stopped interpreter with no process of
    the sandbox running to send it: its handler (or a thread) would run between cells."""
    armed = run(session, SIGCONT_TIMER)
    assert armed.stdout.split() == ["-1", str(errno.EPERM)], armed
    time.sleep(1.0)  # the pause under test: the timer would ring 0.2 s into it
    woken = run(session, "print([round(t - armed, 1) for t in ran])")
    # The next cell's own SIGCONT rings ~1 s after arming; nothing may ring before it.
    assert all(delay >= 0.9 for delay in eval(woken.stdout)), woken.stdout


@pytest.mark.skipif(platform.machine() != "x86_64", reason="SYS_clone is 56 on x86_64 only")
def test_other_ways_to_send_the_interpreter_sigcont_are_refused(session: ReplSession) -> None:
    """A child's exit signal (sent when it is killed as a leftover), and the signal of
    asynchronous I/O or a lease (F_SETSIG), could each be SIGCONT."""
    result = run(
        session,
        "import ctypes, fcntl, os, signal\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "pid = libc.syscall(56, signal.SIGCONT, 0, 0, 0, 0)  # SYS_clone: a fork, exit signal SIGCONT\n"
        "if pid == 0:\n"
        "    os._exit(0)\n"
        "print(pid, ctypes.get_errno())\n"
        "try:\n"
        "    fcntl.fcntl(1, 10, signal.SIGCONT)  # F_SETSIG\n"
        "    print('set')\n"
        "except PermissionError:\n"
        "    print('refused')\n"
        "child = os.fork()  # an ordinary fork and thread still work\n"
        "if child == 0:\n"
        "    os._exit(7)\n"
        "import threading\n"
        "t = threading.Thread(target=print, args=('thread',))\n"
        "t.start(); t.join()\n"
        "print(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))",
    )
    assert result.error is None, result.error
    assert result.stdout.split() == ["-1", str(errno.EPERM), "refused", "thread", "7"], result.stdout


def test_tools_called_from_threads_get_their_own_replies(session: ReplSession) -> None:
    result = run(
        session,
        "from concurrent.futures import ThreadPoolExecutor\n"
        "with ThreadPoolExecutor(8) as pool:\n"
        "    got = list(pool.map(lambda n: echo(n=n), range(64)))\n"
        "print(got == list(range(64)))",
        echo=lambda n: n,
    )
    assert result.error is None and result.stdout == "True\n"


def test_values_nested_too_deep_are_refused_not_crashed_on(session: ReplSession) -> None:
    run(session, "deep = []\nfor _ in range(500):\n    deep = [deep]")
    submitted = run(session, "SUBMIT(answer=deep)")
    assert submitted.final is None and submitted.error is not None
    assert "levels deep" in submitted.error.message
    called = run(
        session,
        "try:\n    echo(n=deep)\nexcept ValueError as exc:\n    print('refused', exc)",
        echo=lambda n: n,
    )
    assert called.error is None and called.stdout.startswith("refused")
    assert run(session, "print(len(deep))").stdout == "1\n"  # the interpreter's state is intact


def forge_frame(payload: str) -> str:
    """A cell that writes `payload` (Python for a str) as a frame to every fd it may hold."""
    return f"""
import os, struct
payload = ({payload}).encode()
frame = struct.pack(">I", len(payload)) + payload
for fd in range(3, 64):
    try:
        os.write(fd, frame)
    except OSError:
        pass
import time
time.sleep(5)
"""


def test_a_forged_deep_frame_resets_the_interpreter(session: ReplSession) -> None:
    forge = forge_frame("""'{"op":"result","id":1,"final":{"answer":' + '[' * 5000 + ']' * 5000 + '}}'""")
    result = run(session, forge)  # the supervisor cannot parse it: the channel counts as broken
    assert result.final is None and result.error is not None and result.error.type == "ReplReset"
    assert run(session, "print('after')").stdout == "after\n"


def test_a_result_too_large_once_escaped_is_a_cell_error_not_a_dead_supervisor(
    session: ReplSession,
) -> None:
    """A forged result of raw UTF-8 fits a frame (24 MB) but not once the supervisor escapes it
    to ASCII again (72 MB): the cell gets an error, and the supervisor (the jail's pid 1, whose
    death would end the REPL) carries on."""
    run(session, "x = 1")
    repl = session._repl
    forge = forge_frame("""'{"op":"result","id":2,"final":{"answer":"' + 'é' * 12_000_000 + '"}}'""")
    result = run(session, forge)
    assert result.error is not None and result.error.type == "ResultTooLarge", result
    assert session._repl is repl  # the same REPL: no crash, no restart
    run(session, "pass")  # the forging cell's own result, late, breaks the protocol here
    assert run(session, "print('after')").stdout == "after\n"


def test_an_interpreter_that_exits_is_replaced(session: ReplSession) -> None:
    result = run(session, "import os\nprint('bye', flush=True)\nos._exit(7)")
    assert result.error is not None and "exited with status 7" in result.error.message
    assert result.stdout == "bye\n"
    assert run(session, "print('again')").stdout == "again\n"


@pytest.mark.parametrize(("number", "named"), [(signal.SIGSEGV, "SIGSEGV"), (signal.SIGRTMIN + 6, "")])
def test_an_interpreter_killed_by_a_signal_is_named_and_replaced(
    session: ReplSession, number: int, named: str
) -> None:
    # A real-time signal has no name in the signal enum: the supervisor must not die on it.
    result = run(session, f"import os\nos.kill(os.getpid(), {int(number)})")
    assert result.error is not None and result.error.type == "ReplReset"
    assert f"died by signal {named or int(number)}" in result.error.message
    assert run(session, "print('again')").stdout == "again\n"


@pytest.mark.parametrize("payload", ['"abc', "[1 2]", '{"a" 1}', '"\\x"', "", '{"op": "result"} trailing'])
def test_a_malformed_frame_from_a_cell_resets_the_interpreter(session: ReplSession, payload: str) -> None:
    # The supervisor reads the interpreter's frames with the C JSON scanner, json not loaded:
    # every malformed frame must read as a broken channel, never kill the supervisor.
    result = run(session, forge_frame(repr(payload)))
    assert result.final is None and result.error is not None and result.error.type == "ReplReset"
    assert run(session, "print('after')").stdout == "after\n"


def test_the_first_failure_of_a_cell_out_of_memory_keeps_the_repl(
    open_session: Callable[..., ReplSession],
) -> None:
    # The traceback formatter is loaded by the first failing cell; with no memory left to load
    # it, the error still comes back as the cell's, and the REPL's state stays.
    session = open_session(memory_mb=160)
    result = run(session, "x = []\nwhile True:\n    x.append(bytearray(64 * 1024))")
    assert result.error is not None and result.error.type == "MemoryError", result.error
    assert run(session, "print(len(x) > 10)").stdout == "True\n"


def test_lone_surrogates_in_output_do_not_break_anything(session: ReplSession) -> None:
    result = run(session, "print('a\\ud800b')\nimport os\nos.write(1, b'\\xff\\xfe\\n')")
    assert result.error is None
    result.stdout.encode("utf-8")  # valid UTF-8, whatever the cell wrote
    assert result.stdout.startswith("a\\ud800b\n")


def test_growth_after_a_quiet_cell_is_still_measured(open_session: Callable[..., ReplSession]) -> None:
    """A cell's end skips the walk only when the filesystem has not changed since the last one:
    quiet cells in between do not hide a cell that grows the workspace."""
    session = open_session(workspace_mb=5)
    for _ in range(3):
        assert run(session, "x = 1").error is None
    grown = run(session, "open('/workspace/artifacts/big', 'wb').write(b'x' * 8 * 2**20)")
    assert grown.error is not None and grown.error.type == "WorkspaceOverBudget"
    assert "sandbox.local.workspace_mb" in grown.error.message
    # Whether the file is still there depends on when the budget caught it: mid-cell, the REPL is
    # stopped and what the cell wrote past the budget removed; at the cell's end, it stays.
    left = run(session, "import os\nprint(os.path.exists('/workspace/artifacts/big'))")
    assert left.error is None and left.stdout.strip() in ("True", "False")
    assert ("removed what this cell wrote past it" in grown.error.message) is (left.stdout.strip() == "False")
    assert (
        run(
            session,
            "import os\nos.path.exists('/workspace/artifacts/big') and os.remove('/workspace/artifacts/big')",
        ).error
        is None
    )
