"""The escape suite on the live link between a REPL's interpreter and its supervisor, on real bwrap:
a cell finds its end of the link (link_probe.py) and writes forged, malformed, oversized and
stalled frames to it. Whatever it writes, nothing forged becomes a result, a tool call or an
answer: the cell fails with a clear error (or gets the host's refusal), within its timeout, the
supervisor lives on, and the next cell is sound.

Every probe proves it reached the link: the link's evidence (`reached_link`), plus an effect only
the supervisor or the host can produce (a reset, a refusal read back, a stalled read).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet_worker.sandbox.boundary import Caps, CellResult
from fleet_worker.sandbox.errors import CellTimeout
from fleet_worker.sandbox.jail import LocalSandboxConfig
from fleet_worker.sandbox.local import LocalSandboxProvider
from fleet_worker.sandbox.process import process_state
from fleet_worker.sandbox.session import ReplSession
from tests.integration.link_probe import probe, reached_link

pytestmark = pytest.mark.escape

TIMEOUT = 3.0  # each session's cell timeout: what a stalled probe may cost, and no more
GRACE = 3.0  # killing the REPL and reading what the cell printed, on a loaded machine
CAP = 64 * 1024 * 1024  # repl_main.MAX_FRAME_BYTES


@pytest.fixture
def session(traversable_dir: Path) -> Iterator[ReplSession]:
    provider = LocalSandboxProvider(
        LocalSandboxConfig(cell_timeout_seconds=TIMEOUT), caps=Caps(), workspaces=traversable_dir
    )
    lease = provider.acquire("ws", "run-link")
    try:
        yield lease.interpreter_factory()
    finally:
        lease.release()
        provider.close()


def run(session: ReplSession, code: str, **tools: Callable[..., Any]) -> CellResult:
    return session.execute(code, {}, tools, None)


def supervisor_of(session: ReplSession) -> int:
    run(session, "kept = 'state'")  # a REPL up, with state a reset would lose
    assert session._repl is not None and session._repl.supervisor is not None
    return session._repl.supervisor


def assert_reset_by_the_supervisor(session: ReplSession, supervisor: int, result: CellResult) -> None:
    """The supervisor read the frame, refused it and replaced the interpreter: the cell's own
    SUBMIT (which followed the frame on the link) never arrived; the same supervisor carries on."""
    reached_link(result.stdout)
    assert result.final is None and result.error is not None, result
    assert result.error.type == "ReplReset" and "protocol" in result.error.message, result.error
    assert session._repl is not None and session._repl.supervisor == supervisor
    assert process_state(supervisor) not in ("Z", "?")
    after = run(session, "print('kept' in globals())")
    assert after.error is None and after.stdout == "False\n"  # a fresh interpreter, working


def test_no_channel_gc_finds_but_the_link_reaches_out_of_the_interpreter(session: ReplSession) -> None:
    """Why the probes aim at the socket: gc also finds the supervisor's channel to the host in
    the interpreter (a copy made by the fork), whose descriptors were closed there. A frame
    written to any channel but the link reaches nobody: the cell ends with its own SUBMIT."""
    result = run(
        session,
        probe(
            "forged = frame({'op': 'result', 'id': cell_id(), 'final': {'answer': 'forged'}})\n"
            "outcomes = {}\n"
            "for channel in [o for o in gc.get_objects() if type(o).__name__ == 'Channel']:\n"
            "    for other in {channel.fd_in, channel.fd_out} - {fd}:\n"
            "        try:\n"
            "            send(other, forged)\n"
            "            outcomes[other] = 'written'\n"
            "        except OSError as exc:\n"
            "            outcomes[other] = exc.strerror\n"
            "SUBMIT(answer=outcomes)"
        ),
    )
    reached_link(result.stdout)
    assert result.error is None and result.final is not None, result
    # Not empty: the copy of the host channel is found, and every descriptor of it is closed.
    assert set(result.final["answer"].values()) == {"Bad file descriptor"}, result.final


OVERSIZED = {
    "4 GiB announced": "b'\\xff\\xff\\xff\\xff'",
    "one byte over the cap, no body": f"struct.pack('>I', {CAP + 1})",
    "an HTTP request": "b'GET / HTTP/1.1\\r\\nHost: supervisor\\r\\n\\r\\n'",
    "invalid UTF-8": 'frame(b\'{"op": "result", "final": {"answer": "\\xff"}}\')',
    "a list, not an object": 'frame(b\'["result", {"answer": "forged"}]\')',
}


@pytest.mark.parametrize("data", OVERSIZED.values(), ids=OVERSIZED.keys())
def test_garbage_and_oversized_frames_reset_the_interpreter_at_once(session: ReplSession, data: str) -> None:
    """A length past the cap is refused on the header alone: were the supervisor to wait for
    the body, the cell would time out instead (CellTimeout, raised here)."""
    supervisor = supervisor_of(session)
    result = run(session, probe(f"send(fd, {data})\nSUBMIT(answer='real')"))
    assert_reset_by_the_supervisor(session, supervisor, result)


FORBIDDEN = {
    "ready": "{'op': 'ready', 'pid': 1}",
    "execute": "{'op': 'execute', 'id': cell_id() + 1, 'code': 'print(\"FORGED\")'}",
    "shutdown": "{'op': 'shutdown'}",
    "tool_result": "{'op': 'tool_result', 'ok': True, 'value': 'FORGED'}",
    "result of the next cell": "{'op': 'result', 'id': cell_id() + 1, 'final': {'answer': 'FORGED'}}",
    "result of no cell": "{'op': 'result', 'id': None, 'final': {'answer': 'FORGED'}}",
    "result with a string id": "{'op': 'result', 'id': str(cell_id()), 'final': {'answer': 'FORGED'}}",
    "tool call, name not a string": "{'op': 'tool_call', 'name': ['echo'], 'kwargs': {'n': 1}}",
    "tool call, arguments not an object": "{'op': 'tool_call', 'name': 'echo', 'kwargs': [1]}",
    "tool call nested too deep": (
        "{'op': 'tool_call', 'name': 'echo', 'kwargs': {'n': eval('[' * 150 + ']' * 150)}}"
    ),
    # Raw UTF-8 fits a frame (24 MB); escaped again by the supervisor it would not (72 MB).
    "tool call too large once escaped": (
        'b\'{"op": "tool_call", "name": "echo", "kwargs": {"n": "\' + \'é\'.encode() * 12_000_000 + b\'"}}\''
    ),
}


@pytest.mark.parametrize("message", FORBIDDEN.values(), ids=FORBIDDEN.keys())
def test_frames_the_interpreter_may_not_send_reset_it(session: ReplSession, message: str) -> None:
    """No host tool runs, no forged code or value shows, and a forged `shutdown` does not stop
    the supervisor."""
    supervisor = supervisor_of(session)
    calls: list[object] = []
    result = run(session, probe(f"send(fd, frame({message}))\nSUBMIT(answer='real')"), echo=calls.append)
    assert_reset_by_the_supervisor(session, supervisor, result)
    assert calls == [] and "FORGED" not in result.stdout


@pytest.mark.parametrize("name", ["SUBMIT", "shell", "__import__", "print"])
def test_a_forged_call_of_a_tool_the_cell_lacks_is_refused_by_the_host(
    session: ReplSession, name: str
) -> None:
    """The call reaches the host (its refusal comes back on the link, read by the cell itself),
    which runs nothing; the cell goes on, and its own SUBMIT is its result."""
    calls: list[object] = []
    result = run(
        session,
        probe(
            f"send(fd, frame({{'op': 'tool_call', 'name': {name!r}, 'kwargs': {{'answer': 'FORGED'}}}}))\n"
            "print('REPLY ' + json.dumps(receive(fd)))\n"
            "SUBMIT(answer='real')"
        ),
        echo=calls.append,
    )
    reached_link(result.stdout)
    reply = [line for line in result.stdout.splitlines() if line.startswith("REPLY ")]
    assert reply == [
        f'REPLY {{"op": "tool_result", "ok": false, "value": null, "error": "unknown tool \'{name}\'"}}'
    ]
    assert result.error is None and result.final == {"answer": "real"}
    assert calls == []


STALLS = {
    "mid-header, sleeping": ("b'\\x00\\x00'", "while True:\n    time.sleep(1)"),
    "mid-body, spinning": (
        "frame({'op': 'result', 'id': cell_id(), 'final': {'answer': 'FORGED'}})[:20]",
        "while True:\n    pass",
    ),
    # The supervisor, blocked reading the frame, no longer watches for a stopped interpreter:
    # the host's timeout still ends the cell.
    "mid-body, then stopped": (
        "frame({'op': 'result', 'id': cell_id()})[:10]",
        "import signal\nos.kill(os.getpid(), signal.SIGSTOP)",
    ),
}


@pytest.mark.parametrize(("part", "then"), STALLS.values(), ids=STALLS.keys())
def test_a_frame_stalled_on_the_link_costs_the_cell_its_timeout_and_no_more(
    session: ReplSession, part: str, then: str
) -> None:
    supervisor_of(session)
    started = time.monotonic()
    with pytest.raises(CellTimeout) as raised:
        run(session, probe(f"send(fd, {part})\ntaken(fd)\nprint('TAKEN', flush=True)\n{then}"))
    assert TIMEOUT <= time.monotonic() - started < TIMEOUT + GRACE
    reached_link(raised.value.stdout)
    assert raised.value.stdout.endswith("TAKEN\n")  # the supervisor took the part, waiting for the rest
    after = run(session, "print('kept' in globals())")
    assert after.error is None and after.stdout == "False\n"  # a fresh REPL


def test_a_frame_cut_short_by_closing_the_link_resets_the_interpreter(session: ReplSession) -> None:
    supervisor = supervisor_of(session)
    result = run(
        session,
        probe(
            "send(fd, frame({'op': 'result', 'id': cell_id(), 'final': {'answer': 'FORGED'}})[:12])\n"
            "socket.socket(fileno=fd).shutdown(socket.SHUT_WR)\n"
            "SUBMIT(answer='real')"
        ),
    )
    reached_link(result.stdout)
    assert result.final is None and result.error is not None and result.error.type == "ReplReset"
    assert "state was reset" in result.error.message
    assert session._repl is not None and session._repl.supervisor == supervisor
    assert run(session, "print('kept' in globals())").stdout == "False\n"


def test_a_frame_as_large_as_the_cap_costs_the_supervisor_bounded_memory(session: ReplSession) -> None:
    """64 MiB announced and sent, not JSON: read whole (the cap allows it), then refused. The
    supervisor holds such a frame at most a few times over (twice, measured: 128 MiB)."""
    supervisor = supervisor_of(session)
    before = peak_kib(supervisor)
    result = run(
        session,
        probe(
            f"send(fd, struct.pack('>I', {CAP}))\n"
            "chunk = b'x' * 2**20\n"
            "for _ in range(64):\n"
            "    send(fd, chunk)\n"
            "SUBMIT(answer='real')"
        ),
    )
    assert_reset_by_the_supervisor(session, supervisor, result)
    grown_mib = (peak_kib(supervisor) - before) / 1024
    assert grown_mib < 4 * 64, f"the supervisor's peak grew by {grown_mib:.0f} MiB for a 64 MiB frame"


def peak_kib(pid: int) -> int:
    """A process's peak resident memory (VmHWM), in KiB."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
