"""Selecting skills on a Turn, through the gateway in-process (Litestar's test client) with a real
arq worker (burst mode), real Redis and both databases; the LM is the scripted LM.

A refused selection is a 422 `invalid_skill_selection` before any Run exists; an accepted one
puts one `data-skill` part (phase `selected`) per skill on the user's Turn, which is where the
worker reads them from."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from fleet_shared.db.models import Run
from tests.integration.harness import Harness
from tests.support.api import ApiClient, new_session

ROOT_PRINT = {"lm": "root", "reasoning": "look", "code": "print(sorted(__import__('os').listdir('.')))"}
ROOT_SUBMIT = {"lm": "root", "reasoning": "done", "code": "SUBMIT(answer='ok')"}


@pytest.fixture
def harness(harness_factory: Any) -> Harness:
    made: Harness = harness_factory(ROOT_PRINT, ROOT_SUBMIT)
    return made


def submit(
    client: ApiClient,
    session_id: str,
    selections: list[dict[str, str]],
    key: str = "k",
) -> httpx.Response:
    return client.post(
        f"/api/sessions/{session_id}/turns",
        json={"text": "use the skill", "skill_selections": selections},
        headers={"Idempotency-Key": key},
    )


async def runs_of(harness: Harness, session_id: str) -> int:
    async with harness.db_sessions() as db:
        return int(
            await db.scalar(select(func.count()).select_from(Run).where(Run.session_id == session_id)) or 0
        )


def assert_refused(response: httpx.Response, *fragments: str) -> None:
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["code"] == "invalid_skill_selection"
    for fragment in fragments:
        assert fragment in body["message"], body["message"]


@pytest.mark.parametrize(
    ("selections", "fragments"),
    [
        ([{"id": "no-such-skill"}], ("unknown skill 'no-such-skill'",)),
        ([{"id": "NOT a slug\u0000"}], ("unknown skill",)),
        ([{"id": "csv-analysis", "expected_version": "0.0-stale"}], ("'csv-analysis'", "'1.0'", "0.0-stale")),
        (
            [{"id": "csv-analysis"}, {"id": "code-review"}, {"id": "csv-analysis"}],
            ("'csv-analysis'", "twice"),
        ),
        ([{"id": "code-review"}, {"id": "nope"}], ("'nope'",)),
    ],
)
async def test_a_refused_selection_creates_nothing(
    client: ApiClient,
    harness: Harness,
    selections: list[dict[str, str]],
    fragments: tuple[str, ...],
) -> None:
    session_id = new_session(client)
    assert_refused(submit(client, session_id, selections), *fragments)
    assert client.get(f"/api/sessions/{session_id}/turns").json()["items"] == []
    assert await runs_of(harness, session_id) == 0


def test_more_than_four_skills_is_a_schema_error(client: ApiClient) -> None:
    session_id = new_session(client)
    response = submit(client, session_id, [{"id": f"s{i}"} for i in range(5)])
    assert response.status_code == 422 and response.json()["code"] == "validation_error"


async def test_after_a_refusal_the_same_key_runs_the_turn_with_its_skills(
    client: ApiClient,
    harness: Harness,
) -> None:
    session_id = new_session(client)
    assert_refused(submit(client, session_id, [{"id": "no-such-skill"}], key="same"), "no-such-skill")
    assert await runs_of(harness, session_id) == 0
    listed = {s: client.get(f"/api/skills/{s}").json() for s in ("research-notes", "csv-analysis")}
    selections = [
        {"id": "research-notes"},  # no expected_version: the current one is taken
        {"id": "csv-analysis", "expected_version": listed["csv-analysis"]["version"]},
    ]
    # The test client returns once the stream has ended, so it posts from a thread while this loop
    # runs the worker.
    posting = asyncio.create_task(asyncio.to_thread(submit, client, session_id, selections, "same"))
    for _ in range(100):
        if await runs_of(harness, session_id):
            break
        await asyncio.sleep(0.05)
    while not posting.done():
        await harness.work()  # burst: the job may be queued a moment after the Run is claimed
        await asyncio.wait([posting], timeout=0.2)
    response = await posting
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.rstrip().endswith("data: [DONE]")
    assert '"finishReason":"stop"' in response.text
    turns = client.get(f"/api/sessions/{session_id}/turns").json()["items"]
    assert [t["role"] for t in turns] == ["user", "assistant"]
    skill_parts = [p for p in turns[0]["parts"] if p["type"] == "data-skill"]
    assert skill_parts == [
        {
            "type": "data-skill",
            "data": {
                "skill_id": skill_id,
                "name": listed[skill_id]["name"],
                "version": listed[skill_id]["version"],
                "phase": "selected",
            },
        }
        for skill_id in ("research-notes", "csv-analysis")
    ]
    assert await runs_of(harness, session_id) == 1
