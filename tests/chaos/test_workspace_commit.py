"""A worker SIGKILLed between storing a Turn's workspace objects and the commit that would refer
to them: the Run ends `worker_lost`, the session's next Turn (another worker process) finds the
version before, whole, and `fleet gc` later removes what the killed Turn stored.

The pause between the uploads and the commit is made from outside: the test holds SQLite's write
lock from the moment the Turn's cell has written its files, so the worker stores everything
and then waits in its commit; the test sees the objects appear in the store and kills it there.
"""

from __future__ import annotations

import hashlib
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.chaos.cluster import Cluster, LiveStream, new_session, post_turn, script_text, wait_for_run
from tests.chaos.conftest import ClusterFactory

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

BIG_BYTES = 8 * 2**20
CODE = """
import pathlib
ws = pathlib.Path('/workspace')
if request == 'before':
    (ws / 'memory' / 'note.txt').write_text('before')
    SUBMIT(answer='kept')
elif request == 'after':
    (ws / 'memory' / 'note.txt').write_text('after')
    (ws / 'memory' / 'big.bin').write_bytes(bytes(range(256)) * (BIG_BYTES // 256))
    (ws / 'artifacts' / 'r.txt').write_text('report')
    print('written')
else:
    files = sorted(str(p.relative_to(ws)) for d in ('memory', 'artifacts') for p in (ws / d).rglob('*'))
    SUBMIT(answer='note=' + (ws / 'memory' / 'note.txt').read_text() + ';files=' + ','.join(files))
""".replace("BIG_BYTES", str(BIG_BYTES))
SCRIPT = script_text(
    {"lm": "root", "reasoning": "write", "code": CODE},
    # Only the 'after' Turn gets here: the LM "thinks" while the test takes the database's lock.
    {"lm": "root", "reasoning": "done", "code": "SUBMIT(answer='too late')", "delay_s": 10},
)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def answer_of(stream: LiveStream) -> str:
    return "".join(str(c.get("delta", "")) for c in stream.chunks if c["type"] == "text-delta")


def stored(blobs: Path, prefix: str) -> set[str]:
    folder = blobs / prefix
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


def fleet_gc(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "fleet_cli", "gc", *args]
    return subprocess.run(
        command, env=cluster.env, cwd=cluster.work, capture_output=True, text=True, check=False, timeout=120
    )


def test_sigkill_between_the_uploads_and_the_commit(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(SCRIPT, sqlite=True)
    blobs = cluster.work / ".fleet" / "blobs"
    gateway = cluster.start_gateway()
    first = cluster.start_worker()
    session = new_session(gateway)
    kept = post_turn(gateway, session, "before", "k1").finish()
    assert kept.types[-2:] == ["finish", "[DONE]"] and answer_of(kept) == "kept"
    before = stored(blobs, "workspaces")
    assert sha(b"before") in before
    artifacts_before = stored(blobs, "artifacts")

    killed = post_turn(gateway, session, "after", "k2")
    killed.wait_for(lambda f: f.type == "tool-output-available" and "written" in f.data)
    database = sqlite3.connect(cluster.work / "fleet.db", isolation_level=None, timeout=30)
    database.execute("BEGIN IMMEDIATE")  # no commit lands until the worker is dead
    try:
        strays = {sha(b"after"), sha(bytes(range(256)) * (BIG_BYTES // 256)), sha(b"report")}
        assert not strays & stored(blobs, "workspaces")  # taken before the settlement's uploads
        cluster.wait_until(
            lambda: strays <= stored(blobs, "workspaces") and stored(blobs, "artifacts") - artifacts_before,
            "the Turn never stored its workspace",
            first,
        )
        first.kill()  # SIGKILL: after its uploads, before (or waiting in) its commit
    finally:
        database.rollback()
        database.close()
    assert killed.headers is not None
    run = wait_for_run(gateway, killed.headers["x-fleet-run-id"], lambda r: r["status"] == "failed")
    assert run["failure_code"] == "worker_lost"
    stray_artifacts = stored(blobs, "artifacts") - artifacts_before
    assert len(stray_artifacts) == 1

    second = cluster.start_worker()  # another process: no record of the folder the killed one left
    looked = post_turn(gateway, session, "look", "k3").finish()
    assert answer_of(looked) == "note=before;files=memory/note.txt"  # the last version, whole

    gc = fleet_gc(cluster, "--grace-seconds", "0")
    assert gc.returncode == 0, gc.stderr
    strays_bytes = len(b"after") + BIG_BYTES + len(b"report")
    assert f"removed 0 manifest(s), 3 workspace object(s) ({strays_bytes} bytes)" in gc.stdout, gc.stdout
    assert stored(blobs, "workspaces") == before  # what the committed versions refer to stays
    # The artifact the killed Turn announced was recorded by the sweep that ended its Run (from
    # the Run's event log): a row refers to it, so it stays.
    assert "0 artifact(s)" in gc.stdout and stored(blobs, "artifacts") - artifacts_before == stray_artifacts
    with sqlite3.connect(cluster.work / "fleet.db") as database:
        rows = database.execute("SELECT id, run_id FROM artifacts").fetchall()
    assert rows == [(*stray_artifacts, run["id"])]

    # A worker process that never saw the folder replaces every file from the store: what gc
    # left is all it takes.
    second.stop()
    cluster.start_worker()
    again = post_turn(gateway, session, "look", "k4").finish()
    assert answer_of(again) == "note=before;files=memory/note.txt"
