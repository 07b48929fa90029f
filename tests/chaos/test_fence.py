"""The fence: a stalled worker is swept, and when it wakes nothing it writes reaches anyone."""

from __future__ import annotations

import signal
import time

import pytest

from tests.chaos.cluster import new_session, post_turn, resume, run_of, script_text, wait_for_run
from tests.chaos.conftest import ClusterFactory

pytestmark = pytest.mark.chaos

SCRIPT = script_text(
    {"lm": "root", "reasoning": "look", "code": "print('before the stall')"},
    {"lm": "root", "reasoning": "zombie thoughts", "code": "print('zombie output')", "delay_s": 6},
    {"lm": "root", "reasoning": "done", "code": "SUBMIT(answer='zombie answer')"},
)


def test_a_stalled_worker_is_swept_and_its_late_writes_are_refused(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(SCRIPT)
    gateway = cluster.start_gateway()
    worker = cluster.start_worker()
    stream = post_turn(gateway, new_session(gateway), "stall", "stall-1")
    # The first step is over; the LM "thinks" 6 s about the second one.
    stream.wait_for(lambda f: f.type == "finish-step")
    assert stream.headers is not None
    run_id = stream.headers["x-fleet-run-id"]
    worker.signal(signal.SIGSTOP)  # a stall: alive, holding the Run, renewing nothing
    stalled = time.monotonic()

    error = stream.wait_for(lambda f: f.type == "error", timeout=30)
    stream.finish()
    assert stream.types[-3:] == ["error", "finish", "[DONE]"]
    assert error.chunk is not None and error.chunk["errorText"].startswith("worker_lost: ")
    assert error.at - stalled < 15  # no worker helped: a gateway swept it (goal: 5 s, see bench)
    swept = run_of(gateway, run_id)
    assert (swept["status"], swept["failure_code"], swept["attempt"]) == ("failed", "worker_lost", 2)

    worker.signal(signal.SIGCONT)  # the zombie wakes up, mid-Turn, sure the Run is its own
    redis = cluster.redis_client()
    cluster.wait_until(lambda: redis.exists(f"arq:result:{run_id}"), "the zombie's job never ended")
    # It found itself fenced out: its output, its answer and its ending reached no one.
    assert run_of(gateway, run_id) == swept
    replay = resume(gateway, run_id).finish()
    assert replay.content == stream.content
    assert "zombie" not in "".join(f.data for f in replay.frames)
    log = redis.xrange(f"fleet:run:{{{run_id}}}:events")
    assert b"zombie" not in b"".join(fields[b"e"] for _id, fields in log)
    assert len(log) == int(swept["last_event_seq"])

    # The worker is healthy afterwards and takes the next Turn.
    after = post_turn(gateway, new_session(gateway), "after", "after-1")
    assert wait_for_run(
        gateway,
        after.wait_for(lambda f: f.type == "start").chunk["messageId"],
        lambda r: r["status"] in ("running", "completed"),
    )  # type: ignore[index]
