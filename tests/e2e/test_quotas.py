"""Per-tenant quotas through real `fleet gateway` and `fleet worker` processes, in `tokens` mode:
active Turns are counted in the claim's transaction, so a burst of POSTs gets exactly the
limit; Turns per minute are counted in Redis after the claim, which a refusal withdraws. A
refused Turn leaves nothing behind, and its Idempotency-Key works again."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fleet_shared.tokens_file import mint_token
from tests.e2e.conftest import Stack, start_stack, stop_stack, work_dir
from tests.e2e.sse import post_turn
from tests.support.policy import private_policy

pytestmark = pytest.mark.e2e

ACTIVE_LIMIT, PER_MINUTE, BURST = 3, 2, 50
TOKENS_PER_DAY = 1  # the first LM call of the day passes it
SCRIPT = [
    {"lm": "root", "reasoning": "Answer at once.", "code": "SUBMIT(answer='quick')"},
    {"lm": "when", "match": "^hold$"},  # a Turn that stays active until it is cancelled
    {"lm": "root", "delay_s": 300, "reasoning": "Take a long time.", "code": "SUBMIT(answer='late')"},
    {"lm": "when", "match": "^two steps$"},
    {"lm": "root", "reasoning": "Compute first.", "code": "x = 6 * 7\nprint(x)"},
    {"lm": "root", "reasoning": "Then answer.", "code": "SUBMIT(answer=str(x))"},
]
QUOTAS = f"""
[profiles.offline.quotas]
active_turns = {ACTIVE_LIMIT}

[profiles.offline.quotas.tenants.paced]
turns_per_minute = {PER_MINUTE}

[profiles.offline.quotas.tenants.metered]
lm_tokens_per_day = {TOKENS_PER_DAY}
"""


@pytest.fixture(scope="module")
def quota_stack() -> Iterator[tuple[Stack, dict[str, str]]]:
    data_dir = work_dir("quotas")
    script = data_dir / "quotas.jsonl"
    script.write_text("".join(json.dumps(line) + "\n" for line in SCRIPT))
    tokens = data_dir / "tokens.toml"
    names = ("busy", "paced", "metered")
    callers = {tenant: mint_token(tokens, tenant=tenant, user="u", scopes=()) for tenant in names}
    env = private_policy(data_dir)
    with Path(env["FLEET_CONFIG"]).open("a", encoding="utf-8") as policy:
        policy.write(QUOTAS)
    env.update(FLEET_SCRIPTED_LM=str(script), FLEET_AUTH_MODE="tokens", FLEET_AUTH_TOKENS_FILE=str(tokens))
    stack = start_stack(data_dir, env)
    yield stack, callers
    stop_stack(stack)


async def sessions(client: httpx.AsyncClient, count: int) -> list[str]:
    made = [await client.post("/api/sessions", json={}) for _ in range(count)]
    assert {response.status_code for response in made} == {201}
    return [response.json()["id"] for response in made]


async def post(
    client: httpx.AsyncClient, session_id: str, text: str, key: str
) -> tuple[int, httpx.Headers, bytes]:
    """The answer's status and headers; an accepted Turn's stream is left unread and closed."""
    url = f"/api/sessions/{session_id}/turns"
    async with client.stream("POST", url, json={"text": text}, headers={"Idempotency-Key": key}) as response:
        body = b"" if response.status_code == 200 else await response.aread()
        return response.status_code, response.headers, body


async def turns_of(client: httpx.AsyncClient, session_id: str) -> list[dict[str, object]]:
    items: list[dict[str, object]] = (await client.get(f"/api/sessions/{session_id}/turns")).json()["items"]
    return items


async def test_a_burst_gets_exactly_the_active_turns_limit(quota_stack: tuple[Stack, dict[str, str]]) -> None:
    stack, callers = quota_stack
    auth = {"Authorization": f"Bearer {callers['busy']}"}
    async with httpx.AsyncClient(base_url=stack.url, headers=auth, timeout=60) as client:
        ids = await sessions(client, BURST)
        answers = await asyncio.gather(*(post(client, sid, "hold", f"k-{n}") for n, sid in enumerate(ids)))
        statuses = [status for status, _, _ in answers]
        assert (statuses.count(200), statuses.count(429)) == (ACTIVE_LIMIT, BURST - ACTIVE_LIMIT), statuses
        for status, headers, body in answers:
            if status == 429:
                assert headers["retry-after"] == "5"
                assert json.loads(body)["code"] == "quota_exceeded"
        accepted = [n for n, (status, _, _) in enumerate(answers) if status == 200]
        refused = [n for n, (status, _, _) in enumerate(answers) if status == 429]
        assert [await turns_of(client, ids[n]) for n in refused] == [[]] * len(refused)  # nothing left

        # One ends: a refused Turn, sent again with its own key, is accepted.
        run_id = answers[accepted[0]][1]["x-fleet-run-id"]
        cancel = await client.put(f"/api/runs/{run_id}/cancellation")
        assert cancel.json()["state"] == "requested"
        deadline = time.monotonic() + 60
        while (await client.get(f"/api/runs/{run_id}")).json()["status"] != "cancelled":
            assert time.monotonic() < deadline, "the cancelled Turn never ended"
            await asyncio.sleep(0.1)
        again = await post(client, ids[refused[0]], "hold", f"k-{refused[0]}")
        assert again[0] == 200
        for n in [*accepted[1:], refused[0]]:  # leave nothing running
            run = (await client.get(f"/api/sessions/{ids[n]}/turns")).json()["items"][0]["metadata"]["runId"]
            await client.put(f"/api/runs/{run}/cancellation")


async def test_turns_per_minute_are_counted_after_the_claim_and_a_refusal_withdraws_it(
    quota_stack: tuple[Stack, dict[str, str]],
) -> None:
    stack, callers = quota_stack
    if time.time() % 60 > 50:  # three POSTs must land in one clock minute
        await asyncio.sleep(61 - time.time() % 60)
    auth = {"Authorization": f"Bearer {callers['paced']}"}
    async with httpx.AsyncClient(base_url=stack.url, headers=auth, timeout=60) as client:
        ids = await sessions(client, PER_MINUTE + 1)
        answers = [await post(client, sid, "go", f"p-{n}") for n, sid in enumerate(ids)]
        assert [status for status, _, _ in answers] == [200] * PER_MINUTE + [429]
        _, headers, body = answers[-1]
        assert 1 <= int(headers["retry-after"]) <= 60
        assert json.loads(body)["message"].startswith(f"this tenant may start {PER_MINUTE} Turn(s) a minute")
        assert await turns_of(client, ids[-1]) == []  # withdrawn: the key is not burned
        for sid in ids[:-1]:
            assert len(await turns_of(client, sid)) >= 1  # each claimed: its prompt is committed


def test_lm_tokens_per_day_stop_the_running_turn_refuse_the_next_and_show_in_usage(
    quota_stack: tuple[Stack, dict[str, str]],
) -> None:
    stack, callers = quota_stack
    auth = {"Authorization": f"Bearer {callers['metered']}"}
    with httpx.Client(base_url=stack.url, headers=auth, timeout=60) as client:
        session_id = client.post("/api/sessions", json={}).json()["id"]
        stopped = post_turn(client, session_id, "two steps", "t-1")
        assert stopped.status == 200
        warnings = [c["data"]["code"] for c in stopped.of_type("data-warning")]
        assert warnings == ["quota_exhausted"]
        assert stopped.of_type("error")[0]["errorText"].startswith("quota_exhausted")
        run_id = stopped.headers["x-fleet-run-id"]
        run = client.get(f"/api/runs/{run_id}").json()
        assert (run["status"], run["failure_code"]) == ("failed", "quota_exhausted")
        history = client.get(f"/api/sessions/{session_id}/turns").json()["items"]
        said = [p["data"]["code"] for p in history[-1]["parts"] if p["type"] == "data-warning"]
        assert said == ["quota_exhausted"]

        refused = post_turn(client, session_id, "two steps", "t-2")
        assert refused.status == 429
        assert 1 <= int(refused.headers["retry-after"]) <= 86_400
        assert json.loads(refused.raw)["code"] == "quota_exceeded"
        assert len(client.get(f"/api/sessions/{session_id}/turns").json()["items"]) == 2  # withdrawn

        usage = client.get("/api/usage").json()
        models = run["usage"]["observed_lm_usage"].values()
        tokens = sum(m["prompt_tokens"] + m["completion_tokens"] for m in models)
        assert usage["tenant"] == "metered"
        assert usage["lm_tokens_today"] == {"used": tokens, "limit": TOKENS_PER_DAY}
        assert usage["turns_today"] == 1 and usage["active_turns"] == {"used": 0, "limit": None}
        assert usage["day"] == time.strftime("%Y-%m-%d", time.gmtime())

    other = {"Authorization": f"Bearer {callers['busy']}"}
    with httpx.Client(base_url=stack.url, headers=other, timeout=60) as client:
        theirs = client.get("/api/usage").json()
        assert theirs["tenant"] == "busy" and theirs["active_turns"]["limit"] == ACTIVE_LIMIT
        assert theirs["lm_tokens_today"]["limit"] is None
