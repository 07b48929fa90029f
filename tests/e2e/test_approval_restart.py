"""A cell waiting for approval outlives the gateway: real processes (a worker and gateways, each
in a working directory of its own, sharing PostgreSQL and Redis). The Turn's cell waits; the
gateway it was sent through is killed (the whole process group); a new gateway takes the
decision, and the Turn completes with the cell's answer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import stop, wait_ready, work_dir
from tests.e2e.sse import parse_frames
from tests.e2e.test_pods_share_nothing import spawn
from tests.support.policy import private_policy
from tests.support.servers import RedisServer, free_port

pytestmark = pytest.mark.e2e
SCRIPT = [
    {"lm": "root", "reasoning": "Answer.", "code": "print('the cell ran')\nSUBMIT(answer='approved and ran')"}
]
WITHIN_SECONDS = 60.0  # a hang guard


@pytest.fixture(scope="module")
def env(postgres_url: str) -> Iterator[dict[str, str]]:
    redis = RedisServer().start()
    folder = work_dir("approval-policy")
    script = folder / "approval.jsonl"
    script.write_text("".join(json.dumps(line) + "\n" for line in SCRIPT))
    found = {
        **os.environ,
        **private_policy(folder),
        "FLEET_PROFILE": "offline",
        "FLEET_REDIS_URL": redis.url(db=0),
        "FLEET_DATABASE_URL": postgres_url,
        "FLEET_SCRIPTED_LM": str(script),
    }
    yield found
    redis.stop()
    subprocess.run(["rm", "-rf", str(folder)], check=False)


def gateway(env: dict[str, str], folders: list[Path]) -> tuple[str, subprocess.Popen[bytes]]:
    folder = work_dir("approval-gateway")
    folders.append(folder)
    port = free_port()
    proc = spawn(folder, env, "gateway", "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, [proc])
    return url, proc


def pending_approval(url: str, run_id: str) -> dict[str, object]:
    """The first `data-approval` part of the Run's stream (read from the start, then closed)."""
    with (
        httpx.Client(base_url=url, timeout=WITHIN_SECONDS) as client,
        client.stream("GET", f"/api/runs/{run_id}/stream") as response,
    ):
        raw = b""
        for piece in response.iter_bytes():
            raw += piece
            for _frame_id, data in parse_frames(raw):
                chunk = json.loads(data) if data != "[DONE]" else {}
                if chunk.get("type") == "data-approval":
                    return dict(chunk["data"])
    raise AssertionError("the stream ended with no approval")


def test_a_pending_approval_is_decided_through_a_gateway_started_after_the_first_died(
    env: dict[str, str],
) -> None:
    folders = [work_dir("approval-worker")]
    processes = [spawn(folders[0], env, "worker", "--metrics-port", "0")]
    try:
        first_url, first = gateway(env, folders)
        processes.append(first)
        with httpx.Client(base_url=first_url, timeout=30) as client:
            session = client.post("/api/sessions", json={}).json()["id"]
            accepted = client.post(
                f"/api/sessions/{session}/turns",
                json={"text": "go", "approval": "always"},
                headers={"Idempotency-Key": "k1", "Prefer": "respond-async"},
            )
        run_id = accepted.json()["run_id"]
        waiting = pending_approval(first_url, run_id)
        assert waiting["state"] == "pending" and "the cell ran" in str(waiting["code"])
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        second_url, second = gateway(env, folders)
        processes.append(second)
        with httpx.Client(base_url=second_url, timeout=30) as client:
            decided = client.post(
                f"/api/runs/{run_id}/approvals/{waiting['approval_id']}", json={"decision": "approve"}
            )
            assert decided.status_code == 200, decided.text
            deadline = time.monotonic() + WITHIN_SECONDS
            while (run := client.get(f"/api/runs/{run_id}").json())["status"] == "running":
                assert time.monotonic() < deadline
                time.sleep(0.1)
            items = client.get(f"/api/sessions/{session}/turns").json()["items"]
        assert run["status"] == "completed"
        parts = items[-1]["parts"]
        assert [p["text"] for p in parts if p["type"] == "text"] == ["approved and ran"]
        [approval] = [p for p in parts if p["type"] == "data-approval"]
        assert approval["data"]["state"] == "approved"
    finally:
        stop(processes)
        for folder in folders:
            subprocess.run(["rm", "-rf", str(folder)], check=False)
