"""SIGTERM to a worker mid-Turn: it drains for `worker.drain_seconds`, then ends the Turn as failed
(`worker_shutdown`) instead of leaving it running and the session locked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, Stack, start_stack, stop_stack, work_dir
from tests.e2e.sse import TurnStream, post_turn

pytestmark = pytest.mark.e2e


@pytest.fixture
def slow_stack() -> Iterator[Stack]:
    script = REPO / "tests" / "e2e" / "scripts" / "slow.jsonl"
    stack = start_stack(work_dir("slow"), {"FLEET_SCRIPTED_LM": str(script)})
    yield stack
    stop_stack(stack)


class SlowTurn:
    """A Turn posted from a thread; `start` returns once the worker is inside its 60 s delay."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        with stack.client() as client:
            self.session_id: str = client.post("/api/sessions", json={}).json()["id"]
        self.stream: TurnStream | None = None
        self.thread = threading.Thread(target=self.post)

    def post(self) -> None:
        with self.stack.client() as client:
            self.stream = post_turn(client, self.session_id, "take your time", "slow-1")

    def start(self) -> SlowTurn:
        self.thread.start()
        log = Path(self.stack.data_dir / "logs" / "worker.log")
        deadline = time.monotonic() + 30
        while "turn.claimed" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        return self

    def finish(self, timeout: float) -> TurnStream:
        self.thread.join(timeout=timeout)
        assert not self.thread.is_alive() and self.stream is not None, "the stream never ended"
        return self.stream


def test_sigterm_mid_turn_settles_it_as_worker_shutdown(slow_stack: Stack) -> None:
    gateway, worker = slow_stack.processes
    turn = SlowTurn(slow_stack).start()
    session_id = turn.session_id
    sent = time.monotonic()
    os.killpg(worker.pid, signal.SIGTERM)
    stream = turn.finish(timeout=40)
    elapsed = time.monotonic() - sent
    assert stream.chunks[-2]["type"] == "error"
    assert stream.chunks[-2]["errorText"].startswith("worker_shutdown: ")
    assert stream.chunks[-1] == {"type": "finish", "finishReason": "error"}
    assert elapsed < 5 + 15  # drain_seconds of the offline profile, plus the stop grace
    assert worker.wait(timeout=20) is not None
    with slow_stack.client() as client:
        history = client.get(f"/api/sessions/{session_id}/turns").json()["items"]
    assert history[-1]["role"] == "assistant" and history[-1]["metadata"]["status"] == "failed"
    assert gateway.poll() is None


def test_sigkilled_worker_is_reaped_by_the_next_worker(slow_stack: Stack) -> None:
    """A worker killed outright cannot settle its Turn; its lease lapses and a live worker's
    reaper ends the Turn `worker_lost` within seconds, unlocking the session."""
    gateway, worker = slow_stack.processes
    turn = SlowTurn(slow_stack).start()
    session_id = turn.session_id
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    killed = time.monotonic()
    replacement = subprocess.Popen(
        [sys.executable, "-m", "fleet_cli", "worker"],
        env=slow_stack.env,
        cwd=slow_stack.data_dir,
        stdout=open(slow_stack.data_dir / "logs" / "worker2.log", "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    slow_stack.processes.append(replacement)
    stream = turn.finish(timeout=60)
    settled_after = time.monotonic() - killed
    assert stream.chunks[-2]["errorText"].startswith("worker_lost: ")
    assert stream.chunks[-1] == {"type": "finish", "finishReason": "error"}
    assert settled_after < 30, settled_after  # lease (6 s) + reaper tick (2 s) + worker start-up
    print(f"SIGKILL → settled in {settled_after:.1f} s")
    with (
        slow_stack.client() as client,
        client.stream(
            "POST",
            f"/api/sessions/{session_id}/turns",
            json={"text": "again"},
            headers={"Idempotency-Key": "k2"},
        ) as again,
    ):
        assert again.status_code == 200  # the session is unlocked (we need not wait for this one)
    assert gateway.poll() is None
