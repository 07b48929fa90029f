"""Webhooks on real processes: a worker without the signing secret and gateways with it, each in a
working directory of its own, sharing PostgreSQL and Redis. A background Turn's webhook reaches a
loopback receiver, signed; a gateway SIGKILLed in the middle of an attempt (the receiver had the
body, the answer was never recorded) leaves the delivery to another gateway, which sends it again
with the same `webhook-id` once the attempt's lease is up."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from standardwebhooks import Webhook

from tests.e2e.conftest import stop, wait_ready, work_dir
from tests.e2e.test_pods_share_nothing import spawn
from tests.support.policy import private_policy
from tests.support.servers import RedisServer, free_port
from tests.support.webhook_receiver import Receiver, serve_receiver

pytestmark = pytest.mark.e2e
SECRET = "whsec_" + base64.b64encode(os.urandom(32)).decode()
# Loopback allowed (the receiver), over http; an attempt's lease is twice 2 s, plus 5 s.
WEBHOOKS = """
[profiles.offline.webhooks]
allow_http = true
allowed_networks = ["127.0.0.1/32"]
timeout_seconds = 2
first_retry_seconds = 0.2
poll_seconds = 0.1
"""
WITHIN_SECONDS = 60.0  # a hang guard


@dataclass
class Deployment:
    env: dict[str, str]  # the gateways' (with the secret); the worker's lacks it
    folders: list[Path]
    processes: list[subprocess.Popen[bytes]]

    def gateway(self) -> tuple[str, subprocess.Popen[bytes]]:
        """A new gateway, the only one: those started before are stopped (the worker stays)."""
        stop(self.processes[1:])
        del self.processes[1:]
        folder = work_dir("hooks-gateway")
        self.folders.append(folder)
        port = free_port()
        proc = spawn(folder, self.env, "gateway", "--port", str(port))
        self.processes.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, [proc])
        return url, proc


@pytest.fixture(scope="module")
def deployment(postgres_url: str) -> Iterator[Deployment]:
    redis = RedisServer().start()
    policy = work_dir("hooks-policy")
    env = private_policy(policy)
    with Path(env["FLEET_CONFIG"]).open("a", encoding="utf-8") as config:
        config.write(WEBHOOKS)
    env = {
        **os.environ,
        **env,
        "FLEET_PROFILE": "offline",
        "FLEET_REDIS_URL": redis.url(db=0),
        "FLEET_DATABASE_URL": postgres_url,
    }
    worker_folder = work_dir("hooks-worker")
    worker = spawn(worker_folder, env, "worker", "--metrics-port", "0")  # no secret: sends nothing
    found = Deployment({**env, "FLEET_WEBHOOK_SECRET": SECRET}, [policy, worker_folder], [worker])
    try:
        yield found
    finally:
        stop(found.processes)
        redis.stop()
        for folder in found.folders:
            subprocess.run(["rm", "-rf", str(folder)], check=False)


def background_turn(url: str, hook: str, key: str) -> str:
    with httpx.Client(base_url=url, timeout=30) as client:
        session = client.post("/api/sessions", json={}).json()["id"]
        accepted = client.post(
            f"/api/sessions/{session}/turns",
            json={"text": "hello there", "webhook": {"url": hook}},
            headers={"Idempotency-Key": key, "Prefer": "respond-async"},
        )
    assert accepted.status_code == 202, accepted.text
    return str(accepted.json()["run_id"])


def settled_delivery(url: str, run_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + WITHIN_SECONDS
    with httpx.Client(base_url=url, timeout=30) as client:
        while True:
            items = client.get(f"/api/runs/{run_id}/webhooks").json()["items"]
            if items and items[0]["status"] != "pending":
                return dict(items[0])
            assert time.monotonic() < deadline, items
            time.sleep(0.1)


def test_a_background_turns_webhook_reaches_the_receiver_signed(deployment: Deployment) -> None:
    url, _gateway = deployment.gateway()
    with serve_receiver(Receiver()) as receiver:
        run_id = background_turn(url, receiver.url, "signed")
        delivery = settled_delivery(url, run_id)
        [got] = receiver.wait_for(1)
    payload = Webhook(SECRET).verify(got.body, got.headers)
    assert payload["run_id"] == run_id and payload["status"] == "completed" and payload["answer"]
    assert delivery["status"] == "delivered" and [a["status_code"] for a in delivery["attempts"]] == [200]


def test_a_gateway_killed_mid_attempt_leaves_the_delivery_to_another(deployment: Deployment) -> None:
    first_url, first = deployment.gateway()
    with serve_receiver(Receiver(hold_first_seconds=1.5)) as receiver:
        run_id = background_turn(first_url, receiver.url, "killed")
        receiver.wait_for(1)  # the first gateway's attempt is in the receiver's hands
        os.killpg(first.pid, signal.SIGKILL)  # the whole pod, before the answer: nothing recorded
        first.wait()
        second_url, _second = deployment.gateway()
        delivery = settled_delivery(second_url, run_id)
        got = receiver.wait_for(2)
    assert delivery["status"] == "delivered"
    assert [a["status_code"] for a in delivery["attempts"]] == [200]  # the killed one left no record
    assert [r.headers["webhook-id"] for r in got] == [delivery["id"]] * 2  # the same id: idempotent
    for request in got:
        Webhook(SECRET).verify(request.body, request.headers)


def test_a_receiver_that_fails_three_times_gets_four_attempts_of_one_delivery(deployment: Deployment) -> None:
    url, _gateway = deployment.gateway()
    with serve_receiver(Receiver(statuses=[500, 502, 503])) as receiver:
        run_id = background_turn(url, receiver.url, "retried")
        delivery = settled_delivery(url, run_id)
        got = receiver.wait_for(4)
    assert delivery["status"] == "delivered"
    assert [a["status_code"] for a in delivery["attempts"]] == [500, 502, 503, 200]
    assert {r.headers["webhook-id"] for r in got} == {delivery["id"]} and len({r.body for r in got}) == 1
