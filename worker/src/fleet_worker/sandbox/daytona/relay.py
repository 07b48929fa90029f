"""The host end of a Daytona REPL: a process the worker starts exactly as it starts a local REPL.

Its stdin and stdout carry the REPL's binary frames, and `--output-fd` the cells' output, as
for bwrap. It opens a session in the sandbox, runs `repl_bridge.py` there as a session command,
sends what arrives on stdin as base64 lines with the toolbox API, and follows the command's log
stream (a WebSocket the SDK opens) to write `F` lines back as frames and `O` lines as output. It
ends when the command ends; killing it (a cell timeout) leaves the command to the lease, which
deletes the session on release.

Environment (set by the lease): DAYTONA_API_KEY, DAYTONA_API_URL, DAYTONA_TARGET (read by the
SDK), FLEET_RELAY_SANDBOX, FLEET_RELAY_SESSION, FLEET_RELAY_COMMAND.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import os
import sys
import threading
from typing import Any

CHUNK = 48 * 1024


class Demux:
    """Bridge lines (`F <b64>` / `O <b64>`) from the log stream, which arrive in any pieces."""

    def __init__(self, frames_fd: int, output_fd: int) -> None:
        self.frames_fd = frames_fd
        self.output_fd = output_fd
        self.pending = ""

    def feed(self, text: str) -> None:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            kind, _, payload = line.strip().partition(" ")
            try:
                data = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                continue  # not ours (a stray print of the bridge's interpreter): dropped
            if kind == "F":
                write_all(self.frames_fd, data)
            elif kind == "O":
                write_all(self.output_fd, data)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def forward_stdin(process: Any, session: str, command: str) -> None:
    """Frames from the host, as base64 lines on the command's stdin, until stdin closes."""
    with contextlib.suppress(Exception):  # the command is gone: the log stream ends too
        while data := os.read(0, CHUNK):
            process.send_session_command_input(session, command, base64.b64encode(data).decode() + "\n")


def to_stderr(text: str) -> None:
    sys.stderr.write(text)  # the REPL session keeps the tail, for crash reports


def main() -> int:
    from daytona import Daytona, SessionExecuteRequest

    argv = sys.argv[1:]
    output_fd = int(argv[argv.index("--output-fd") + 1])
    frames_fd = os.dup(1)
    os.dup2(2, 1)  # the SDK's own prints must never look like frames
    session = os.environ["FLEET_RELAY_SESSION"]
    sandbox = Daytona().get(os.environ["FLEET_RELAY_SANDBOX"])
    process = sandbox.process
    process.create_session(session)
    started = process.execute_session_command(
        session,
        SessionExecuteRequest(
            command=os.environ["FLEET_RELAY_COMMAND"], run_async=True, suppress_input_echo=True
        ),
    )
    command = started.cmd_id
    threading.Thread(target=forward_stdin, args=(process, session, command), daemon=True).start()
    demux = Demux(frames_fd, output_fd)
    try:
        asyncio.run(process.get_session_command_logs_async(session, command, demux.feed, to_stderr))
    finally:
        with contextlib.suppress(Exception):
            process.delete_session(session)
    return 0


if __name__ == "__main__":
    sys.exit(main())
