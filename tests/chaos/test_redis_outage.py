"""Redis goes away (killed, restarted empty on the same port): running Turns carry on, queued
ones are queued again, a POST is refused cleanly, and streams ride it out."""

from __future__ import annotations

import signal
import time

import pytest

from tests.chaos.cluster import new_session, post_turn, run_of, script_text, wait_for_run
from tests.chaos.conftest import ClusterFactory
from tests.support.servers import RedisServer

pytestmark = pytest.mark.chaos

SCRIPT = script_text(
    {"lm": "root", "reasoning": "look", "code": "print('a')"},
    {"lm": "root", "reasoning": "think", "code": "print('b')", "delay_s": 3},
    {"lm": "root", "reasoning": "done", "code": "SUBMIT(answer='survived')"},
)


def test_a_brief_redis_restart_loses_no_turn(
    cluster_factory: ClusterFactory, chaos_redis: RedisServer
) -> None:
    cluster = cluster_factory(SCRIPT)
    gateway = cluster.start_gateway()
    cluster.start_worker(concurrency=2)
    streams = [post_turn(gateway, new_session(gateway), "go", f"k-{i}") for i in range(3)]
    run_ids = []
    for stream in streams:
        stream.wait_for(lambda f: f.type == "start")
        assert stream.headers is not None
        run_ids.append(stream.headers["x-fleet-run-id"])
    # Two run and one waits in the queue. Which one waits is not known: the three POSTs stream
    # from threads of their own, so their jobs reach the queue in any order.
    deadline = time.monotonic() + 60
    while sorted((statuses := {r: run_of(gateway, r)["status"] for r in run_ids}).values()) != [
        "queued",
        "running",
        "running",
    ]:
        assert time.monotonic() < deadline, statuses
        time.sleep(0.05)
    waiting = next(run_id for run_id, status in statuses.items() if status == "queued")

    chaos_redis.kill()  # everything in it is gone: leases, logs, the queue with the waiting job
    time.sleep(1)
    chaos_redis.start()
    restarted = time.monotonic()

    for stream in streams:
        stream.finish(timeout=60)
        assert stream.types[-2:] == ["finish", "[DONE]"], stream.types
        assert "survived" in "".join(f.data for f in stream.frames)
    for run_id in run_ids:
        run = run_of(gateway, run_id)
        assert (run["status"], run["attempt"]) == ("completed", 1), run
    queued_done = run_of(gateway, waiting)["finished_at"]
    assert queued_done is not None
    print({"queued_run_done_after_restart_s": round(time.monotonic() - restarted, 1)})


def test_redis_down_at_post_is_503_and_the_key_works_afterwards(
    cluster_factory: ClusterFactory, chaos_redis: RedisServer
) -> None:
    cluster = cluster_factory(script_text({"lm": "root", "reasoning": "r", "code": "SUBMIT(answer='ok')"}))
    gateway = cluster.start_gateway()
    cluster.start_worker()
    session_id = new_session(gateway)
    chaos_redis.kill()
    try:
        with gateway.client() as client:
            refused = client.post(
                f"/api/sessions/{session_id}/turns", json={"text": "hi"}, headers={"Idempotency-Key": "same"}
            )
            history = client.get(f"/api/sessions/{session_id}/turns").json()["items"]
    finally:
        chaos_redis.start()
    assert (refused.status_code, refused.json()["code"]) == (503, "service_unavailable")
    assert history == []  # nothing committed: no user Turn, no failed Run
    cluster.wait_until(lambda: cluster.redis_client().exists("fleet:queue:health-check"), "no worker")
    again = post_turn(gateway, session_id, "hi", "same").finish()
    assert again.status == 200 and again.types[-2:] == ["finish", "[DONE]"]


def test_a_stream_that_loses_redis_shows_the_committed_ending(
    cluster_factory: ClusterFactory, chaos_redis: RedisServer
) -> None:
    cluster = cluster_factory(SCRIPT)
    gateway = cluster.start_gateway()
    cluster.start_worker()
    stream = post_turn(gateway, new_session(gateway), "go", "lose-1")
    stream.wait_for(lambda f: f.type == "finish-step")
    assert stream.headers is not None
    run_id = stream.headers["x-fleet-run-id"]
    chaos_redis.kill()
    try:
        # The Turn completes while Redis is away (the DB is fine): the worker commits it.
        wait_for_run(gateway, run_id, lambda r: r["status"] == "completed", timeout=30)
    finally:
        chaos_redis.start()
    stream.finish(timeout=60)
    assert stream.types[-2:] == ["finish", "[DONE]"], stream.types
    text = "".join(f.data for f in stream.frames)
    assert "survived" in text and "interrupted" not in text


def test_a_redis_stall_sweeps_no_healthy_run(
    cluster_factory: ClusterFactory, chaos_redis: RedisServer
) -> None:
    """Redis stops answering for 5 s (longer than a lease), then carries on with its data: the
    leases expired meanwhile, but their workers are fine and keep their Runs."""
    script = script_text(
        {"lm": "root", "reasoning": "look", "code": "print('a')"},
        {"lm": "root", "reasoning": "think", "code": "print('b')", "delay_s": 8},
        {"lm": "root", "reasoning": "done", "code": "SUBMIT(answer='kept')"},
    )
    cluster = cluster_factory(script)
    gateway = cluster.start_gateway()
    cluster.start_worker()
    streams = [post_turn(gateway, new_session(gateway), "go", f"stall-{i}") for i in range(3)]
    for stream in streams:
        stream.wait_for(lambda f: f.type == "finish-step")
    assert chaos_redis.proc is not None
    chaos_redis.proc.send_signal(signal.SIGSTOP)
    time.sleep(5)
    chaos_redis.proc.send_signal(signal.SIGCONT)
    for stream in streams:
        stream.finish(timeout=60)
        assert stream.types[-2:] == ["finish", "[DONE]"], stream.types
        assert stream.headers is not None
        run = run_of(gateway, stream.headers["x-fleet-run-id"])
        assert (run["status"], run["attempt"]) == ("completed", 1), run


def test_a_hung_redis_at_post_is_a_quick_503(
    cluster_factory: ClusterFactory, chaos_redis: RedisServer
) -> None:
    cluster = cluster_factory(script_text({"lm": "root", "reasoning": "r", "code": "SUBMIT(answer='ok')"}))
    gateway = cluster.start_gateway()
    cluster.start_worker()
    session_id = new_session(gateway)
    assert chaos_redis.proc is not None
    chaos_redis.proc.send_signal(signal.SIGSTOP)  # up, but answering nothing
    try:
        started = time.monotonic()
        with gateway.client(timeout=30) as client:
            refused = client.post(
                f"/api/sessions/{session_id}/turns", json={"text": "hi"}, headers={"Idempotency-Key": "hung"}
            )
            history = client.get(f"/api/sessions/{session_id}/turns").json()["items"]
        took = time.monotonic() - started
    finally:
        chaos_redis.proc.send_signal(signal.SIGCONT)
    assert (refused.status_code, refused.json()["code"]) == (503, "service_unavailable")
    assert took < 10 and history == []
    again = post_turn(gateway, session_id, "hi", "hung").finish()
    assert again.types[-2:] == ["finish", "[DONE]"]


def test_after_a_long_redis_outage_new_turns_start_at_once(
    cluster_factory: ClusterFactory, chaos_redis: RedisServer
) -> None:
    """Redis is away for 25 s (longer than arq's own retries) while a long Turn runs: once Redis
    is back, a new Turn starts within seconds, not when the long one ends."""
    script = script_text(
        {"lm": "root", "reasoning": "look", "code": "print('a')"},
        {"lm": "root", "reasoning": "think", "code": "print('b')", "delay_s": 60},
        {"lm": "root", "reasoning": "done", "code": "SUBMIT(answer='late')"},
    )
    cluster = cluster_factory(script)
    gateway = cluster.start_gateway()
    worker = cluster.start_worker(concurrency=2)
    long = post_turn(gateway, new_session(gateway), "long", "long-1")
    long.wait_for(lambda f: f.type == "finish-step")
    chaos_redis.kill()
    time.sleep(25)
    chaos_redis.start()
    back = time.monotonic()
    fresh = post_turn(gateway, new_session(gateway), "fresh", "fresh-1")
    fresh.wait_for(lambda f: f.type == "start-step", timeout=60)  # a worker runs it
    started_after = time.monotonic() - back
    assert started_after < 15, started_after
    assert worker.popen.poll() is None  # the same worker process, still serving
    for stream in (long, fresh):
        assert stream.headers is not None
        with gateway.client() as client:
            client.put(f"/api/runs/{stream.headers['x-fleet-run-id']}/cancellation")
        assert stream.finish(timeout=30).types[-2:] == ["abort", "[DONE]"]
