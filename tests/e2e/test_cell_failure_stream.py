"""End to end: a cell that prints, then runs past its timeout. The client is told what it printed.

Real `fleet gateway` and `fleet worker` processes, a real bwrap sandbox with a short cell timeout,
the scripted LM. `tool-output-error` has only `errorText`, so the cell's output is there, ahead of
why it failed: in the live stream, in the committed Turn, and in the replay of that Turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Stack, ai_sdk_parse, start_stack, stop_stack, work_dir
from tests.e2e.sse import post_turn
from tests.support.policy import private_policy

pytestmark = pytest.mark.e2e

PRINTED = "BEFORE-LOOP"
CELL_TIMEOUT_SECONDS = 2
SCRIPT = [
    {"lm": "root", "reasoning": "Print, then spin.", "code": f"print('{PRINTED}')\nwhile True:\n    pass"},
    {"lm": "root", "reasoning": "Answer.", "code": "SUBMIT(answer='after the timeout')"},
]


@pytest.fixture(scope="module")
def timeout_stack() -> Iterator[Stack]:
    data_dir = work_dir("cell-timeout")
    script = data_dir / "timeout.jsonl"
    script.write_text("".join(json.dumps(line) + "\n" for line in SCRIPT))
    env = {
        **private_policy(data_dir, cell_timeout_seconds=CELL_TIMEOUT_SECONDS),
        "FLEET_SCRIPTED_LM": str(script),
    }
    stack = start_stack(data_dir, env)
    yield stack
    stop_stack(stack)


def python_tool_parts(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in parts if p.get("type") == "dynamic-tool" and p.get("toolName") == "python"]


def test_a_timed_out_cell_streams_what_it_printed(timeout_stack: Stack, node_check: Path) -> None:
    with timeout_stack.client() as client:
        response = client.post("/api/sessions", json={"title": "cell timeout"})
        assert response.status_code == 201, response.text
        session_id = response.json()["id"]
        live = post_turn(client, session_id, "spin", "spin-1")
        history = client.get(f"/api/sessions/{session_id}/turns").json()
        replay = post_turn(client, session_id, "spin", "spin-1")
    assert live.chunks[-1]["finishReason"] == "stop", live.chunks[-3:]

    errors = live.of_type("tool-output-error")
    assert len(errors) == 1, live.types
    error_text = errors[0]["errorText"]
    assert error_text.startswith(f"{PRINTED}\n"), error_text
    told = error_text.index(f"exceeded the {CELL_TIMEOUT_SECONDS}s timeout")
    assert told > error_text.index(PRINTED), error_text  # the output comes first

    for alias in ("ai6", "ai7"):
        parsed = python_tool_parts(ai_sdk_parse(node_check, alias, live.raw)["message"]["parts"])
        assert parsed[0]["state"] == "output-error" and parsed[0]["errorText"] == error_text

    committed = python_tool_parts(history["items"][-1]["parts"])
    assert committed[0]["state"] == "output-error" and committed[0]["errorText"] == error_text
    assert replay.of_type("start")[0]["messageMetadata"]["delivery"] == "replay"
    assert [c["errorText"] for c in replay.of_type("tool-output-error")] == [error_text]
    for alias in ("ai6", "ai7"):
        ai_sdk_parse(node_check, alias, replay.raw)
