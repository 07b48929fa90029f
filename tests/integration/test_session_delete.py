"""Deleting a session (DELETE /api/sessions/{id}): every route of it answers 404 at once, and its
rows, its artifacts' and its own attachments' objects go, on SQLite and PostgreSQL; a fork keeps
what it copied (the parent's Runs it names are handed to it); an active Run is cancelled first,
and a session idle past storage.session_ttl_days is deleted by the gc. In-process gateway
(Litestar's test client) on a local store; the Runs are claimed and settled as workers do."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, select, update

import fleet_gateway.cancellation
from fleet_shared.blob_gc import Collector
from fleet_shared.blobs import artifact_key, attachment_key, open_blob_store
from fleet_shared.config import Settings
from fleet_shared.db.engine import create_engine, session_factory
from fleet_shared.db.models import Artifact, Attachment, Run, Session
from fleet_shared.db.queries import get_run
from fleet_shared.db.runs import Settlement, commit_settlement
from fleet_shared.events import ArtifactCreated, RunCompleted
from fleet_shared.run_state import RunCommand, RunStatus
from tests.integration.test_files_api import add_run, client, record_version, settings
from tests.support.api import ApiClient, session_row
from tests.support.session_rows import rows_naming

__all__ = ["client", "settings"]  # fixtures: pytest finds them by these names


def on_db(settings: Settings, work: Any) -> Any:
    async def run() -> Any:
        engine = create_engine(settings.database_url)
        try:
            async with session_factory(engine)() as db:
                return await work(db)
        finally:
            await engine.dispose()

    return asyncio.run(run())


def settle(settings: Settings, run_id: str, artifact: bytes | None = None) -> str | None:
    """The Run completed as a worker commits it, with one artifact (put in the store first)."""
    artifact_id = str(uuid.uuid4()) if artifact is not None else None
    events: list[Any] = [RunCompleted(run_id=run_id, seq=1, duration_ms=1)]
    if artifact is not None and artifact_id is not None:
        store = open_blob_store(settings)
        path = settings.data_dir / "artifact.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(artifact)
        store.put_file(artifact_key(artifact_id), path)
        created = ArtifactCreated(
            run_id=run_id, artifact_id=artifact_id, name="r.txt", media_type="text/plain",
            byte_size=len(artifact), checksum_sha256="0" * 64,
        )  # fmt: skip
        events.insert(0, created)

    async def work(db: Any) -> None:
        run = await get_run(db, run_id)
        await db.execute(update(Run).where(Run.id == run_id).values(status=RunStatus.RUNNING.value))
        await db.commit()
        settlement = Settlement(
            run_id=run_id,
            session_id=run.session_id,
            attempt=run.attempt,
            current=RunStatus.RUNNING,
            command=RunCommand.COMPLETE,
            sequence=run.user_sequence + 1,
            parts=[{"type": "text", "text": "done"}],
            turn_status="completed",
            events=events,
        )
        assert await commit_settlement(db, settlement)

    on_db(settings, work)
    return artifact_id


def upload(client: ApiClient, name: str) -> str:
    response = client.post(
        "/api/attachments",
        files={"attachment": (name, b"bytes of " + name.encode(), "text/plain")},
        headers={"x-requested-with": "test"},
    )
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def count(settings: Settings, model: Any, *where: Any) -> int:
    async def work(db: Any) -> int:
        return int(await db.scalar(select(func.count()).select_from(model).where(*where)))

    return int(on_db(settings, work))


def test_a_deleted_session_leaves_no_row_or_object_and_its_fork_keeps_its_copies(
    client: ApiClient, settings: Settings
) -> None:
    store = open_blob_store(settings)
    parent = session_row(client, "parent")
    only, shared = upload(client, "only.txt"), upload(client, "shared.txt")
    copied = add_run(settings, parent["id"], "k1", [shared])  # the fork's copy names it too
    record_version(settings, parent["workspace_id"], {"memory/note.txt": b"v1"}, run_id=copied)
    copied_artifact = settle(settings, copied, b"copied")
    fork = client.post(f"/api/sessions/{parent['id']}/fork").json()
    own = add_run(settings, parent["id"], "k2", [only])
    record_version(settings, parent["workspace_id"], {"memory/note.txt": b"v2"}, run_id=own)
    own_artifact = settle(settings, own, b"own")
    assert client.post(
        f"/api/sessions/{parent['id']}/traces/feedback", json={"run_id": own, "rating": "up"}
    ).is_success
    other = session_row(client, "other")
    settle(settings, add_run(settings, other["id"], "k3", [shared]))
    fork_history = client.get(f"/api/sessions/{fork['id']}/turns").json()

    response = client.delete(f"/api/sessions/{parent['id']}")
    assert response.status_code == 204, response.text

    sid = parent["id"]
    for route in (f"/api/sessions/{sid}", f"/api/sessions/{sid}/turns", f"/api/sessions/{sid}/task"):
        gone = client.get(route)
        assert gone.status_code == 404 and gone.json()["code"] == "not_found", route
    assert client.get(f"/api/runs/{own}").status_code == 404
    assert client.get(f"/api/artifacts/{own_artifact}").status_code == 404
    assert client.get("/api/files", params={"session_id": sid}).status_code == 404
    assert client.delete(f"/api/sessions/{sid}").status_code == 404
    assert client.post(f"/api/sessions/{sid}/fork").status_code == 404
    turn = client.post(f"/api/sessions/{sid}/turns", json={"text": "hi"}, headers={"Idempotency-Key": "k9"})
    assert turn.status_code == 404, turn.text
    listed = [s["id"] for s in client.get("/api/sessions").json()["items"]]
    assert sid not in listed and fork["id"] in listed

    counts = rows_naming(settings.database_url, sid, parent["workspace_id"], [own])
    assert counts == dict.fromkeys(counts, 0), counts
    assert count(settings, Attachment, Attachment.id == only) == 0
    assert not store.exists(artifact_key(str(own_artifact)))
    assert count(settings, Attachment, Attachment.id == shared) == 1
    assert store.exists(attachment_key(only))  # its bytes are the gc's, past its grace period
    gc(settings, ttl=None, grace=timedelta(0))
    assert not store.exists(attachment_key(only)) and store.exists(attachment_key(shared))

    # The fork reads as before: its copied Turns, its files, and the Run (and artifact) they
    # name, which is the fork's now.
    assert client.get(f"/api/sessions/{fork['id']}/turns").json() == fork_history
    assert client.get(f"/api/runs/{copied}").json()["session_id"] == fork["id"]
    assert client.get(f"/api/artifacts/{copied_artifact}/content").content == b"copied"
    note = client.get("/api/files/content", params={"session_id": fork["id"], "path": "memory/note.txt"})
    assert note.json()["content"] == "v1"


def test_an_active_run_is_cancelled_first_and_a_run_that_outlasts_the_wait_is_purged_by_the_gc(
    client: ApiClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    queued = session_row(client)
    run = add_run(settings, queued["id"], "k1")
    assert client.delete(f"/api/sessions/{queued['id']}").status_code == 204
    assert count(settings, Run, Run.id == run) == 0  # cancelled at once while queued, then removed

    running = session_row(client)
    run = add_run(settings, running["id"], "k1")
    on_db(settings, lambda db: set_running(db, run))
    monkeypatch.setattr(fleet_gateway.cancellation, "CANCEL_WAIT_SECONDS", 0.2)
    assert client.delete(f"/api/sessions/{running['id']}").status_code == 204
    assert client.get(f"/api/sessions/{running['id']}").status_code == 404
    assert count(settings, Run, Run.id == run) == 1  # its worker has not ended it yet

    async def settle_cancelled(db: Any) -> None:
        found = await get_run(db, run)
        settlement = Settlement(
            run_id=run, session_id=found.session_id, attempt=found.attempt, current=RunStatus.RUNNING,
            command=RunCommand.CANCEL, sequence=found.user_sequence + 1, parts=[], turn_status="cancelled",
            events=[],
        )  # fmt: skip
        assert await commit_settlement(db, settlement)

    on_db(settings, settle_cancelled)
    assert gc(settings, ttl=None).sessions >= 1
    assert count(settings, Session, Session.id == running["id"]) == count(settings, Run, Run.id == run) == 0


async def set_running(db: Any, run_id: str) -> None:
    await db.execute(update(Run).where(Run.id == run_id).values(status=RunStatus.RUNNING.value))
    await db.commit()


def gc(
    settings: Settings, ttl: timedelta | None, grace: timedelta = timedelta(hours=1), dry_run: bool = False
) -> Any:
    async def work(db: Any) -> Any:
        collector = Collector(
            session_factory(db.bind),
            open_blob_store(settings),
            older_than=datetime.now(UTC) - grace + timedelta(seconds=1),
            session_ttl=ttl,
            dry_run=dry_run,
        )
        return await collector.run()

    return on_db(settings, work)


def test_a_session_idle_past_its_ttl_is_deleted_by_the_gc_and_others_are_kept(
    client: ApiClient, settings: Settings
) -> None:
    """The clock is shifted by dating the rows back: `idle` was last changed, and its last Run
    made, ten days ago; `recent` had a Turn now; `busy` is as old as `idle` but has a Turn queued."""
    idle, recent, busy = session_row(client), session_row(client), session_row(client)
    settle(settings, add_run(settings, idle["id"], "k1"))
    settle(settings, add_run(settings, recent["id"], "k1"))
    add_run(settings, busy["id"], "k1")
    ten_days_ago = datetime.now(UTC) - timedelta(days=10)

    async def date_back(db: Any) -> None:
        for sid in (idle["id"], recent["id"], busy["id"]):
            await db.execute(update(Session).where(Session.id == sid).values(updated_at=ten_days_ago))
        for sid in (idle["id"], busy["id"]):
            await db.execute(update(Run).where(Run.session_id == sid).values(created_at=ten_days_ago))
        await db.commit()

    on_db(settings, date_back)
    looked = gc(settings, ttl=timedelta(days=7), dry_run=True)  # counts, changes nothing
    assert looked.sessions_expired == 1 and looked.sessions >= 1  # the database is the test session's
    assert client.get(f"/api/sessions/{idle['id']}").status_code == 200
    collected = gc(settings, ttl=timedelta(days=7))
    assert collected.sessions_expired == 1 and collected.sessions >= 1
    assert client.get(f"/api/sessions/{idle['id']}").status_code == 404
    assert (
        count(settings, Session, Session.id == idle["id"])
        == count(settings, Run, Run.session_id == idle["id"])
        == 0
    )
    for kept in (recent, busy):
        assert client.get(f"/api/sessions/{kept['id']}").status_code == 200
    assert gc(settings, ttl=None).sessions_expired == 0  # no TTL: nothing expires


def test_a_fork_that_used_the_same_key_keeps_its_own_run_and_inherits_the_parents(
    client: ApiClient, settings: Settings
) -> None:
    """The fork's own Turn used the key of a parent Run it copied: after the parent is deleted,
    the fork holds both, the inherited one under a key no client sent, and the key still replays
    the fork's own Run."""
    parent = session_row(client)
    copied = add_run(settings, parent["id"], "same-key")
    settle(settings, copied)
    fork = client.post(f"/api/sessions/{parent['id']}/fork").json()
    own = add_run(settings, fork["id"], "same-key")
    settle(settings, own)
    assert client.delete(f"/api/sessions/{parent['id']}").status_code == 204
    assert count(settings, Session, Session.id == parent["id"]) == 0
    inherited = client.get(f"/api/runs/{copied}").json()
    assert inherited["session_id"] == fork["id"]
    assert add_run(settings, fork["id"], "same-key") == own  # the key replays the fork's own Run

    async def key_of(db: Any) -> str:
        return str(await db.scalar(select(Run.idempotency_key).where(Run.id == copied)))

    assert on_db(settings, key_of) == f"inherited:{copied}"


def test_a_patch_after_a_delete_is_404_and_a_queued_run_of_a_deleted_session_never_starts(
    client: ApiClient, settings: Settings
) -> None:
    from fleet_shared.db import purge
    from fleet_shared.db.engine import run_whole
    from fleet_shared.db.runs import start_run_on

    session = session_row(client)
    run = add_run(settings, session["id"], "k1")
    on_db(settings, lambda db: purge.mark_deleted(db, session["id"]))  # marked; its Run not yet cancelled
    assert client.patch(f"/api/sessions/{session['id']}", json={"status": "active"}).status_code == 404

    async def start(db: Any) -> Any:
        return await run_whole(session_factory(db.bind), lambda sync: start_run_on(sync, run))

    assert on_db(settings, start) is None  # a worker that takes its job starts nothing
    assert gc(settings, ttl=None).sessions >= 1  # a queued Run does not hold the purge back
    assert count(settings, Run, Run.id == run) == 0


def test_the_gc_goes_on_past_a_session_it_cannot_purge_and_a_store_outage_fails_no_delete(
    client: ApiClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fleet_shared.blobs import BlobStore
    from fleet_shared.db import purge

    stuck, fine = session_row(client), session_row(client)
    for session in (stuck, fine):
        on_db(settings, lambda db, sid=session["id"]: purge.mark_deleted(db, sid))
    real = purge.purge_on

    def failing(db: Any, session_id: str) -> Any:
        if session_id == stuck["id"]:
            raise RuntimeError("the database refused")
        return real(db, session_id)

    monkeypatch.setattr(purge, "purge_on", failing)
    gc(settings, ttl=None)
    assert count(settings, Session, Session.id == fine["id"]) == 0
    assert count(settings, Session, Session.id == stuck["id"]) == 1
    monkeypatch.setattr(purge, "purge_on", real)
    gc(settings, ttl=None)
    assert count(settings, Session, Session.id == stuck["id"]) == 0  # the next pass took it

    async def store_away(self: Any, key: str) -> None:
        raise RuntimeError("the store is away")

    monkeypatch.setattr(BlobStore, "delete", store_away)
    parent = session_row(client)
    artifact = settle(settings, add_run(settings, parent["id"], "k1"), b"kept by the outage")
    assert client.delete(f"/api/sessions/{parent['id']}").status_code == 204
    assert count(settings, Session, Session.id == parent["id"]) == 0
    assert count(settings, Artifact, Artifact.id == artifact) == 0  # its object: the gc's
