"""A fork through real Turns on the worker harness: each Turn of the fork or of its parent changes
only its own workspace, and every earlier version of either stays readable. The worker and the
gateway (in-process) each have a data dir of their own and share only the database, Redis and
an S3-compatible store (moto's server on loopback)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from litestar.testing import AsyncTestClient

from fleet_gateway.app import create_app
from fleet_shared.db import queries
from tests.integration.harness import Harness
from tests.integration.test_workspace_versions import answer_of, bucket, on_disk_of_its_own, s3_endpoint

__all__ = ["bucket", "s3_endpoint"]  # fixtures: pytest finds them by these names

HarnessFactory = Callable[..., Harness]
CODE = """
import pathlib
ws = pathlib.Path('/workspace')
note = ws / 'memory' / 'note.txt'
if request == 'write':
    note.write_text('parent v1')
    (ws / 'memory' / 'kept.txt').write_text('kept')
    answer = 'wrote'
elif request.startswith('set '):
    answer = note.read_text()
    note.write_text(request[4:])
    (ws / 'memory' / (request[4:] + '.txt')).write_text(request)
else:
    answer = repr(sorted(str(p.relative_to(ws)) for p in ws.rglob('*') if p.is_file()))
SUBMIT(answer=answer)
"""


async def test_a_fork_and_its_parent_diverge_through_real_turns(
    harness_factory: HarnessFactory, work_dir: Path, bucket: Any
) -> None:
    _client, bucket_name = bucket
    base = harness_factory({"lm": "root", "reasoning": "work", "code": CODE})
    worker = on_disk_of_its_own(base, work_dir / "worker", bucket_name)
    gateway = on_disk_of_its_own(base, work_dir / "gateway", bucket_name).settings

    wrote = await worker.submit("write")
    await worker.work()
    assert await answer_of(worker, wrote) == "wrote"
    async with worker.db_sessions() as db:
        run = await queries.get_run(db, wrote)
        assert run is not None
        parent = run.session_id

    async with AsyncTestClient(create_app(gateway)) as client:

        async def note(session_id: str, **chosen: Any) -> str:
            params = {"session_id": session_id, "path": "memory/note.txt", **chosen}
            response = await client.get("/api/files/content", params=params)
            assert response.status_code == 200, response.text
            return str(response.json()["content"])

        async def names(session_id: str) -> list[str]:
            listing = await client.get("/api/files", params={"session_id": session_id, "path": "memory"})
            return [item["name"] for item in listing.json()["items"]]

        forked = await client.post(f"/api/sessions/{parent}/fork", json={"title": "fork"})
        assert forked.status_code == 201, forked.text
        fork = forked.json()["id"]
        assert await note(fork) == "parent v1" and await names(fork) == ["kept.txt", "note.txt"]
        parent_turns = (await client.get(f"/api/sessions/{parent}/turns")).json()["items"]
        fork_turns = (await client.get(f"/api/sessions/{fork}/turns")).json()["items"]
        assert [t["parts"] for t in fork_turns] == [t["parts"] for t in parent_turns]

        in_fork = await worker.submit("set child", session_id=fork, key="f1")
        await worker.work()
        assert await answer_of(worker, in_fork) == "parent v1"  # the fork's Turn found the parent's file
        assert await note(fork) == "child" and await names(fork) == ["child.txt", "kept.txt", "note.txt"]
        assert await note(parent) == "parent v1" and await names(parent) == ["kept.txt", "note.txt"]

        in_parent = await worker.submit("set parent v2", session_id=parent, key="p2")
        await worker.work()
        assert await answer_of(worker, in_parent) == "parent v1"  # the fork's Turn changed nothing here
        assert await note(parent) == "parent v2" and "child.txt" not in await names(parent)
        assert await note(fork) == "child" and "parent v2.txt" not in await names(fork)

        assert await note(parent, version=1) == "parent v1"  # the parent's older version
        assert await note(parent, run_id=wrote) == "parent v1"
        assert await note(fork, run_id=wrote) == "parent v1" and await note(fork, version=2) == "child"
        looked = await worker.submit("look", session_id=fork, key="f2")
        await worker.work()
        assert await answer_of(worker, looked) == repr(
            ["memory/child.txt", "memory/kept.txt", "memory/note.txt"]
        )
        parent_versions = (await client.get(f"/api/sessions/{parent}/workspace/versions")).json()["items"]
        fork_versions = (await client.get(f"/api/sessions/{fork}/workspace/versions")).json()["items"]
        assert [(v["version"], v["run_id"]) for v in parent_versions] == [(2, in_parent), (1, wrote)]
        assert [(v["version"], v["run_id"]) for v in fork_versions] == [(3, looked), (2, in_fork), (1, wrote)]
