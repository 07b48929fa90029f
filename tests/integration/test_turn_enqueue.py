"""`multitask: enqueue`: a follow-up sent while a Turn runs waits (`waiting`) behind it and runs
once every Turn ahead of it has settled, reading their answers; cancelling, interrupting, the
line's limit, a replayed key and a line the sweep has to promote. The gateway in-process
(Litestar's test client), a real arq worker in burst mode (the scripted LM), on real SQLite and
PostgreSQL and Redis."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy import update

from fleet_gateway.app import create_app
from fleet_shared.db import claims, queries
from fleet_shared.db.models import Attachment, Run, Session
from fleet_shared.run_state import RunStatus
from tests.integration.harness import Harness

HarnessFactory = Callable[..., Harness]
ASYNC = {"Prefer": "respond-async"}
# Each answer names the request and every answer the RLM found in the session's history.
CODE = """
messages = history.get('messages', []) if isinstance(history, dict) else getattr(history, 'messages', [])
SUBMIT(answer=request + ' after [' + ','.join(m['answer'] for m in messages) + ']')
"""
LINE = {"lm": "root", "reasoning": "answer", "code": CODE}


@pytest.fixture
async def stack(harness_factory: HarnessFactory) -> AsyncIterator[tuple[Harness, Any]]:
    harness = harness_factory(LINE)
    async with AsyncTestClient(create_app(harness.settings)) as client:
        yield harness, client


async def send(client: Any, session: str, text: str, key: str, multitask: str = "enqueue") -> Any:
    return await client.post(
        f"/api/sessions/{session}/turns",
        json={"text": text, "multitask": multitask},
        headers={"Idempotency-Key": key, **ASYNC},
    )


async def new_session(client: Any) -> str:
    response = await client.post("/api/sessions", json={"title": "line"})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


async def status_of(client: Any, run_id: str) -> str:
    return str((await client.get(f"/api/runs/{run_id}")).json()["status"])


async def history(client: Any, session: str) -> list[tuple[str, str, str]]:
    items = (await client.get(f"/api/sessions/{session}/turns")).json()["items"]
    texts = [next((p["text"] for p in t["parts"] if p["type"] == "text"), "") for t in items]
    return [(t["role"], t["metadata"]["runId"], text) for t, text in zip(items, texts, strict=True)]


async def test_follow_ups_wait_in_order_and_each_reads_the_answers_settled_before_it(
    stack: tuple[Harness, Any],
) -> None:
    harness, client = stack
    session = await new_session(client)
    first = (await send(client, session, "one", "k1", multitask="reject")).json()["run_id"]
    accepted = [await send(client, session, text, f"k-{text}") for text in ("two", "three")]
    assert [r.status_code for r in accepted] == [202, 202], [r.text for r in accepted]
    assert [(r.json()["status"], r.json()["ahead"]) for r in accepted] == [("waiting", 1), ("waiting", 2)]
    second, third = (r.json()["run_id"] for r in accepted)
    assert await status_of(client, second) == "waiting"
    assert await history(client, session) == [("user", first, "one")]  # a waiting Turn is not history yet

    await harness.work()  # the burst worker runs the one, then each follow-up it promoted

    assert [await status_of(client, run) for run in (first, second, third)] == ["completed"] * 3
    turns = await history(client, session)
    assert [(role, run) for role, run, _ in turns] == [
        ("user", first), ("assistant", first), ("user", second), ("assistant", second),
        ("user", third), ("assistant", third),
    ]  # fmt: skip
    answers = [text for role, _, text in turns if role == "assistant"]
    assert answers[1] == "two after [one after []]"
    assert answers[2] == "three after [one after [],two after [one after []]]"
    async with harness.db_sessions() as db:
        ran = [await queries.get_run(db, run) for run in (first, second, third)]
    for ahead, behind in itertools.pairwise(ran):
        assert ahead is not None and behind is not None and ahead.finished_at and behind.started_at
        assert behind.started_at >= ahead.finished_at  # never two at once


async def test_cancelling_the_turn_ahead_promotes_the_first_follow_up_only(
    stack: tuple[Harness, Any],
) -> None:
    harness, client = stack
    session = await new_session(client)
    first = (await send(client, session, "one", "k1")).json()
    assert first["status"] == "queued"  # nothing ran: an enqueue is an ordinary Turn then
    second, third = [(await send(client, session, t, f"k-{t}")).json()["run_id"] for t in ("two", "three")]
    cancelled = await client.put(f"/api/runs/{first['run_id']}/cancellation")
    assert cancelled.status_code == 200, cancelled.text
    assert [await status_of(client, r) for r in (second, third)] == ["queued", "waiting"]
    assert [(role, run) for role, run, _ in await history(client, session)] == [
        ("user", first["run_id"]), ("assistant", first["run_id"]), ("user", second),
    ]  # fmt: skip
    assert await harness.jobs().pending(second)  # its job was queued at once


async def test_a_cancelled_follow_up_leaves_no_turn_and_its_stream_ends_with_abort(
    stack: tuple[Harness, Any],
) -> None:
    _harness, client = stack
    session = await new_session(client)
    first = (await send(client, session, "one", "k1")).json()["run_id"]
    second = (await send(client, session, "two", "k2")).json()["run_id"]
    assert (await client.put(f"/api/runs/{second}/cancellation")).json()["state"] == "requested"
    assert await status_of(client, second) == "cancelled"
    stream = await client.get(f"/api/runs/{second}/stream")
    chunks = [line for line in stream.text.splitlines() if line.startswith("data: ")]
    assert chunks[-2:] == ['data: {"type":"abort","reason":"Turn cancelled"}', "data: [DONE]"], chunks
    assert await history(client, session) == [("user", first, "one")]


async def test_the_line_has_a_limit_and_a_refused_follow_up_burns_no_key(
    harness_factory: HarnessFactory,
) -> None:
    harness = harness_factory(LINE)
    profile = harness.settings.profile
    limits = msgspec.structs.replace(profile.gateway.limits, max_waiting_turns=2)
    gateway = msgspec.structs.replace(profile.gateway, limits=limits)
    settings = msgspec.structs.replace(
        harness.settings, profile=msgspec.structs.replace(profile, gateway=gateway)
    )
    async with AsyncTestClient(create_app(settings)) as client:
        session = await new_session(client)
        await send(client, session, "one", "k1")
        line = [await send(client, session, t, f"k-{t}") for t in ("a", "b")]
        assert [r.status_code for r in line] == [202, 202]
        full = await send(client, session, "c", "k-c")
        assert full.status_code == 409 and full.json()["code"] == "queue_full", full.text
        await client.put(f"/api/runs/{line[0].json()['run_id']}/cancellation")
        again = await send(client, session, "c", "k-c")  # a place is free, and the key was not burned
        assert again.status_code == 202 and again.json()["replayed"] is False, again.text


async def test_the_same_key_replays_a_waiting_follow_up(stack: tuple[Harness, Any]) -> None:
    _harness, client = stack
    session = await new_session(client)
    await send(client, session, "one", "k1")
    waiting = await send(client, session, "two", "k2")
    replayed = await send(client, session, "two", "k2")
    assert replayed.status_code == 202, replayed.text
    assert replayed.json() == {**waiting.json(), "replayed": True}
    other = await send(client, session, "not two", "k2")
    assert other.status_code == 409 and other.json()["code"] == "idempotency_key_mismatch"


async def test_an_interrupt_cancels_the_line_and_the_turn_ahead(stack: tuple[Harness, Any]) -> None:
    _harness, client = stack
    session = await new_session(client)
    first = (await send(client, session, "one", "k1")).json()["run_id"]
    line = [(await send(client, session, t, f"k-{t}")).json()["run_id"] for t in ("two", "three")]
    now = await send(client, session, "now", "k-now", multitask="interrupt")
    assert now.status_code == 202, now.text
    assert [await status_of(client, run) for run in (first, *line)] == ["cancelled"] * 3
    assert await status_of(client, now.json()["run_id"]) == "queued"
    assert [run for _, run, _ in await history(client, session)] == [first, first, now.json()["run_id"]]


async def test_a_withdrawn_claim_promotes_the_follow_up_behind_it(stack: tuple[Harness, Any]) -> None:
    """A gateway withdraws a claim that a quota refused, or whose job Redis refused, after a
    follow-up was accepted behind it: the follow-up is first now, at once."""
    _harness, client = stack
    session = await new_session(client)
    first = (await send(client, session, "one", "k1")).json()["run_id"]
    second = (await send(client, session, "two", "k2")).json()["run_id"]
    async with _harness.db_sessions() as db:
        assert await claims.withdraw_claim(db, first)
    assert await status_of(client, second) == "queued"
    assert await history(client, session) == [("user", second, "two")]


async def test_a_line_an_older_writer_left_with_nothing_ahead_is_promoted_by_the_sweep(
    stack: tuple[Harness, Any],
) -> None:
    """A Run ended by a process without follow-ups (an older release, mid-upgrade) leaves the line
    behind it waiting on nothing: the sweep promotes its first and enqueues its job."""
    harness, client = stack
    session = await new_session(client)
    first = (await send(client, session, "one", "k1")).json()["run_id"]
    second, third = [(await send(client, session, t, f"k-{t}")).json()["run_id"] for t in ("two", "three")]
    async with harness.db_sessions() as db:
        await db.execute(update(Run).where(Run.id == first).values(status=RunStatus.CANCELLED.value))
        await db.commit()
    assert await status_of(client, second) == "waiting"
    assert await harness.sweeper().promote_stranded() == 1
    assert [await status_of(client, r) for r in (second, third)] == ["queued", "waiting"]
    assert await harness.jobs().pending(second)
    assert await harness.sweeper().promote_stranded() == 0  # one at a time: the second is active


async def test_a_deleted_parents_follow_ups_handed_to_its_fork_keep_no_place_in_its_line(
    stack: tuple[Harness, Any],
) -> None:
    """Parent and fork each ran a follow-up (each first in its own line); the parent's, handed to
    the fork when the parent is deleted, does not collide with the fork's own."""
    _harness, client = stack

    async def ran_a_follow_up(session: str, prefix: str) -> str:
        first = (await send(client, session, "one", f"{prefix}1")).json()["run_id"]
        follow = (await send(client, session, "two", f"{prefix}2")).json()["run_id"]
        await client.put(f"/api/runs/{first}/cancellation")  # the follow-up is promoted
        await client.put(f"/api/runs/{follow}/cancellation")  # and ends
        return str(follow)

    parent = await new_session(client)
    handed = await ran_a_follow_up(parent, "p")
    fork = (await client.post(f"/api/sessions/{parent}/fork", json={})).json()["id"]
    await ran_a_follow_up(fork, "f")
    assert (await client.delete(f"/api/sessions/{parent}")).status_code == 204
    assert (await client.get(f"/api/sessions/{parent}")).status_code == 404
    async with _harness.db_sessions() as db:
        assert await db.get(Session, parent) is None  # purged, not stuck on the fork's place 1
        moved = await db.get(Run, handed)
        assert moved is not None and moved.session_id == fork and moved.waiting_place is None


async def test_an_attachment_a_waiting_follow_up_names_outlives_the_deletion_of_another_session(
    stack: tuple[Harness, Any],
) -> None:
    _harness, client = stack
    uploaded = await client.post(
        "/api/attachments",
        files={"attachment": ("notes.txt", b"notes", "text/plain")},
        headers={"x-requested-with": "test"},
    )
    attachment = uploaded.json()["id"]
    named_once = await new_session(client)
    await client.post(
        f"/api/sessions/{named_once}/turns",
        json={"text": "read it", "attachment_ids": [attachment]},
        headers={"Idempotency-Key": "a1", **ASYNC},
    )
    waits = await new_session(client)
    await send(client, waits, "one", "w1")
    follow = await client.post(
        f"/api/sessions/{waits}/turns",
        json={"text": "read it too", "attachment_ids": [attachment], "multitask": "enqueue"},
        headers={"Idempotency-Key": "w2", **ASYNC},
    )
    assert follow.json()["status"] == "waiting"
    assert (await client.delete(f"/api/sessions/{named_once}")).status_code == 204
    async with _harness.db_sessions() as db:
        assert await db.get(Session, named_once) is None
        assert await db.get(Attachment, attachment) is not None  # the follow-up still names it
