"""The link probes (link_probe.py) through real Turns (attacks.py): what a cell forges on its link
to the supervisor never becomes the Run's answer, a tool call the Turn did not offer, or an LM
call past the Turn's budget. The Run's answer is what the Turn's code submits: a probe's cell
ends with SUBMIT(answer='first'), which its forged frame keeps from arriving (the cell fails with
the supervisor's error), so the next action's SUBMIT(answer='second') is the answer. A probe that
missed the link would leave 'first'.
"""

from __future__ import annotations

import json

import pytest

from fleet_shared.events import LMQueryStarted
from tests.integration.attacks import HarnessFactory, attack
from tests.integration.link_probe import probe, reached_link

pytestmark = pytest.mark.escape

MARKER = "'INJ' + 'ECTED'"  # cell code spells it so: the code itself is in the Run's events


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    """SQLite only: the sandbox is the subject here, not the database."""
    return sqlite_url


FORGED = {
    "a final answer for the next cell": (
        f"frame({{'op': 'result', 'id': cell_id() + 1, 'final': {{'answer': {MARKER}}}}})"
    ),
    "a final answer with no cell id": f"frame({{'op': 'result', 'final': {{'answer': {MARKER}}}}})",
    "a frame far over the cap": f"struct.pack('>I', 2**32 - 1) + ({MARKER}).encode()",
    "garbage": f"({MARKER} + ' is no frame').encode()",
    "an LM call with arguments not an object": (
        f"frame({{'op': 'tool_call', 'name': 'llm_query', 'kwargs': [{MARKER}]}})"
    ),
}


@pytest.mark.parametrize("forged", FORGED.values(), ids=FORGED.keys())
async def test_nothing_forged_on_the_link_becomes_the_answer(
    harness_factory: HarnessFactory, forged: str
) -> None:
    outcome = await attack(
        harness_factory, probe(f"send(fd, {forged})\nSUBMIT(answer='first')"), answer="'second'"
    )
    first = outcome.cell_outputs[0]
    reached_link(first.stdout)
    assert first.error is not None and "protocol does not allow" in first.error
    assert outcome.run.status == "completed" and outcome.answer == "second"
    assert not [e for e in outcome.events if isinstance(e, LMQueryStarted)]
    assert all("INJECTED" not in repr(event) for event in outcome.events)


async def test_forged_lm_calls_are_metered_and_a_forged_submit_call_is_refused(
    harness_factory: HarnessFactory,
) -> None:
    """LM calls written to the link are admitted by the Turn's budget like any other; `SUBMIT`
    is no tool the host has. The cell reads each reply back from the link."""
    outcome = await attack(
        harness_factory,
        probe(
            "calls = [('llm_query', {'prompt': 'hi'})] * 4 + [('SUBMIT', {'answer': " + MARKER + "})]\n"
            "replies = []\n"
            "for name, kwargs in calls:\n"
            "    send(fd, frame({'op': 'tool_call', 'name': name, 'kwargs': kwargs}))\n"
            "    reply = receive(fd)\n"
            "    replies.append([reply['ok'], reply['value'] if reply['ok'] else reply['error']])\n"
            "result = json.dumps(replies)"
        ),
        lines=({"lm": "sub", "text": "a sub answer"},) * 4,
        rlm={"max_llm_calls": 2},
    )
    reached_link(outcome.cell_outputs[0].stdout)
    assert outcome.run.status == "completed"
    replies = json.loads(outcome.answer)  # the real SUBMIT's answer: what the cell read back
    assert replies[-1] == [False, "unknown tool 'SUBMIT'"]
    answered = [value for ok, value in replies[:-1] if ok]
    refused = [value for ok, value in replies[:-1] if not ok]
    assert answered and set(answered) == {"a sub answer"}  # served by the host, as a stub call is
    assert len(answered) == len([e for e in outcome.events if isinstance(e, LMQueryStarted)]) <= 2
    assert refused and all("rlm.max_llm_calls" in error for error in refused)


async def test_a_frame_stalled_on_the_link_times_the_cell_out_and_the_turn_goes_on(
    harness_factory: HarnessFactory,
) -> None:
    """Half a header, taken by the supervisor, which waits for the rest: the cell ends at its
    timeout (2 s here), the next action runs in a fresh REPL, and the Turn completes."""
    outcome = await attack(
        harness_factory,
        probe(
            "send(fd, b'\\x00\\x00')\ntaken(fd)\nprint('TAKEN', flush=True)\nwhile True:\n    time.sleep(1)"
        ),
        answer="'second'",
    )
    first = outcome.cell_outputs[0]
    reached_link(first.stdout)
    assert first.stdout.endswith("TAKEN\n")
    assert first.error is not None and "timeout" in first.error
    assert outcome.run.status == "completed" and outcome.answer == "second"
    assert outcome.run.started_at and outcome.run.finished_at
    assert (outcome.run.finished_at - outcome.run.started_at).total_seconds() < 15
