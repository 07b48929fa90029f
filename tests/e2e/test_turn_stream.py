"""End to end: real gateway and worker processes, a real bwrap sandbox, Redis and SQLite.

The LM is the deterministic scripted LM (the provider is unreachable here); everything else is real.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import SECRET_SENTINEL, Stack, ai_sdk_parse
from tests.e2e.sse import TurnStream, parse_frames, post_turn

pytestmark = pytest.mark.e2e


def new_session(stack: Stack, title: str = "e2e") -> str:
    with stack.client() as client:
        response = client.post("/api/sessions", json={"title": title})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def assert_well_formed(stream: TurnStream) -> None:
    assert stream.status == 200
    headers = stream.headers
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["cache-control"] == "no-cache"
    assert headers["x-vercel-ai-ui-message-stream"] == "v1"
    assert headers["x-accel-buffering"] == "no"
    assert "content-encoding" not in headers
    assert stream.raw.endswith(b"data: [DONE]\n\n")
    assert [data for _id, data in stream.frames].count("[DONE]") == 1
    assert all(event_id is not None for event_id, data in stream.frames if data != "[DONE]")
    types = stream.types
    start_index = types.index("start")
    assert types.count("start") == 1
    assert all(t == "data-status" for t in types[:start_index])
    assert stream.chunks[start_index]["messageId"] == headers["x-fleet-run-id"]


def test_demo_turn_streams_and_commits(demo_stack: Stack, node_check: Path) -> None:
    session_id = new_session(demo_stack)
    with demo_stack.client() as client:
        stream = post_turn(client, session_id, "Please say hello to the fleet", "turn-1")
        assert client.get(f"/api/sessions/{session_id}").json()["cost_usd"] is None  # nothing priced
    assert_well_formed(stream)
    run_id = stream.headers["x-fleet-run-id"]
    start = stream.of_type("start")[0]
    assert start["messageMetadata"]["model"] == "scripted/demo"
    assert start["messageMetadata"]["delivery"] == "live"
    assert start["messageMetadata"]["runId"] == run_id
    assert start["messageMetadata"]["sessionId"] == session_id

    types = stream.types
    assert types[-1] == "finish" and stream.chunks[-1]["finishReason"] == "stop"
    assert stream.chunks[-1]["messageMetadata"]["idempotentReplay"] is False
    assert types.count("start-step") == types.count("finish-step") == 3
    assert "reasoning-delta" in types
    cells = [c for c in stream.of_type("tool-input-available") if c["toolName"] == "python"]
    assert len(cells) == 3 and all(c["providerExecuted"] and c["dynamic"] for c in cells)
    outputs = {c["toolCallId"]: c for c in stream.of_type("tool-output-available")}
    assert outputs[cells[0]["toolCallId"]]["output"]["stdout"].startswith("6 words")
    queries = [c for c in stream.of_type("tool-input-available") if c["toolName"] == "llm_query"]
    assert len(queries) == 1 and "hello to the fleet" in queries[0]["input"]["prompt"]
    assert "offline demo" in outputs[queries[0]["toolCallId"]]["output"]["text"]
    answer = "".join(c["delta"] for c in stream.of_type("text-delta"))
    assert "offline demo" in answer and "6 words" in answer
    usage = stream.of_type("data-usage")[0]["data"]["usage"]
    assert usage["iterations"] == 3 and usage["observed_lm_usage"]["scripted/demo"]["prompt_tokens"] > 0
    # The scripted LM has no price: its cost is unknown (left out), never 0.
    assert "cost_usd" not in usage and "cost_usd" not in usage["observed_lm_usage"]["scripted/demo"]

    for alias in ("ai6", "ai7"):
        report = ai_sdk_parse(node_check, alias, stream.raw)
        message = report["message"]
        assert message["id"] == run_id and message["role"] == "assistant"
        texts = [p["text"] for p in message["parts"] if p["type"] == "text"]
        assert texts == [answer]
        tool_names = [p["toolName"] for p in message["parts"] if p["type"] == "dynamic-tool"]
        assert tool_names.count("python") == 3 and "llm_query" in tool_names

    with demo_stack.client() as client:
        history = client.get(f"/api/sessions/{session_id}/turns").json()
    assert [m["role"] for m in history["items"]] == ["user", "assistant"]
    assistant = history["items"][1]
    assert assistant["id"] == run_id and assistant["metadata"]["runId"] == run_id
    assert [p["text"] for p in assistant["parts"] if p["type"] == "text"] == [answer]
    assert history["next_after_sequence"] is None


def test_idempotent_replay_and_key_mismatch(demo_stack: Stack, node_check: Path) -> None:
    session_id = new_session(demo_stack)
    with demo_stack.client() as client:
        first = post_turn(client, session_id, "count my words", "same-key")
        replay = post_turn(client, session_id, "count my words", "same-key")
        mismatch = client.post(
            f"/api/sessions/{session_id}/turns",
            json={"text": "something else"},
            headers={"Idempotency-Key": "same-key"},
        )
        history = client.get(f"/api/sessions/{session_id}/turns").json()
    assert_well_formed(replay)
    assert replay.headers["x-fleet-run-id"] == first.headers["x-fleet-run-id"]
    # Where the time before the stream went: the claim, and the enqueue only for a new Run.
    assert re.fullmatch(r"claim;dur=\d+\.\d{3}, enqueue;dur=\d+\.\d{3}", first.headers["server-timing"])
    assert re.fullmatch(r"claim;dur=\d+\.\d{3}", replay.headers["server-timing"])
    start = replay.of_type("start")[0]["messageMetadata"]
    assert start["delivery"] == "replay"
    assert replay.chunks[-1]["type"] == "finish"
    assert replay.chunks[-1]["messageMetadata"]["idempotentReplay"] is True
    # The replay carries the same body as the live stream: same answer, same tool calls.
    assert [c for c in replay.chunks if c["type"] == "text-delta"] == first.of_type("text-delta")
    assert replay.of_type("tool-input-available") == first.of_type("tool-input-available")
    assert len(history["items"]) == 2  # nothing was executed twice
    assert mismatch.status_code == 409
    assert mismatch.json() == {
        "code": "idempotency_key_mismatch",
        "message": "this Idempotency-Key was already used with a different request body",
    }
    assert mismatch.headers["x-request-id"]
    for alias in ("ai6", "ai7"):
        ai_sdk_parse(node_check, alias, replay.raw)


def test_second_turn_sees_history_and_both_turns_are_listed(demo_stack: Stack) -> None:
    session_id = new_session(demo_stack)
    with demo_stack.client() as client:
        one = post_turn(client, session_id, "first question", "k-1")
        two = post_turn(client, session_id, "second question here", "k-2")
        page = client.get(f"/api/sessions/{session_id}/turns", params={"limit": 2}).json()
        rest = client.get(
            f"/api/sessions/{session_id}/turns", params={"after_sequence": page["next_after_sequence"]}
        ).json()
    assert one.chunks[-1]["finishReason"] == "stop" and two.chunks[-1]["finishReason"] == "stop"
    assert one.headers["x-fleet-run-id"] != two.headers["x-fleet-run-id"]
    assert [m["role"] for m in page["items"]] == ["user", "assistant"]
    assert page["next_after_sequence"] == 2
    assert [m["role"] for m in rest["items"]] == ["user", "assistant"]
    assert rest["items"][0]["parts"] == [{"type": "text", "text": "second question here"}]
    assert rest["items"][1]["metadata"]["runId"] == two.headers["x-fleet-run-id"]


def post_oversize(client: httpx.Client, path: str) -> httpx.Response:
    """2 MB against a 1 MiB limit. The server answers 413 without reading the body; on loopback
    the client may see the socket reset before it reads that answer, so it tries again."""
    body = b'{"text": "' + b"x" * 2_000_000 + b'"}'
    for _ in range(4):
        try:
            return client.post(
                path, content=body, headers={"Idempotency-Key": "k", "content-type": "application/json"}
            )
        except httpx.RemoteProtocolError:
            continue
    raise AssertionError("the oversize request never got an answer")


def test_errors_use_the_envelope(demo_stack: Stack) -> None:
    session_id = new_session(demo_stack)
    unknown = str(uuid.uuid4())
    with demo_stack.client() as client:
        cases = {
            "unknown session": client.post(
                f"/api/sessions/{unknown}/turns", json={"text": "x"}, headers={"Idempotency-Key": "k"}
            ),
            "malformed id": client.get("/api/sessions/not-a-uuid"),
            "malformed json": client.post(
                f"/api/sessions/{session_id}/turns",
                content=b'{"text": ',
                headers={"Idempotency-Key": "k", "content-type": "application/json"},
            ),
            "unknown field": client.post(
                f"/api/sessions/{session_id}/turns",
                json={"text": "x", "temperature": 2},
                headers={"Idempotency-Key": "k"},
            ),
            "missing key": client.post(f"/api/sessions/{session_id}/turns", json={"text": "x"}),
            "oversize": post_oversize(client, f"/api/sessions/{session_id}/turns"),
        }
        history = client.get(f"/api/sessions/{session_id}/turns").json()
    expected = {
        "unknown session": (404, "not_found"),
        "malformed id": (404, "not_found"),
        "malformed json": (422, "validation_error"),
        "unknown field": (422, "validation_error"),
        "missing key": (422, "validation_error"),
        "oversize": (413, "payload_too_large"),
    }
    for name, response in cases.items():
        body = response.json()
        assert (response.status_code, body["code"]) == expected[name], (name, body)
        assert set(body) == {"code", "message"} and body["message"]
        assert response.headers["x-request-id"]
    assert history["items"] == []  # bad input lost nothing and wrote nothing


def test_sandbox_cannot_reach_services_or_host_files(probe_stack: Stack) -> None:
    session_id = new_session(probe_stack)
    with probe_stack.client() as client:
        stream = post_turn(client, session_id, "probe", "probe-1")
    assert stream.chunks[-1]["finishReason"] == "stop", stream.chunks[-3:]
    probe = json.loads("".join(c["delta"] for c in stream.of_type("text-delta")))
    assert probe["6379"] == "blocked" and probe["5432"] == "blocked"
    assert probe["cwd"] == "/workspace"
    assert "work" not in probe["root"] and "root" not in probe["root"]  # no repo, no home
    assert probe["workspace"] == ["artifacts", "attachments", "memory", "skills"]  # not .fleet/
    assert probe["env_secret"] == "absent"
    assert SECRET_SENTINEL.encode() not in stream.raw
    # The host really is reachable from outside the sandbox, so "blocked" means isolation.
    import socket

    for port in (6379, 5432):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_turn_in_progress_is_refused(probe_stack: Stack) -> None:
    session_id = new_session(probe_stack)
    with (
        probe_stack.client() as client,
        client.stream(
            "POST",
            f"/api/sessions/{session_id}/turns",
            json={"text": "slow"},
            headers={"Idempotency-Key": "slow-1"},
        ) as first,
    ):
        assert first.status_code == 200
        busy = client.post(
            f"/api/sessions/{session_id}/turns", json={"text": "again"}, headers={"Idempotency-Key": "slow-2"}
        )
        # The same key and body while the Run is active: attach to its live stream from the start.
        attached = post_turn(client, session_id, "slow", "slow-1")
        body = first.read()
    assert busy.status_code == 409 and busy.json()["code"] == "turn_in_progress"
    assert body.endswith(b"data: [DONE]\n\n")
    assert attached.headers["x-fleet-run-id"] == first.headers["x-fleet-run-id"]
    start = attached.of_type("start")[0]["messageMetadata"]
    assert start["delivery"] == "live"
    assert attached.chunks[-1]["finishReason"] == "stop"
    assert attached.chunks[-1]["messageMetadata"]["idempotentReplay"] is True
    original = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]
    strip = {"data-status"}  # heartbeats depend on timing; everything else is the same Run's stream
    assert [c for c in attached.chunks if c["type"] not in strip][1:-1] == [
        c for c in original if c["type"] not in strip
    ][1:-1]


def test_failed_turn_ends_with_error_and_both_sdks_accept_it(probe_stack: Stack, node_check: Path) -> None:
    session_id = new_session(probe_stack)
    with probe_stack.client() as client:
        stream = post_turn(client, session_id, "fail", "fail-1")
        history = client.get(f"/api/sessions/{session_id}/turns").json()
        after = post_turn(client, session_id, "probe", "after-fail")  # the session is unlocked
    assert_well_formed(stream)
    assert stream.types[-2:] == ["error", "finish"]
    assert stream.chunks[-1] == {"type": "finish", "finishReason": "error"}
    assert stream.chunks[-2]["errorText"].startswith("script_exhausted: ")
    for alias in ("ai6", "ai7"):
        ai_sdk_parse(node_check, alias, stream.raw)
    assistant = history["items"][-1]
    assert assistant["role"] == "assistant" and assistant["metadata"]["status"] == "failed"
    assert assistant["metadata"]["failureCode"] == "script_exhausted"
    assert after.chunks[-1]["finishReason"] == "stop"


def test_logs_carry_ids_and_no_secrets(demo_stack: Stack) -> None:
    session_id = new_session(demo_stack)
    with demo_stack.client() as client:
        stream = post_turn(client, session_id, "log me", "log-1")
    run_id = stream.headers["x-fleet-run-id"]

    def read_logs() -> dict[str, str]:
        return {
            name: (demo_stack.data_dir / "logs" / f"{name}.log").read_text() for name in ("gateway", "worker")
        }

    deadline = time.monotonic() + 10  # the worker logs its last line just after the stream ends
    while '"turn.settled"' not in read_logs()["worker"].split(run_id, 1)[-1] and time.monotonic() < deadline:
        time.sleep(0.1)
    logs = read_logs()
    for text in logs.values():
        assert SECRET_SENTINEL not in text
    gateway_lines = [json.loads(line) for line in logs["gateway"].splitlines() if line.startswith("{")]
    claimed = [
        line for line in gateway_lines if line.get("event") == "turn.claimed" and line.get("run_id") == run_id
    ]
    assert claimed and claimed[0]["session_id"] == session_id and claimed[0]["request_id"]
    worker_lines = [json.loads(line) for line in logs["worker"].splitlines() if line.startswith("{")]
    settled = [
        line for line in worker_lines if line.get("event") == "turn.settled" and line.get("run_id") == run_id
    ]
    assert settled and settled[0]["status"] == "completed"


def test_parallel_retries_with_one_key_share_one_run(demo_stack: Stack) -> None:
    from concurrent.futures import ThreadPoolExecutor

    session_id = new_session(demo_stack)

    def attempt(_: int) -> TurnStream:
        with demo_stack.client() as client:
            return post_turn(client, session_id, "same request", "retry-key")

    with ThreadPoolExecutor(8) as pool:
        streams = list(pool.map(attempt, range(8)))
    assert [s.status for s in streams] == [200] * 8, [s.raw[:200] for s in streams]
    assert len({s.headers["x-fleet-run-id"] for s in streams}) == 1
    assert all(s.chunks[-1]["finishReason"] == "stop" for s in streams)
    with demo_stack.client() as client:
        history = client.get(f"/api/sessions/{session_id}/turns").json()["items"]
    assert len(history) == 2  # executed once


def test_a_turn_on_postgresql(postgres_stack: Stack, node_check: Path) -> None:
    session_id = new_session(postgres_stack)
    with postgres_stack.client() as client:
        stream = post_turn(client, session_id, "Please say hello to the fleet", "pg-1")
        replay = post_turn(client, session_id, "Please say hello to the fleet", "pg-1")
        history = client.get(f"/api/sessions/{session_id}/turns").json()["items"]
    assert_well_formed(stream)
    assert stream.chunks[-1]["finishReason"] == "stop"
    assert replay.of_type("start")[0]["messageMetadata"]["delivery"] == "replay"
    assert [m["role"] for m in history] == ["user", "assistant"]
    for alias in ("ai6", "ai7"):
        ai_sdk_parse(node_check, alias, stream.raw)


def test_a_background_turn_answers_202_and_its_stream_is_read_later(demo_stack: Stack) -> None:
    """`Prefer: respond-async`: 202 with the Run's id and `Location`, no stream; the Turn runs all
    the same, and its stream (and the history) are there afterwards. The key replays as 202."""
    session_id = new_session(demo_stack)
    with demo_stack.client() as client:
        headers = {"Idempotency-Key": "bg-1", "Prefer": "wait=5, respond-async"}
        accepted = client.post(
            f"/api/sessions/{session_id}/turns", json={"text": "count my words"}, headers=headers
        )
        assert accepted.status_code == 202, accepted.text
        run_id = accepted.json()["run_id"]
        expected = {
            "run_id": run_id,
            "session_id": session_id,
            "status": "queued",
            "ahead": 0,
            "replayed": False,
        }
        assert accepted.json() == expected
        assert accepted.headers["location"] == f"/api/runs/{run_id}"
        assert accepted.headers["preference-applied"] == "respond-async"
        assert not accepted.headers["content-type"].startswith("text/event-stream")
        with client.stream("GET", accepted.headers["location"] + "/stream") as response:
            frames = response.read().decode()
        assert '"type":"text-delta"' in frames and frames.endswith("data: [DONE]\n\n")
        assert client.get(f"/api/runs/{run_id}").json()["status"] == "completed"
        again = client.post(
            f"/api/sessions/{session_id}/turns", json={"text": "count my words"}, headers=headers
        )
        assert (
            again.status_code == 202 and again.json()["replayed"] is True and again.json()["run_id"] == run_id
        )
        assert len(client.get(f"/api/sessions/{session_id}/turns").json()["items"]) == 2


def test_a_follow_up_that_interrupts_cancels_the_running_turn_mid_cell_then_runs(demo_stack: Stack) -> None:
    """`multitask: interrupt` while the demo's slow Turn sleeps in a cell: the slow Turn's stream
    ends with `abort`, the follow-up streams its own answer, and the history keeps both. The
    default (`reject`) is the 409 it always was."""
    import threading

    session_id = new_session(demo_stack)
    in_cell = threading.Event()
    slow: dict[str, bytes] = {}

    def run_slow() -> None:
        with (
            demo_stack.client() as client,
            client.stream(
                "POST",
                f"/api/sessions/{session_id}/turns",
                json={"text": "Run a slow task"},
                headers={"Idempotency-Key": "slow-1"},
            ) as response,
        ):
            raw = b""
            for piece in response.iter_bytes():
                raw += piece
                if b'"toolCallId":"cell-2"' in raw:  # step 1's cell sleeps 2.5 s
                    in_cell.set()
            slow["raw"] = raw

    reader = threading.Thread(target=run_slow)
    reader.start()
    try:
        assert in_cell.wait(60), "the slow Turn never reached its second cell"
        with demo_stack.client() as client:
            refused = client.post(
                f"/api/sessions/{session_id}/turns",
                json={"text": "hello"},
                headers={"Idempotency-Key": "f-1"},
            )
            assert refused.status_code == 409 and refused.json()["code"] == "turn_in_progress"
            follow_up = post_turn(client, session_id, "hello there", "f-2", multitask="interrupt")
            history = client.get(f"/api/sessions/{session_id}/turns").json()["items"]
    finally:
        reader.join(60)
    assert_well_formed(follow_up)
    assert follow_up.chunks[-1]["type"] == "finish" and follow_up.of_type("text-delta")
    cut = parse_frames(slow["raw"])
    assert json.loads(cut[-2][1])["type"] == "abort"  # then [DONE]
    assert [(t["role"], t["metadata"]["status"]) for t in history] == [
        ("user", "completed"),
        ("assistant", "cancelled"),
        ("user", "completed"),
        ("assistant", "completed"),
    ]
