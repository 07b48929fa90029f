"""POST /api/sessions/{id}/traces/feedback on SQLite and PostgreSQL: stored in `feedback`, never
forwarded (no tracing backend), and only for a Run of that session."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from fleet_shared.db import queries
from fleet_shared.db.models import Feedback
from tests.integration.harness import Harness
from tests.support.api import ApiClient

UNKNOWN = "00000000-0000-0000-0000-000000000000"


@pytest.fixture
def harness(harness_factory: Any) -> Harness:
    made: Harness = harness_factory({"lm": "root", "reasoning": "r", "code": "SUBMIT(answer='ok')"})
    return made


async def claimed_run(harness: Harness) -> tuple[str, str]:
    """A session and a Run of it (claimed; feedback does not wait for it to settle)."""
    run_id = await harness.submit(enqueue=False)
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None
        return run.session_id, run_id


async def stored(harness: Harness, feedback_id: str) -> Feedback | None:
    async with harness.db_sessions() as db:
        return await db.scalar(select(Feedback).where(Feedback.id == feedback_id))


async def test_feedback_is_stored_and_never_forwarded(
    client: ApiClient,
    harness: Harness,
) -> None:
    session_id, run_id = await claimed_run(harness)
    url = f"/api/sessions/{session_id}/traces/feedback"
    response = client.post(url, json={"run_id": run_id, "rating": "up", "comment": "clear answer"})
    assert response.status_code == 201, response.text
    body = response.json()
    assert set(body) == {"id", "session_id", "run_id", "rating", "comment", "created_at", "forwarded"}
    assert (body["session_id"], body["run_id"], body["rating"]) == (session_id, run_id, "up")
    assert body["comment"] == "clear answer" and body["forwarded"] is False
    assert body["created_at"].endswith("Z")
    row = await stored(harness, body["id"])
    assert row is not None and (row.run_id, row.rating, row.comment) == (run_id, "up", "clear answer")

    bare = client.post(url, json={"run_id": run_id.upper(), "rating": "down"})
    assert bare.status_code == 201, bare.text
    assert "comment" not in bare.json()  # omitted, never null
    assert bare.json()["forwarded"] is False and bare.json()["run_id"] == run_id
    row = await stored(harness, bare.json()["id"])
    assert row is not None and row.comment is None and row.rating == "down"


async def test_a_run_of_another_session_is_the_same_404_as_an_unknown_one(
    client: ApiClient,
    harness: Harness,
) -> None:
    _, run_id = await claimed_run(harness)
    other_session = client.post("/api/sessions", json={}).json()["id"]
    cases = [
        (other_session, run_id),  # a real Run, but not this session's
        (other_session, UNKNOWN),
        (UNKNOWN, run_id),
        ("not-a-uuid", run_id),
    ]
    for session_id, asked in cases:
        response = client.post(
            f"/api/sessions/{session_id}/traces/feedback", json={"run_id": asked, "rating": "up"}
        )
        assert response.status_code == 404, (session_id, asked, response.text)
        assert response.json()["code"] == "not_found"
    async with harness.db_sessions() as db:
        assert (await db.scalars(select(Feedback).where(Feedback.run_id == run_id))).all() == []


@pytest.mark.parametrize(
    "body",
    [
        {"rating": "up"},
        {"run_id": "not-a-uuid", "rating": "up"},
        {"run_id": UNKNOWN, "rating": "meh"},
        {"run_id": UNKNOWN, "rating": None},
        {"run_id": UNKNOWN, "rating": "up", "comment": "x" * 4001},
        {"run_id": UNKNOWN, "rating": "up", "comment": "a\u0000b"},
        {"run_id": UNKNOWN, "rating": "up", "forwarded": True},
    ],
)
def test_bad_bodies_are_422(client: ApiClient, body: dict[str, object]) -> None:
    session_id = client.post("/api/sessions", json={}).json()["id"]
    response = client.post(f"/api/sessions/{session_id}/traces/feedback", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["code"] == "validation_error"


async def test_a_comment_of_the_maximum_length_is_kept_whole(
    client: ApiClient,
    harness: Harness,
) -> None:
    session_id, run_id = await claimed_run(harness)
    comment = "é" * 4000
    response = client.post(
        f"/api/sessions/{session_id}/traces/feedback",
        json={"run_id": run_id, "rating": "down", "comment": comment},
    )
    assert response.status_code == 201, response.text
    row = await stored(harness, response.json()["id"])
    assert row is not None and row.comment == comment
