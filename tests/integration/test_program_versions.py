"""Program versions on real Turns: the shipped text is seeded active, each Run records the version
it ran, a candidate runs only in Turns that name it until it is activated, and a rollback brings
the previous one back. The LM is the provider path's loopback server, which shows the
instructions each call carried; both databases."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy import delete, update

from fleet_gateway.app import create_app
from fleet_shared.config import load_settings
from fleet_shared.db import programs, queries
from fleet_shared.db.models import ProgramVersion, Run
from fleet_shared.program_text import SHIPPED_INSTRUCTIONS
from fleet_shared.tenancy import ADMIN
from fleet_shared.tokens_file import mint_token
from fleet_worker import dspy_adapter
from tests.integration.harness import Harness
from tests.support.fake_provider import FakeProvider, serve_fake_provider

REPO = Path(__file__).resolve().parents[2]
SUBMIT = "[[ ## reasoning ## ]]\nDone.\n\n[[ ## code ## ]]\nSUBMIT(answer='ok')\n\n[[ ## completed ## ]]"
CANDIDATE = "MARKER-7. Answer in one word. " + SHIPPED_INSTRUCTIONS


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    with serve_fake_provider() as fake:
        fake.replies = [SUBMIT] * 20
        yield fake


async def no_versions(harness: Harness) -> None:
    async with harness.db_sessions() as db:
        await db.execute(update(Run).values(program_version_id=None, requested_program_version_id=None))
        await db.execute(delete(ProgramVersion))
        await db.commit()


@pytest.fixture
async def harness(
    harness_factory: Callable[..., Harness], provider: FakeProvider, redis_url: str
) -> AsyncIterator[Harness]:
    """The scripted harness, its LMs replaced by the `local` profile's, on the loopback server;
    the session's database holds no program version yet (another test's are removed)."""
    made = harness_factory()
    await no_versions(made)
    env = {
        "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"), "FLEET_PROFILE": "local",
        "FLEET_REDIS_URL": redis_url, "FLEET_LM_MODEL": "openai/program-model", "FLEET_LM_API_KEY": "sk-x",
        "FLEET_LM_BASE_URL": provider.url,
    }  # fmt: skip
    lm = load_settings(env).root_lm
    made.settings = msgspec.structs.replace(made.settings, root_lm=lm, sub_lm=lm)
    yield made
    await no_versions(made)  # the session's other tests run on a database with none, as before


async def turn(harness: Harness, provider: FakeProvider, **claim: Any) -> tuple[str | None, str]:
    """One Turn: the version its Run recorded, and the instructions its first LM call carried."""
    seen = len(provider.requests)
    run_id = await harness.submit(key=f"k-{uuid.uuid4()}", **claim)
    await harness.work()
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
    assert run is not None and run.status == "completed", run and (run.status, run.failure_message)
    return run.program_version_id, provider.requests[seen]["messages"][0]["content"]


async def test_runs_record_and_run_the_active_version_and_a_rollback_restores_it(
    harness: Harness, provider: FakeProvider
) -> None:
    async with harness.db_sessions() as db:
        seeded = await programs.seed_on(db)
        assert seeded.outcome == "active"
        assert (await programs.seed_on(db)).outcome == "present"  # once per text
        candidate = await programs.add_candidate(
            db, CANDIDATE, created_by="test", parent_id=seeded.version_id
        )
        await db.commit()
        candidate_id = candidate.id

    version, instructions = await turn(harness, provider)
    assert version == seeded.version_id and "Use the REPL" in instructions and "MARKER-7" not in instructions

    # A candidate runs only where a Turn names it; the active version stays what it was.
    version, instructions = await turn(harness, provider, program_version_id=candidate_id)
    assert version == candidate_id and "MARKER-7" in instructions
    version, instructions = await turn(harness, provider)
    assert version == seeded.version_id and "MARKER-7" not in instructions

    async with harness.db_sessions() as db:
        assert (await programs.activate_on(db, candidate_id)) is not None
        await db.commit()
    version, instructions = await turn(harness, provider)
    assert version == candidate_id and "MARKER-7" in instructions

    async with harness.db_sessions() as db:
        previous = await programs.previous_version(db)
        assert previous is not None and previous.id == seeded.version_id
        await programs.activate_on(db, previous.id)
        await db.commit()
        statuses = {v.id: v.status for v in await programs.list_versions(db)}
    assert statuses == {seeded.version_id: "active", candidate_id: "retired"}
    version, instructions = await turn(harness, provider)
    assert version == seeded.version_id and "MARKER-7" not in instructions


async def test_a_new_shipped_text_waits_as_a_candidate(harness: Harness) -> None:
    async with harness.db_sessions() as db:
        first = await programs.seed_on(db)
        later = await programs.seed_on(db, SHIPPED_INSTRUCTIONS + "\nA later release's sentence.")
        active = await programs.active_version(db)
    assert (first.outcome, later.outcome) == ("active", "candidate")
    assert active is not None and active.id == first.version_id


async def test_the_routes_need_the_admin_scope_and_activate_what_they_name(
    harness: Harness, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens.toml"
    admin = {"Authorization": f"Bearer {mint_token(tokens, tenant='ops', user='ana', scopes=(ADMIN,))}"}
    user = {"Authorization": f"Bearer {mint_token(tokens, tenant='acme', user='bo', scopes=())}"}
    gateway = harness.settings.profile.gateway
    auth = msgspec.structs.replace(gateway.auth, mode="tokens")
    # A web origin allowed to call the API: still never to change program versions.
    cors = msgspec.structs.replace(gateway.cors, allowed_origins=("https://app.example",))
    profile = msgspec.structs.replace(
        harness.settings.profile, gateway=msgspec.structs.replace(gateway, auth=auth, cors=cors)
    )
    settings = msgspec.structs.replace(harness.settings, profile=profile, tokens_file=tokens)
    async with harness.db_sessions() as db:
        shipped = (await programs.seed_on(db)).version_id
    async with AsyncTestClient(create_app(settings)) as client:
        assert (await client.get("/api/programs", headers=user)).status_code == 403
        assert (await client.post("/api/programs", json={"text": "x"}, headers=user)).status_code == 403
        added = await client.post("/api/programs", json={"text": CANDIDATE, "notes": "n"}, headers=admin)
        assert added.status_code == 201, added.text
        body = added.json()
        assert (body["status"], body["created_by"], body["text"]) == ("candidate", "ana", CANDIDATE)
        listed = (await client.get("/api/programs", headers=admin)).json()["items"]
        assert [(item["id"], item["status"]) for item in listed] == [
            (shipped, "active"),
            (body["id"], "candidate"),
        ]
        assert "text" not in listed[0]
        assert (await client.get(f"/api/programs/{uuid.uuid4()}", headers=admin)).status_code == 404
        assert (await client.get("/api/programs/not-a-uuid", headers=admin)).status_code == 404
        missing = await client.put("/api/programs/active", json={"id": str(uuid.uuid4())}, headers=admin)
        assert missing.status_code == 404
        assert (
            await client.put("/api/programs/active", json={"id": body["id"]}, headers=user)
        ).status_code == 403
        # Never changed from a web page, even with an admin's credential; read, it may be.
        page = {**admin, "Origin": "https://app.example", "Sec-Fetch-Site": "cross-site"}
        session_from_page = await client.post("/api/sessions", json={}, headers=page)
        assert session_from_page.status_code == 201  # the origin may use the rest of the API
        from_page = await client.put("/api/programs/active", json={"id": body["id"]}, headers=page)
        assert from_page.status_code == 403 and from_page.json()["code"] == "origin_not_allowed"
        assert (await client.get("/api/programs", headers=page)).status_code == 200

        # A Turn may name a version only with the admin scope, and only one that exists.
        session = (await client.post("/api/sessions", json={}, headers=user)).json()["id"]
        refused = await client.post(
            f"/api/sessions/{session}/turns",
            json={"text": "hi", "program_version": body["id"]},
            headers={**user, "Idempotency-Key": "k1"},
        )
        assert refused.status_code == 403 and refused.json()["code"] == "forbidden"
        mine = (await client.post("/api/sessions", json={}, headers=admin)).json()["id"]
        unknown = await client.post(
            f"/api/sessions/{mine}/turns",
            json={"text": "hi", "program_version": str(uuid.uuid4())},
            headers={**admin, "Idempotency-Key": "k2", "Prefer": "respond-async"},
        )
        assert unknown.status_code == 422 and "program_version" in unknown.json()["message"]

        activated = await client.put("/api/programs/active", json={"id": body["id"]}, headers=admin)
        assert activated.status_code == 200 and activated.json()["status"] == "active"
        shown = (await client.get(f"/api/programs/{shipped}", headers=admin)).json()
        assert shown["status"] == "retired" and shown["text"] == SHIPPED_INSTRUCTIONS


async def test_rollbacks_walk_back_through_what_each_version_replaced(harness: Harness) -> None:
    async with harness.db_sessions() as db:
        first = (await programs.seed_on(db)).version_id
        later = []
        for n in (2, 3):
            added = await programs.add_candidate(db, f"Version {n}.", created_by="test")
            later.append(added.id)
            await programs.activate_on(db, added.id)
            await db.commit()
        second, third = later
        for expected in (second, first):
            previous = await programs.previous_version(db)
            assert previous is not None and previous.id == expected
            await programs.activate_on(db, previous.id, rollback=True)
            await db.commit()
        assert await programs.previous_version(db) is None  # the first replaced nothing
        active = await programs.active_version(db)
    assert active is not None and active.id == first and third not in (first, second)


async def test_two_activations_at_once_leave_one_active(harness: Harness) -> None:
    async with harness.db_sessions() as db:
        await programs.seed_on(db)
        ids = []
        for n in (1, 2):
            ids.append((await programs.add_candidate(db, f"Racer {n}.", created_by="test")).id)
        await db.commit()

    async def activate(version_id: str) -> None:
        async with harness.db_sessions() as db:
            assert await programs.activate_on(db, version_id) is not None
            await db.commit()

    await asyncio.gather(*(activate(version_id) for version_id in ids))
    async with harness.db_sessions() as db:
        actives = [v.id for v in await programs.list_versions(db) if v.status == "active"]
    assert len(actives) == 1 and actives[0] in ids


async def test_a_stored_text_is_the_text_the_rlm_runs(harness: Harness) -> None:
    """A signature's instructions are read with inspect.cleandoc: stored so, the bytes match."""
    async with harness.db_sessions() as db:
        added = await programs.add_candidate(db, "  Rules:\n    - be brief\n", created_by="test")
        await db.commit()
    assert added.text == "Rules:\n- be brief"
    assert dspy_adapter.signature_for(added.text).instructions == added.text
