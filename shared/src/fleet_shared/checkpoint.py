"""The per-session task checkpoint: a bounded goal-and-progress record (docs/rlm.md).

The worker computes the next record at settlement and the commit stores it with the Turn, in the
same transaction, as version `checkpoint_version` (the Turn's `finish.messageMetadata` says which
version it wrote). The goal is what the session set out to do (its first request); the progress
keeps the latest Turns' outcomes, each clipped, so the record stays small however long the
session runs.
"""

from __future__ import annotations

from typing import Any

GOAL_CHARS = 500
REQUEST_CHARS = 200
OUTCOME_CHARS = 300
PROGRESS_ENTRIES = 8


def clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def next_task(
    previous: dict[str, Any] | None,
    *,
    sequence: int,
    run_id: str,
    request: str,
    status: str,
    outcome: str,
    at: str,
) -> dict[str, Any]:
    """The record after one more settled Turn; `previous` is the stored one (None at first)."""
    previous = previous or {}
    goal = previous.get("goal") if isinstance(previous.get("goal"), str) else None
    stored = previous.get("progress")
    earlier: list[Any] = stored if isinstance(stored, list) else []
    entry = {
        "sequence": sequence,
        "run_id": run_id,
        "status": status,
        "request": clip(request, REQUEST_CHARS),
        "outcome": clip(outcome, OUTCOME_CHARS),
        "at": at,
    }
    return {
        "goal": goal or clip(request, GOAL_CHARS),
        "progress": [*earlier, entry][-PROGRESS_ENTRIES:],
        "updated_at": at,
    }
