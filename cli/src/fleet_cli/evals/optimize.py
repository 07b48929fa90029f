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
from dataclasses import dataclass, field
from typing import Any

from fleet_cli.evals.dataset import Dataset, Metric, Row, metric_of
from fleet_cli.evals.gateway import Gateway
from fleet_cli.evals.metrics import Judge, score
from fleet_shared.program_text import text_sha256

CREATED_BY = "fleet optimize (GEPA)"


@dataclass
class Candidates:
    """Program versions by text: the active one, and those stored for GEPA's proposals."""

    gateway: Gateway
    active_id: str
    active_text: str
    by_text: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def version_for(self, text: str) -> str:
        if text == self.active_text:
            return self.active_id
        with self.lock:
            if text not in self.by_text:
                stored = self.gateway.call(
                    "POST",
                    "/api/programs",
                    json={"text": text, "parent_id": self.active_id, "notes": "proposed by GEPA"},
                )
                self.by_text[text] = stored["id"]
            return self.by_text[text]


def split(rows: tuple[Row, ...], val_fraction: float, seed: int) -> tuple[list[Row], list[Row]]:
    """A seeded split: at least one row on each side."""
    shuffled = list(rows)
    random.Random(seed).shuffle(shuffled)
    cut = min(len(shuffled) - 1, max(1, round(len(shuffled) * val_fraction)))
    return shuffled[cut:], shuffled[:cut]


def optimize(
    dataset: Dataset,
    gateway: Gateway,
    *,
    default_metric: Metric,
    reflection_lm: Any,
    budget: int,
    val_fraction: float = 0.5,
    seed: int = 0,
    concurrency: int = 2,
    judge: Judge | None = None,
) -> dict[str, Any]:
    """Run GEPA; what it stored: the candidates with their validation scores, and the active
    version's score on the same rows."""
    import dspy

    active = next(p for p in gateway.call("GET", "/api/programs")["items"] if p["status"] == "active")
    active_text = gateway.call("GET", f"/api/programs/{active['id']}")["text"]
    candidates = Candidates(gateway, active["id"], active_text)
    rows = {row.id: row for row in dataset.rows}
    train, val = split(dataset.rows, val_fraction, seed)

    def answer_with(text: str, row_id: str) -> str:
        label = f"optimize {dataset.path.stem}"
        answered = gateway.answer(dataset, rows[row_id], label, candidates.version_for(text))
        return answered.answer if answered.run.get("status") == "completed" else ""

    class RunsAsTurns(dspy.Module):  # type: ignore[misc]  # dspy's Module is untyped
        def __init__(self) -> None:
            super().__init__()
            self.program = dspy.Predict(dspy.Signature("request -> answer", active_text))

        def forward(self, request: str, row_id: str) -> Any:
            prediction = dspy.Prediction(answer=answer_with(self.program.signature.instructions, row_id))
            if dspy.settings.trace is not None:  # as a predictor's own call would be recorded
                dspy.settings.trace.append((self.program, {"request": request}, prediction))
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
        num_threads=concurrency,
        track_stats=True,
        use_merge=False,
        seed=seed,
    )
    compiled = optimizer.compile(RunsAsTurns(), trainset=examples(train), valset=examples(val))
    results = compiled.detailed_results
    texts = [candidate.program.signature.instructions for candidate in results.candidates]
    active_score = next(
        (s for t, s in zip(texts, results.val_aggregate_scores, strict=True) if t == active_text), None
    )
    stored = []
    for text, val_score in zip(texts, results.val_aggregate_scores, strict=True):
        if text == active_text:
            continue
        version_id = candidates.version_for(text)
        validation = {
            "score": round(val_score, 4),
            "active_score": None if active_score is None else round(active_score, 4),
            "rows": len(val),
            "dataset_sha256": dataset.sha256,
            "optimizer": "dspy.GEPA",
            "budget": budget,
        }
        gateway.call("PATCH", f"/api/programs/{version_id}", json={"validation": validation})
        stored.append({"id": version_id, "text_sha256": text_sha256(text), **validation})
    unscored = [
        {"id": version_id, "text_sha256": text_sha256(text)}
        for text, version_id in candidates.by_text.items()
        if text not in texts
    ]
    return {
        "active": {"id": candidates.active_id, "validation_score": active_score},
        "candidates": stored,
        "proposed_not_validated": unscored,
        "train_rows": [r.id for r in train],
        "validation_rows": [r.id for r in val],
    }


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
