"""Workspaces end to end, on real `fleet gateway` + `fleet worker` processes and bwrap: durable
memory across a session's Turns (and not across sessions), an uploaded attachment used by the
RLM, and an artifact it wrote, downloaded with its ETag and by byte range."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import REPO, Stack, ai_sdk_parse, start_stack, stop_stack, work_dir
from tests.e2e.sse import post_turn
from tests.support.api import new_session

pytestmark = pytest.mark.e2e
CSV = b"name,colour\nada,blue\nbob,green\n"


@pytest.fixture(scope="module")
def workspace_stack() -> Iterator[Stack]:
    script = REPO / "tests" / "e2e" / "scripts" / "workspace.jsonl"
    stack = start_stack(work_dir("workspace"), {"FLEET_SCRIPTED_LM": str(script)})
    yield stack
    stop_stack(stack)


def upload(client: httpx.Client, name: str, data: bytes, media_type: str) -> dict[str, object]:
    response = client.post(
        "/api/attachments",
        files={"attachment": (name, data, media_type)},
        headers={"x-requested-with": "e2e"},
    )
    assert response.status_code == 201, response.text
    return dict(response.json())


def answer_of(stream: object) -> str:
    deltas = [c["delta"] for c in stream.of_type("text-delta")]  # type: ignore[attr-defined]
    return "".join(deltas)


def test_memory_attachments_and_artifacts_through_real_turns(
    workspace_stack: Stack, node_check: Path
) -> None:
    with workspace_stack.client() as client:
        attachment = upload(client, "data.csv", CSV, "text/csv")
        assert attachment["byte_size"] == len(CSV)
        assert attachment["checksum_sha256"] == hashlib.sha256(CSV).hexdigest()
        assert attachment["media_type"] == "text/csv" and attachment["filename"] == "data.csv"
        assert client.get(f"/api/attachments/{attachment['id']}").json() == attachment

        first = new_session(client)
        stream = post_turn(client, first, "remember blue", "k-1", attachment_ids=[attachment["id"]])
        assert stream.status == 200
        assert answer_of(stream) == "saved: attachments=['data.csv'] rows=3 described=1"
        staged = stream.of_type("data-attachment")
        assert [p["data"] for p in staged] == [
            {"attachment_id": attachment["id"], "filename": "data.csv", "byte_size": len(CSV)}
        ]
        [announced] = stream.of_type("data-artifact")
        types = stream.types
        assert types.index("data-artifact") < types.index("finish")
        artifact = announced["data"]
        assert artifact["name"] == "reports/summary.txt" and artifact["media_type"] == "text/plain"
        for alias in ("ai6", "ai7"):  # the SDK keeps both data parts in the message it rebuilds
            parts = ai_sdk_parse(node_check, alias, stream.raw)["message"]["parts"]
            kinds = [p["type"] for p in parts]
            assert "data-attachment" in kinds and "data-artifact" in kinds

        meta = client.get(f"/api/artifacts/{artifact['artifact_id']}")
        assert meta.status_code == 200 and meta.json()["checksum_sha256"] == artifact["checksum_sha256"]
        content = client.get(f"/api/artifacts/{artifact['artifact_id']}/content")
        assert content.status_code == 200
        body = content.content
        assert hashlib.sha256(body).hexdigest() == artifact["checksum_sha256"]
        assert content.headers["etag"] == f'"{artifact["checksum_sha256"]}"'
        assert content.headers["content-length"] == str(len(body)) == str(artifact["byte_size"])
        assert content.headers["x-content-type-options"] == "nosniff"
        assert 'filename="summary.txt"' in content.headers["content-disposition"]
        part = client.get(
            f"/api/artifacts/{artifact['artifact_id']}/content", headers={"Range": "bytes=5-19"}
        )
        assert part.status_code == 206 and part.content == body[5:20]
        assert part.headers["content-range"] == f"bytes 5-19/{len(body)}"
        cached = client.get(
            f"/api/artifacts/{artifact['artifact_id']}/content",
            headers={"If-None-Match": content.headers["etag"]},
        )
        assert cached.status_code == 304 and cached.content == b""

        again = post_turn(client, first, "recall", "k-2")
        assert answer_of(again) == "blue"
        other = new_session(client)
        assert answer_of(post_turn(client, other, "recall", "k-3")) == "nothing remembered"

        note = client.get("/api/files/content", params={"session_id": first, "path": "memory/note.txt"})
        assert note.status_code == 200 and note.json()["content"] == "blue"
        foreign = client.get("/api/files/content", params={"session_id": other, "path": "memory/note.txt"})
        assert foreign.status_code == 404
        escape = client.get("/api/files", params={"session_id": other, "path": f"../{first}"})
        assert escape.status_code == 404

        history = client.get(f"/api/sessions/{first}/turns").json()["items"]
        user, assistant = history[0], history[1]
        assert {"type": "data-attachment", "data": staged[0]["data"]} in user["parts"]
        assert any(p["type"] == "data-artifact" for p in assistant["parts"])


def test_an_unknown_attachment_is_refused_before_the_stream_opens(workspace_stack: Stack) -> None:
    with workspace_stack.client() as client:
        session = new_session(client)
        unknown = str(uuid.uuid4())
        stream = post_turn(client, session, "remember red", "k-unknown", attachment_ids=[unknown])
        assert stream.status == 422
        assert unknown in stream.raw.decode()
        # Nothing was claimed: the same key works once the body is right.
        assert post_turn(client, session, "remember red", "k-unknown").status == 200
