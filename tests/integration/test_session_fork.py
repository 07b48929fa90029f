"""Forking a session: the fork starts from its parent's committed history, checkpoint and workspace
versions (rows only, no object copied); a Run in progress is left out; from then on the two
diverge. In-process gateway (Litestar's test client) on real SQLite/PostgreSQL and Redis
(tests/integration/test_fork_turns.py takes a fork through real Turns)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from sqlalchemy import event, select
from sqlalchemy.util import await_only

from fleet_shared.config import Settings
from fleet_shared.db import queries
from fleet_shared.db.engine import create_engine, session_factory
from fleet_shared.db.files import StoredBytes, stored_bytes
from fleet_shared.db.forks import fork_session
from fleet_shared.db.models import Session, Workspace
from fleet_shared.db.runs import Settlement, commit_settlement
from fleet_shared.db.workspace_versions import WorkspaceChange
from fleet_shared.manifests import FileEntry, Manifest
from fleet_shared.run_state import RunCommand, RunStatus
from fleet_shared.tenancy import OPERATOR

# The gateway's fixtures (its own data dir, a store folder) are test_files_api's.
from tests.integration.test_files_api import add_run, client, record_version, settings
from tests.support.api import ApiClient, session_row

__all__ = ["client", "settings"]  # fixtures: pytest finds them by these names


def end_run(settings: Settings, run_id: str, answer: str, task: dict[str, Any]) -> None:
    """The Run's ending as a worker commits it: its answer and the task checkpoint (its version
    was recorded before, by record_version)."""

    async def settle() -> None:
        engine = create_engine(settings.database_url)
        try:
            async with session_factory(engine)() as db:
                run = await queries.get_run(db, run_id)
                assert run is not None
                session = await db.get(Session, run.session_id)
                assert session is not None
                settlement = Settlement(
                    run_id=run_id,
                    session_id=run.session_id,
                    attempt=run.attempt,
                    current=RunStatus.QUEUED,
                    command=RunCommand.FAIL,
                    sequence=run.user_sequence + 1,
                    parts=[{"type": "text", "text": answer}],
                    turn_status="failed",
                    events=[],
                    task=task,
                    checkpoint_version=session.checkpoint_version + 1,
                )
                assert await commit_settlement(db, settlement)
        finally:
            await engine.dispose()

    asyncio.run(settle())


def test_a_fork_starts_from_the_committed_state_and_leaves_a_run_in_progress_out(
    client: ApiClient,
    settings: Settings,
) -> None:
    parent = client.post("/api/sessions", json={"title": "the parent"}).json()
    ended = add_run(settings, parent["id"], "k1")
    record_version(settings, parent["workspace_id"], {"memory/note.txt": b"v1"}, run_id=ended)
    end_run(settings, ended, "the answer", {"goal": "g", "progress": []})
    record_version(settings, parent["workspace_id"], {"memory/note.txt": b"v2"})
    running = add_run(settings, parent["id"], "k2")  # queued: still in progress

    response = client.post(f"/api/sessions/{parent['id']}/fork")
    assert response.status_code == 201, response.text
    fork = response.json()
    assert fork["id"] != parent["id"] and fork["workspace_id"] != parent["workspace_id"]
    assert fork["title"] == "the parent" and fork["status"] == "active"
    assert client.get(f"/api/sessions/{fork['id']}").json() == {**fork, "cost_usd": None}  # nothing run yet

    history = client.get(f"/api/sessions/{parent['id']}/turns").json()["items"]
    copied = client.get(f"/api/sessions/{fork['id']}/turns").json()["items"]
    assert [t["metadata"]["runId"] for t in history] == [ended, ended, running]
    assert [(t["role"], t["parts"], t["metadata"]) for t in copied] == [
        (t["role"], t["parts"], t["metadata"]) for t in history[:2]
    ]
    assert copied[0]["id"] != history[0]["id"]  # a Turn of its own, the same message
    task = client.get(f"/api/sessions/{fork['id']}/task").json()
    assert task["goal"] == "g" and task["checkpoint_version"] == 1
    assert task == {**client.get(f"/api/sessions/{parent['id']}/task").json(), "session_id": fork["id"]}

    def versions(session: dict[str, Any]) -> Any:
        return client.get(f"/api/sessions/{session['id']}/workspace/versions").json()["items"]

    assert versions(fork) == versions(parent) and [v["version"] for v in versions(fork)] == [2, 1]
    note = {"path": "memory/note.txt"}
    read = client.get("/api/files/content", params={"session_id": fork["id"], **note}).json()
    assert read["content"] == "v2"
    by_run = client.get("/api/files/content", params={"session_id": fork["id"], "run_id": ended, **note})
    assert by_run.json()["content"] == "v1"

    next_run = add_run(settings, fork["id"], "k2")  # the fork has no Run in progress
    assert next_run != running

    record_version(settings, fork["workspace_id"], {"memory/note.txt": b"fork"})
    parent_note = client.get("/api/files/content", params={"session_id": parent["id"], **note}).json()
    assert parent_note["content"] == "v2" and [v["version"] for v in versions(parent)] == [2, 1]
    assert [v["version"] for v in versions(fork)] == [3, 2, 1]


def test_a_fork_counts_the_bytes_it_refers_to(
    client: ApiClient,
    settings: Settings,
) -> None:
    """Review of #28: the copies counted 0 bytes, so a fork held the parent's files uncounted
    by its own quota, and by every quota once the parent's versions went."""
    parent = client.post("/api/sessions", json={"title": "the parent"}).json()
    record_version(settings, parent["workspace_id"], {"memory/a.bin": b"a" * 300}, added_bytes=300)
    record_version(settings, parent["workspace_id"], {"memory/b.bin": b"b" * 200}, added_bytes=200)

    async def counted(session_id: str) -> StoredBytes:
        engine = create_engine(settings.database_url)
        try:
            async with session_factory(engine)() as db:
                return await stored_bytes(db, session_id)
        finally:
            await engine.dispose()

    before = asyncio.run(counted(parent["id"]))  # the database may hold other tests' sessions
    fork = client.post(f"/api/sessions/{parent['id']}/fork").json()
    # The tenant (`default`, in token mode) counts the fork's copies too.
    expected = StoredBytes(session=500, deployment=before.deployment + 500, tenant=before.tenant + 500)
    assert asyncio.run(counted(fork["id"])) == expected
    assert asyncio.run(counted(parent["id"])).session == before.session == 500


def test_fork_bodies_titles_and_unknown_parents(
    client: ApiClient,
) -> None:
    parent = session_row(client)
    url = f"/api/sessions/{parent['id']}/fork"
    empty = client.post(f"/api/sessions/{session_row(client)['id']}/fork", json={})
    assert empty.status_code == 201 and empty.json()["title"] == ""
    titled = client.post(url, json={"title": "  try another way  "})
    assert titled.status_code == 201 and titled.json()["title"] == "try another way"
    files = client.get("/api/files", params={"session_id": titled.json()["id"]}).json()
    assert [i["name"] for i in files["items"]] == ["artifacts", "attachments", "memory", "skills"]
    assert client.get(f"/api/sessions/{titled.json()['id']}/workspace/versions").json()["items"] == []
    for body in ({"title": "x", "extra": 1}, {"title": None}, {"title": "x" * 201}, [], {"title": "\x00"}):
        refused = client.post(url, json=body)
        assert refused.status_code == 422 and refused.json()["code"] == "validation_error", body
    for unknown in (str(uuid.uuid4()), "not-a-uuid"):
        missing = client.post(f"/api/sessions/{unknown}/fork")
        assert missing.status_code == 404 and missing.json()["code"] == "not_found"
    foreign = client.post(url, headers={"Origin": "https://evil.example"})
    assert foreign.status_code == 403
    archived = session_row(client)
    client.patch(f"/api/sessions/{archived['id']}", json={"status": "archived"})
    again = client.post(f"/api/sessions/{archived['id']}/fork")
    assert again.status_code == 201 and again.json()["status"] == "active"


def test_a_settlement_committed_during_a_fork_is_wholly_in_it_or_wholly_out(
    client: ApiClient,
    settings: Settings,
) -> None:
    """A Run's commit lands between the fork's read of the parent's versions and its read of
    the Turns (forced: a hook on the fork's connection commits it there). The fork sees one
    state of the parent: without that Run's Turns, as without its version."""
    if not settings.database_url.startswith("postgresql"):
        pytest.skip("on SQLite the fork holds the one write lock: nothing can commit during it")
    parent = session_row(client)
    first = add_run(settings, parent["id"], "k1")
    record_version(settings, parent["workspace_id"], {"memory/note.txt": b"v1"}, run_id=first)
    end_run(settings, first, "first answer", {"goal": "g", "progress": []})
    second = add_run(settings, parent["id"], "k2")  # running while the fork is made

    async def settle_second(engine: Any) -> None:
        async with session_factory(engine)() as db:
            change = WorkspaceChange(
                workspace_id=parent["workspace_id"],
                seen_version=1,
                manifest=Manifest.of([FileEntry("memory/note.txt", 2, 0o644, "0" * 64, 0)]),
            )
            settlement = Settlement(
                run_id=second,
                session_id=parent["id"],
                attempt=0,
                current=RunStatus.QUEUED,
                command=RunCommand.FAIL,
                sequence=4,
                parts=[{"type": "text", "text": "second answer"}],
                turn_status="failed",
                events=[],
                workspace=change,
            )
            assert await commit_settlement(db, settlement)

    async def fork_while_it_settles() -> tuple[list[str], int, list[str]]:
        engine, other = create_engine(settings.database_url), create_engine(settings.database_url)
        fired: list[str] = []

        def commit_meanwhile(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
            if not fired and "FROM turns" in statement:
                fired.append(statement)
                await_only(settle_second(other))

        event.listen(engine.sync_engine, "before_cursor_execute", commit_meanwhile)
        try:
            fork = await fork_session(session_factory(engine), parent["id"], None, OPERATOR)
            assert fork is not None and fired
            async with session_factory(other)() as db:
                turns = await queries.list_turns(db, fork.id, after_sequence=0, limit=10)
                version = await db.scalar(select(Workspace.version).where(Workspace.id == fork.workspace_id))
                parent_turns = await queries.list_turns(db, parent["id"], after_sequence=0, limit=10)
            return [t.run_id for t in turns], int(version or 0), [t.run_id for t in parent_turns]
        finally:
            await engine.dispose()
            await other.dispose()

    fork_runs, fork_version, parent_runs = asyncio.run(fork_while_it_settles())
    assert parent_runs == [first, first, second, second]  # the settlement did commit, mid-fork
    assert (fork_runs, fork_version) == ([first, first], 1)
