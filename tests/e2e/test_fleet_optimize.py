"""End to end: `fleet optimize` runs dspy.GEPA over the RLM's instructions on real Turns (real
gateway and worker processes; their LM the provider path's loopback server), stores what GEPA
proposed as candidates with validation scores against the active version, activates nothing;
`fleet program activate` then makes the next Turn run the candidate, `rollback` undoes it.

The loopback server answers by what each call carries: GEPA's reflection prompt gets a scripted
rewrite of the instructions (marked REWRITTEN); a Turn whose instructions carry the mark submits
the word its request names (right), any other submits "wrong"."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleet_shared.program_text import SHIPPED_INSTRUCTIONS
from tests.e2e.conftest import Stack, fleet, start_stack, stop_stack, work_dir
from tests.support.fake_provider import FakeProvider, serve_fake_provider

pytestmark = pytest.mark.e2e

MARK = "REWRITTEN"
WORDS = ("apple", "birch", "cedar", "delta", "ember", "fjord")


def action(code: str) -> str:
    return f"[[ ## reasoning ## ]]\nAnswer.\n\n[[ ## code ## ]]\n{code}\n\n[[ ## completed ## ]]"


def reply_for(body: dict[str, Any]) -> str:
    text = "\n".join(str(m.get("content", "")) for m in body.get("messages", []))
    if "new_instruction" in text:  # GEPA's reflection (dspy's ProposeInstruction signature)
        rewrite = f"{MARK}: say the word the request names.\n{SHIPPED_INSTRUCTIONS}"
        if "Outputs will be a JSON object" in text:  # DSPy's JSON adapter, when chat's parse failed
            return json.dumps({"new_instruction": rewrite})
        return f"[[ ## new_instruction ## ]]\n{rewrite}\n\n[[ ## completed ## ]]"
    if MARK in text:
        return action("SUBMIT(answer=request.rsplit(':', 1)[1].strip())")
    return action("SUBMIT(answer='wrong')")


@pytest.fixture(scope="module")
def provider() -> Iterator[FakeProvider]:
    with serve_fake_provider() as fake:
        fake.reply_for = reply_for
        yield fake


@pytest.fixture(scope="module")
def provider_stack(provider: FakeProvider) -> Iterator[Stack]:
    env = {
        "FLEET_PROFILE": "local", "FLEET_LM_MODEL": "openai/fake-model", "FLEET_LM_API_KEY": "sk-fake",
        "FLEET_LM_BASE_URL": provider.url,
    }  # fmt: skip
    stack = start_stack(work_dir("optimize"), env)
    yield stack
    stop_stack(stack)


def run_fleet(folder: Path, stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        fleet(*args), cwd=folder, env={**os.environ, **stack.env}, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip


def test_gepa_stores_a_better_candidate_that_only_activation_makes_live(provider_stack: Stack) -> None:
    folder = Path(tempfile.mkdtemp(prefix="fleet-optimize-"))
    rows = [{"id": word, "request": f"Say this word: {word}", "expected": word} for word in WORDS]
    (folder / "words.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with httpx.Client(base_url=provider_stack.url) as client:
        listed = client.get("/api/programs")
        assert listed.status_code == 200, listed.text
        before = listed.json()["items"]
    (active,) = [p for p in before if p["status"] == "active"]

    done = run_fleet(
        folder, provider_stack, "optimize", "--dataset", "words.jsonl", "--api-url", provider_stack.url,
        "--budget", "30", "--reflection-profile", "local", "--out", "report.json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((folder / "report.json").read_text())
    assert report["active"] == {"id": active["id"], "validation_score": 0.0}
    (candidate,) = report["candidates"]
    assert candidate["score"] == 1.0 and candidate["active_score"] == 0.0 and candidate["rows"] == 3
    assert sorted(report["train_rows"] + report["validation_rows"]) == sorted(WORDS)

    with httpx.Client(base_url=provider_stack.url) as client:
        stored = client.get(f"/api/programs/{candidate['id']}").json()
        statuses = {p["id"]: p["status"] for p in client.get("/api/programs").json()["items"]}
    assert stored["status"] == "candidate" and stored["text"].startswith(MARK)
    assert stored["validation"]["score"] == 1.0 and stored["parent_id"] == active["id"]
    assert statuses[active["id"]] == "active"  # nothing activated

    # Activated, the next Turn runs it (its Run records it); rolled back, the shipped one again.
    assert run_fleet(folder, provider_stack, "program", "activate", candidate["id"]).returncode == 0
    assert turn(provider_stack, "Say this word: apple") == ("apple", candidate["id"])
    assert run_fleet(folder, provider_stack, "program", "rollback").returncode == 0
    assert turn(provider_stack, "Say this word: apple") == ("wrong", active["id"])


def turn(stack: Stack, text: str) -> tuple[str, str]:
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        session = client.post("/api/sessions", json={}).json()["id"]
        with client.stream(
            "POST", f"/api/sessions/{session}/turns", json={"text": text}, headers={"Idempotency-Key": "k"}
        ) as response:
            run_id = response.headers["x-fleet-run-id"]
            response.read()
        run = client.get(f"/api/runs/{run_id}").json()
        items = client.get(f"/api/sessions/{session}/turns").json()["items"]
    answer = "".join(p.get("text", "") for p in items[-1]["parts"] if p["type"] == "text")
    return answer, run["program_version_id"]


def test_a_budget_too_small_or_a_failing_reflection_lm_stops_it_before_any_turn(
    provider_stack: Stack, provider: FakeProvider
) -> None:
    folder = Path(tempfile.mkdtemp(prefix="fleet-optimize-"))
    rows = [{"id": word, "request": f"Say this word: {word}", "expected": word} for word in WORDS]
    (folder / "words.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = (
        "optimize",
        "--dataset",
        "words.jsonl",
        "--api-url",
        provider_stack.url,
        "--reflection-profile",
        "local",
    )
    with httpx.Client(base_url=provider_stack.url) as client:
        before = client.get("/api/programs").json()["items"]

    seen = len(provider.requests)
    small = run_fleet(folder, provider_stack, *args, "--budget", "5")
    assert small.returncode == 2 and "--budget 5 is below 9" in small.stderr
    assert len(provider.requests) == seen  # not even the reflection LM was asked

    provider.statuses = [401] * 5  # the reflection LM's key is refused
    refused = run_fleet(folder, provider_stack, *args, "--budget", "30")
    provider.statuses = []
    assert refused.returncode == 2 and "the reflection LM failed" in refused.stderr
    with httpx.Client(base_url=provider_stack.url) as client:
        assert client.get("/api/programs").json()["items"] == before  # no Turn ran, nothing stored
    assert not list(folder.glob("optimize-*.json"))
