"""Tenancy route by route (`gateway.auth.mode = "tokens"`): for every operation in the served
OpenAPI document that names a resource, a caller of another tenant, and a user of the same
tenant without `sessions:read:all`, get exactly what an unknown id gets. A new route that takes
an id fails this test until it has a case here, so none can be forgotten."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import structlog
from litestar.testing import AsyncTestClient
from structlog.testing import capture_logs

from fleet_gateway.app import create_app
from fleet_shared.config import Settings
from fleet_shared.db import scoped
from fleet_shared.tenancy import ADMIN, READ_ALL_SESSIONS, Principal
from fleet_shared.tokens_file import mint_token
from tests.integration.harness import Harness

HarnessFactory = Callable[..., Harness]
WRITES_AN_ARTIFACT = (
    "import pathlib\npathlib.Path('artifacts/r.txt').write_text('tenant data')\nSUBMIT(answer='done')"
)
IDS = ("session_id", "run_id", "artifact_id", "attachment_id")
# Skills are shared, read-only, by every tenant; program versions are the deployment's, for
# callers with the `admin` scope only (checked below, and in test_program_versions.py).
SHARED = {
    ("GET", "/api/skills/{skill_id}"),
    ("GET", "/api/programs/{version_id}"),
    ("PATCH", "/api/programs/{version_id}"),
}


def in_tokens_mode(settings: Settings, tokens: Path) -> Settings:
    gateway = settings.profile.gateway
    auth = msgspec.structs.replace(gateway.auth, mode="tokens")
    profile = msgspec.structs.replace(settings.profile, gateway=msgspec.structs.replace(gateway, auth=auth))
    return msgspec.structs.replace(settings, profile=profile, tokens_file=tokens)


DELETE_SESSION = ("DELETE", "/api/sessions/{session_id}")
APPROVE = ("POST", "/api/runs/{run_id}/approvals/{approval_id}")


def case(method: str, path: str, ids: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """The request for one operation with these ids: a body and parameters that pass validation,
    so only scoping can refuse it."""
    url = path.format(**ids, approval_id="0123456789abcdef")
    files = {"session_id": ids["session_id"]}
    cases: dict[tuple[str, str], dict[str, Any]] = {
        ("GET", "/api/sessions/{session_id}"): {},
        ("PATCH", "/api/sessions/{session_id}"): {"json": {"title": "taken over"}},
        ("DELETE", "/api/sessions/{session_id}"): {},
        ("GET", "/api/sessions/{session_id}/task"): {},
        ("POST", "/api/sessions/{session_id}/fork"): {"json": {}},
        ("GET", "/api/sessions/{session_id}/turns"): {},
        ("POST", "/api/sessions/{session_id}/turns"): {
            "json": {"text": "hi"},
            "headers": {"Idempotency-Key": f"k-{uuid.uuid4()}"},
        },
        ("GET", "/api/sessions/{session_id}/workspace/versions"): {},
        ("POST", "/api/sessions/{session_id}/traces/feedback"): {
            "json": {"run_id": ids["run_id"], "rating": "up"}
        },
        ("GET", "/api/runs/{run_id}"): {},
        ("GET", "/api/runs/{run_id}/stream"): {},
        ("PUT", "/api/runs/{run_id}/cancellation"): {},
        ("GET", "/api/runs/{run_id}/webhooks"): {},
        ("POST", "/api/runs/{run_id}/approvals/{approval_id}"): {"json": {"decision": "approve"}},
        ("GET", "/api/artifacts/{artifact_id}"): {},
        ("GET", "/api/artifacts/{artifact_id}/content"): {},
        ("GET", "/api/attachments/{attachment_id}"): {},
        ("GET", "/api/files"): {"params": {**files, "path": ""}},
        ("GET", "/api/files/stat"): {"params": {**files, "path": "artifacts/r.txt"}},
        ("GET", "/api/files/content"): {"params": {**files, "path": "artifacts/r.txt"}},
        ("GET", "/api/volume/tree"): {"params": files},
    }
    key = (method, path)
    assert key in cases, f"{method} {path} takes an id: add its case to the tenancy matrix"
    return url, cases[key]


def scoped_operations(document: dict[str, Any]) -> list[tuple[str, str]]:
    """Every operation whose path or query names one of a caller's resources."""
    found = []
    for path, item in document["paths"].items():
        for method, operation in item.items():
            names = {p["name"] for p in operation.get("parameters", []) if p["in"] in ("path", "query")}
            if (method.upper(), path) not in SHARED and (names & set(IDS) or "{" in path):
                found.append((method.upper(), path))
    return sorted(found)


async def plant(client: Any, harness: Harness, owner: dict[str, str]) -> dict[str, str]:
    """Alice's resources: an attachment, a session, a finished Run that used it, its artifact."""
    upload = await client.post(
        "/api/attachments",
        files={"attachment": ("notes.txt", b"alice's notes", "text/plain")},
        headers={**owner, "X-Requested-With": "test"},
    )
    assert upload.status_code == 201, upload.text
    session = await client.post("/api/sessions", json={"title": "alice's"}, headers=owner)
    assert session.status_code == 201, session.text
    mine = {"session_id": session.json()["id"], "attachment_id": upload.json()["id"]}
    async with harness.db_sessions() as db:
        attached = await scoped.get_attachments(db, [mine["attachment_id"]], Principal("acme", "alice"))
    mine["run_id"] = await harness.submit(
        "go", session_id=mine["session_id"], attachments=attached, caller=Principal("acme", "alice")
    )
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        await harness.work()
    # The worker's log names the tenant. Only this Run's line counts: the queue and the database
    # are the session's, and a sweep may hand the worker another test's lost job meanwhile.
    settled = [e for e in logs if e["event"] == "turn.settled" and e["run_id"] == mine["run_id"]]
    assert [e["tenant"] for e in settled] == ["acme"]
    turns = await client.get(f"/api/sessions/{mine['session_id']}/turns", headers=owner)
    artifact = next(
        part["data"]
        for turn in turns.json()["items"]
        for part in turn["parts"]
        if part["type"] == "data-artifact"
    )
    mine["artifact_id"] = artifact["artifact_id"]
    return mine


def owner_may(method: str, path: str, owner: tuple[int, Any]) -> None:
    if (method, path) == APPROVE:  # found, and refused only because the Run has ended
        assert owner[0] == 409 and owner[1]["code"] == "approval_decided", owner
    else:
        assert owner[0] < 400, (method, path, owner)


async def test_every_route_hides_another_tenants_and_another_users_resources(
    harness_factory: HarnessFactory, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens.toml"
    alice = mint_token(tokens, tenant="acme", user="alice", scopes=())
    bob = mint_token(tokens, tenant="acme", user="bob", scopes=())
    dave = mint_token(tokens, tenant="acme", user="dave", scopes=(READ_ALL_SESSIONS,))
    carol = mint_token(tokens, tenant="globex", user="carol", scopes=(ADMIN, READ_ALL_SESSIONS))
    harness = harness_factory({"lm": "root", "reasoning": "write", "code": WRITES_AN_ARTIFACT})
    settings = in_tokens_mode(harness.settings, tokens)

    def auth(token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    async with AsyncTestClient(create_app(settings)) as client:
        mine = await plant(client, harness, auth(alice))
        unknown = {name: str(uuid.uuid4()) for name in IDS}

        document = (await client.get("/schema/openapi.json")).json()
        operations = scoped_operations(document)
        assert len(operations) >= 18, operations

        async def answer(token: str, method: str, path: str, ids: dict[str, str]) -> tuple[int, Any]:
            url, request = case(method, path, ids)
            headers = {**auth(token), **request.pop("headers", {})}
            response = await client.request(method, url, headers=headers, **request)
            json_body = response.headers.get("content-type", "").startswith("application/json")
            body = response.json() if json_body else response.content
            if isinstance(body, dict) and "message" in body:
                for name in IDS:  # a message may name the id it was given
                    body["message"] = body["message"].replace(ids[name], "<id>")
            return response.status_code, body

        checked = 0
        for method, path in operations:
            absent = await answer(carol, method, path, unknown)
            assert absent[0] in (404, 204), (method, path, absent)
            for outsider in (carol, bob):
                assert await answer(outsider, method, path, mine) == absent, (method, path)
                checked += 1
            # The owner's Turn would be a live stream, and its DELETE would end the matrix: last.
            if (method, path) not in (("POST", "/api/sessions/{session_id}/turns"), DELETE_SESSION):
                owner_may(method, path, await answer(alice, method, path, mine))
            reader = await answer(dave, method, path, mine)
            if method == "GET" or path.endswith(("/fork", "/feedback")):
                assert reader[0] < 400, (method, path, reader)  # a reader of the tenant's sessions
            else:
                assert reader == absent, (method, path)  # ...may not change them
        assert checked == 2 * len(operations)

        listed = {
            who: [s["id"] for s in (await client.get("/api/sessions", headers=auth(token))).json()["items"]]
            for who, token in (("alice", alice), ("bob", bob), ("carol", carol), ("dave", dave))
        }
        assert mine["session_id"] in listed["alice"] and mine["session_id"] in listed["dave"]
        assert mine["session_id"] not in listed["bob"] and mine["session_id"] not in listed["carol"]

        # Another tenant's attachment in a Turn is as unknown as a made-up id.
        theirs = (await client.post("/api/sessions", json={}, headers=auth(carol))).json()["id"]
        refused = await client.post(
            f"/api/sessions/{theirs}/turns",
            json={"text": "read it", "attachment_ids": [mine["attachment_id"]]},
            headers={**auth(carol), "Idempotency-Key": "steal"},
        )
        assert refused.status_code == 422
        assert refused.json()["message"] == f"attachment_ids: unknown attachment {mine['attachment_id']}"

        # Settings need the admin scope (and loopback, as before); so do program versions.
        assert (await client.get("/api/settings", headers=auth(alice))).status_code == 403
        assert (await client.get("/api/programs", headers=auth(dave))).status_code == 403
        assert (await client.get("/api/programs", headers=auth(carol))).status_code == 200
        assert (await client.get("/api/skills", headers=auth(carol))).status_code == 200
        assert (await client.get("/api/sessions", headers=auth("not-a-token"))).status_code == 401

        # Last, the owner's DELETE: from then on the session is as unknown to her as a made-up id.
        assert (await answer(alice, *DELETE_SESSION, mine))[0] == 204
        unknown_session = await answer(alice, "GET", "/api/sessions/{session_id}", unknown)
        assert (await answer(alice, "GET", "/api/sessions/{session_id}", mine)) == unknown_session
