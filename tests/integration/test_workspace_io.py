"""Files across the sandbox boundary through real Turns (arq worker, bwrap, real DB and Redis):
attachments staged in, artifacts collected out, with the hostile cases a sandbox can set up."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import select

from fleet_shared.blobs import open_blob_store
from fleet_shared.db import files, queries
from fleet_shared.db.models import Artifact
from fleet_shared.events import ArtifactCreated, AttachmentStaged, RunWarning
from fleet_shared.ids import new_id
from fleet_shared.tenancy import OPERATOR
from tests.integration.harness import Harness

HarnessFactory = Callable[..., Harness]


def one_action(code: str) -> dict[str, Any]:
    return {"lm": "root", "reasoning": "work in the workspace", "code": code}


async def artifacts_of(harness: Harness, run_id: str) -> list[Artifact]:
    async with harness.db_sessions() as db:
        rows = await db.scalars(select(Artifact).where(Artifact.run_id == run_id).order_by(Artifact.name))
        return list(rows)


async def test_artifacts_are_new_or_changed_regular_files_only(harness_factory: HarnessFactory) -> None:
    """A first Turn writes files, a link to a host file and a FIFO; a second one changes one file.
    Each Turn keeps exactly what it wrote or changed, the bytes in the blob store match, and the
    rows come from the same commit as the Turn."""
    code = (
        "import os, pathlib\nart = pathlib.Path('/workspace/artifacts')\n"
        "if request == 'first':\n"
        "    (art / 'a.txt').write_text('alpha')\n"
        "    (art / 'sub').mkdir()\n"
        "    (art / 'sub' / 'b.bin').write_bytes(bytes(range(256)))\n"
        "    os.symlink('/etc/passwd', art / 'link')\n"
        "    os.symlink('/workspace/memory', art / 'dirlink')\n"
        "    os.mkfifo(art / 'pipe')\n"
        "else:\n"
        "    (art / 'a.txt').write_text('alpha, changed')\n"
        "SUBMIT(answer='done')"
    )
    harness = harness_factory(one_action(code))
    first = await harness.submit("first")
    await harness.work()
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, first)
        assert run is not None and run.status == "completed"
        session_id = run.session_id
    second = await harness.submit("second", session_id=session_id, key="k2")
    await harness.work()

    created = [e for e in await harness.events(first) if isinstance(e, ArtifactCreated)]
    assert [e.name for e in created] == ["a.txt", "sub/b.bin"]
    rows = await artifacts_of(harness, first)
    assert [(r.name, r.byte_size, r.checksum_sha256) for r in rows] == [
        ("a.txt", 5, hashlib.sha256(b"alpha").hexdigest()),
        ("sub/b.bin", 256, hashlib.sha256(bytes(range(256))).hexdigest()),
    ]
    assert rows[0].media_type == "text/plain" and rows[1].media_type == "application/octet-stream"
    blobs = harness.settings.blobs_dir / "artifacts"
    assert (blobs / rows[1].id).read_bytes() == bytes(range(256))
    [changed] = await artifacts_of(harness, second)
    assert changed.name == "a.txt" and (blobs / changed.id).read_bytes() == b"alpha, changed"
    async with harness.db_sessions() as db:
        turns = await queries.list_turns(db, session_id, after_sequence=0, limit=10)
    parts = [p for p in turns[1].parts if p["type"] == "data-artifact"]
    assert [p["data"]["artifact_id"] for p in parts] == [r.id for r in rows]


async def test_artifact_limits_keep_the_turn_and_say_why(harness_factory: HarnessFactory) -> None:
    code = (
        "import pathlib\nart = pathlib.Path('/workspace/artifacts')\n"
        "for i in range(4):\n    (art / f'f{i}.txt').write_text(str(i))\n"
        "(art / 'big.bin').write_bytes(b'x' * (1024 * 1024 + 1))\n"
        "SUBMIT(answer='done')"
    )
    harness = harness_factory(one_action(code), storage={"max_artifacts_per_run": 3, "max_artifact_mb": 1})
    run_id = await harness.submit("go")
    await harness.work()
    events = await harness.events(run_id)
    warnings = {e.code: e.message for e in events if isinstance(e, RunWarning)}
    assert set(warnings) == {"artifacts_truncated", "artifact_too_large"}
    assert "storage.max_artifacts_per_run" in warnings["artifacts_truncated"]
    assert "big.bin" in warnings["artifact_too_large"]
    # Sorted names: big.bin (refused: too large), f0.txt, f1.txt — three considered, two kept.
    assert [r.name for r in await artifacts_of(harness, run_id)] == ["f0.txt", "f1.txt"]
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
    assert run is not None and run.status == "completed"


async def test_attachments_are_staged_read_only_copies(harness_factory: HarnessFactory) -> None:
    """Two attachments with the same name are both staged (the second renamed), the RLM sees
    their descriptions, and a missing blob fails the Turn with a clear code."""
    code = (
        "import os\nnames = sorted(os.listdir('/workspace/attachments'))\n"
        "texts = [open('/workspace/attachments/' + n).read() for n in names]\n"
        "SUBMIT(answer=repr((names, texts, attachments)))"
    )
    harness = harness_factory(one_action(code))
    store = open_blob_store(harness.settings)
    rows = []
    async with harness.db_sessions() as db:
        for body in (b"one", b"two"):
            attachment_id = new_id()
            source = harness.settings.data_dir / "upload.tmp"
            source.parent.mkdir(parents=True, exist_ok=True)
            source.write_bytes(body)
            store.put_file(f"attachments/{attachment_id}", source)
            rows.append(
                await files.add_attachment(
                    db,
                    attachment_id=attachment_id,
                    filename="notes.txt",
                    media_type="text/plain",
                    byte_size=len(body),
                    checksum_sha256=hashlib.sha256(body).hexdigest(),
                    owner=OPERATOR,
                )
            )
    run_id = await harness.submit("read them", attachments=rows)
    await harness.work()
    events = await harness.events(run_id)
    staged = [e for e in events if isinstance(e, AttachmentStaged)]
    assert [(e.attachment_id, e.filename) for e in staged] == [
        (rows[0].id, "notes.txt"),
        (rows[1].id, "notes (2).txt"),
    ]
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None and run.status == "completed", run.failure_message
        turns = await queries.list_turns(db, run.session_id, after_sequence=0, limit=10)
    answer = "".join(p.get("text", "") for p in turns[1].parts if p["type"] == "text")
    names, texts, described = eval(answer)
    assert names == ["notes (2).txt", "notes.txt"] and texts == ["two", "one"]
    assert described == [
        "/workspace/attachments/notes.txt (text/plain, 3 bytes)",
        "/workspace/attachments/notes (2).txt (text/plain, 3 bytes)",
    ]

    (harness.settings.blobs_dir / "attachments" / rows[0].id).unlink()
    again = await harness.submit("read them", attachments=rows[:1], session_id=run.session_id, key="k2")
    await harness.work()
    async with harness.db_sessions() as db:
        failed = await queries.get_run(db, again)
    assert failed is not None and failed.status == "failed"
    assert failed.failure_code == "attachment_unavailable"
    assert str(Path(harness.settings.data_dir)) not in (failed.failure_message or "")
