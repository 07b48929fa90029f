"""`fleet cli` as a newcomer runs it, in a pseudo-terminal: the embedded stack starts in the
background with its logs in .fleet/logs/, the terminal client opens, a prompt streams to the
scripted answer, and /exit stops everything."""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, free_port
from tests.e2e.test_fleet_up import descendants, newcomer_env, pid_alive

pytestmark = pytest.mark.e2e

ANSI = re.compile(r"\x1b\[[0-9;?<>=]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[=>()][0-9A-Za-z]?")


class Screen:
    """Everything the client wrote, read from the pty's leader side without blocking forever."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.raw = b""
        self.closed = False

    def text(self) -> str:
        return ANSI.sub("", self.raw.decode(errors="replace"))

    def pump(self, seconds: float) -> None:
        ready, _, _ = select.select([self.fd], [], [], seconds)
        if ready:
            try:
                self.raw += os.read(self.fd, 65536)
            except OSError:  # EIO: every process holding the terminal has exited
                self.closed = True

    def wait_for(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.text():
                return
            if self.closed:
                break
            self.pump(0.2)
        raise AssertionError(f"{needle!r} never appeared; the screen ends with:\n{self.text()[-3000:]}")


@pytest.mark.timeout(360)
@pytest.mark.skipif(shutil.which("node") is None, reason="the terminal client needs Node")
def test_fleet_cli_opens_the_client_on_the_embedded_stack(tmp_path: Path) -> None:
    port = free_port()
    leader, follower = pty.openpty()
    os.set_inheritable(follower, True)
    env = {**newcomer_env(), "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleet_cli", "cli", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdin=follower,
        stdout=follower,
        stderr=follower,
        start_new_session=True,
    )
    os.close(follower)
    screen = Screen(leader)
    tree: set[int] = set()
    try:
        screen.wait_for("Type a prompt", timeout=180)  # a first run may build the client
        tree = descendants(proc.pid)
        os.write(leader, b"Say hello to the fleet\r")
        screen.wait_for("Hello from fleet's offline demo", timeout=90)
        screen.wait_for("(Your request had 5 words.)", timeout=30)
        tree |= descendants(proc.pid)
        os.write(leader, b"/exit\r")
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline and not screen.closed:
            screen.pump(0.2)
        proc.wait(timeout=60)
        assert proc.returncode == 0, screen.text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        os.close(leader)
    logs = tmp_path / ".fleet" / "logs"
    assert (logs / "gateway.log").stat().st_size > 0
    assert (logs / "worker-1.log").stat().st_size > 0
    assert "fleet: stopped" in screen.text()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(pid_alive(pid) for pid in tree):
        time.sleep(0.1)
    assert not [pid for pid in tree if pid_alive(pid)], "fleet cli left processes behind"
    assert REPO.joinpath("tui", "dist", "main.js").is_file()
