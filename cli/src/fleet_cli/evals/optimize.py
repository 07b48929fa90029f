"""`fleet optimize`: dspy.GEPA (its public API) over the RLM's instructions, every evaluation a
real Turn through a gateway, and the proposals stored as candidate program versions only.

- The dataset splits, seeded, into a train set (GEPA reflects on its failures) and a validation
  set (GEPA ranks candidates on it). Each row is scored with `fleet eval`'s metrics; the metric
  gives GEPA the expected answer, the answer and why it scored so, as feedback.
- GEPA's student is one predictor whose instructions are the program's text. Calling it runs the
  row as a Turn on the program version holding that text: the active one for the seed, a new
  candidate (`POST /api/programs`) for each text GEPA proposes. The call is recorded in DSPy's
  trace as the predictor's own would be, so GEPA's reflection sees its inputs and output.
- The reflection LM is a profile's root LM (`--reflection-profile`): a provider, never scripted.
- At the end each candidate GEPA scored on the validation set gets `validation`: its score, the
  active version's on the same rows, the rows, the dataset's hash. Nothing is activated.
"""

from __future__ import annotations

import os
import random
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from fleet_cli.evals.dataset import Dataset, Metric, Row, metric_of
from fleet_cli.evals.gateway import Gateway, TurnRefused
from fleet_cli.evals.metrics import Judge, score
from fleet_shared.program_text import text_sha256

PROPOSED = "proposed by fleet optimize (dspy.GEPA)"
NOT_VALIDATED = "not validated: on its minibatch it did not beat the version it was proposed from"
MINIBATCH = 3  # train rows GEPA reflects on at a time


class OptimizeError(RuntimeError):
    """The optimization cannot start, or stopped; the message says why."""


@dataclass
class Candidates:
    """Program versions by text: the active one, and those stored for GEPA's proposals; and, per
    version, the Turns that ended without an answer to score (refused, failed, cut off)."""

    gateway: Gateway
    active_id: str
    active_text: str
    by_text: dict[str, str] = field(default_factory=dict)
    unanswered: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def version_for(self, text: str) -> str:
        if text == self.active_text:
            return self.active_id
        with self.lock:
            if text not in self.by_text:
                stored = self.gateway.call(
                    "POST",
                    "/api/programs",
                    json={"text": text, "parent_id": self.active_id, "notes": PROPOSED},
                )
                self.by_text[text] = stored["id"]
            return self.by_text[text]

    def count_unanswered(self, version: str) -> None:
        with self.lock:  # GEPA evaluates rows on several threads
            self.unanswered[version] += 1

    def stored(self) -> list[dict[str, Any]]:
        return [{"id": i, "text_sha256": text_sha256(t)} for t, i in self.by_text.items()]


def split(rows: tuple[Row, ...], val_fraction: float, seed: int) -> tuple[list[Row], list[Row]]:
    """A seeded split: at least one row on each side."""
    shuffled = list(rows)
    random.Random(seed).shuffle(shuffled)
    cut = min(len(shuffled) - 1, max(1, round(len(shuffled) * val_fraction)))
    return shuffled[cut:], shuffled[:cut]


def smallest_budget(validation_rows: int) -> int:
    """GEPA scores the active version on every validation row first, then a minibatch of the
    train set for it and one for a proposal: less than that never proposes anything."""
    return validation_rows + 2 * MINIBATCH


def optimize(
    dataset: Dataset,
    gateway: Gateway,
    report: dict[str, Any],
    *,
    default_metric: Metric,
    reflection_lm: Any,
    budget: int,
    val_fraction: float = 0.5,
    seed: int = 0,
    concurrency: int = 2,
    judge: Judge | None = None,
) -> None:
    """Run GEPA, filling `report` as it goes (so a run that stops midway still says which
    candidates it stored): the split, the candidates with their validation scores, and the
    active version's score on the same rows. OptimizeError when it cannot start."""
    import dspy

    listed = gateway.call("GET", "/api/programs")["items"]
    active = next((p for p in listed if p["status"] == "active"), None)
    if active is None:
        raise OptimizeError("no program version is active: `fleet db upgrade` seeds the shipped one")
    active_text = gateway.call("GET", f"/api/programs/{active['id']}")["text"]
    candidates = Candidates(gateway, active["id"], active_text)
    rows = {row.id: row for row in dataset.rows}
    train, val = split(dataset.rows, val_fraction, seed)
    preflight(budget, len(val), reflection_lm)
    report.update(
        active={"id": active["id"], "validation_score": None},
        train_rows=[r.id for r in train],
        validation_rows=[r.id for r in val],
        candidates=[],
    )

    def answer_with(text: str, row_id: str) -> str:
        version = candidates.version_for(text)
        label = f"optimize {dataset.path.stem}"
        try:
            answered = gateway.answer(dataset, rows[row_id], label, version)
        except (TurnRefused, httpx.HTTPError, OSError, ValueError, KeyError):
            candidates.count_unanswered(version)  # scored 0 by GEPA, and said in the report
            raise
        if answered.run.get("status") != "completed":
            candidates.count_unanswered(version)
            return ""
        return answered.answer

    class RunsAsTurns(dspy.Module):  # type: ignore[misc]  # dspy's Module is untyped
        def __init__(self) -> None:
            super().__init__()
            self.program = dspy.Predict(dspy.Signature("request -> answer", active_text))

        def forward(self, request: str, row_id: str) -> Any:
            prediction = dspy.Prediction(answer=answer_with(self.program.signature.instructions, row_id))
            trace = dspy.settings.trace  # recorded as the predictor's own call would be
            if trace is not None and len(trace) < dspy.settings.max_trace_size:
                trace.append((self.program, {"request": request}, prediction))
            return prediction

    def metric(gold: Any, pred: Any, trace: Any = None, pred_name: Any = None, pred_trace: Any = None) -> Any:
        row = rows[gold.row_id]
        scored = score(metric_of(row, default_metric), row, str(pred.answer), judge, dataset.path.parent)
        value = 0.0 if scored.value is None else scored.value
        feedback = f"Expected {row.expected!r}; the answer was {str(pred.answer)[:2000]!r}. {scored.detail}"
        return dspy.Prediction(score=value, feedback=feedback)

    def examples(part: list[Row]) -> list[Any]:
        return [dspy.Example(request=r.request, row_id=r.id).with_inputs("request", "row_id") for r in part]

    optimizer = dspy.GEPA(
        metric=metric,
        max_metric_calls=budget,
        reflection_lm=reflection_lm,
        reflection_minibatch_size=MINIBATCH,
        num_threads=concurrency,
        track_stats=True,
        use_merge=False,
        seed=seed,
    )
    try:
        compiled = optimizer.compile(RunsAsTurns(), trainset=examples(train), valset=examples(val))
    finally:
        report["proposed"] = candidates.stored()
        report["unanswered_turns"] = {version: n for version, n in candidates.unanswered.items()}
    record(
        compiled.detailed_results,
        candidates,
        report,
        dataset=dataset,
        validation_rows=len(val),
        budget=budget,
    )


def preflight(budget: int, validation_rows: int, reflection_lm: Any) -> None:
    """What stops an optimization before its first Turn: a budget too small to propose
    anything, a reflection LM that does not answer."""
    if budget < smallest_budget(validation_rows):
        raise OptimizeError(
            f"--budget {budget} is below {smallest_budget(validation_rows)}: GEPA first scores the active "
            f"version on all {validation_rows} validation rows, then needs two minibatches of {MINIBATCH}"
        )
    try:
        reflection_lm("Reply with the word OK.")  # a bad key or endpoint fails here, not unseen in GEPA
    except Exception as exc:  # the LM client's own errors: say which, and stop before any Turn
        raise OptimizeError(f"the reflection LM failed: {type(exc).__name__}: {exc}") from exc


def record(
    results: Any,
    candidates: Candidates,
    report: dict[str, Any],
    *,
    dataset: Dataset,
    validation_rows: int,
    budget: int,
) -> None:
    """Each stored proposal's outcome on its version: validation scores beside the active
    version's, or a note that it was never validated."""
    texts = [candidate.program.signature.instructions for candidate in results.candidates]
    scores = dict(zip(texts, results.val_aggregate_scores, strict=True))
    active_score = scores.get(candidates.active_text)
    report["active"]["validation_score"] = active_score
    for text, version_id in candidates.by_text.items():
        if text not in scores:  # GEPA tried it on a minibatch only: it did not beat its parent
            notes = f"{PROPOSED}; {NOT_VALIDATED}"
            candidates.gateway.call("PATCH", f"/api/programs/{version_id}", json={"notes": notes})
            continue
        validation = {
            "score": round(scores[text], 4),
            "active_score": None if active_score is None else round(active_score, 4),
            "rows": validation_rows,
            "dataset_sha256": dataset.sha256,
            "optimizer": "dspy.GEPA",
            "budget": budget,
            "unanswered_turns": candidates.unanswered[version_id],
            "active_unanswered_turns": candidates.unanswered[candidates.active_id],
        }
        candidates.gateway.call("PATCH", f"/api/programs/{version_id}", json={"validation": validation})
        report["candidates"].append({"id": version_id, "text_sha256": text_sha256(text), **validation})


def reflection_lm_of(profile: str) -> Any:
    """The profile's root LM, as dspy.GEPA's reflection LM."""
    import dspy

    from fleet_shared.config import load_settings

    environ = {**os.environ, "FLEET_PROFILE": profile}
    environ.setdefault("FLEET_REDIS_URL", "redis://unused")
    lm = load_settings(environ).root_lm
    if lm.scripted:
        raise ValueError(f"profile {profile!r}: its root LM is the scripted LM, which cannot reflect")
    return dspy.LM(
        lm.name,
        api_key=lm.api_key.reveal() if lm.api_key else None,
        api_base=lm.base_url,
        num_retries=lm.num_retries,
        max_tokens=lm.max_tokens or 4000,
        temperature=1.0,
        cache=False,
    )
