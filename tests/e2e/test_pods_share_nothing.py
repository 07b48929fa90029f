"""The deployment's shape on one machine: one gateway and two workers, each started as a user
starts them in a working directory of its own (its own `.fleet/`), sharing only Redis,
PostgreSQL and an S3-compatible store (moto's server, a process on loopback). A session's
attachment, artifact and workspace files travel between them through the store alone: a Turn
on one worker, the next on the other after the first is stopped, an older version read after a
newer one changed it, and a fork that goes its own way."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import REPO, fleet, stop, wait_ready, work_dir
from tests.e2e.sse import TurnStream, post_turn
from tests.support.s3 import S3Server
from tests.support.servers import RedisServer, free_port
from tests.support.session_rows import rows_naming

pytestmark = pytest.mark.e2e
CSV = b"name,colour\nada,blue\nbob,green\n"


@dataclass
class Pods:
    url: str
    gateway: subprocess.Popen[bytes]
    workers: dict[str, subprocess.Popen[bytes]]
    folders: dict[str, Path]
    store: S3Server
    env: dict[str, str]

    def worker_that_ran(self, run_id: str) -> str:
        """Which worker's log names the Run (its claim is logged with the run id)."""
        ran = [name for name in self.workers if run_id in (self.folders[name] / "fleet.log").read_text()]
        assert len(ran) == 1, ran
        return ran[0]


def pod_env(redis_url: str, database_url: str, script: str, **extra: str) -> dict[str, str]:
    """A pod's environment: the repository's config, offline profile, the shared Redis and
    database, and a scripted LM from tests/e2e/scripts."""
    return {
        **os.environ,
        "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"),
        "FLEET_PROFILE": "offline",
        "FLEET_REDIS_URL": redis_url,
        "FLEET_DATABASE_URL": database_url,
        "FLEET_SCRIPTED_LM": str(REPO / "tests" / "e2e" / "scripts" / script),
        **extra,
    }


def spawn(folder: Path, env: dict[str, str], *argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        fleet(*argv),
        env=env,
        cwd=folder,
        stdout=open(folder / "fleet.log", "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.fixture(scope="module")
def pods(postgres_url: str) -> Iterator[Pods]:
    redis, store = RedisServer().start(), S3Server("fleet-pods").start()
    folders = {name: work_dir(f"pod-{name}") for name in ("gateway", "a", "b")}
    env = pod_env(redis.url(db=0), postgres_url, "pods.jsonl", **store.env())
    port = free_port()
    gateway = spawn(folders["gateway"], env, "gateway", "--port", str(port))
    workers = {name: spawn(folders[name], env, "worker", "--metrics-port", "0") for name in ("a", "b")}
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, [gateway, *workers.values()])
        yield Pods(url, gateway, workers, folders, store, env)
    finally:
        stop([gateway, *workers.values()])
        store.stop()
        redis.stop()
        for folder in folders.values():
            subprocess.run(["rm", "-rf", str(folder)], check=False)


def turn(client: httpx.Client, session_id: str, text: str, key: str, **body: object) -> tuple[str, str]:
    """A Turn's run id and answer (it must complete)."""
    stream: TurnStream = post_turn(client, session_id, text, key, **body)
    finish = stream.chunks[-1]
    assert finish.get("finishReason") == "stop", stream.chunks[-3:]
    answer = "".join(c["delta"] for c in stream.of_type("text-delta"))
    return stream.headers["x-fleet-run-id"], answer


def note(client: httpx.Client, session_id: str, **version: object) -> httpx.Response:
    params = {"session_id": session_id, "path": "memory/note.txt", **version}
    return client.get("/api/files/content", params=params)


def test_a_session_travels_between_pods_through_the_store_alone(pods: Pods) -> None:
    with httpx.Client(base_url=pods.url, timeout=60) as client:
        upload = client.post(
            "/api/attachments",
            files={"attachment": ("data.csv", CSV, "text/csv")},
            headers={"x-requested-with": "e2e"},
        )
        assert upload.status_code == 201, upload.text
        session = client.post("/api/sessions", json={"title": "pods"}).json()["id"]

        # 1-2: a Turn reads the attachment, writes memory/note.txt and artifacts/r.txt.
        learned_run, answer = turn(client, session, "learn", "k1", attachment_ids=[upload.json()["id"]])
        assert answer == "learned"

        # 3: the artifact, through the gateway, from the store.
        turns = client.get(f"/api/sessions/{session}/turns").json()["items"]
        [artifact] = [p["data"] for p in turns[-1]["parts"] if p["type"] == "data-artifact"]
        content = client.get(f"/api/artifacts/{artifact['artifact_id']}/content")
        assert content.status_code == 200 and content.content == b"report: ada,blue"
        sha = hashlib.sha256(content.content).hexdigest()
        assert content.headers["etag"] == f'"{sha}"' == f'"{artifact["checksum_sha256"]}"'

        # 4: the workspace, through the files API, from the store.
        assert note(client, session).json()["content"] == "rows=2"

        # 5-6: the worker that ran it stops; the next Turn runs on the other and finds the note.
        ran = pods.worker_that_ran(learned_run)
        stop([pods.workers[ran]])
        recall_run, recalled = turn(client, session, "recall first", "k2")
        assert recalled == "rows=2"
        assert pods.worker_that_ran(recall_run) != ran
        assert note(client, session).json()["content"] == "rows=2;recalled first"

        # 7: version 1, read after version 2 changed it.
        assert note(client, session, version=1).json()["content"] == "rows=2"
        assert note(client, session, run_id=learned_run).json()["content"] == "rows=2"

        # 8: a fork starts from the parent's history and files, then each goes its own way.
        fork = client.post(f"/api/sessions/{session}/fork", json={"title": "fork"})
        assert fork.status_code == 201, fork.text
        forked = fork.json()["id"]
        assert note(client, forked).json()["content"] == "rows=2;recalled first"
        assert len(client.get(f"/api/sessions/{forked}/turns").json()["items"]) == len(
            client.get(f"/api/sessions/{session}/turns").json()["items"]
        )
        turn(client, forked, "recall in the fork", "k3")
        turn(client, session, "recall in the parent", "k4")
        assert note(client, forked).json()["content"] == "rows=2;recalled first;recalled in the fork"
        assert note(client, session).json()["content"] == "rows=2;recalled first;recalled in the parent"

    # Nothing durable stayed on a pod's own disk: the gateway's folder never saw a workspace.
    assert not (pods.folders["gateway"] / ".fleet" / "workspaces").exists()
    assert any(key.startswith("fleet/workspaces/") for key in pods.store.keys("fleet/"))


def test_a_deleted_session_leaves_no_row_or_object_behind(pods: Pods, postgres_url: str) -> None:
    """DELETE on the gateway pod: the session's rows and its artifact go at once; `fleet gc` (run
    as an operator runs it, from a folder of its own) then removes its own attachment's bytes and
    the workspace contents only it held."""
    with httpx.Client(base_url=pods.url, timeout=60) as client:
        upload = client.post(
            "/api/attachments",
            files={"attachment": ("data.csv", CSV, "text/csv")},
            headers={"x-requested-with": "e2e"},
        )
        attachment = upload.json()["id"]
        created = client.post("/api/sessions", json={"title": "to delete"}).json()
        session, workspace = created["id"], created["workspace_id"]
        learned, _ = turn(client, session, "learn", "d1", attachment_ids=[attachment])
        recalled, answer = turn(client, session, "recall only here", "d2")
        assert answer == "rows=2"
        feedback = client.post(
            f"/api/sessions/{session}/traces/feedback", json={"run_id": recalled, "rating": "up"}
        )
        assert feedback.status_code == 201, feedback.text
        turns = client.get(f"/api/sessions/{session}/turns").json()["items"]
        [artifact] = [
            p["data"]["artifact_id"] for t in turns for p in t["parts"] if p["type"] == "data-artifact"
        ]
        only_here = hashlib.sha256(b"rows=2;recalled only here").hexdigest()
        held = {
            f"fleet/artifacts/{artifact}",
            f"fleet/attachments/{attachment}",
            f"fleet/workspaces/{only_here}",
        }
        assert held <= set(pods.store.keys("fleet/"))

        before = rows_naming(postgres_url, session, workspace, [learned, recalled])
        assert all(before.values()) and before["turns"] == 4 and before["runs"] == 2, before
        deleted = client.delete(f"/api/sessions/{session}")
        assert deleted.status_code == 204, deleted.text
        for route in (f"/api/sessions/{session}", f"/api/sessions/{session}/turns", f"/api/runs/{learned}"):
            assert client.get(route).status_code == 404, route
        assert client.get(f"/api/artifacts/{artifact}/content").status_code == 404
        assert client.get("/api/files", params={"session_id": session}).status_code == 404

    counts = rows_naming(postgres_url, session, workspace, [learned, recalled])
    assert counts == dict.fromkeys(counts, 0), counts
    left = set(pods.store.keys("fleet/"))
    assert f"fleet/artifacts/{artifact}" not in left
    # The attachment's bytes and the content-addressed workspace files are the gc's to remove.
    assert {f"fleet/attachments/{attachment}", f"fleet/workspaces/{only_here}"} <= left

    folder = work_dir("pod-gc")
    gc = subprocess.run(
        fleet("gc", "--grace-seconds", "0"),
        check=False,
        env=pods.env,
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert gc.returncode == 0, gc.stdout + gc.stderr
    left = set(pods.store.keys("fleet/"))
    assert not {f"fleet/attachments/{attachment}", f"fleet/workspaces/{only_here}"} & left, gc.stdout
    subprocess.run(["rm", "-rf", str(folder)], check=False)
