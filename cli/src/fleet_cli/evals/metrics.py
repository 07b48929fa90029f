"""Scoring an answer: a number in [0, 1] (1 is right), or None when a row has nothing to score
against. `exact`, `contains`, `regex` and `numeric` are pure; `judge` asks an LM; a hook
(`module:function`) is the operator's own code, called as `function(answer=, expected=, row=)`."""

from __future__ import annotations

import importlib
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from fleet_cli.evals.dataset import Metric, Row

# A number standing on its own: not the tail of a word or an id ("river-512" holds no -512),
# thousands in groups of three ("1,234.5"; "1,2" is two numbers), a Unicode minus as a minus.
NUMBER = re.compile(
    r"(?<![\w.,-])[-+\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w,]\d)"
)
JUDGE_PROMPT = """You grade an answer to a request. Reply with one JSON object and nothing else:
{{"score": <a number from 0 (wrong) to 1 (right)>, "reason": "<one sentence>"}}

Rubric: {rubric}

Request:
{request}

Expected answer (may be empty):
{expected}

Answer to grade:
{answer}
"""
DEFAULT_RUBRIC = "The answer says what the expected answer says; wording and format do not matter."

Judge = Callable[[str], str]  # a prompt to the judge LM's reply


@dataclass(frozen=True)
class Score:
    value: float | None  # None: not scored (no expected answer, or the Turn did not answer)
    detail: str = ""


def score(
    metric: Metric, row: Row, answer: str, judge: Judge | None = None, hooks: Path | None = None
) -> Score:
    """`answer`'s score under `metric`; `hooks` is the folder a hook's module may live in."""
    expected = None if row.expected is None else str(row.expected)
    if metric.name == "judge":
        if judge is None:
            raise ValueError("the judge metric needs --judge-profile")
        return judged(judge, metric, row, answer)
    if ":" in metric.name:
        return hooked(metric.name, row, answer, hooks)
    if metric.name == "regex":
        pattern = metric.pattern or expected
        if pattern is None:
            return Score(None, "no pattern and no expected answer")
        return Score(float(re.search(pattern, answer) is not None))
    if expected is None:
        return Score(None, "no expected answer")
    if metric.name == "exact":
        return Score(float(" ".join(answer.split()) == " ".join(expected.split())))
    if metric.name == "contains":
        return Score(float(expected.casefold() in answer.casefold()))
    return numeric(answer, expected, metric.tolerance)


def number(text: str) -> float | None:
    """`text` as a number when it is exactly one (as NUMBER reads them), else None."""
    if NUMBER.fullmatch(text) is None:
        return None
    return float(text.replace(",", "").replace("\u2212", "-"))


def numeric(answer: str, expected: str, tolerance: float) -> Score:
    """The answer's number (the whole answer when it is one, else the last number in it) within
    `tolerance` of the expected one: "112" never passes for "12"."""
    want = number(expected.strip())
    if want is None:
        return Score(None, f"the expected answer {expected!r} is not a number")
    found = number(answer.strip().rstrip("."))
    if found is None:
        numbers = [n for n in (number(m.group(0)) for m in NUMBER.finditer(answer)) if n is not None]
        found = numbers[-1] if numbers else None
    if found is None:
        return Score(0.0, "no number in the answer")
    return Score(float(math.isclose(found, want, rel_tol=0, abs_tol=tolerance)), f"read {found:g}")


def judged(judge: Judge, metric: Metric, row: Row, answer: str) -> Score:
    prompt = JUDGE_PROMPT.format(
        rubric=metric.rubric or DEFAULT_RUBRIC,
        request=row.request[:20_000],
        expected="" if row.expected is None else row.expected,
        answer=answer[:20_000],
    )
    reply = judge(prompt)
    match = re.search(r"\{.*\}", reply, re.S)
    try:
        verdict = json.loads(match.group(0)) if match else {}
        value = float(verdict["score"])
    except (ValueError, KeyError, TypeError):
        return Score(None, f"the judge's reply has no score: {reply[:200]!r}")
    return Score(min(1.0, max(0.0, value)), str(verdict.get("reason", ""))[:500])


def hooked(name: str, row: Row, answer: str, hooks: Path | None) -> Score:
    module_name, _, function_name = name.partition(":")
    if hooks is not None and str(hooks) not in sys.path:
        sys.path.append(str(hooks))  # a metrics module next to the dataset (never shadowing one)
    function = getattr(importlib.import_module(module_name), function_name)
    result: Any = function(answer=answer, expected=row.expected, row=msgspec.to_builtins(row))
    if result is None:
        return Score(None, f"{name} did not score it")
    if isinstance(result, bool | int | float) and 0 <= float(result) <= 1:
        return Score(float(result))
    raise ValueError(f"{name} returned {result!r}: a bool or a number from 0 to 1")


def check_metric(metric: Metric, hooks: Path, judge: Judge | None) -> str | None:
    """Why rows with `metric` cannot be scored, found before any Turn is paid for; None: they can."""
    if metric.name == "judge" and judge is None:
        return "a `judge` row needs --judge-profile"
    if metric.pattern is not None:
        try:
            re.compile(metric.pattern)
        except re.error as exc:
            return f"the pattern {metric.pattern!r}: {exc}"
    if ":" in metric.name:
        module_name, _, function_name = metric.name.partition(":")
        if str(hooks) not in sys.path:
            sys.path.append(str(hooks))
        try:
            function = getattr(importlib.import_module(module_name), function_name, None)
        except Exception as exc:  # the operator's module failed to import: say how
            return f"{metric.name}: {type(exc).__name__}: {exc}"
        if not callable(function):
            return f"{metric.name}: no such function"
    return None


def litellm_judge(profile: str) -> Judge:
    """The named profile's root LM as a judge (a provider LM; temperature 0)."""
    import os

    from fleet_shared.config import load_settings

    environ = {**os.environ, "FLEET_PROFILE": profile}
    environ.setdefault("FLEET_REDIS_URL", "redis://unused")
    lm = load_settings(environ).root_lm
    if lm.scripted:
        raise ValueError(f"profile {profile!r}: its root LM is the scripted LM, which cannot judge")
    import litellm  # the worker side's LM client

    def ask(prompt: str) -> str:
        reply = litellm.completion(
            model=lm.name,
            messages=[{"role": "user", "content": prompt}],
            api_key=lm.api_key.reveal() if lm.api_key else None,
            api_base=lm.base_url,
            temperature=0,
            num_retries=lm.num_retries,
            timeout=lm.request_timeout,
        )
        return str(reply.choices[0].message.content or "")

    return ask
