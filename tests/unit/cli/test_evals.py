"""`fleet eval`'s pure parts: the dataset's checks, the metrics, the paired tests, the comparison
and the generated datasets."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

from fleet_cli.evals.compare import ReceiptError, compare, load_receipt, render
from fleet_cli.evals.dataset import DatasetError, Metric, Row, load_dataset, metric_of
from fleet_cli.evals.generate import generate, sizes, write_dataset
from fleet_cli.evals.metrics import check_metric, score
from fleet_cli.evals.runner import totals, unanswered
from fleet_cli.evals.stats import mcnemar, paired_test, percentile, sign_flip


def dataset(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def test_a_dataset_loads_with_its_metrics_and_hash(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    path = dataset(
        tmp_path,
        '{"id": "a", "request": "2+2?", "expected": 4, "metric": "numeric"}',
        "",
        '{"id": "b", "request": "hi", "attachments": ["notes.txt"],'
        ' "metric": {"name": "regex", "pattern": "h"}}',
        '{"id": "c", "request": "x", "metric": "scoring:grade"}',
    )
    loaded = load_dataset(path)
    assert [r.id for r in loaded.rows] == ["a", "b", "c"]
    assert loaded.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert loaded.attachment("notes.txt") == (tmp_path / "notes.txt").resolve()
    default = Metric(name="exact")
    assert [metric_of(r, default).name for r in loaded.rows] == ["numeric", "regex", "scoring:grade"]
    assert load_dataset(path, limit=1).rows == loaded.rows[:1]


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "data.jsonl:2: not a JSON object"),
        ('{"id": "b"}', "data.jsonl:2: Object missing required field `request`"),
        ('{"id": "a", "request": "again"}', "the id 'a' is used twice"),
        ('{"id": "b", "request": "x", "metric": "fuzzy"}', "data.jsonl:2"),
        ('{"id": "b", "request": "x", "metric": "os.system"}', "data.jsonl:2"),  # not module:function
        ('{"id": "b", "request": "x", "attachments": ["gone.txt"]}', "is not a file next to the dataset"),
        ('{"id": "b", "request": "x", "attachments": ["../secret"]}', "is outside the dataset's folder"),
        (
            '{"id": "b", "request": "x", "metric": {"name": "regex", "pattern": "("}}',
            "the pattern is not a regex",
        ),
        ('{"id": "b", "request": "x", "bogus": 1}', "unknown field `bogus`"),
    ],
)
def test_a_bad_line_stops_the_run_naming_it(tmp_path: Path, line: str, says: str) -> None:
    path = dataset(tmp_path, '{"id": "a", "request": "fine"}', line)
    with pytest.raises(DatasetError) as raised:
        load_dataset(path)
    assert says in str(raised.value)


def test_an_empty_dataset_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no rows"):
        load_dataset(dataset(tmp_path, ""))


def row(expected: Any = None, **fields: Any) -> Row:
    return Row(id="r", request="what?", expected=expected, **fields)


@pytest.mark.parametrize(
    ("metric", "expected", "answer", "value"),
    [
        (Metric(name="exact"), "Paris", "  Paris ", 1.0),
        (Metric(name="exact"), "Paris", "paris", 0.0),
        (Metric(name="exact"), "new  york", "new york", 1.0),  # runs of whitespace are one space
        (Metric(name="contains"), "paris", "It is PARIS.", 1.0),
        (Metric(name="contains"), "lyon", "It is Paris.", 0.0),
        (Metric(name="regex"), r"^\d{4}$", "2026", 1.0),
        (Metric(name="regex", pattern=r"\bcat\b"), None, "a cat sat", 1.0),
        (Metric(name="numeric"), 12, "112", 0.0),  # never a substring
        (Metric(name="numeric"), 3367, "37 * 91 = 3,367 (computed in the sandbox).", 1.0),
        (Metric(name="numeric"), "3.14", "about 3.1416", 0.0),
        (Metric(name="numeric", tolerance=0.01), "3.14", "about 3.1416", 1.0),
        (Metric(name="numeric"), 7, "no number here", 0.0),
        (Metric(name="numeric"), -2, "-2", 1.0),
        (Metric(name="numeric"), "482913", "482913 (the code for river-512)", 1.0),  # no -512
        (Metric(name="numeric"), "1234.5", "it is 1,234.5", 1.0),
        (Metric(name="numeric"), 12, "1,2", 0.0),  # not a thousands group: no number
        (Metric(name="numeric"), -3, "\u22123", 1.0),  # a Unicode minus
        (Metric(name="numeric"), 42, "The answer is 42.", 1.0),
    ],
)
def test_the_built_in_metrics(metric: Metric, expected: Any, answer: str, value: float) -> None:
    assert score(metric, row(expected), answer).value == value


def test_rows_without_an_expected_answer_are_not_scored() -> None:
    for name in ("exact", "contains", "numeric", "regex"):
        assert score(Metric(name=name), row(None), "anything").value is None
    assert score(Metric(name="numeric"), row("many"), "3").value is None  # not a number: said


def test_a_hook_scores_with_the_operators_code(tmp_path: Path) -> None:
    (tmp_path / "eval_hooks_for_test.py").write_text(
        "def grade(answer, expected, row):\n"
        "    return 0.5 if row['id'] == 'r' and answer == expected else 0\n"
        "def wrong(answer, expected, row):\n    return 'yes'\n"
    )
    assert score(Metric(name="eval_hooks_for_test:grade"), row("x"), "x", hooks=tmp_path).value == 0.5
    with pytest.raises(ValueError, match="a bool or a number from 0 to 1"):
        score(Metric(name="eval_hooks_for_test:wrong"), row("x"), "x", hooks=tmp_path)


def test_the_judge_reads_a_score_and_its_reason() -> None:
    prompts: list[str] = []

    def judge(prompt: str) -> str:
        prompts.append(prompt)
        return 'Sure. {"score": 0.8, "reason": "close enough"}'

    scored = score(Metric(name="judge", rubric="be kind"), row("Paris"), "It is Paris", judge)
    assert (scored.value, scored.detail) == (0.8, "close enough")
    assert "Rubric: be kind" in prompts[0] and "It is Paris" in prompts[0] and "Paris" in prompts[0]
    assert score(Metric(name="judge"), row("x"), "y", lambda _p: "no idea").value is None
    assert score(Metric(name="judge"), row("x"), "y", lambda _p: '{"score": 7}').value == 1.0  # clamped


def test_percentiles_are_nearest_rank() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(n) for n in range(1, 21)], 0.95) == 19.0


def test_mcnemar_is_exact() -> None:
    # 6 rows right only in B, none only in A: p = 2 * (1/2)^6.
    pairs = [(0.0, 1.0)] * 6 + [(1.0, 1.0)] * 10
    p, test = mcnemar(pairs)
    assert p == pytest.approx(2 / 64) and "6 rows right only in B, 0 only in A" in test
    assert mcnemar([(1.0, 1.0), (0.0, 0.0)])[0] == 1.0
    assert paired_test(pairs)[1].startswith("McNemar")


def test_the_sign_flip_test_is_exact_for_few_rows() -> None:
    # Three rows, all +0.5: of 8 sign patterns, 2 reach |sum| = 1.5.
    p, test = sign_flip([(0.0, 0.5)] * 3)
    assert p == pytest.approx(2 / 8) and "exact" in test
    assert paired_test([(0.2, 0.7)] * 3)[1].startswith("sign-flip")
    many, test = sign_flip([(0.0, 0.5)] * 30)
    assert many < 0.001 and "20000 samples" in test


def receipt(sha: str, scores: dict[str, float | None], status: str = "completed") -> dict[str, Any]:
    rows = [{"id": i, "score": s, "status": status} for i, s in scores.items()]
    totals = {"usd_per_query": 0.01, "seconds_p50": 1.0, "seconds_p95": 2.0, "lm_calls": 4, "failed": 0}
    return {"kind": "fleet-eval/1", "dataset": {"sha256": sha}, "rows": rows, "totals": totals}


def test_compare_pairs_rows_by_id_and_tests_the_difference() -> None:
    a = receipt("s", {f"r{i}": 0.0 for i in range(8)} | {"gone": 1.0})
    b = receipt("s", {f"r{i}": 1.0 for i in range(8)} | {"new": 1.0})
    result = compare(a, b)
    assert result["paired_rows"] == 8 and result["only_in_a"] == ["gone"] and result["only_in_b"] == ["new"]
    assert (result["mean_a"], result["mean_b"]) == (0.0, 1.0)
    assert result["p_value"] == pytest.approx(2 / 256) and result["significant"]
    assert [c["id"] for c in result["changed"]] == [f"r{i}" for i in range(8)]
    text = render(result, "a.json", "b.json")
    assert "B - A = +1.0000" in text and "significant at 0.05" in text and "only in A: gone" in text


def test_compare_of_the_same_run_finds_nothing() -> None:
    a = receipt("s", {"x": 1.0, "y": 0.0})
    result = compare(a, a)
    assert result["changed"] == [] and result["p_value"] == 1.0 and not result["significant"]
    assert "(no row changed)" in render(result, "a", "a")


def test_generated_datasets_are_seeded_and_hold_their_answers(tmp_path: Path) -> None:
    first = write_dataset(tmp_path / "a" / "d.jsonl", "niah", 3, seed=1, smallest=2_000, largest=8_000)
    second = write_dataset(tmp_path / "b" / "d.jsonl", "niah", 3, seed=1, smallest=2_000, largest=8_000)
    assert first.read_bytes() == second.read_bytes()
    rows = [json.loads(line) for line in first.read_text().splitlines()]
    for entry in rows:
        (name,) = entry["attachments"]
        text = (first.parent / name).read_text()
        assert text == (second.parent / name).read_text()
        found = re.search(r"The secret code for (\S+) is (\d+)\.", text)
        assert found is not None and found.group(2) == entry["expected"]
        assert found.group(1) in entry["request"] and name in entry["request"]
    lengths = [len((first.parent / r["attachments"][0]).read_text()) for r in rows]
    assert lengths == sorted(lengths) and lengths[0] >= 2_000
    assert load_dataset(first).rows[0].attachments == (rows[0]["attachments"][0],)  # it loads
    assert sizes(10, 100_000, 1_000_000)[0] == 100_000 and sizes(10, 100_000, 1_000_000)[-1] == 1_000_000
    # The requests stay short whatever the size: the gateway's max_text_chars is 100,000 at most.
    assert all(len(row["request"]) < 500 for row, _ in generate("niah", 3, seed=7))
    for index, (entry, table) in enumerate(generate("oolong", 4, seed=3, smallest=3_000, largest=3_000)):
        label = re.search(r"labelled (\w+)", entry["request"]).group(1)  # type: ignore[union-attr]
        records = [line.split(" | ") for line in table.splitlines()[1:]]
        mine = [int(amount) for _, _, lab, amount in records if lab == label]
        assert entry["expected"] == (sum(mine) if index % 2 else len(mine))


@pytest.mark.parametrize(
    "body",
    [
        "[]",
        '{"kind": "fleet-eval/1"}',
        '{"kind": "fleet-eval/1", "rows": [{"id": "a"}], "totals": {}, "dataset": {}}',
    ],
)
def test_a_malformed_receipt_is_refused_by_name(tmp_path: Path, body: str) -> None:
    path = tmp_path / "r.json"
    path.write_text(body)
    with pytest.raises(ReceiptError, match=r"r\.json"):
        load_receipt(path)


def test_rows_no_run_answered_score_zero_when_they_would_have_been_scored() -> None:
    refused = unanswered(row(5), Metric(name="numeric"), "refused", "429 quota_exceeded")
    assert (refused.status, refused.score, refused.failure_code) == ("refused", 0.0, "refused")
    assert unanswered(row(None), Metric(name="exact"), "error", "x").score is None
    assert totals([refused])["accuracy"] == 0.0 and totals([refused])["refused"] == 1


def test_metrics_that_cannot_score_are_found_before_any_turn(tmp_path: Path) -> None:
    (tmp_path / "eval_hooks_broken.py").write_text("raise RuntimeError('no')\n")
    assert check_metric(Metric(name="judge"), tmp_path, None) == "a `judge` row needs --judge-profile"
    assert check_metric(Metric(name="judge"), tmp_path, lambda _p: "") is None
    assert "RuntimeError: no" in (check_metric(Metric(name="eval_hooks_broken:grade"), tmp_path, None) or "")
    assert "no such function" in (check_metric(Metric(name="json:no_such"), tmp_path, None) or "")
    assert check_metric(Metric(name="exact"), tmp_path, None) is None
