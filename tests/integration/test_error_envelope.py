"""Framework errors use the envelope `{code, message}` and carry `x-request-id`, like the API's
own: an unknown route, a wrong method (with `Allow`), a wrong content type, malformed JSON, a
schema violation, an oversize body, and a bad Idempotency-Key (checked by Litestar's parameter
constraints). In-process app, real Redis and both databases."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.integration.harness import Harness
from tests.support.api import ApiClient

SUBMIT = {"lm": "root", "reasoning": "r", "code": "SUBMIT(answer='x')"}


def assert_envelope(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert len(response.headers.get("x-request-id", "")) >= 8
    body = response.json()
    assert set(body) == {"code", "message"} and body["code"] == code and body["message"], body
    return dict(body)


async def post_while_working(
    client: ApiClient,
    harness: Harness,
    url: str,
    headers: dict[str, str],
) -> httpx.Response:
    """The test client returns only once the stream ends: it posts from a thread while this loop
    runs burst workers (the job may be queued a moment after the Run is claimed)."""
    posting = asyncio.create_task(asyncio.to_thread(client.post, url, json={"text": "hi"}, headers=headers))
    async with asyncio.timeout(60):
        while not posting.done():
            await harness.work()
            await asyncio.wait([posting], timeout=0.2)
    return await posting


@pytest.fixture
def harness(harness_factory: Any) -> Harness:
    made: Harness = harness_factory(SUBMIT)
    return made


async def test_framework_errors_use_the_envelope(client: ApiClient, harness: Harness) -> None:
    session_id = client.post("/api/sessions", json={}).json()["id"]
    turns = f"/api/sessions/{session_id}/turns"
    assert_envelope(client.get("/api/nothing-here"), 404, "not_found")
    limit = harness.settings.profile.gateway.limits.max_header_bytes
    huge = client.get("/api/sessions", headers={"x-padding": "a" * limit})
    assert str(limit) in assert_envelope(huge, 431, "headers_too_large")["message"]
    wrong = client.delete("/api/sessions")
    assert_envelope(wrong, 405, "method_not_allowed")
    assert {m.strip() for m in wrong.headers["allow"].split(",")} >= {"GET", "POST"}
    form = client.post(
        turns,
        content=b"text=hi",
        headers={"content-type": "application/x-www-form-urlencoded", "Idempotency-Key": "a"},
    )
    assert "application/json" in assert_envelope(form, 415, "unsupported_media_type")["message"]
    # No body at all is not a content-type question (`curl -X PUT -d ''` sends form-urlencoded).
    empty = client.put(
        "/api/runs/00000000-0000-0000-0000-000000000000/cancellation",
        content=b"",
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert_envelope(empty, 404, "not_found")
    malformed = client.post(
        turns, content=b"{nope", headers={"content-type": "application/json", "Idempotency-Key": "a"}
    )
    assert "not valid JSON" in assert_envelope(malformed, 422, "validation_error")["message"]
    schema = client.post(turns, json={"text": 5}, headers={"Idempotency-Key": "a"})
    assert "text" in assert_envelope(schema, 422, "validation_error")["message"]
    unknown_field = client.post(turns, json={"text": "hi", "model": "x"}, headers={"Idempotency-Key": "a"})
    unknown = assert_envelope(unknown_field, 422, "validation_error")["message"]
    assert unknown == "the request body has a field this endpoint does not take: `model`"
    body_limit = harness.settings.profile.gateway.limits.max_body_bytes
    oversize = client.post(
        turns,
        content=b'{"text": "' + b"a" * body_limit + b'"}',
        headers={"content-type": "application/json", "Idempotency-Key": "a"},
    )
    too_large = assert_envelope(oversize, 413, "payload_too_large")["message"]
    assert too_large == f"the request body is over the limit of {body_limit} bytes"
    # Nothing above created a Run: the session takes a Turn with the same key.
    ok = await post_while_working(client, harness, turns, {"Idempotency-Key": "a"})
    assert ok.status_code == 200 and ok.headers["x-fleet-run-id"]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Idempotency-Key": ""},
        {"Idempotency-Key": "   "},
        {"Idempotency-Key": "k" * 129},
        {"Idempotency-Key": "tab\there"},
    ],
    ids=["missing", "empty", "blank", "too-long", "control-char"],
)
def test_a_bad_idempotency_key_is_refused_by_the_parameter_constraints(
    client: ApiClient,
    headers: dict[str, str],
) -> None:
    session_id = client.post("/api/sessions", json={}).json()["id"]
    response = client.post(f"/api/sessions/{session_id}/turns", json={"text": "hi"}, headers=headers)
    assert "Idempotency-Key" in assert_envelope(response, 422, "validation_error")["message"]


async def test_the_longest_idempotency_key_is_accepted(client: ApiClient, harness: Harness) -> None:
    session_id = client.post("/api/sessions", json={}).json()["id"]
    turns = f"/api/sessions/{session_id}/turns"
    response = await post_while_working(client, harness, turns, {"Idempotency-Key": "k" * 128})
    assert response.status_code == 200
