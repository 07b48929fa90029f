"""The fleet-tui contract suite: the rules a terminal client checks, over every kind of stream.

Real `fleet gateway` and `fleet worker` processes on a private Redis and SQLite, the scripted LM
(tests/e2e/scripts/contract.jsonl) and a 1 s heartbeat, so slow Turns carry `data-status` frames.
Each stream (live, idempotent replay, resume from a middle frame, cancelled, failed) goes through
the one checker in contract.py and through the AI SDK's own parsers (ai@6 and ai@7).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import REPO, Stack, ai_sdk_parse, start_stack, stop_stack, work_dir
from tests.e2e.contract import check_error, check_history, check_stream, is_control
from tests.e2e.sse import TurnStream, parse_frames, post_turn
from tests.support.api import new_session
from tests.support.policy import private_policy

pytestmark = pytest.mark.e2e

SCRIPT = REPO / "tests" / "e2e" / "scripts" / "contract.jsonl"
SKILL = "csv-analysis"
SDKS = ("ai6", "ai7")


@pytest.fixture(scope="module")
def contract_stack() -> Iterator[Stack]:
    data_dir = work_dir("contract")
    env = {**private_policy(data_dir, heartbeat_seconds=1), "FLEET_SCRIPTED_LM": str(SCRIPT)}
    stack = start_stack(data_dir, env)
    yield stack
    stop_stack(stack)


@dataclass
class Completed:
    """A Turn that ran to the end, with an attachment and a skill, and what it was sent with."""

    session_id: str
    body: dict[str, Any]
    key: str
    stream: TurnStream

    @property
    def run_id(self) -> str:
        return self.stream.headers["x-fleet-run-id"]


@pytest.fixture(scope="module")
def completed(contract_stack: Stack) -> Completed:
    with contract_stack.client() as client:
        session_id = new_session(client)
        upload = client.post(
            "/api/attachments",
            files={"attachment": ("rows.csv", b"a,b\n1,2\n", "text/csv")},
            headers={"x-requested-with": "fleet-tui"},  # as our client sends it
        )
        assert upload.status_code == 201, upload.text
        body = {"attachment_ids": [upload.json()["id"]], "skill_selections": [{"id": SKILL}]}
        stream = post_turn(client, session_id, "summarize the rows", "contract-live", **body)
    return Completed(session_id, {"text": "summarize the rows", **body}, "contract-live", stream)


def content_frames(stream: TurnStream) -> list[tuple[str, dict[str, Any]]]:
    """The Run's content (ids `s.k` and their chunks): what every stream of one Run shares."""
    return [
        (frame_id, json.loads(data))
        for frame_id, data in stream.frames
        if frame_id is not None and not is_control(frame_id)
    ]


def sdk_accepts(node_check: Path, stream: TurnStream) -> list[dict[str, Any]]:
    return [ai_sdk_parse(node_check, alias, stream.raw)["message"] for alias in SDKS]


def history(client: httpx.Client, session_id: str) -> list[dict[str, Any]]:
    response = client.get(f"/api/sessions/{session_id}/turns")
    assert response.status_code == 200, response.text
    items: list[dict[str, Any]] = response.json()["items"]
    check_history(items)
    return items


def resume(client: httpx.Client, run_id: str, last_event_id: str) -> TurnStream:
    with client.stream(
        "GET", f"/api/runs/{run_id}/stream", headers={"Last-Event-ID": last_event_id}
    ) as response:
        raw = response.read()
    return TurnStream(response.status_code, response.headers, raw, parse_frames(raw))


def test_live_stream_keeps_the_contract(
    contract_stack: Stack, completed: Completed, node_check: Path
) -> None:
    stream = completed.stream
    check_stream(stream.frames, stream.headers, delivery="live", status=stream.status)
    assert stream.chunks[-1]["finishReason"] == "stop", stream.chunks[-3:]
    types = set(stream.types)
    # The stream exercised every data part the contract names keys for.
    assert {"data-attachment", "data-skill", "data-artifact", "data-usage"} <= types, types
    assert {"tool-input-available", "tool-output-available", "reasoning-delta", "text-delta"} <= types
    for message in sdk_accepts(node_check, stream):
        assert message["id"] == completed.run_id

    with contract_stack.client() as client:
        items = history(client, completed.session_id)
    assert [m["role"] for m in items] == ["user", "assistant"]
    user, assistant = items
    assert {p["type"] for p in user["parts"]} == {"text", "data-attachment", "data-skill"}
    assert assistant["metadata"]["runId"] == completed.run_id
    assert assistant["metadata"]["status"] == "completed"
    assert {"data-artifact", "data-attachment", "data-skill", "dynamic-tool", "step-start"} <= {
        p["type"] for p in assistant["parts"]
    }


def test_idempotent_replay_keeps_the_contract(
    contract_stack: Stack, completed: Completed, node_check: Path
) -> None:
    body = dict(completed.body)
    text = body.pop("text")
    with contract_stack.client() as client:
        replay = post_turn(client, completed.session_id, text, completed.key, **body)
        items = history(client, completed.session_id)
    check_stream(replay.frames, replay.headers, delivery="replay", status=replay.status)
    assert replay.headers["x-fleet-run-id"] == completed.run_id
    live, again = content_frames(completed.stream), content_frames(replay)
    # The same Run's content, frame for frame; only `finish` says that this was a replay.
    assert again[:-1] == live[:-1]
    assert again[-1][1]["messageMetadata"]["idempotentReplay"] is True
    assert live[-1][1]["messageMetadata"]["idempotentReplay"] is False
    sdk_accepts(node_check, replay)
    assert len(items) == 2  # nothing ran twice


def test_resume_from_a_middle_frame_gets_exactly_the_rest(
    contract_stack: Stack, completed: Completed, node_check: Path
) -> None:
    live = content_frames(completed.stream)
    # A frame between steps (every part closed), so the rest is a stream the SDK can read alone...
    between_steps = next(i for i, (_id, chunk) in enumerate(live) if chunk["type"] == "finish-step")
    # ...and one inside an event (a reasoning part cut after its delta).
    inside_event = next(i for i, (_id, chunk) in enumerate(live) if chunk["type"] == "reasoning-delta")
    assert 0 < between_steps < len(live) - 1 and 0 < inside_event < len(live) - 1
    with contract_stack.client() as client:
        resumed = {i: resume(client, completed.run_id, live[i][0]) for i in (between_steps, inside_event)}
    for index, stream in resumed.items():
        check_stream(stream.frames, stream.headers, delivery="resume", status=stream.status)
        assert content_frames(stream) == live[index + 1 :], f"resume after {live[index][0]}"
        start_id = stream.frames[0][0]
        assert start_id == f"{live[index][0]}.1", start_id  # the start is a control frame after it
    sdk_accepts(node_check, resumed[between_steps])


def read_until_cells(pieces: Iterator[bytes], cells: int) -> bytes:
    """Read the open stream until `cells` python cells have returned; the bytes so far."""
    raw = b""
    for piece in pieces:
        raw += piece
        complete = raw[: raw.rfind(b"\n\n") + 2] if b"\n\n" in raw else b""
        chunks = [json.loads(d) for _id, d in parse_frames(complete) if d != "[DONE]"]
        if sum(c["type"] == "tool-output-available" for c in chunks) >= cells:
            return raw
    raise AssertionError(f"the stream ended before {cells} cells returned: {raw[-500:]!r}")


def test_cancelled_stream_keeps_the_contract(contract_stack: Stack, node_check: Path) -> None:
    with contract_stack.client() as client, contract_stack.client() as other:
        session_id = new_session(client)
        with client.stream(
            "POST",
            f"/api/sessions/{session_id}/turns",
            json={"text": "cancel"},
            headers={"Idempotency-Key": "contract-cancel"},
        ) as response:
            assert response.status_code == 200
            run_id = response.headers["x-fleet-run-id"]
            pieces = response.iter_bytes()
            # Both cells ran: the Run now waits on the script's slow last line (delay_s).
            raw = read_until_cells(pieces, cells=2)
            # A second client resumes the active Run from between its two steps...
            seen = parse_frames(raw[: raw.rfind(b"\n\n") + 2])
            step_end = next(i for i, (_id, d) in enumerate(seen) if '"finish-step"' in d)
            with ThreadPoolExecutor(1) as pool:
                resumed = pool.submit(resume, other, run_id, str(seen[step_end][0]))
                time.sleep(0.5)  # ...and is following it live when the cancel lands
                cancelled = other.put(f"/api/runs/{run_id}/cancellation")
                raw += b"".join(pieces)
                follower = resumed.result(timeout=60)
        headers = response.headers
        items = history(client, session_id)
    assert cancelled.status_code == 200 and cancelled.json() == {"run_id": run_id, "state": "requested"}
    stream = TurnStream(200, headers, raw, parse_frames(raw))
    check_stream(stream.frames, headers, delivery="live")
    assert stream.chunks[-1] == {"type": "abort", "reason": "Turn cancelled"}
    sdk_accepts(node_check, stream)
    check_stream(follower.frames, follower.headers, delivery="resume", status=follower.status)
    live = content_frames(stream)
    cut = next(i for i, (frame_id, _c) in enumerate(live) if frame_id == seen[step_end][0])
    assert content_frames(follower) == live[cut + 1 :]
    sdk_accepts(node_check, follower)
    assistant = items[-1]
    assert assistant["role"] == "assistant" and assistant["metadata"]["status"] == "cancelled"
    assert assistant["metadata"]["runId"] == run_id


def test_failed_stream_keeps_the_contract(contract_stack: Stack, node_check: Path) -> None:
    with contract_stack.client() as client:
        session_id = new_session(client)
        stream = post_turn(client, session_id, "fail", "contract-fail")
        items = history(client, session_id)
    check_stream(stream.frames, stream.headers, delivery="live", status=stream.status)
    assert stream.chunks[-1] == {"type": "finish", "finishReason": "error"}
    assert stream.chunks[-2]["errorText"].startswith("script_exhausted: "), stream.chunks[-2]
    # The slow last line was silent for longer than the 1 s heartbeat.
    assert any(c["data"]["status"] == "heartbeat" for c in stream.of_type("data-status")), stream.types
    sdk_accepts(node_check, stream)
    assistant = items[-1]
    assert assistant["role"] == "assistant" and assistant["metadata"]["status"] == "failed"
    assert assistant["id"] == stream.headers["x-fleet-run-id"]
    code, message = assistant["metadata"]["failureCode"], assistant["metadata"]["failureMessage"]
    assert stream.chunks[-2]["errorText"] == f"{code}: {message}"  # what the live stream said


def test_error_bodies_use_the_envelope(contract_stack: Stack, completed: Completed) -> None:
    turns = f"/api/sessions/{completed.session_id}/turns"
    unknown = "00000000-0000-4000-8000-000000000000"
    with contract_stack.client() as client:
        check_error(
            client.post(
                f"/api/sessions/{unknown}/turns", json={"text": "x"}, headers={"Idempotency-Key": "k"}
            ),
            404,
            "not_found",
        )
        check_error(client.post(turns, json={"text": "x"}), 422, "validation_error")  # no key
        check_error(
            client.post(turns, json={"text": "other"}, headers={"Idempotency-Key": completed.key}),
            409,
            "idempotency_key_mismatch",
        )
        check_error(
            client.post(turns, json={"text": "x", "skill_selections": [{"id": "no-such-skill"}]},
                        headers={"Idempotency-Key": "k-skill"}),
            422,
            "invalid_skill_selection",
        )  # fmt: skip
        check_error(
            client.get(f"/api/runs/{completed.run_id}/stream", headers={"Last-Event-ID": "not-an-id"}),
            422,
            "validation_error",
        )
        check_error(client.put(f"/api/runs/{unknown}/cancellation"), 404, "not_found")
        check_error(client.get(f"/api/runs/{unknown}"), 404, "not_found")
        check_error(client.get("/api/no-such-route"), 404, "not_found")
