"""Sessions through the gateway in-process, on SQLite and PostgreSQL: listing with filters and
paging, PATCH (rename, archive), and archived sessions refusing new Turns while a repeated
Idempotency-Key still replays its Run (a real burst worker runs the Turns)."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, update

from fleet_gateway.schemas import TurnRequest
from fleet_shared.db import claims, queries
from fleet_shared.db.models import Run
from fleet_shared.tenancy import OPERATOR
from tests.integration.harness import Harness
from tests.support.api import ApiClient, new_session

ROOT_SUBMIT = {"lm": "root", "reasoning": "done", "code": "SUBMIT(answer='ok')"}


@pytest.fixture
def harness(harness_factory: Any) -> Harness:
    made: Harness = harness_factory(ROOT_SUBMIT)
    return made


def post_turn(client: ApiClient, session_id: str, key: str, text: str = "hi") -> httpx.Response:
    return client.post(
        f"/api/sessions/{session_id}/turns", json={"text": text}, headers={"Idempotency-Key": key}
    )


async def runs_in(harness: Harness, session_id: str) -> int:
    async with harness.db_sessions() as db:
        query = select(func.count()).select_from(Run).where(Run.session_id == session_id)
        return int(await db.scalar(query) or 0)


async def post_while_working(
    harness: Harness,
    client: ApiClient,
    session_id: str,
    key: str,
) -> httpx.Response:
    """The test client returns once the stream ended: post from a thread while this loop runs the
    burst worker (the job may be queued a moment after the Run is claimed)."""
    posting = asyncio.create_task(asyncio.to_thread(post_turn, client, session_id, key))
    while not posting.done():
        await harness.work()
        await asyncio.wait([posting], timeout=0.2)
    return await posting


def test_list_filters_by_status_and_search_and_pages(client: ApiClient) -> None:
    marker = f"list-{uuid.uuid4().hex[:8]}"
    ids = [new_session(client, f"{marker} {i}") for i in range(3)]
    new_session(client, f"{marker}%_ literal")
    assert client.patch(f"/api/sessions/{ids[0]}", json={"status": "archived"}).status_code == 200

    def listed(**params: Any) -> dict[str, Any]:
        response = client.get("/api/sessions", params={"search": marker, **params})
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    everything = listed()
    assert everything["total"] == 4
    assert [s["id"] for s in everything["items"]][1:] == ids[::-1]  # newest first
    active = listed(status="active")
    assert active["total"] == 3 and ids[0] not in {s["id"] for s in active["items"]}
    archived = listed(status="archived")
    assert [s["id"] for s in archived["items"]] == [ids[0]] and archived["total"] == 1
    first, rest = listed(limit=3), listed(limit=3, offset=3)
    assert (len(first["items"]), len(rest["items"]), first["total"], rest["total"]) == (3, 1, 4, 4)
    assert listed(search=f"{marker}%_")["total"] == 1  # % and _ match literally


def test_patch_renames_and_archives(client: ApiClient) -> None:
    session_id = new_session(client, "before")
    created = client.get(f"/api/sessions/{session_id}").json()
    renamed = client.patch(f"/api/sessions/{session_id}", json={"title": "  after  "})
    assert renamed.status_code == 200, renamed.text
    body = renamed.json()
    assert body["title"] == "after" and body["status"] == "active"
    assert body["updated_at"] >= created["updated_at"] and body["created_at"] == created["created_at"]
    both = client.patch(f"/api/sessions/{session_id}", json={"title": "t", "status": "archived"}).json()
    assert (both["title"], both["status"]) == ("t", "archived")
    assert client.get(f"/api/sessions/{session_id}").json() == {**both, "cost_usd": None}
    assert set(both) == {
        "id",
        "title",
        "status",
        "workspace_id",
        "created_at",
        "updated_at",
        "webhook_url",
        "approval",
    }


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"title": None},
        {"status": None},
        {"status": "deleted"},
        {"title": "x" * 201},
        {"title": "a\u0000b"},
        {"title": "ok", "bogus": 1},
        {"id": "00000000-0000-0000-0000-000000000000"},
        [],
    ],
)
def test_patch_refuses_bad_bodies(client: ApiClient, body: object) -> None:
    session_id = new_session(client, "kept")
    response = client.patch(f"/api/sessions/{session_id}", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["code"] == "validation_error" and response.json()["message"]
    assert client.get(f"/api/sessions/{session_id}").json()["title"] == "kept"


@pytest.mark.parametrize("session_id", ["00000000-0000-0000-0000-000000000000", "not-a-uuid"])
def test_patch_of_an_unknown_session_is_404(client: ApiClient, session_id: str) -> None:
    response = client.patch(f"/api/sessions/{session_id}", json={"title": "x"})
    assert response.status_code == 404 and response.json()["code"] == "not_found"


async def test_an_archived_session_refuses_turns_but_replays_a_known_key(
    client: ApiClient,
    harness: Harness,
) -> None:
    session_id = new_session(client)
    first = await post_while_working(harness, client, session_id, "first")
    assert first.status_code == 200 and first.text.rstrip().endswith("data: [DONE]")
    run_id = first.headers["x-fleet-run-id"]

    assert client.patch(f"/api/sessions/{session_id}", json={"status": "archived"}).status_code == 200
    refused = post_turn(client, session_id, "second")
    assert refused.status_code == 409, refused.text
    assert refused.json()["code"] == "session_archived"
    assert "active" in refused.json()["message"]
    assert await runs_in(harness, session_id) == 1  # nothing was claimed

    replay = post_turn(client, session_id, "first")  # the same key and body: the same Run
    assert replay.status_code == 200 and replay.headers["x-fleet-run-id"] == run_id
    assert '"delivery":"replay"' in replay.text and replay.text.rstrip().endswith("data: [DONE]")

    assert client.patch(f"/api/sessions/{session_id}", json={"status": "active"}).status_code == 200
    again = await post_while_working(harness, client, session_id, "second")
    assert again.status_code == 200, again.text
    assert '"finishReason":"stop"' in again.text
    assert await runs_in(harness, session_id) == 2


async def test_the_claim_checks_the_key_before_the_archive(harness: Harness) -> None:
    """In the query itself: a known key replays (or mismatches) in an archived session; a new key
    is refused inside the claim's transaction, leaving no Run and no Turn."""
    fingerprint = hashlib.sha256(TurnRequest(text="hi").fingerprint_bytes()).hexdigest()
    async with harness.db_sessions() as db:
        session_id = (await queries.create_session(db, "t", OPERATOR)).id

        async def claim(key: str, fingerprint: str, text: str) -> claims.Claimed | claims.ClaimRefused:
            return await claims.claim_turn(
                db, caller=OPERATOR, session_id=session_id, idempotency_key=key,
                fingerprint=fingerprint, text=text, model="m",
            )  # fmt: skip

        claimed = await claim("k", fingerprint, "hi")
        assert isinstance(claimed, claims.Claimed) and claimed.created
        run_id = claimed.run.id  # a plain string: a refused claim rolls back, expiring ORM objects
        await queries.update_session(db, session_id, status="archived")
        again = await claim("k", fingerprint, "hi")
        assert isinstance(again, claims.Claimed) and not again.created and again.run.id == run_id
        other_body = await claim("k", "other", "x")
        assert other_body == claims.ClaimRefused("idempotency_key_mismatch", run_id)
        await db.execute(update(Run).where(Run.id == run_id).values(status="completed"))
        await db.commit()
        refused = await claim("new", fingerprint, "hi")
        assert refused == claims.ClaimRefused("session_archived")
        turns = await queries.list_turns(db, session_id, after_sequence=0, limit=10)
        assert [t.run_id for t in turns] == [run_id]
        await queries.update_session(db, session_id, status="active")
        allowed = await claim("new", fingerprint, "hi")
        assert isinstance(allowed, claims.Claimed) and allowed.created
    assert await runs_in(harness, session_id) == 2


async def test_a_failed_turn_s_history_says_why_it_failed(client: ApiClient, harness: Harness) -> None:
    """Found in first-run testing: a resumed session showed "the Turn failed" with no code or
    message, which the live stream and /api/runs/{id} had."""
    from fleet_shared.db import runs

    session_id = new_session(client)
    run_id = await harness.submit(session_id=session_id, enqueue=False)
    async with harness.db_sessions() as db:
        assert await runs.fail_queued_run(db, run_id, "enqueue_lost", "the job was lost; send it again")
    items = client.get(f"/api/sessions/{session_id}/turns").json()["items"]
    user, assistant = items[-2:]
    assert assistant["id"] == run_id and assistant["metadata"]["status"] == "failed"
    assert assistant["metadata"]["failureCode"] == "enqueue_lost"
    assert assistant["metadata"]["failureMessage"] == "the job was lost; send it again"
    assert "failureCode" not in user["metadata"]
