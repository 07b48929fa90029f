"""Exact resume on any gateway: a client cut off inside an event gets exactly the rest."""

from __future__ import annotations

import uuid

import pytest

from tests.chaos.cluster import Frame, new_session, post_turn, resume, script_text, wait_for_run
from tests.chaos.conftest import ClusterFactory

pytestmark = pytest.mark.chaos

SCRIPT = script_text(
    {"lm": "root", "reasoning": "first look", "code": "print('one')", "delay_s": 0.2},
    {"lm": "root", "reasoning": "second look", "code": "print('two')", "delay_s": 1.5},
    {"lm": "root", "reasoning": "third look", "code": "print('three')", "delay_s": 60},
    {"lm": "root", "reasoning": "done", "code": "SUBMIT(answer='resumed')"},
)


def second_reasoning_delta(seen: list[Frame]):  # type: ignore[no-untyped-def]
    def stop(frame: Frame) -> bool:
        seen.append(frame)
        return sum(f.type == "reasoning-delta" for f in seen) == 2

    return stop


def test_sigkill_the_gateway_mid_event_then_resume_on_another(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(SCRIPT)
    first = cluster.start_gateway()
    cluster.start_worker()
    seen: list[Frame] = []
    cut = post_turn(first, new_session(first), "resume me", "r-1", stop_when=second_reasoning_delta(seen))
    cut.finish()
    first.process.kill()  # the gateway dies with the client cut off inside an event
    last_id = cut.frames[-1].id
    assert last_id is not None and last_id.endswith(".1")  # reasoning-delta: chunk 1 of 3
    assert cut.headers is not None
    run_id = cut.headers["x-fleet-run-id"]

    second = cluster.start_gateway()  # started after the Run began
    assert wait_for_run(second, run_id, lambda r: r["status"] == "running")
    resumed = resume(second, run_id, last_id)
    # The log part: the rest of the cut event and the second step; then the Run is live (the
    # third step "thinks" for 60 s), and a cancel ends it while this stream follows it.
    resumed.wait_for(lambda f: f.type == "tool-output-available" and "two" in f.data)
    with second.client() as client:
        assert client.put(f"/api/runs/{run_id}/cancellation").json()["state"] == "requested"
    resumed.finish()
    assert resumed.status == 200 and resumed.types[-2:] == ["abort", "[DONE]"]
    start = resumed.chunks[0]
    assert start["type"] == "start" and start["messageMetadata"]["delivery"] == "resume"
    assert resumed.content[0][0] == last_id.rsplit(".", 1)[0] + ".2"  # the very next chunk

    # What the client has now is exactly the whole stream: nothing lost, nothing repeated.
    reference = resume(second, run_id).finish()
    assert cut.content + resumed.content == reference.content
    ids = [frame_id for frame_id, _ in reference.content]
    positions = [tuple(int(p) for p in i.split(".")) for i in ids]  # type: ignore[union-attr]
    assert positions == sorted(positions) and len(set(ids)) == len(ids)

    # From any frame at all, a resume yields exactly the frames after it.
    for index, (frame_id, _data) in enumerate(reference.content):
        assert frame_id is not None
        rest = resume(second, run_id, frame_id).finish()
        assert rest.content == reference.content[index + 1 :], frame_id
        assert rest.types[-1] == "[DONE]"


def test_resume_answers_unknown_runs_and_bad_ids_plainly(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(script_text({"lm": "root", "reasoning": "r", "code": "SUBMIT(answer='x')"}))
    gateway = cluster.start_gateway()
    cluster.start_worker()
    done = post_turn(gateway, new_session(gateway), "quick", "q-1").finish()
    assert done.headers is not None
    run_id = done.headers["x-fleet-run-id"]
    with gateway.client() as client:
        unknown = client.get(f"/api/runs/{uuid.uuid4()}/stream")
        malformed_run = client.get("/api/runs/nope/stream")
        bad_id = client.get(f"/api/runs/{run_id}/stream", headers={"Last-Event-ID": "banana"})
        past_end = client.get(f"/api/runs/{run_id}/stream", headers={"Last-Event-ID": "9999.0"})
        at_end = client.get(
            f"/api/runs/{run_id}/stream", headers={"Last-Event-ID": done.content[-1][0] or ""}
        )
    assert (unknown.status_code, unknown.content) == (204, b"")
    assert malformed_run.status_code == 204
    assert (bad_id.status_code, bad_id.json()["code"]) == (422, "validation_error")
    assert (past_end.status_code, past_end.json()["code"]) == (422, "validation_error")
    assert at_end.status_code == 200 and at_end.text.endswith("data: [DONE]\n\n")
    assert "finish" not in at_end.text  # the client already had everything


def test_resume_after_redis_lost_the_log_of_an_active_run(cluster_factory: ClusterFactory) -> None:
    script = script_text(
        {"lm": "root", "reasoning": "first", "code": "print('one')"},
        {"lm": "root", "reasoning": "second", "code": "print('two')", "delay_s": 6},
        {"lm": "root", "reasoning": "done", "code": "SUBMIT(answer='refilled')"},
    )
    cluster = cluster_factory(script)
    gateway = cluster.start_gateway()
    cluster.start_worker()
    cut = post_turn(
        gateway, new_session(gateway), "go", "lost-log", stop_when=lambda f: f.type == "finish-step"
    )
    cut.finish()
    assert cut.headers is not None
    run_id, last_id = cut.headers["x-fleet-run-id"], cut.content[-1][0]
    cluster.redis.kill()  # the log, the lease and the queue are gone
    cluster.redis.start()
    resumed = resume(gateway, run_id, last_id).finish(timeout=60)
    assert resumed.status == 200 and resumed.types[-2:] == ["finish", "[DONE]"]
    reference = resume(gateway, run_id).finish()
    assert cut.content + resumed.content == reference.content
