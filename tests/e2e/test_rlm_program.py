"""The RLM at full depth on real processes (`fleet db upgrade`, `fleet gateway`, `fleet worker`,
bwrap): the `local-recursive` profile with the scripted LM standing in for the model, and the
`local` profile against a loopback OpenAI-compatible server (the only fake: no provider is
reachable here)."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import REPO, Stack, ai_sdk_parse, start_stack, stop_stack, work_dir
from tests.e2e.sse import TurnStream, parse_frames, post_turn
from tests.e2e.test_fleet_up import newcomer_env, spawn_up, wait_for_banner
from tests.support.api import new_session
from tests.support.fake_provider import serve_fake_provider
from tests.support.servers import free_port

pytestmark = pytest.mark.e2e
UNUSED_BASE_URL = "http://127.0.0.1:9/v1"  # the profile names it; the scripted LM never calls it


@pytest.fixture(scope="module")
def recursive_stack() -> Iterator[Stack]:
    script = REPO / "tests" / "e2e" / "scripts" / "rlm_depth.jsonl"
    env = {
        "FLEET_PROFILE": "local-recursive",
        "FLEET_LM_MODEL": "scripted/depth",
        "FLEET_LM_BASE_URL": UNUSED_BASE_URL,
        "FLEET_SCRIPTED_LM": str(script),
    }
    stack = start_stack(work_dir("rlm"), env)
    yield stack
    stop_stack(stack)


def answer_of(stream: TurnStream) -> str:
    return "".join(c["delta"] for c in stream.of_type("text-delta"))


def test_a_deep_turn_uses_history_a_skill_a_batch_and_a_child(
    recursive_stack: Stack, node_check: Path
) -> None:
    with recursive_stack.client() as client:
        skill = client.get("/api/skills/long-document-qa").json()
        session_id = new_session(client)
        first = post_turn(client, session_id, "the report says 41", "k-1")
        assert answer_of(first) == "noted: the report says 41"

        selection = [{"id": skill["id"], "expected_version": skill["version"]}]
        stream = post_turn(client, session_id, "go deeper", "k-2", skill_selections=selection)
        assert stream.status == 200 and stream.types[-1] == "finish"
        assert answer_of(stream) == "noted: the report says 41 -> alpha/beta/gamma -> 6 (1 skill)"
        for alias in ("ai6", "ai7"):
            ai_sdk_parse(node_check, alias, stream.raw)

        skills = [c["data"] for c in stream.of_type("data-skill")]
        names = {"skill_id": skill["id"], "name": skill["name"], "version": skill["version"]}
        assert skills == [{**names, "phase": "activated"}, {**names, "phase": "loaded"}]
        inputs = {c["toolName"]: c["input"] for c in stream.of_type("tool-input-available")}
        assert inputs["llm_query_batched"] == {"prompt_count": 3}
        assert inputs["rlm_query"] == {"prompt": "add up: 1 2 3"}
        outputs = {c["toolCallId"]: c["output"] for c in stream.of_type("tool-output-available")}
        batch_id = next(
            c["toolCallId"]
            for c in stream.of_type("tool-input-available")
            if c["toolName"] == "llm_query_batched"
        )
        assert sorted(outputs[batch_id]["texts"]) == ["alpha", "beta", "gamma"]
        progress = [
            (c["id"], c["data"]["state"], c["data"]["cleanup_state"])
            for c in stream.of_type("data-child-progress")
        ]
        assert progress == [("child-1", "started", "pending"), ("child-1", "completed", "released")]

        types = stream.types
        assert types.index("data-usage") < types.index("finish")
        usage = stream.of_type("data-usage")[0]["data"]["usage"]
        assert usage["iterations"] == 4
        tokens = usage["observed_lm_usage"]["scripted/depth"]
        assert tokens["prompt_tokens"] > 0 and tokens["completion_tokens"] > 0
        finish = stream.of_type("finish")[0]
        run_id = finish["messageMetadata"]["runId"]
        assert finish["finishReason"] == "stop" and finish["messageMetadata"]["checkpointVersion"] == 2

        run = client.get(f"/api/runs/{run_id}").json()
        assert run["status"] == "completed" and run["usage"] == usage
        task = client.get(f"/api/sessions/{session_id}/task").json()
        assert task["checkpoint_version"] == 2 and task["goal"] == "the report says 41"
        assert [p["request"] for p in task["progress"]] == ["the report says 41", "go deeper"]
        turns = client.get(f"/api/sessions/{session_id}/turns").json()["items"]
        kinds = [p["type"] for p in turns[-1]["parts"]]
        assert kinds.count("data-child-progress") == 1 and kinds.count("data-skill") == 2
        assert not list((recursive_stack.data_dir / ".fleet" / "workspaces").glob("scratch-*"))


PRICED_MODEL = "openai/gpt-4o-mini"  # the loopback server answers as any model
LONG_REASONING = "Count the words of the request one by one, then print how many there are."


def content(frames: list[tuple[str | None, str]]) -> list[tuple[str | None, str]]:
    return [f for f in frames if f[0] is None or f[0].count(".") == 1]


def action(reasoning: str, code: str) -> str:
    return f"[[ ## reasoning ## ]]\n{reasoning}\n\n[[ ## code ## ]]\n{code}\n\n[[ ## completed ## ]]"


def test_a_three_iteration_turn_through_fleet_up_profile_local(tmp_path: Path, node_check: Path) -> None:
    """`fleet up --profile local` as a user runs it, with FLEET_LM_* pointing at the loopback
    OpenAI-compatible server: root actions and the sub-LM answer come over HTTP."""
    with serve_fake_provider() as provider:
        # A provider that streams: its first token after 200 ms, then 100 tokens a second.
        provider.ttft_s, provider.tokens_per_s = 0.2, 100
        provider.replies += [
            action(LONG_REASONING, "```python\nn = len(request.split())\nprint(n)\n```"),
            action("Ask the sub-LM.", "word = llm_query('one word for ' + str(n))\nprint(word)"),
            "plenty",
            action("Submit.", "SUBMIT(answer=f'{n} words: {word}')"),
        ]
        env = newcomer_env(
            FLEET_LM_MODEL=PRICED_MODEL,
            FLEET_LM_API_KEY="sk-loopback-key",
            FLEET_LM_BASE_URL=provider.url,
        )
        port = free_port()
        proc = spawn_up(tmp_path, env, port, "--profile", "local")
        try:
            banner = wait_for_banner(proc, timeout=60)
            assert "  profile local" in banner
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                session_id = new_session(client)
                stream = post_turn(client, session_id, "how many words here", "k-1")
                session = client.get(f"/api/sessions/{session_id}").json()
                history = client.get(f"/api/sessions/{session_id}/turns").json()["items"][-1]
                run_id = stream.headers["x-fleet-run-id"]
                # Resume from the middle of the first step's reasoning deltas: exactly the rest.
                deltas = [i for i, c in enumerate(stream.chunks) if c["type"] == "reasoning-delta"]
                middle = stream.frames[deltas[1]][0]
                with client.stream(
                    "GET", f"/api/runs/{run_id}/stream", headers={"Last-Event-ID": middle}
                ) as response:
                    resumed = parse_frames(response.read())
        finally:
            proc.send_signal(signal.SIGINT)
            output = proc.communicate(timeout=40)[0].decode()
    assert answer_of(stream) == "4 words: plenty", output[-3000:]
    # The first step's reasoning streamed in several deltas, which add up to the whole text the
    # history keeps as one part.
    first = [c["delta"] for c in stream.chunks if c["type"] == "reasoning-delta" and c["id"] == "reasoning-1"]
    assert len(first) >= 3 and "".join(first).strip() == LONG_REASONING
    reasoning = [p["text"] for p in history["parts"] if p["type"] == "reasoning"]
    assert reasoning[0] == LONG_REASONING and len(reasoning) == 3
    # The first cell's code streamed as its tool input (JSON text, without the fence) before the
    # cell's whole input; the history keeps the input whole.
    cell = [c for c in stream.chunks if c.get("toolCallId") == "cell-1"]
    assert cell[0]["type"] == "tool-input-start"
    available = next(i for i, c in enumerate(cell) if c["type"] == "tool-input-available")
    text = "".join(c["inputTextDelta"] for c in cell[:available] if c["type"] == "tool-input-delta")
    assert json.loads(text + '"}') == {"code": "n = len(request.split())\nprint(n)\n"}
    assert cell[available]["input"] == {"code": "n = len(request.split())\nprint(n)"}
    tools = [p for p in history["parts"] if p.get("toolCallId") == "cell-1"]
    assert tools[0]["input"] == {"code": "n = len(request.split())\nprint(n)"}
    # Content frames (`s.k`) are the same in every stream of a Run; control frames (`s.k.n`) are its own.
    after = stream.frames[[f[0] for f in stream.frames].index(middle) + 1 :]
    assert content(resumed) == content(after) and len(content(after)) > 10
    for alias in ("ai6", "ai7"):
        ai_sdk_parse(node_check, alias, stream.raw)
    usage = stream.of_type("data-usage")[0]["data"]["usage"]
    assert usage["iterations"] == 3
    # 11 and 7 tokens per request, 4 requests, at LiteLLM's price for gpt-4o-mini (USD 0.15 and
    # 0.60 per million).
    cost = round(44 * 0.15e-6 + 28 * 0.6e-6, 10)
    expected = {"prompt_tokens": 44, "completion_tokens": 28, "calls": 4, "cost_usd": cost}
    assert usage["observed_lm_usage"][PRICED_MODEL] == expected
    assert usage["cost_usd"] == cost and session["cost_usd"] == cost
    assert [r["model"] for r in provider.requests] == ["gpt-4o-mini"] * 4
    assert all(h["authorization"] == "Bearer sk-loopback-key" for h in provider.headers)
    assert stream.of_type("start")[0]["messageMetadata"]["model"] == PRICED_MODEL
    assert "sk-loopback-key" not in output


EXTRACTED = "Each of the four words was counted once, so the request has 4 words in all, as printed."


def test_an_answer_the_lm_writes_itself_streams_as_text_deltas(tmp_path: Path, node_check: Path) -> None:
    """`fleet up --profile local` with rlm.max_iters = 1 and a streaming provider: the one action
    does not SUBMIT, so DSPy's extract fallback has the LM write the answer, which reaches the
    client as text-delta chunks while that call is in flight. A resume from the middle of them
    gets exactly the rest; the history keeps the answer as one whole part."""
    config = (REPO / "config" / "fleet.toml").read_text()
    local_rlm = "[profiles.local.rlm]\nmax_iters = 20\n"
    assert local_rlm in config
    (tmp_path / "fleet.toml").write_text(config.replace(local_rlm, "[profiles.local.rlm]\nmax_iters = 1\n"))
    with serve_fake_provider() as provider:
        provider.ttft_s, provider.tokens_per_s = 0.2, 100
        provider.replies += [
            action("Count them.", "print(len(request.split()))"),
            f"[[ ## answer ## ]]\n{EXTRACTED}\n\n[[ ## completed ## ]]",
        ]
        env = newcomer_env(
            FLEET_CONFIG=str(tmp_path / "fleet.toml"),
            FLEET_LM_MODEL="openai/loopback-model",
            FLEET_LM_API_KEY="sk-loopback-key",
            FLEET_LM_BASE_URL=provider.url,
        )
        port = free_port()
        proc = spawn_up(tmp_path, env, port, "--profile", "local")
        try:
            wait_for_banner(proc, timeout=60)
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                session_id = new_session(client)
                stream = post_turn(client, session_id, "how many words here", "k-1")
                history = client.get(f"/api/sessions/{session_id}/turns").json()["items"][-1]
                deltas = [i for i, c in enumerate(stream.chunks) if c["type"] == "text-delta"]
                middle = stream.frames[deltas[1]][0]
                with client.stream(
                    "GET",
                    f"/api/runs/{stream.headers['x-fleet-run-id']}/stream",
                    headers={"Last-Event-ID": middle},
                ) as response:
                    resumed = parse_frames(response.read())
        finally:
            proc.send_signal(signal.SIGINT)
            output = proc.communicate(timeout=40)[0].decode()
    assert stream.status == 200 and stream.types[-1] == "finish", output[-3000:]
    text = [c for c in stream.chunks if c["type"].startswith("text-")]
    assert [c["type"] for c in text[:1] + text[-1:]] == ["text-start", "text-end"]
    assert {c["id"] for c in text} == {"text-answer"}  # one part, not restated
    assert len(deltas) >= 3 and answer_of(stream).strip() == EXTRACTED
    warning = stream.of_type("data-warning")[0]["data"]
    assert warning["code"] == "max_iters"
    assert [p["text"] for p in history["parts"] if p["type"] == "text"] == [EXTRACTED]
    after = stream.frames[[f[0] for f in stream.frames].index(middle) + 1 :]
    assert content(resumed) == content(after) and any('"text-delta"' in f[1] for f in content(after))
    for alias in ("ai6", "ai7"):
        ai_sdk_parse(node_check, alias, stream.raw)
