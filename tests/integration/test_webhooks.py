"""Webhooks on real parts: a Turn run by a real worker (the scripted LM), its delivery row written
in the transaction that ended it, sent by the delivery loop over real sockets to a loopback
receiver, signed as Standard Webhooks says; retries, the deliveries route, refused targets (at
the POST and, for a name that resolves to a refused address, at the connection), and a delete
that leaves no delivery row. SQLite and PostgreSQL, Redis, the gateway in-process."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy import func, select
from standardwebhooks import Webhook

from fleet_gateway.app import create_app
from fleet_shared.config import Secret, Settings
from fleet_shared.config_file import WebhooksSection
from fleet_shared.db.models import WebhookAttempt, WebhookDelivery
from fleet_shared.webhook_delivery import Deliverer
from fleet_shared.webhook_targets import IPAddress
from tests.integration.harness import Harness
from tests.support.webhook_receiver import Receiver, serve_receiver

HarnessFactory = Callable[..., Harness]
SECRET = "whsec_" + base64.b64encode(os.urandom(32)).decode()
LINE = {"lm": "root", "reasoning": "answer", "code": "SUBMIT(answer='the answer is 42')"}
ASYNC = {"Prefer": "respond-async"}
LOOPBACK_ONLY = WebhooksSection(allow_http=True, allowed_networks=["127.0.0.1/32"], first_retry_seconds=0.05)


def with_webhooks(settings: Settings, section: WebhooksSection = LOOPBACK_ONLY) -> Settings:
    profile = msgspec.structs.replace(settings.profile, webhooks=section)
    return msgspec.structs.replace(settings, profile=profile, webhook_secret=Secret(SECRET))


@pytest.fixture
async def stack(harness_factory: HarnessFactory) -> AsyncIterator[tuple[Harness, Any]]:
    harness = harness_factory(LINE)
    harness.settings = with_webhooks(harness.settings)
    async with AsyncTestClient(create_app(harness.settings)) as client:
        yield harness, client


def deliverer(harness: Harness, resolve: Any = None) -> Deliverer:
    settings = harness.settings
    assert settings.webhook_secret is not None
    extra = {"resolve": resolve} if resolve else {}
    return Deliverer(harness.db_sessions, settings.profile.webhooks, settings.webhook_secret, "test", **extra)


async def run_turn(harness: Harness, client: Any, url: str, key: str = "k1") -> tuple[str, str]:
    session = (await client.post("/api/sessions", json={})).json()["id"]
    accepted = await client.post(
        f"/api/sessions/{session}/turns",
        json={"text": "what is it?", "webhook": {"url": url}},
        headers={"Idempotency-Key": key, **ASYNC},
    )
    assert accepted.status_code == 202, accepted.text
    await harness.work()
    return session, accepted.json()["run_id"]


async def deliver_until_settled(
    sender: Deliverer, client: Any, run_id: str, passes: int = 200
) -> dict[str, Any]:
    page: list[dict[str, Any]] = []
    for _ in range(200):
        await sender.deliver_due()
        page = (await client.get(f"/api/runs/{run_id}/webhooks")).json()["items"]
        if page and page[0]["status"] != "pending":
            return dict(page[0])
        await asyncio.sleep(0.02)
    raise AssertionError(f"the delivery never settled: {page}")


async def test_a_settled_turn_is_posted_once_signed_and_its_delivery_is_listed(
    stack: tuple[Harness, Any],
) -> None:
    harness, client = stack
    with serve_receiver(Receiver()) as receiver:
        session, run_id = await run_turn(harness, client, receiver.url)
        delivery = await deliver_until_settled(deliverer(harness), client, run_id)
        [got] = receiver.wait_for(1)
    payload = Webhook(SECRET).verify(got.body, got.headers)  # raises on a bad signature
    assert payload["run_id"] == run_id and payload["session_id"] == session
    assert payload["status"] == "completed" and payload["answer"] == "the answer is 42"
    assert payload["usage"]["iterations"] == 1 and "failure_code" not in payload
    assert got.headers["webhook-id"] == delivery["id"] and got.headers["content-type"] == "application/json"
    assert delivery["status"] == "delivered" and delivery["url"] == receiver.url
    assert [(a["number"], a["status_code"], a["error"]) for a in delivery["attempts"]] == [(1, 200, None)]
    with pytest.raises(Exception, match="signature"):
        Webhook("whsec_" + base64.b64encode(os.urandom(32)).decode()).verify(got.body, got.headers)


async def test_a_receiver_that_fails_three_times_gets_four_attempts_of_one_delivery(
    stack: tuple[Harness, Any],
) -> None:
    harness, client = stack
    with serve_receiver(Receiver(statuses=[500, 503, 429])) as receiver:
        _session, run_id = await run_turn(harness, client, receiver.url)
        delivery = await deliver_until_settled(deliverer(harness), client, run_id)
        got = receiver.wait_for(4)
    assert delivery["status"] == "delivered"
    assert [a["status_code"] for a in delivery["attempts"]] == [500, 503, 429, 200]
    assert {r.headers["webhook-id"] for r in got} == {delivery["id"]}  # one delivery, the same id
    assert len({r.body for r in got}) == 1
    async with harness.db_sessions() as db:
        assert (
            await db.scalar(
                select(func.count()).select_from(WebhookDelivery).where(WebhookDelivery.run_id == run_id)
            )
            == 1
        )


async def test_a_receiver_that_answers_gone_is_not_tried_again(stack: tuple[Harness, Any]) -> None:
    harness, client = stack
    with serve_receiver(Receiver(statuses=[410])) as receiver:
        _session, run_id = await run_turn(harness, client, receiver.url)
        delivery = await deliver_until_settled(deliverer(harness), client, run_id)
    assert delivery["status"] == "failed" and [a["status_code"] for a in delivery["attempts"]] == [410]


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://10.0.0.7/hook", "not a public address"),
        ("http://169.254.169.254/latest/meta-data", "not a public address"),
        ("http://[::1]:8080/hook", "not a public address"),
        ("http://[::ffff:127.0.0.1]/hook", "not a public address"),
        ("http://localhost.localdomain:9/hook", None),  # loopback, which this deployment allows
        ("http://0.0.0.0/hook", "not a public address"),
        ("ftp://198.51.100.1/hook", "must be https or http"),
        ("http://user:pw@127.0.0.1/hook", "credentials"),
        ("file:///etc/passwd", "must be https or http"),
    ],
)
async def test_targets_the_policy_refuses_are_422_and_leave_nothing(
    stack: tuple[Harness, Any], url: str, why: str | None
) -> None:
    _harness, client = stack
    session = (await client.post("/api/sessions", json={})).json()["id"]
    answer = await client.post(
        f"/api/sessions/{session}/turns",
        json={"text": "x", "webhook": {"url": url}},
        headers={"Idempotency-Key": "k", **ASYNC},
    )
    if why is None:
        assert answer.status_code == 202, answer.text
        return
    assert answer.status_code == 422 and answer.json()["code"] == "invalid_webhook", answer.text
    assert why in answer.json()["message"]
    patched = await client.patch(f"/api/sessions/{session}", json={"webhook": {"url": url}})
    assert patched.status_code == 422 and patched.json()["code"] == "invalid_webhook"
    assert (await client.get(f"/api/sessions/{session}/turns")).json()["items"] == []  # the key unused


async def test_a_name_that_resolves_to_a_refused_address_at_delivery_is_never_connected(
    stack: tuple[Harness, Any],
) -> None:
    """DNS rebinding: the name passed the POST's check; at delivery it resolves to a private
    address, which the connection refuses (the delivery fails for good, and nothing is sent)."""
    harness, client = stack
    calls: list[str] = []

    async def rebinding(host: str, port: int) -> list[IPAddress]:
        calls.append(host)
        return [ipaddress.ip_address("127.0.0.1" if host == "hooks.allowed.test" else "10.1.2.3")]

    with serve_receiver(Receiver()) as receiver:
        port = receiver.url.split(":")[2].split("/")[0]
        _session, run_id = await run_turn(harness, client, f"http://rebound.test:{port}/hooks/fleet")
        delivery = await deliver_until_settled(deliverer(harness, rebinding), client, run_id)
        assert receiver.received == []
        # The same resolver's allowed name connects, by the address it resolved to (a real socket).
        _session, other = await run_turn(
            harness, client, f"http://hooks.allowed.test:{port}/hooks/fleet", "k2"
        )
        allowed = await deliver_until_settled(deliverer(harness, rebinding), client, other)
        assert len(receiver.wait_for(1)) == 1
    assert delivery["status"] == "failed"
    [attempt] = delivery["attempts"]
    # The tenant learns it was refused, not which address the name had: that is the operator's log.
    assert attempt["status_code"] is None and attempt["error"].startswith("refused:")
    assert "10.1.2.3" not in attempt["error"]
    assert allowed["status"] == "delivered" and calls == ["rebound.test", "hooks.allowed.test"]


async def test_the_session_default_webhook_and_a_delete_that_leaves_no_delivery_row(
    stack: tuple[Harness, Any],
) -> None:
    harness, client = stack
    with serve_receiver(Receiver()) as receiver:
        session = (await client.post("/api/sessions", json={})).json()["id"]
        patched = await client.patch(f"/api/sessions/{session}", json={"webhook": {"url": receiver.url}})
        assert patched.status_code == 200 and patched.json()["webhook_url"] == receiver.url
        accepted = await client.post(
            f"/api/sessions/{session}/turns", json={"text": "hi"}, headers={"Idempotency-Key": "k", **ASYNC}
        )
        await harness.work()
        run_id = accepted.json()["run_id"]
        delivery = await deliver_until_settled(deliverer(harness), client, run_id)
        assert json.loads(receiver.wait_for(1)[0].body)["run_id"] == run_id
    assert delivery["status"] == "delivered"
    cleared = await client.patch(f"/api/sessions/{session}", json={"webhook": None})
    assert cleared.json()["webhook_url"] is None
    assert (await client.delete(f"/api/sessions/{session}")).status_code == 204
    async with harness.db_sessions() as db:
        of_session = WebhookDelivery.session_id == session
        assert await db.scalar(select(func.count()).select_from(WebhookDelivery).where(of_session)) == 0
        attempts = (
            select(func.count())
            .select_from(WebhookAttempt)
            .where(WebhookAttempt.delivery_id == delivery["id"])
        )
        assert await db.scalar(attempts) == 0


async def test_without_a_secret_a_webhook_is_refused(harness_factory: HarnessFactory) -> None:
    harness = harness_factory(LINE)
    async with AsyncTestClient(create_app(harness.settings)) as client:
        session = (await client.post("/api/sessions", json={})).json()["id"]
        answer = await client.post(
            f"/api/sessions/{session}/turns",
            json={"text": "x", "webhook": {"url": "https://hooks.example.test/x"}},
            headers={"Idempotency-Key": "k", **ASYNC},
        )
    assert answer.status_code == 422 and "FLEET_WEBHOOK_SECRET" in answer.json()["message"]


async def test_an_attempt_that_breaks_unexpectedly_fails_its_delivery_and_the_loop_goes_on(
    stack: tuple[Harness, Any],
) -> None:
    harness, client = stack

    async def broken(host: str, port: int) -> list[IPAddress]:
        if host == "breaks.test":
            raise RuntimeError("a resolver bug")
        return [ipaddress.ip_address("127.0.0.1")]

    with serve_receiver(Receiver()) as receiver:
        port = receiver.url.split(":")[2].split("/")[0]
        _session, broke = await run_turn(harness, client, f"http://breaks.test:{port}/x", "k1")
        _session, fine = await run_turn(harness, client, f"http://fine.test:{port}/x", "k2")
        sender = deliverer(harness, broken)
        failed = await deliver_until_settled(sender, client, broke)
        delivered = await deliver_until_settled(sender, client, fine)
    assert (
        failed["status"] == "failed" and failed["attempts"][0]["error"] == "the attempt failed inside fleet"
    )
    assert delivered["status"] == "delivered"
