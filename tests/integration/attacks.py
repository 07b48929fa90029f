"""Attacks run as real Turns, for the escape suite: a two-action script whose first action attacks
only when the Turn's request starts with "attack", and the session's next Turn ("hello"), which
runs the same script without the attack and must succeed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleet_shared.db import queries
from fleet_shared.events import CellOutput, RunEvent
from tests.integration.harness import Harness

HarnessFactory = Callable[..., Harness]


def attack_script(code: str, answer: str = "str(result)") -> tuple[dict[str, Any], ...]:
    """Two actions: the attack (only when the request says so), then a SUBMIT of what it found."""
    indented = "\n".join("    " + line for line in code.strip().splitlines())
    first = f"result = 'not attacked'\nif request.startswith('attack'):\n{indented}\nprint('cell 1 done')"
    return (
        {"lm": "root", "reasoning": "attack", "code": first},
        {"lm": "root", "reasoning": "report", "code": f"SUBMIT(answer={answer})"},
    )


@dataclass
class Attack:
    harness: Harness
    session_id: str
    run: Any
    events: list[RunEvent]
    answer: str
    next_run: Any

    @property
    def cell_outputs(self) -> list[CellOutput]:
        return [e for e in self.events if isinstance(e, CellOutput)]


async def attack(
    factory: HarnessFactory,
    code: str,
    *,
    answer: str = "str(result)",
    lines: tuple[dict[str, Any], ...] = (),
    **settings: Any,
) -> Attack:
    """`lines`: more of the script (the sub-LM's answers to `llm_query`, say)."""
    harness = factory(*attack_script(code, answer), *lines, **settings)
    run_id = await harness.submit("attack")
    await harness.work()
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None
        session_id = run.session_id
    next_id = await harness.submit("hello", session_id=session_id, key="next")
    await harness.work()
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
        next_run = await queries.get_run(db, next_id)
        turns = await queries.list_turns(db, session_id, after_sequence=0, limit=10)
    answer_text = "".join(p.get("text", "") for p in turns[1].parts if p["type"] == "text")
    assert next_run is not None and next_run.status == "completed", "the session's next Turn failed"
    return Attack(harness, session_id, run, await harness.events(run_id), answer_text, next_run)
