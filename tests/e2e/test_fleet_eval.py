"""End to end: `fleet eval` as a user runs it, in a folder of its own (it shares nothing with the
stack but the gateway's API), against real `fleet gateway` and `fleet worker` processes on the
scripted LM; the judge is the `local` profile's LM, a loopback OpenAI-compatible server."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet_cli.evals.dataset import load_dataset
from tests.e2e.conftest import REPO, Stack, fleet, start_stack, stop_stack, work_dir
from tests.support.fake_provider import FakeProvider, serve_fake_provider

pytestmark = pytest.mark.e2e

GRADING = """
def mentions_the_file(answer, expected, row):
    return "notes.md has" in answer
"""
ROWS: list[dict[str, Any]] = [
    {"id": "mul", "request": "What is 37 * 91?", "expected": 3367, "metric": "numeric"},
    {"id": "add", "request": "What is 12 + 30?", "expected": "= 42", "metric": "contains"},
    {
        "id": "file",
        "request": "Summarise my file",
        "attachments": ["notes.md"],
        "metric": "grading:mentions_the_file",
    },
    {"id": "greet", "request": "hello there", "metric": {"name": "judge", "rubric": "It greets the user."}},
    {"id": "wrong", "request": "What is 2 + 2?", "expected": 5, "metric": "numeric"},
    {"id": "huge", "request": "x" * 100_001},  # past gateway.limits.max_text_chars: refused, run goes on
]


@pytest.fixture(scope="module")
def eval_stack() -> Iterator[Stack]:
    stack = start_stack(work_dir("eval"), {})
    yield stack
    stop_stack(stack)


@pytest.fixture
def judge() -> Iterator[FakeProvider]:
    with serve_fake_provider() as fake:
        fake.replies = ['{"score": 1, "reason": "it greets"}'] * 4
        yield fake


def eval_folder(rows: list[dict[str, Any]]) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="fleet-eval-cli-"))
    (folder / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "notes.md").write_text("# Notes\n\nThe eval uploads this file with its row.\n")
    (folder / "grading.py").write_text(GRADING)
    return folder


def fleet_eval(
    folder: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        fleet("eval", *args),
        cwd=folder,
        env={**os.environ, "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"), **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_a_dataset_runs_as_turns_and_its_receipt_scores_each_row(
    eval_stack: Stack, judge: FakeProvider
) -> None:
    folder = eval_folder(ROWS)
    judge_env = {
        "FLEET_LM_MODEL": "openai/judge-model",
        "FLEET_LM_BASE_URL": judge.url,
        "FLEET_LM_API_KEY": "sk-j",
    }
    done = fleet_eval(
        folder, "run", "data.jsonl", "--api-url", eval_stack.url, "--concurrency", "3",
        "--judge-profile", "local", "--out", "a.json", env=judge_env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "receipt: a.json" in done.stdout and "6/6 rows" in done.stderr
    receipt = json.loads((folder / "a.json").read_text())
    rows = {row["id"]: row for row in receipt["rows"]}
    assert {i: rows[i]["score"] for i in rows} == {
        "mul": 1.0, "add": 1.0, "file": 1.0, "greet": 1.0, "wrong": 0.0, "huge": None,
    }  # fmt: skip
    assert rows["huge"]["status"] == "refused" and "422 validation_error" in rows["huge"]["detail"]
    assert rows["mul"]["answer"].startswith("37 * 91 = 3,367") and rows["greet"]["detail"] == "it greets"
    for row_id in ("mul", "add", "file", "greet", "wrong"):
        row = rows[row_id]
        assert row["status"] == "completed" and row["failure_code"] is None
        assert row["iterations"] >= 2 and row["lm_calls"] >= 2 and row["input_tokens"] > 0
        assert row["seconds"] > 0 and row["run_id"] and row["model"] == "scripted/demo"
    totals = receipt["totals"]
    assert (
        totals["rows"] == 6 and totals["scored"] == 5 and totals["accuracy"] == 0.8 and totals["failed"] == 1
    )
    assert totals["seconds_p50"] <= totals["seconds_p95"]
    assert receipt["fleet"]["git_sha"] == git_head() and receipt["target"]["url"] == eval_stack.url
    assert {"id": "csv-analysis", "version": "1.0"} in receipt["skills"]
    (asked,) = judge.requests  # the judge saw the rubric and the answer, and nothing else asked it
    assert "It greets the user." in asked["messages"][0]["content"]

    # B: the same Turns, one expectation corrected; compare says which row changed and tests it.
    rows_b = [dict(row, expected=4) if row["id"] == "wrong" else row for row in ROWS if row["id"] != "greet"]
    (folder / "data-b.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows_b))
    done = fleet_eval(folder, "run", "data-b.jsonl", "--api-url", eval_stack.url, "--out", "b.json")
    assert done.returncode == 0, done.stderr
    compared = fleet_eval(folder, "compare", "a.json", "b.json")
    assert compared.returncode == 0, compared.stderr
    assert "wrong" in compared.stdout and "only in A: greet" in compared.stdout
    assert "McNemar (exact): 1 rows right only in B, 0 only in A: p = 1" in compared.stdout
    as_json = json.loads(fleet_eval(folder, "compare", "a.json", "b.json", "--json").stdout)
    assert [row["id"] for row in as_json["changed"]] == ["wrong"] and not as_json["same_dataset"]


def test_a_bad_dataset_is_refused_before_any_turn(eval_stack: Stack) -> None:
    folder = eval_folder([{"id": "a", "request": "hi"}, {"id": "a", "request": "again"}])
    done = fleet_eval(folder, "run", "data.jsonl", "--api-url", eval_stack.url)
    assert done.returncode == 2 and "data.jsonl:2: the id 'a' is used twice" in done.stderr
    assert not list(folder.glob("eval-*.json"))


def test_without_a_url_it_runs_on_an_embedded_stack(tmp_path: Path) -> None:
    folder = eval_folder([ROWS[0]])
    folder.chmod(0o711)  # its .fleet/ holds the embedded stack's workspaces
    done = fleet_eval(folder, "run", "data.jsonl", "--out", "r.json")
    assert done.returncode == 0, done.stderr
    receipt = json.loads((folder / "r.json").read_text())
    assert receipt["target"] == {"url": "embedded", "profile": "offline"}
    assert receipt["rows"][0]["score"] == 1.0


def git_head() -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_rated_answers_export_as_a_dataset_eval_can_run(eval_stack: Stack) -> None:
    folder = eval_folder([ROWS[0], ROWS[4]])
    assert (
        fleet_eval(folder, "run", "data.jsonl", "--api-url", eval_stack.url, "--out", "r.json").returncode
        == 0
    )
    rows = {row["id"]: row for row in json.loads((folder / "r.json").read_text())["rows"]}
    with eval_stack.client() as client:
        for row_id, rating, comment in (("mul", "up", None), ("wrong", "down", "that is not 5")):
            row = rows[row_id]
            body = {"run_id": row["run_id"], "rating": rating, **({"comment": comment} if comment else {})}
            sent = client.post(f"/api/sessions/{row['session_id']}/traces/feedback", json=body)
            assert sent.status_code == 201, sent.text
    done = fleet_eval(
        folder, "export-feedback", "--out", "feedback.jsonl", "--all-tenants", env=eval_stack.env
    )
    assert done.returncode == 0, done.stderr
    exported = [json.loads(line) for line in (folder / "feedback.jsonl").read_text().splitlines()]
    by_request = {row["request"]: row for row in exported}
    approved, rejected = by_request["What is 37 * 91?"], by_request["What is 2 + 2?"]
    assert approved["expected"] == rows["mul"]["answer"] and approved["metric"]["name"] == "judge"
    assert "expected" not in rejected and "'that is not 5'" in rejected["metric"]["rubric"]  # quoted
    assert (folder / "feedback.jsonl").stat().st_mode & 0o777 == 0o600
    assert rows["wrong"]["answer"] in rejected["metric"]["rubric"]
    assert load_dataset(folder / "feedback.jsonl").rows  # a dataset `fleet eval run` takes
    ups = fleet_eval(
        folder,
        "export-feedback",
        "--out",
        "up.jsonl",
        "--rating",
        "up",
        "--tenant",
        "default",
        env=eval_stack.env,
    )
    assert ups.returncode == 0 and len((folder / "up.jsonl").read_text().splitlines()) >= 1
    assert all("expected" in json.loads(line) for line in (folder / "up.jsonl").read_text().splitlines())
