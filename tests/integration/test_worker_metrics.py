"""The worker's metrics port after a real Turn (real arq worker in burst mode, real Redis, real
bwrap sandbox, the scripted LM): time in queue, the queue's depth rising and falling, the Turn's
outcome and duration, the sandbox lease, and LM calls and tokens by model and role; concurrent
scrapes share one evaluation of the queue's counting script."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from fleet_shared.metrics import QUEUE_COUNTS_MAX_AGE_SECONDS, queue_counts_in
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


def depth_becomes(url: str, queue: str, expected: float) -> Samples:
    """Scrape until the depth is `expected`: a scrape may see a read up to the cache's age."""
    deadline = time.monotonic() + QUEUE_COUNTS_MAX_AGE_SECONDS + 5
    while value(found := scrape(url), "fleet_queue_depth", queue=queue) != expected:
        assert time.monotonic() < deadline, f"the depth never became {expected}"
        time.sleep(0.1)
    return found


@pytest.fixture
def serve_metrics() -> Iterator[Any]:
    """Start the worker's metrics port (as `fleet worker` does) for a harness's settings."""
    with ExitStack() as stack:

        def serve(harness: Harness) -> str:
            settings = harness.settings
            stack.enter_context(
                queue_counts_in(REGISTRY, settings.profile.worker.queue_name, settings.redis_url)
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
    waiting = depth_becomes(url, queue, 1)  # waiting, no worker yet
    assert value(waiting, "fleet_queue_in_progress", queue=queue) == 0
    await harness.work()
    after = depth_becomes(url, queue, 0)  # taken and done
    assert value(after, "fleet_queue_in_progress", queue=queue) == 0

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


def script_runs(redis_url: str) -> int:
    """EVAL and EVALSHA calls the test Redis has served so far (its INFO commandstats)."""
    with Redis.from_url(redis_url) as client:
        stats: dict[str, dict[str, int]] = client.info("commandstats")  # type: ignore[assignment]
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("eval", "evalsha"))


def test_concurrent_scrapes_share_one_evaluation(redis_url: str) -> None:
    scrapes, jobs = 6, 50_000  # fewer scrapes than slots; a long queue, so that they overlap
    queue = "fleet:test:scrapes"
    registry = CollectorRegistry()
    with Redis.from_url(redis_url) as redis, queue_counts_in(registry, queue, redis_url):
        redis.zadd(queue, {f"job-{n}": n for n in range(jobs)})
        server = MetricsServer.start("127.0.0.1", 0, registry, Heartbeat())
        assert server is not None
        try:
            before = script_runs(redis_url)
            together = threading.Barrier(scrapes)

            def scrape_together(url: str) -> Samples:
                together.wait(timeout=10)
                return scrape(url)

            with ThreadPoolExecutor(scrapes) as pool:
                found = list(pool.map(scrape_together, [f"http://127.0.0.1:{server.port}"] * scrapes))
            assert all(value(f, "fleet_queue_depth", queue=queue) == jobs for f in found)
            assert all(("fleet_queue_in_progress", (("queue", queue),)) in f for f in found)
            assert script_runs(redis_url) - before == 1
        finally:
            server.stop()
            redis.delete(queue)
