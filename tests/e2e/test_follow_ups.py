"""`multitask: enqueue` on real processes (a gateway, a worker, the scripted LM, bwrap), on
SQLite and PostgreSQL: 20 follow-ups POSTed at once while a slow Turn runs each wait, then run
one at a time in the order the gateway accepted them (the place each was told), and the history
reads in that order."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

import pytest

from tests.e2e.conftest import Stack

pytestmark = pytest.mark.e2e
FOLLOW_UPS = 20
SETTLED = {"completed", "failed", "cancelled", "timed_out"}
WITHIN_SECONDS = 180.0  # a hang guard: 21 Turns of the demo script take a few seconds each at most


def post(stack: Stack, session_id: str, text: str, key: str, multitask: str) -> dict[str, Any]:
    with stack.client() as client:
        response = client.post(
            f"/api/sessions/{session_id}/turns",
            json={"text": text, "multitask": multitask},
            headers={"Idempotency-Key": key, "Prefer": "respond-async"},
        )
    assert response.status_code == 202, response.text
    return dict(response.json())


def settled_runs(stack: Stack, run_ids: list[str]) -> list[dict[str, Any]]:
    deadline = time.monotonic() + WITHIN_SECONDS
    with stack.client() as client:
        while True:
            runs = [client.get(f"/api/runs/{run_id}").json() for run_id in run_ids]
            if all(run["status"] in SETTLED for run in runs):
                return runs
            assert time.monotonic() < deadline, [run["status"] for run in runs]
            time.sleep(0.2)


def moment(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


@pytest.mark.parametrize("stack_name", ["demo_stack", "postgres_stack"])
def test_twenty_follow_ups_sent_at_once_run_one_at_a_time_in_the_order_accepted(
    stack_name: str, request: pytest.FixtureRequest
) -> None:
    stack: Stack = request.getfixturevalue(stack_name)
    with stack.client() as client:
        session_id = client.post("/api/sessions", json={"title": "line"}).json()["id"]
    slow = post(stack, session_id, "Run a slow task", "slow", multitask="reject")
    with ThreadPoolExecutor(FOLLOW_UPS) as pool:
        accepted = list(
            pool.map(
                lambda n: post(stack, session_id, f"hello there {n}", f"follow-{n}", "enqueue"),
                range(FOLLOW_UPS),
            )
        )
    assert [a["status"] for a in accepted] == ["waiting"] * FOLLOW_UPS  # the slow Turn was running
    # Each was told its place: 1 (only the slow Turn ahead) to 20, each once.
    assert sorted(a["ahead"] for a in accepted) == list(range(1, FOLLOW_UPS + 1))
    places = {a["run_id"]: a["ahead"] for a in accepted}

    runs = settled_runs(stack, [slow["run_id"], *(a["run_id"] for a in accepted)])
    assert [run["status"] for run in runs] == ["completed"] * (FOLLOW_UPS + 1)
    by_acceptance = [runs[0], *sorted(runs[1:], key=lambda run: places[run["id"]])]
    by_start = sorted(runs, key=lambda run: moment(run["started_at"]))
    assert [run["id"] for run in by_start] == [run["id"] for run in by_acceptance]
    for ahead, behind in itertools.pairwise(by_start):
        assert moment(behind["started_at"]) >= moment(ahead["finished_at"])  # never two at once

    with stack.client() as client:
        items = client.get(f"/api/sessions/{session_id}/turns", params={"limit": 200}).json()["items"]
    expected = [(role, run["id"]) for run in by_acceptance for role in ("user", "assistant")]
    assert [(t["role"], t["metadata"]["runId"]) for t in items] == expected
    assert [t["metadata"]["sequence"] for t in items] == list(range(1, 2 * (FOLLOW_UPS + 1) + 1))
