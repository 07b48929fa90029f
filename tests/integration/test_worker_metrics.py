"""The worker's metrics port after a real Turn (real arq worker in burst mode, real Redis, real
bwrap sandbox, the scripted LM): time in queue, the queue's depth rising and falling, the Turn's
outcome and duration, the sandbox lease, and LM calls and tokens by model and role."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from fleet_shared.metrics import queue_depth_in
from fleet_worker.metrics_http import Heartbeat, MetricsServer
from tests.integration.harness import Harness

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

ROOT_ASK = {"lm": "root", "reasoning": "ask", "code": "x = llm_query('say hi')\nprint(x)"}
SUB_ANSWER = {"lm": "sub", "text": "hi from the sub-LM"}
ROOT_SUBMIT = {"lm": "root", "reasoning": "done", "code": "SUBMIT(answer=x)"}


def scrape(url: str) -> Samples:
    response = httpx.get(f"{url}/metrics", timeout=5)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def serve_metrics() -> Iterator[Any]:
    """Start the worker's metrics port (as `fleet worker` does) for a harness's settings."""
    with ExitStack() as stack:

        def serve(harness: Harness) -> str:
            settings = harness.settings
            stack.enter_context(
                queue_depth_in(REGISTRY, settings.profile.worker.queue_name, settings.redis_url)
            )
            server = MetricsServer.start("127.0.0.1", 0, REGISTRY, Heartbeat())
            assert server is not None
            stack.callback(server.stop)
            return f"http://127.0.0.1:{server.port}"

        yield serve


async def test_a_turn_shows_on_the_worker_metrics_port(harness_factory: Any, serve_metrics: Any) -> None:
    harness: Harness = harness_factory(ROOT_ASK, SUB_ANSWER, ROOT_SUBMIT)
    url = serve_metrics(harness)
    queue = harness.settings.profile.worker.queue_name
    root_model, sub_model = harness.settings.root_lm.name, harness.settings.sub_lm.name
    before = scrape(url)
    assert value(before, "fleet_queue_depth", queue=queue) == 0

    await harness.submit()
    assert value(scrape(url), "fleet_queue_depth", queue=queue) == 1  # waiting, no worker yet
    await harness.work()
    after = scrape(url)
    assert value(after, "fleet_queue_depth", queue=queue) == 0  # taken and done

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("fleet_turns_total", outcome="completed") == 1
    assert delta("fleet_turn_duration_seconds_count", outcome="completed") == 1
    assert delta("fleet_turn_duration_seconds_sum", outcome="completed") > 0
    assert delta("fleet_queue_wait_seconds_count") == 1
    assert delta("fleet_sandbox_lease_wait_seconds_count", provider="local") == 1
    assert delta("fleet_sandbox_lease_seconds_count", provider="local") == 1
    assert delta("fleet_lm_calls_total", model=root_model, role="root") == 2
    assert delta("fleet_lm_calls_total", model=sub_model, role="sub") == 1
    for role, model in (("root", root_model), ("sub", sub_model)):
        for kind in ("prompt", "completion"):
            assert delta("fleet_lm_tokens_total", model=model, role=role, kind=kind) > 0, (role, kind)
    grown = {key for key in after if key[0].startswith("fleet_lm_") and delta(key[0], **dict(key[1]))}
    assert {dict(labels)["model"] for _name, labels in grown} <= {root_model, sub_model}  # config names


async def test_a_failed_turn_is_counted_by_its_outcome(harness_factory: Any, serve_metrics: Any) -> None:
    harness: Harness = harness_factory({"lm": "root", "reasoning": "r", "code": "print(1)"})  # no SUBMIT
    url = serve_metrics(harness)
    before = scrape(url)
    await harness.submit()
    await harness.work()
    after = scrape(url)
    completed = ("fleet_turns_total", (("outcome", "completed"),))
    assert after.get(completed, 0) == before.get(completed, 0)
    ended = {key: count for key, count in after.items() if key[0] == "fleet_turns_total"}
    grown = [key for key, count in ended.items() if count > before.get(key, 0)]
    assert len(grown) == 1 and dict(grown[0][1])["outcome"] in ("failed", "timed_out"), grown
