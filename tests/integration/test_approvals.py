"""Approvals before a cell runs, on real parts: a real arq worker (the scripted LM, bwrap) waits
on Redis for the decision a gateway (in-process) records; approved, denied (the RLM is told
why and tries another way), timed out, and decided through a gateway started after the cell
began to wait. SQLite and PostgreSQL, Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from litestar.testing import AsyncTestClient

from fleet_gateway.app import create_app
from fleet_shared.events import Approval, CellOutput
from fleet_worker.approvals import risk_of
from tests.integration.harness import Harness

HarnessFactory = Callable[..., Harness]
ASYNC = {"Prefer": "respond-async"}
RISKY = {
    "lm": "root",
    "reasoning": "Start a process.",
    "code": "import subprocess\nprint('ran the risky cell')",
}
SAFE = {"lm": "root", "reasoning": "Answer another way.", "code": "SUBMIT(answer='another way')"}
WITHIN_SECONDS = 30.0  # a hang guard


def with_timeout(harness: Harness, seconds: float) -> Harness:
    runtime = msgspec.structs.replace(harness.settings.profile.runtime, approval_timeout_seconds=seconds)
    profile = msgspec.structs.replace(harness.settings.profile, runtime=runtime)
    harness.settings = msgspec.structs.replace(harness.settings, profile=profile)
    return harness


async def submit(client: Any, approval: str, key: str = "k1") -> tuple[str, str]:
    session = (await client.post("/api/sessions", json={})).json()["id"]
    accepted = await client.post(
        f"/api/sessions/{session}/turns",
        json={"text": "do it", "approval": approval},
        headers={"Idempotency-Key": key, **ASYNC},
    )
    assert accepted.status_code == 202, accepted.text
    return session, accepted.json()["run_id"]


async def approvals_of(harness: Harness, run_id: str, state: str) -> list[Approval]:
    """The Run's approval reports once one is in `state` (polled: the worker is another task)."""
    deadline = time.monotonic() + WITHIN_SECONDS
    while True:
        found = [e for e in await harness.events(run_id) if isinstance(e, Approval)]
        if any(a.state == state for a in found):
            return found
        assert time.monotonic() < deadline, found
        await asyncio.sleep(0.05)


async def decide(client: Any, run_id: str, approval_id: str, decision: str, note: str | None = None) -> Any:
    body = {"decision": decision, **({"note": note} if note else {})}
    return await client.post(f"/api/runs/{run_id}/approvals/{approval_id}", json=body)


async def answer(client: Any, session: str) -> tuple[str, list[dict[str, Any]]]:
    items = (await client.get(f"/api/sessions/{session}/turns")).json()["items"]
    parts = items[-1]["parts"]
    texts = [p["text"] for p in parts if p["type"] == "text"]
    return (texts[-1] if texts else ""), parts


async def test_an_approved_cell_runs_and_the_history_keeps_the_decision(
    harness_factory: HarnessFactory,
) -> None:
    harness = harness_factory({"lm": "root", "reasoning": "Answer.", "code": "SUBMIT(answer='ran')"})
    async with AsyncTestClient(create_app(harness.settings)) as client:
        session, run_id = await submit(client, "always")
        worker = asyncio.create_task(harness.work())
        [pending] = await approvals_of(harness, run_id, "pending")
        assert pending.code == "SUBMIT(answer='ran')" and pending.call_id == "cell-1"
        assert pending.reason == "every cell of this Turn waits for approval"
        decided = await decide(client, run_id, pending.approval_id, "approve")
        assert decided.status_code == 200, decided.text
        again = await decide(client, run_id, pending.approval_id, "deny")
        assert again.status_code == 409 and again.json()["code"] == "approval_decided"
        await asyncio.wait_for(worker, WITHIN_SECONDS)
        text, parts = await answer(client, session)
    assert text == "ran"
    [shown] = [p for p in parts if p["type"] == "data-approval"]
    assert shown["id"] == pending.approval_id
    assert shown["data"]["state"] == "approved" and shown["data"]["decided_by"]


async def test_a_denied_cell_does_not_run_and_the_rlm_tries_another_way(
    harness_factory: HarnessFactory,
) -> None:
    harness = harness_factory(RISKY, SAFE)
    async with AsyncTestClient(create_app(harness.settings)) as client:
        session, run_id = await submit(client, "on_risk")
        worker = asyncio.create_task(harness.work())
        [pending] = await approvals_of(harness, run_id, "pending")
        assert pending.reason == "it starts processes (subprocess)"
        assert (
            await decide(client, run_id, pending.approval_id, "deny", "no processes, please")
        ).status_code == 200
        await asyncio.wait_for(worker, WITHIN_SECONDS)
        text, _parts = await answer(client, session)
    assert text == "another way"  # the safe cell was not asked about: on_risk found nothing in it
    events = await harness.events(run_id)
    [refused] = [e for e in events if isinstance(e, CellOutput) and e.call_id == "cell-1"]
    assert refused.error is not None and "the user denied it" in refused.error
    assert "no processes, please" in refused.error and "ran the risky cell" not in refused.stdout
    assert [a.state for a in events if isinstance(a, Approval)] == ["pending", "denied"]


async def test_a_cell_nobody_decides_on_is_denied_at_the_deadline(harness_factory: HarnessFactory) -> None:
    harness = with_timeout(harness_factory(RISKY, SAFE), 1)
    async with AsyncTestClient(create_app(harness.settings)) as client:
        session, run_id = await submit(client, "on_risk")
        started = time.monotonic()
        await asyncio.wait_for(harness.work(), WITHIN_SECONDS)
        waited = time.monotonic() - started
        text, _parts = await answer(client, session)
        approvals = [e for e in await harness.events(run_id) if isinstance(e, Approval)]
        late = await decide(client, run_id, approvals[0].approval_id, "approve")
    assert text == "another way" and waited >= 1
    assert [a.state for a in approvals] == ["pending", "timed_out"]
    assert late.status_code == 409  # the Run ended; nothing waits


async def test_a_pending_approval_is_decided_through_a_gateway_started_after_it_began(
    harness_factory: HarnessFactory,
) -> None:
    harness = harness_factory({"lm": "root", "reasoning": "Answer.", "code": "SUBMIT(answer='ran')"})
    async with AsyncTestClient(create_app(harness.settings)) as first:
        session, run_id = await submit(first, "always")
        worker = asyncio.create_task(harness.work())
        [pending] = await approvals_of(harness, run_id, "pending")
    # The first gateway has stopped; the worker still waits (on Redis, not on any gateway).
    async with AsyncTestClient(create_app(harness.settings)) as second:
        assert (await decide(second, run_id, pending.approval_id, "approve")).status_code == 200
        await asyncio.wait_for(worker, WITHIN_SECONDS)
        text, _parts = await answer(second, session)
    assert text == "ran"


async def test_decisions_the_route_refuses(harness_factory: HarnessFactory) -> None:
    harness = harness_factory({"lm": "root", "reasoning": "Answer.", "code": "SUBMIT(answer='ran')"})
    async with AsyncTestClient(create_app(harness.settings)) as client:
        _session, run_id = await submit(client, "always")
        unknown = await decide(client, run_id, "0123456789abcdef", "approve")
        assert unknown.status_code == 404 and unknown.json()["code"] == "not_found"
        bad = await client.post(f"/api/runs/{run_id}/approvals/x", json={"decision": "maybe"})
        assert bad.status_code == 422
        nobody = await decide(client, "00000000-0000-0000-0000-000000000000", "0123456789abcdef", "approve")
        assert nobody.status_code == 404


@pytest.mark.parametrize(
    ("code", "asked"),
    [
        ("import subprocess", True),
        ("from subprocess import run", True),
        ("import os\nos.system('ls')", True),
        ("import os\nos.remove('data.csv')", True),
        ("import os\nos.remove('artifacts/old.md')", False),
        ("import os\nos.remove('artifacts/../data.csv')", True),
        ("import shutil\nshutil.rmtree(path)", True),
        ("from pathlib import Path\nPath('x').unlink()", True),
        ("for i in range(10**8): pass", True),
        ("for i in range(1000): pass", False),
        ("for i in range(2 * 10**7): pass", True),
        ("for i in range(-10**9, 0): pass", True),
        ("for i in range(10**10**10): pass", True),  # saturated, never computed
        ("range(10**7, 10**7 + 2)", False),  # two items
        ("x = [1]\nx.remove(1)", False),  # a list's remove
        ("import platform\nplatform.system()", False),
        ("from os import system\nsystem('ls')", True),
        ("import asyncio\nasyncio.create_subprocess_shell('ls')", True),
        ("from concurrent.futures import ProcessPoolExecutor\nProcessPoolExecutor()", True),
        ("import aiohttp", True),
        ("rlm_query('summarise the table')", True),  # a child's cells run without asking
        ("x = " + "1 + " * 100_000 + "1", True),  # too deep to read: asked, not a crash
        ("while True:\n    break", True),
        ("import socket", True),
        ("import urllib.request", True),
        ("print(sum(range(10)))\nSUBMIT(answer='x')", False),
        ("this is not python", False),
    ],
)
def test_the_on_risk_rules(code: str, asked: bool) -> None:
    assert (risk_of(code) is not None) is asked


async def test_a_sessions_approval_applies_to_its_turns_unless_a_turn_says(
    harness_factory: HarnessFactory,
) -> None:
    harness = harness_factory({"lm": "root", "reasoning": "Answer.", "code": "SUBMIT(answer='ran')"})
    async with AsyncTestClient(create_app(harness.settings)) as client:
        session = (await client.post("/api/sessions", json={})).json()["id"]
        patched = await client.patch(f"/api/sessions/{session}", json={"approval": "always"})
        assert patched.status_code == 200 and patched.json()["approval"] == "always"
        assert (await client.patch(f"/api/sessions/{session}", json={"approval": "often"})).status_code == 422
        asked = await client.post(
            f"/api/sessions/{session}/turns", json={"text": "go"}, headers={"Idempotency-Key": "k1", **ASYNC}
        )
        run_id = asked.json()["run_id"]
        worker = asyncio.create_task(harness.work())
        [pending] = await approvals_of(harness, run_id, "pending")
        await decide(client, run_id, pending.approval_id, "approve")
        await asyncio.wait_for(worker, WITHIN_SECONDS)
        told = await client.post(
            f"/api/sessions/{session}/turns",
            json={"text": "go", "approval": "never"},
            headers={"Idempotency-Key": "k2", **ASYNC},
        )
        await asyncio.wait_for(harness.work(), WITHIN_SECONDS)  # nothing to wait for: never
        text, parts = await answer(client, session)
    assert text == "ran" and not [p for p in parts if p["type"] == "data-approval"]
    assert told.json()["run_id"] != run_id


async def test_a_cancel_ends_the_wait_and_the_stream_says_the_cell_never_ran(
    harness_factory: HarnessFactory,
) -> None:
    harness = harness_factory({"lm": "root", "reasoning": "Answer.", "code": "SUBMIT(answer='ran')"})
    async with AsyncTestClient(create_app(harness.settings)) as client:
        _session, run_id = await submit(client, "always")
        worker = asyncio.create_task(harness.work())
        [pending] = await approvals_of(harness, run_id, "pending")
        assert (await client.put(f"/api/runs/{run_id}/cancellation")).status_code == 200
        await asyncio.wait_for(worker, WITHIN_SECONDS)
        run = (await client.get(f"/api/runs/{run_id}")).json()
        late = await decide(client, run_id, pending.approval_id, "approve")
    assert run["status"] == "cancelled" and late.status_code == 409
    assert [a.state for a in await harness.events(run_id) if isinstance(a, Approval)] == [
        "pending",
        "stopped",
    ]


async def test_the_first_decision_counts_a_retry_of_it_is_recorded_and_a_timeout_yields_to_it(
    redis_client: Any,
) -> None:
    """The two scripts that share an approval key, on a real Redis."""
    from fleet_shared import redis_keys
    from fleet_shared.approvals import PENDING, TIME_OUT_SCRIPT, TIMED_OUT, ApprovalDecision
    from fleet_shared.approvals import decide as record

    key = redis_keys.run_approval("run-x", "ap1")
    await redis_client.set(key, PENDING, ex=60)
    yes, no = ApprovalDecision("approve", None, "alice"), ApprovalDecision("deny", "no", "bob")
    assert await record(redis_client, "run-x", "ap1", yes) == "recorded"
    assert await record(redis_client, "run-x", "ap1", yes) == "recorded"  # the same call, retried
    assert await record(redis_client, "run-x", "ap1", no) == "already_decided"
    # The worker's timeout finds the decision and leaves it (it runs the cell).
    found = await redis_client.eval(TIME_OUT_SCRIPT, 1, key, PENDING, TIMED_OUT)
    assert msgspec.json.decode(found, type=ApprovalDecision) == yes
    other = redis_keys.run_approval("run-x", "ap2")
    await redis_client.set(other, PENDING, ex=60)
    assert await redis_client.eval(TIME_OUT_SCRIPT, 1, other, PENDING, TIMED_OUT) == PENDING.encode()
    assert await record(redis_client, "run-x", "ap2", yes) == "already_decided"  # too late
    assert await record(redis_client, "run-x", "never-asked", yes) == "unknown"
