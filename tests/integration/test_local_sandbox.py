"""The local bubblewrap sandbox, end to end with real bwrap: cells, tools, limits and isolation."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from fleet_shared.manifests import WORKSPACE_DIRS
from fleet_worker.sandbox.boundary import Caps, CellResult
from fleet_worker.sandbox.errors import (
    CellInterrupted,
    CellTimeout,
    SandboxError,
    SandboxUnavailable,
)
from fleet_worker.sandbox.jail import LocalSandboxConfig
from fleet_worker.sandbox.lease import LocalSandboxLease
from fleet_worker.sandbox.local import LocalSandboxProvider
from fleet_worker.sandbox.session import ReplSession

REPO = Path(__file__).resolve().parents[2]
HOST_SERVICES = {"redis": 6379, "postgresql": 5432}


@pytest.fixture
def workspace(traversable_dir: Path) -> Path:
    return traversable_dir / "ws"


@pytest.fixture
def open_lease(workspace: Path) -> Iterator[Callable[..., LocalSandboxLease]]:
    leases: list[LocalSandboxLease] = []
    providers: list[LocalSandboxProvider] = []

    def open_lease(
        max_output_chars: int = 10_000, search_path: str | None = None, **settings: Any
    ) -> LocalSandboxLease:
        cfg = LocalSandboxConfig(**{"cell_timeout_seconds": 20.0, **settings})
        provider = LocalSandboxProvider(
            cfg,
            caps=Caps(max_output_chars=max_output_chars),
            search_path=search_path,
            workspaces=workspace.parent,
        )
        lease = provider.acquire(workspace.name, "run-test")
        leases.append(lease)
        providers.append(provider)
        return lease

    yield open_lease
    for lease in leases:
        lease.release()
    for provider in providers:  # its warm REPLs and its staged driver
        provider.close()


@pytest.fixture
def session(open_lease: Callable[..., LocalSandboxLease]) -> ReplSession:
    return open_lease().interpreter_factory()


def run(
    session: ReplSession,
    code: str,
    variables: Mapping[str, Any] | None = None,
    tools: Mapping[str, Callable[..., Any]] | None = None,
    output_fields: Sequence[str] | None = None,
) -> CellResult:
    return session.execute(code, variables or {}, tools or {}, output_fields)


def ok(session: ReplSession, code: str, **kwargs: Any) -> str:
    result = run(session, code, **kwargs)
    assert result.error is None, result.error
    return result.stdout


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


# --- cells ---------------------------------------------------------------------------------


def test_state_persists_across_cells(session: ReplSession) -> None:
    ok(session, "import math\ncounter = 1\ndef bump():\n    global counter\n    counter += 1")
    ok(session, "bump(); bump()")
    assert ok(session, "print(counter, math.pi > 3)") == "3 True\n"


def test_a_new_repl_has_loaded_no_module_it_does_not_need(session: ReplSession) -> None:
    # Each Turn starts a REPL: what its start imports is every Turn's latency and worker CPU.
    # These pull in re, enum or functools (~15 ms a start), or ctypes' type layer (~2 ms);
    # a cell may import them itself.
    heavy = ["collections", "contextlib", "ctypes", "enum", "functools", "json", "re", "threading"]
    heavy.append("traceback")
    code = f"import sys\nprint([name for name in {heavy!r} if name in sys.modules])"
    assert ok(session, code) == "[]\n"
    assert ok(session, "import json, threading\nprint(json.dumps({'a': [1]}))") == '{"a": [1]}\n'


def test_variables_are_injected(session: ReplSession) -> None:
    variables = {"context": {"docs": ["a", "b"]}, "n": 3, "path": Path("/x/y")}
    assert ok(session, "print(context['docs'][n - 2], n, path)", variables=variables) == "b 3 /x/y\n"


def test_a_request_larger_than_a_socket_buffer_reaches_a_stopped_interpreter(session: ReplSession) -> None:
    # Between cells the interpreter is stopped; a small request is queued before it is woken,
    # a large one (it could fill the socket) only after: both must arrive whole.
    ok(session, "x = 1")
    for size in (10, 300_000, 4_000_000):
        assert ok(session, "print(len(blob), x)", variables={"blob": "y" * size}) == f"{size} 1\n"


def test_print_and_stderr_are_captured(session: ReplSession) -> None:
    code = "import sys\nprint('hello', 42)\nsys.stdout.write('out\\n')\nsys.stderr.write('err\\n')"
    result = run(session, code)
    assert result == CellResult(stdout="hello 42\nout\nerr\n", truncated=False, final=None, error=None)


def test_output_cap_truncates(open_lease: Callable[..., LocalSandboxLease]) -> None:
    session = open_lease(max_output_chars=1000).interpreter_factory()
    result = run(session, "print('x' * 10**7)\nfor _ in range(100000): print('more')")
    assert result.truncated is True
    assert len(result.stdout) <= 1000
    assert result.stdout.startswith("xxx")
    assert run(session, "print('small')").truncated is False


def test_raw_fd_writes_and_subprocess_output_are_captured_not_framed(session: ReplSession) -> None:
    """fds 1 and 2 are the host-read output pipe: raw writes and subprocesses land in the output
    and can never corrupt a frame."""
    code = "import os, subprocess\nos.write(1, b'junk')\nsubprocess.run(['echo', 'child'])\nprint('ok')"
    assert ok(session, code) == "junkchild\nok\n"
    assert ok(session, "print('still fine')") == "still fine\n"


# --- SUBMIT --------------------------------------------------------------------------------


def test_submit_with_keywords_ends_the_cell(session: ReplSession) -> None:
    result = run(session, "print('before')\nSUBMIT(answer=42)\nprint('after')")
    assert result.final == {"answer": 42}
    assert result.stdout == "before\n"
    assert result.error is None


def test_submit_positional_maps_onto_output_fields(session: ReplSession) -> None:
    result = run(session, "SUBMIT('yes', 0.9)", output_fields=["answer", "confidence"])
    assert result.final == {"answer": "yes", "confidence": 0.9}


def test_submit_with_missing_fields_is_an_error(session: ReplSession) -> None:
    result = run(session, "SUBMIT('yes')", output_fields=["answer", "confidence"])
    assert result.final is None
    assert result.error is not None and result.error.type == "TypeError"
    assert "confidence" in result.error.message


def test_submit_survives_a_broad_except(session: ReplSession) -> None:
    result = run(session, "try:\n    SUBMIT(answer=1)\nexcept Exception:\n    print('swallowed')")
    assert result.final == {"answer": 1}


# --- errors --------------------------------------------------------------------------------


def test_raising_cell_reports_the_error_and_the_repl_lives_on(session: ReplSession) -> None:
    ok(session, "kept = 'state'")
    result = run(session, "def f():\n    raise ValueError('boom')\nf()")
    assert result.error is not None
    assert (result.error.type, result.error.message) == ("ValueError", "boom")
    assert 'File "<cell>", line 3' in result.error.traceback
    assert "raise ValueError('boom')" in result.error.traceback
    assert "repl_main" not in result.error.traceback
    assert ok(session, "print(kept)") == "state\n"


def test_syntax_error_is_reported(session: ReplSession) -> None:
    result = run(session, "x = (1,")
    assert result.error is not None
    assert result.error.type == "SyntaxError"
    assert "<cell>" in result.error.traceback
    assert ok(session, "print('alive')") == "alive\n"


def test_system_exit_is_an_error_not_a_crash(session: ReplSession) -> None:
    result = run(session, "import sys\nsys.exit(3)")
    assert result.error is not None and result.error.type == "SystemExit"
    assert ok(session, "print('alive')") == "alive\n"


# --- host tools ----------------------------------------------------------------------------


def test_tool_calls_reach_the_host(session: ReplSession) -> None:
    calls: list[tuple[str, str | None]] = []
    threads: set[threading.Thread] = set()

    def llm_query(prompt: str, model: str | None = None) -> str:
        calls.append((prompt, model))
        threads.add(threading.current_thread())
        return f"answer to {prompt}"

    code = (
        "a = llm_query('q1')\n"
        "b = llm_query('q2', model='small')\n"
        "c = llm_query(prompt='q3')\n"
        "print(a, b, c, sep='|')"
    )
    stdout = ok(session, code, tools={"llm_query": llm_query})
    assert stdout == "answer to q1|answer to q2|answer to q3\n"
    assert calls == [("q1", None), ("q2", "small"), ("q3", None)]
    # The host callable runs right away on the thread that called execute().
    assert threads == {threading.current_thread()}


def test_tool_results_that_are_not_json_are_converted(session: ReplSession) -> None:
    class Doc:
        def model_dump(self, mode: str = "python") -> dict[str, str]:
            return {"title": "t"}

    stdout = ok(session, "print(fetch()['title'])", tools={"fetch": Doc})
    assert stdout == "t\n"


def test_tool_that_raises_becomes_a_catchable_runtime_error(session: ReplSession) -> None:
    def flaky(prompt: str) -> str:
        raise ValueError(f"upstream refused {prompt}")

    code = "try:\n    flaky('x')\nexcept RuntimeError as exc:\n    print('caught:', exc)"
    assert ok(session, code, tools={"flaky": flaky}) == "caught: ValueError: upstream refused x\n"
    uncaught = run(session, "flaky('y')", tools={"flaky": flaky})
    assert uncaught.error is not None and uncaught.error.type == "RuntimeError"
    assert "upstream refused y" in uncaught.error.message


def test_a_tool_replaced_under_the_same_name_gets_its_own_parameters(session: ReplSession) -> None:
    # The session remembers each tool's parameter names between cells (a Turn passes the same
    # tools to every cell); a new callable under an old name must not inherit the old names.
    def first(prompt: str) -> str:
        return f"first:{prompt}"

    def second(question: str, depth: int = 0) -> str:
        return f"second:{question}:{depth}"

    assert ok(session, "print(ask('a'))", tools={"ask": first}) == "first:a\n"
    assert ok(session, "print(ask('b', 2))", tools={"ask": second}) == "second:b:2\n"
    assert ok(session, "print(ask('c'))", tools={"ask": first}) == "first:c\n"


def test_tool_called_with_too_many_arguments(session: ReplSession) -> None:
    result = run(session, "one('a', 'b')", tools={"one": lambda value: value})
    assert result.error is not None and result.error.type == "TypeError"


# --- timeouts, interrupts, lifecycle -------------------------------------------------------


def test_timeout_kills_the_repl_and_the_next_cell_starts_fresh(
    open_lease: Callable[..., LocalSandboxLease],
) -> None:
    session = open_lease(cell_timeout_seconds=1.0).interpreter_factory()
    ok(session, "x = 1")
    started = time.monotonic()
    with pytest.raises(CellTimeout, match="lost"):
        run(session, "import time\ntime.sleep(30)")
    assert time.monotonic() - started < 5
    result = run(session, "print(x)")
    assert result.error is not None and result.error.type == "NameError"


def test_timeout_leaves_no_process_behind(open_lease: Callable[..., LocalSandboxLease]) -> None:
    marker = "4173.25"
    session = open_lease(cell_timeout_seconds=1.0).interpreter_factory()
    code = f"import subprocess, time\nsubprocess.Popen(['sleep', '{marker}'])\ntime.sleep(30)"
    with pytest.raises(CellTimeout):
        run(session, code)
    deadline = time.monotonic() + 5
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == []


def test_interrupt_cancels_the_running_cell(session: ReplSession) -> None:
    ok(session, "x = 1")
    timer = threading.Timer(0.5, session.interrupt)
    timer.start()
    started = time.monotonic()
    with pytest.raises(CellInterrupted):
        run(session, "import time\ntime.sleep(30)")
    assert time.monotonic() - started < 5
    result = run(session, "print(x)")
    assert result.error is not None and result.error.type == "NameError"


def test_shutdown_during_a_cell_interrupts_it(session: ReplSession) -> None:
    ok(session, "x = 1")
    threading.Timer(0.5, session.shutdown).start()
    with pytest.raises(CellInterrupted):
        run(session, "import time\ntime.sleep(30)")
    with pytest.raises(SandboxError):
        run(session, "print(x)")


def test_tool_aborted_by_cancellation_discards_the_repl(session: ReplSession) -> None:
    def cancelled() -> None:
        raise asyncio.CancelledError

    ok(session, "x = 1")
    with pytest.raises(asyncio.CancelledError):
        run(session, "cancelled()", tools={"cancelled": cancelled})
    # The REPL that waited for the aborted call is gone; the next cell gets a fresh one.
    assert ok(session, "print('x' in globals())") == "False\n"


def test_session_outlives_the_thread_that_started_it(session: ReplSession) -> None:
    # bwrap --die-with-parent tracks the forking *thread*; the REPL must not die with it.
    worker = threading.Thread(target=ok, args=(session, "x = 'kept'"))
    worker.start()
    worker.join()
    time.sleep(0.3)
    assert ok(session, "print(x)") == "kept\n"


def test_release_stops_every_session(open_lease: Callable[..., LocalSandboxLease]) -> None:
    lease = open_lease()
    sessions = [lease.interpreter_factory(), lease.interpreter_factory()]
    for index, session in enumerate(sessions):
        ok(session, f"me = {index}")
    pids = [session.pid for session in sessions]
    assert all(pid is not None for pid in pids)
    assert ok(sessions[1], "print(me)") == "1\n"
    lease.release()
    lease.release()
    for pid in pids:
        assert pid is not None and not Path(f"/proc/{pid}").exists()
    with pytest.raises(SandboxError):
        lease.interpreter_factory()
    with pytest.raises(SandboxError):
        run(sessions[0], "print(1)")


def test_a_lease_starts_its_repl_before_the_program_asks(
    open_lease: Callable[..., LocalSandboxLease],
) -> None:
    """No warm REPL for the workspace: the lease starts one at once, so the spawn overlaps the
    Run's staging and its program's setup; the program's start() then finds it up."""
    lease = open_lease(pool_size=0)
    session = lease.interpreter_factory()  # hands the REPL out; nothing here starts it
    deadline = time.monotonic() + 20
    while session.pid is None:
        assert time.monotonic() < deadline, "the REPL never started on its own"
        time.sleep(0.01)
    pid = session.pid
    session.start()
    assert session.pid == pid  # start() waited for that REPL rather than spawning another
    assert ok(session, "print(6 * 7)") == "42\n"


def test_a_lease_released_while_its_repl_starts_leaves_nothing(
    open_lease: Callable[..., LocalSandboxLease], workspace: Path
) -> None:
    open_lease(pool_size=0).release()
    deadline = time.monotonic() + 20
    while processes_with(str(workspace)):
        assert time.monotonic() < deadline, "a REPL of the released lease is still running"
        time.sleep(0.05)


def test_a_warm_repl_is_started_only_when_the_last_lease_comes_back(workspace: Path) -> None:
    # Under load, a warm REPL for a Run that may never come takes CPU the running Turns need;
    # an idle worker starts one for the workspace's next Run.
    provider = LocalSandboxProvider(LocalSandboxConfig(pool_size=4), caps=Caps(), workspaces=workspace.parent)
    pool = provider._pool
    try:
        other = provider.acquire(f"{workspace.name}-other", "run-other")
        busy = provider.acquire(workspace.name, "run-busy")
        busy.release()  # another lease is still out: no warm REPL
        pool.wait_started()
        assert not pool.holds(workspace)
        other.release()  # the last one out: its workspace gets a warm REPL
        pool.wait_started()
        assert pool.holds(workspace.parent / f"{workspace.name}-other")
        assert not pool.holds(workspace)
    finally:
        provider.close()


def test_acquire_creates_the_workspace_layout(
    open_lease: Callable[..., LocalSandboxLease], workspace: Path
) -> None:
    session = open_lease().interpreter_factory()
    assert all((workspace / name).is_dir() for name in WORKSPACE_DIRS)
    assert ok(session, "import os\nprint(sorted(os.listdir('.')))") == f"{sorted(WORKSPACE_DIRS)}\n"


# --- isolation -----------------------------------------------------------------------------


@pytest.mark.parametrize(("service", "port"), HOST_SERVICES.items())
def test_host_services_are_unreachable(session: ReplSession, service: str, port: int) -> None:
    # The service really listens on the host, so the check below cannot pass vacuously.
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    code = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), 1)\n"
        "    print('connected')\n"
        "except OSError as exc:\n"
        "    print('blocked', type(exc).__name__)"
    )
    assert ok(session, code).startswith("blocked"), service


def test_host_filesystem_is_hidden(session: ReplSession) -> None:
    stdout = ok(session, "import os\nprint(sorted(os.listdir('/')))")
    visible = eval(stdout)
    for hidden in ("work", "root", "home", "etc", "var", "srv"):
        assert hidden not in visible
    paths = [str(REPO), "/root", "/etc/passwd"]
    code = f"import os\nprint([os.path.exists(p) for p in {paths!r}])"
    assert ok(session, code) == "[False, False, False]\n"


def test_host_environment_does_not_leak(
    open_lease: Callable[..., LocalSandboxLease], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_LM_API_KEY", "secret-value")
    session = open_lease().interpreter_factory()
    code = (
        "import os\n"
        "print(os.environ.get('FLEET_LM_API_KEY'), 'secret-value' in open('/proc/self/environ').read())"
    )
    assert ok(session, code) == "None False\n"


def test_workspace_writes_reach_the_host(session: ReplSession, workspace: Path) -> None:
    ok(session, "open('/workspace/artifacts/out.txt', 'w').write('made inside')")
    assert (workspace / "artifacts" / "out.txt").read_text() == "made inside"


def test_usr_is_read_only(session: ReplSession) -> None:
    code = (
        "try:\n    open('/usr/evil', 'w')\n    print('wrote')\nexcept OSError as exc:\n    print(exc.errno)"
    )
    assert ok(session, code).strip() in {str(errno.EROFS), str(errno.EACCES)}


def test_code_runs_unprivileged(session: ReplSession, workspace: Path) -> None:
    code = "import os\nprint(os.getuid(), os.getgid(), os.access('/proc/sys/kernel/core_pattern', os.W_OK))"
    uid, gid, writable = ok(session, code).split()
    # Also on root hosts: writable global sysctls would mean the jail's uid is host root.
    assert writable == "False" and uid == gid
    if os.geteuid() == 0:  # a uid of the configured range, never root and never nobody
        config = LocalSandboxConfig()
        assert config.uid_base <= int(uid) < config.uid_base + config.uid_count
        assert workspace.stat().st_uid == int(uid)
    else:
        assert int(uid) == os.geteuid()


# --- availability --------------------------------------------------------------------------


def test_missing_bwrap_without_unisolated_is_unavailable(tmp_path: Path) -> None:
    provider = LocalSandboxProvider(
        LocalSandboxConfig(allow_unisolated=False),
        caps=Caps(max_output_chars=1000),
        search_path=str(tmp_path),
    )
    with pytest.raises(SandboxUnavailable) as raised:
        provider.check()
    assert "apt-get install bubblewrap" in str(raised.value)
    assert "sandbox.local.allow_unisolated = true" in str(raised.value)


def test_missing_bwrap_with_unisolated_runs_plain_subprocesses(
    open_lease: Callable[..., LocalSandboxLease],
    tmp_path: Path,
    workspace: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEET_LM_API_KEY", "secret-value")
    lease = open_lease(allow_unisolated=True, search_path=str(tmp_path))
    assert lease.isolated is False
    session = lease.interpreter_factory()
    stdout = ok(session, "import os\nprint(os.getcwd(), os.environ.get('FLEET_LM_API_KEY'))")
    assert stdout == f"{workspace.resolve()} None\n"
    assert run(session, "SUBMIT(answer=1)").final == {"answer": 1}
