"""Traces from a real deployment's processes: a gateway and a worker, each in its own working
directory, export over OTLP/HTTP to a receiver on loopback, configured by the standard `OTEL_*`
variables alone. One Turn is one trace of fleet's own, linked to the caller's `traceparent` (a
caller is not trusted to pick the trace or its sampling): the gateway's submit, claim and
enqueue; the worker's run, its phases, iterations, cells, sub-LM queries and LM calls with
tokens; and the feedback, attached to it. No span carries the user's text."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import stop, wait_ready, work_dir
from tests.e2e.sse import parse_frames
from tests.e2e.test_metrics_ports import eventually
from tests.e2e.test_pods_share_nothing import pod_env, spawn
from tests.support.otlp import OtlpReceiver, ReceivedSpan
from tests.support.servers import RedisServer, free_port

pytestmark = pytest.mark.e2e
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
REQUEST = "a private question 7f3a9c"  # must appear in no span


@dataclass
class Traced:
    url: str
    receiver: OtlpReceiver
    folders: dict[str, Path]


@pytest.fixture(scope="module")
def traced(postgres_url: str) -> Iterator[Traced]:
    redis, receiver = RedisServer().start(), OtlpReceiver().start()
    folders = {name: work_dir(f"traced-{name}") for name in ("gateway", "worker")}
    env = pod_env(
        redis.url(db=0),
        postgres_url,
        "traced.jsonl",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_BSP_SCHEDULE_DELAY="50",  # ms: the test waits on spans, not on the batch timer
    )
    port = free_port()
    processes = [
        spawn(folders["gateway"], env, "gateway", "--port", str(port)),
        spawn(folders["worker"], env, "worker", "--metrics-port", "0"),
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, processes)
        yield Traced(url, receiver, folders)
    finally:
        stop(processes)
        receiver.stop()
        redis.stop()
        for folder in folders.values():
            subprocess.run(["rm", "-rf", str(folder)], check=False)


def one(spans: list[ReceivedSpan]) -> ReceivedSpan:
    assert len(spans) == 1, spans
    return spans[0]


def test_a_turn_is_one_trace_across_the_gateway_and_the_worker(traced: Traced) -> None:
    receiver = traced.receiver
    with httpx.Client(base_url=traced.url, timeout=60) as client:
        session = client.post("/api/sessions", json={"title": "traced"}).json()["id"]
        headers = {"Idempotency-Key": "t1", "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
        with client.stream(
            "POST", f"/api/sessions/{session}/turns", json={"text": REQUEST}, headers=headers
        ) as response:
            raw = response.read()
        chunks = [json.loads(data) for _event, data in parse_frames(raw) if data.startswith("{")]
        assert chunks[-1].get("finishReason") == "stop", chunks[-3:]
        run_id = response.headers["x-fleet-run-id"]
        eventually(lambda: bool(receiver.named("turn.run")), 30)
        rating = client.post(
            f"/api/sessions/{session}/traces/feedback",
            json={"run_id": run_id, "rating": "up", "comment": "helpful"},
        )
    assert rating.status_code == 201 and rating.json()["forwarded"] is True, rating.text
    eventually(lambda: bool(receiver.named("turn.feedback")), 30)

    submit = one(receiver.named("turn.submit"))
    trace_id = submit.trace_id
    assert (submit.service, submit.parent_id) == ("fleet-gateway", "") and trace_id != CALLER_TRACE
    assert submit.links == [(CALLER_TRACE, CALLER_SPAN)]
    assert submit.attributes["fleet.run_id"] == run_id
    for name in ("turn.claim", "turn.enqueue"):
        assert one(receiver.named(name)).parent_id == submit.span_id

    run = one(receiver.named("turn.run"))
    assert (run.service, run.trace_id, run.parent_id) == ("fleet-worker", trace_id, submit.span_id)
    assert run.attributes["fleet.run_id"] == run_id and run.attributes["fleet.attempt"] == 1
    assert run.attributes["fleet.status"] == "completed" and not run.failed
    for name in ("turn.prepare", "turn.settle"):
        assert one(receiver.named(name)).parent_id == run.span_id

    iterations = sorted(receiver.named("rlm.iteration"), key=lambda s: s.attributes["fleet.iteration"])
    assert [s.attributes["fleet.iteration"] for s in iterations] == [1, 2]
    assert all(s.parent_id == run.span_id for s in iterations)
    cells = receiver.named("sandbox.cell")
    assert {c.parent_id for c in cells} <= {s.span_id for s in iterations} and len(cells) == 2
    query = one(receiver.named("rlm.lm_query"))
    assert query.attributes["fleet.tool"] == "llm_query" and query.parent_id == iterations[0].span_id

    calls = receiver.named("lm.call")
    roles = sorted(c.attributes["fleet.lm_role"] for c in calls)
    assert roles == ["root", "root", "sub"], roles
    sub_call = next(c for c in calls if c.attributes["fleet.lm_role"] == "sub")
    assert sub_call.parent_id == query.span_id  # under the query that made it
    for call in calls:
        assert call.attributes["gen_ai.request.model"].startswith("scripted/")
        assert call.attributes["gen_ai.usage.input_tokens"] > 0
        assert call.attributes["gen_ai.usage.output_tokens"] > 0

    feedback = one(receiver.named("turn.feedback"))
    assert (feedback.trace_id, feedback.parent_id) == (trace_id, submit.span_id)
    assert feedback.events == [("feedback", {"fleet.rating": "up"})]  # no comment: content is off

    every = receiver.spans
    assert {s.trace_id for s in every} == {trace_id}
    assert not [s.name for s in every if REQUEST in json.dumps(s.attributes | dict(s.events))]
    assert not [s.name for s in every if "fleet.code" in s.attributes or "fleet.prompt" in s.attributes]

    claimed = [
        json.loads(line)
        for line in (traced.folders["worker"] / "fleet.log").read_text().splitlines()
        if line.startswith("{") and '"turn.claimed"' in line
    ]
    assert [(entry["trace_id"], entry["span_id"]) for entry in claimed] == [(trace_id, run.span_id)]
