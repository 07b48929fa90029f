"""`quotas.lm_tokens_per_day` on a real arq worker, real Redis and a real bwrap sandbox: each LM
call's tokens are added to the tenant's count for the UTC day, and once the count reaches the
limit a running Turn stops at its next LM call (the root's, a sub-LM's) with one
`quota_exhausted` warning, failing `quota_exhausted`; the committed history says so."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY
from redis.exceptions import ConnectionError as RedisConnectionError

from fleet_shared.db import queries
from fleet_shared.events import CodeCell, LMQueryStarted, RunCompleted, RunFailed, RunWarning
from fleet_shared.tenancy import Principal
from fleet_shared.tenant_usage import add_lm_tokens, lm_tokens_today, utc_day
from fleet_worker.tenant_tokens import TenantTokens
from tests.integration.harness import Harness

ROOT_PRINT = {"lm": "root", "reasoning": "look", "code": "x = 21 * 2\nprint(x)"}
ROOT_SUBMIT = {"lm": "root", "reasoning": "done", "code": "SUBMIT(answer=str(x))"}
ROOT_ASKS = {"lm": "root", "reasoning": "ask", "code": "x = llm_query('what is 6 * 7?')\nprint(x)"}
SUB = {"lm": "sub", "text": "42"}


def tokens_of(usage: dict[str, Any] | None) -> int:
    assert usage is not None
    models = usage["observed_lm_usage"].values()
    return sum(m["prompt_tokens"] + m["completion_tokens"] for m in models)


def tenant(name: str) -> Principal:
    """A tenant of this test only: the counts live in a Redis that other tests share."""
    return Principal(f"{name}-{uuid.uuid4().hex[:8]}", "u")


def quota(metered: Principal, limit: int) -> dict[str, Any]:
    return {"tenants": {metered.tenant: {"lm_tokens_per_day": limit}}}


async def ending(harness: Harness, run_id: str) -> tuple[Any, list[Any], list[Any]]:
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None
        turns = await queries.list_turns(db, run.session_id, after_sequence=0, limit=10)
    return run, turns, await harness.events(run_id)


async def test_a_turn_stops_at_its_next_root_call_once_the_tenant_is_out_of_tokens(harness_factory) -> None:  # type: ignore[no-untyped-def]
    metered = tenant("metered")
    harness: Harness = harness_factory(ROOT_PRINT, ROOT_SUBMIT, quotas=quota(metered, 1))
    run_id = await harness.submit(caller=metered)
    await harness.work()
    run, turns, logged = await ending(harness, run_id)
    assert (run.status, run.failure_code) == ("failed", "quota_exhausted")
    assert "quotas.lm_tokens_per_day" in (run.failure_message or "")
    warnings = [e for e in logged if isinstance(e, RunWarning)]
    assert [w.code for w in warnings] == ["quota_exhausted"]
    assert isinstance(logged[-1], RunFailed) and logged[-1].code == "quota_exhausted"
    assert len([e for e in logged if isinstance(e, CodeCell)]) == 1  # the second action's call never ran
    # The count is the Run's own usage: the first call's tokens, nothing of the refused one.
    assert await lm_tokens_today(harness.redis, metered.tenant) == tokens_of(run.usage) > 1
    answer = turns[-1]
    assert (answer.role, answer.status) == ("assistant", "failed")
    said = [p["data"] for p in answer.parts if p["type"] == "data-warning"]
    assert [s["code"] for s in said] == ["quota_exhausted"]


async def test_a_sub_lm_call_is_refused_too_and_other_tenants_go_on(harness_factory) -> None:  # type: ignore[no-untyped-def]
    metered, other_tenant = tenant("metered"), tenant("other")
    harness: Harness = harness_factory(ROOT_ASKS, SUB, ROOT_SUBMIT, quotas=quota(metered, 1))
    stopped = await harness.submit(caller=metered)
    other = await harness.submit(caller=other_tenant)  # no quota of its own: only counted
    await harness.work()
    run, _, logged = await ending(harness, stopped)
    assert (run.status, run.failure_code) == ("failed", "quota_exhausted")
    assert [e.tool for e in logged if isinstance(e, LMQueryStarted)] == ["llm_query"]  # started, refused
    assert await lm_tokens_today(harness.redis, metered.tenant) == tokens_of(run.usage)
    run, _, logged = await ending(harness, other)
    assert run.status == "completed" and isinstance(logged[-1], RunCompleted)
    assert await lm_tokens_today(harness.redis, other_tenant.tenant) == tokens_of(run.usage) > 0


async def test_a_turn_that_starts_over_the_limit_makes_no_lm_call(harness_factory) -> None:  # type: ignore[no-untyped-def]
    metered = tenant("metered")
    harness: Harness = harness_factory(ROOT_PRINT, ROOT_SUBMIT, quotas=quota(metered, 1000))
    await add_lm_tokens(harness.redis, metered.tenant, 1000, utc_day())  # others used the day's tokens
    run_id = await harness.submit(caller=metered)
    await harness.work()
    run, _, _ = await ending(harness, run_id)
    assert (run.status, run.failure_code) == ("failed", "quota_exhausted")
    assert tokens_of(run.usage) == 0
    assert await lm_tokens_today(harness.redis, metered.tenant) == 1000


async def test_within_the_limit_a_turn_completes_and_is_counted(harness_factory) -> None:  # type: ignore[no-untyped-def]
    metered = tenant("metered")
    harness: Harness = harness_factory(ROOT_PRINT, ROOT_SUBMIT, quotas=quota(metered, 10_000_000))
    first = await harness.submit(caller=metered)
    await harness.work()
    second = await harness.submit(caller=metered, key="k2")
    await harness.work()
    counted = 0
    for run_id in (first, second):
        run, _, _ = await ending(harness, run_id)
        assert run.status == "completed"
        counted += tokens_of(run.usage)
    assert await lm_tokens_today(harness.redis, metered.tenant) == counted


async def test_the_view_counts_its_own_calls_at_once_and_others_once_redis_answers(redis_url: str) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    loop = asyncio.get_running_loop()
    name, stranger_name = tenant("view").tenant, tenant("stranger").tenant
    mine = TenantTokens(redis, loop, name, limit=100)
    theirs = TenantTokens(redis, loop, name, limit=100)
    stranger = TenantTokens(redis, loop, stranger_name, limit=100)
    await asyncio.to_thread(mine.add, 60)  # from a program's thread
    assert not mine.exhausted()
    await asyncio.to_thread(mine.add, 40)
    assert mine.exhausted()  # at once: its own tokens are counted before Redis answers
    await theirs.refresh()
    assert theirs.exhausted() and not stranger.exhausted()
    assert await lm_tokens_today(redis, name) == 100
    await redis.aclose()


async def test_a_check_on_a_stale_view_reads_the_count_again(redis_url: str) -> None:
    """Another Turn's tokens stop this one at its next call once its view is older than
    `fresh_seconds`, though this Turn made no call meanwhile that would have told it."""
    redis = aioredis.Redis.from_url(redis_url)
    loop = asyncio.get_running_loop()
    name = tenant("stale").tenant
    waiting = TenantTokens(redis, loop, name, limit=100, fresh_seconds=3600)
    await waiting.refresh()
    spender = TenantTokens(redis, loop, name, limit=100)
    sent = await asyncio.to_thread(spender.add, 100)
    assert sent is not None
    await asyncio.wrap_future(sent)
    assert not await asyncio.to_thread(waiting.exhausted)  # fresh enough: not read again
    waiting.fresh_seconds = 0
    assert await asyncio.to_thread(waiting.exhausted)  # from a program's thread: read, and seen
    await redis.aclose()


async def test_a_redis_outage_counts_nothing_and_stops_nothing() -> None:
    """While Redis does not answer, the Turn's own tokens count; once the add has failed, they are
    given up, and an outage stops no Turn."""
    connections: list[asyncio.StreamWriter] = []

    async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)  # accepted, never answered: a Redis that hangs

    silent = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    redis = aioredis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
    loop = asyncio.get_running_loop()
    tokens = TenantTokens(redis, loop, "view", limit=10)
    await tokens.refresh()  # timed out: logged, not raised
    sent = await asyncio.to_thread(tokens.add, 50)
    assert sent is not None and not sent.done()
    assert tokens.exhausted()  # its own calls count until Redis says otherwise
    silent.close()  # the outage becomes a refusal: every retry of the add fails
    for writer in connections:
        writer.close()
    with pytest.raises(RedisConnectionError):
        await asyncio.wrap_future(sent)
    assert tokens.unanswered == 0 and not tokens.exhausted()  # the failed add was given up
    await redis.aclose()


@pytest.mark.parametrize("labelled", [True, False])
async def test_tenant_metrics_only_when_the_label_is_on(harness_factory, labelled: bool) -> None:  # type: ignore[no-untyped-def]
    harness: Harness = harness_factory(ROOT_PRINT, ROOT_SUBMIT)
    profile = harness.settings.profile
    observability = msgspec.structs.replace(profile.observability, metrics_tenant_label=labelled)
    harness.settings = msgspec.structs.replace(
        harness.settings, profile=msgspec.structs.replace(profile, observability=observability)
    )
    counted = tenant("counted")
    run_id = await harness.submit(caller=counted)
    await harness.work()
    run, _, _ = await ending(harness, run_id)
    turns = REGISTRY.get_sample_value(
        "fleet_tenant_turns_total", {"tenant": counted.tenant, "outcome": "completed"}
    )
    tokens = REGISTRY.get_sample_value("fleet_tenant_lm_tokens_total", {"tenant": counted.tenant})
    if labelled:
        assert (turns, tokens) == (1.0, float(tokens_of(run.usage)))
    else:
        assert (turns, tokens) == (None, None)
