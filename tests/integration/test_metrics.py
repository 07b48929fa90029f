"""GET /metrics: Prometheus text with requests labelled by route template (bounded cardinality)
and the gauge of open Turn streams."""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from litestar.testing import TestClient
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from fleet_gateway.app import create_app
from fleet_gateway.streaming import RunView, StreamDeps, stream_run
from fleet_shared.config import load_settings
from fleet_shared.db import queries
from tests.integration.harness import Harness

REPO = Path(__file__).resolve().parents[2]
REQUESTS = "fleet_gateway_http_requests"
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-")


@pytest.fixture
def client(sqlite_url: str, redis_url: str) -> Iterator[TestClient]:  # type: ignore[type-arg]
    settings = load_settings(
        {
            "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"),
            "FLEET_DATABASE_URL": sqlite_url,
            "FLEET_REDIS_URL": redis_url,
        }
    )
    with TestClient(create_app(settings)) as client:
        yield client


def samples(client: TestClient, name: str) -> dict[tuple[tuple[str, str], ...], float]:  # type: ignore[type-arg]
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    found: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def count(found: dict[tuple[tuple[str, str], ...], float], **labels: str) -> float:
    return found.get(tuple(sorted(labels.items())), 0.0)


def test_requests_are_labelled_by_route_template(client: TestClient) -> None:  # type: ignore[type-arg]
    first = client.post("/api/sessions", json={}).json()["id"]
    second = client.post("/api/sessions", json={}).json()["id"]
    before = samples(client, f"{REQUESTS}_total")
    template = "/api/sessions/{session_id}"
    assert client.get(f"/api/sessions/{first}").status_code == 200
    assert client.get(f"/api/sessions/{second}").status_code == 200
    assert client.get("/api/sessions/00000000-0000-0000-0000-000000000000").status_code == 404
    assert client.get(f"/nowhere/{first}").status_code == 404
    assert client.request("BREW", "/api/sessions").status_code in (400, 405)
    after = samples(client, f"{REQUESTS}_total")

    def delta(**labels: str) -> float:
        return count(after, **labels) - count(before, **labels)

    assert delta(method="GET", route=template, status="200") == 2  # two ids, one label value
    assert delta(method="GET", route=template, status="404") == 1
    assert delta(method="GET", route="unmatched", status="404") == 1
    assert sum(v for k, v in after.items() if ("method", "other") in k) >= 1
    routes = {dict(labels)["route"] for labels in after}
    assert all(route == "unmatched" or not UUID.search(route) for route in routes), routes
    assert "process_cpu_seconds_total" in client.get("/metrics").text  # the default registry too


async def test_the_active_streams_gauge_counts_a_stream_until_it_is_closed(harness_factory: Any) -> None:
    harness: Harness = harness_factory({"lm": "root", "reasoning": "r", "code": "SUBMIT(answer='ok')"})
    run_id = await harness.submit()
    await harness.work()
    async with harness.sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None
        view = RunView.of(run)

    def gauge() -> float:
        value = REGISTRY.get_sample_value("fleet_gateway_active_streams")
        assert value is not None
        return value

    base = gauge()
    deps = StreamDeps(redis=harness.redis, fanout=None, sessions=harness.sessions, heartbeat_seconds=10)  # type: ignore[arg-type]
    cut_off = cast(AsyncGenerator[bytes, None], stream_run(deps, view, delivery="resume", from_db=True))
    await anext(cut_off)  # the start frame: the stream is open
    assert gauge() == base + 1
    await cut_off.aclose()  # the client went away
    assert gauge() == base
    whole = [frame async for frame in stream_run(deps, view, delivery="resume", from_db=True)]
    assert whole[-1].startswith(b"data: [DONE]") and gauge() == base
