"""What crosses back from a sandbox: cleaned and capped on the host (pure functions, no I/O)."""

from __future__ import annotations

import json

import pytest

from fleet_worker.conversation import CUT_MARK, bounded
from fleet_worker.outcome import failure_outcome
from fleet_worker.sandbox.boundary import Caps, call_host_tool, clean, parse_result
from fleet_worker.sandbox.errors import SandboxCrashed
from fleet_worker.sandbox.protocol import HEADER, decode_payload


def test_clean_replaces_lone_surrogates_at_any_depth() -> None:
    dirty = json.loads('{"a\\ud800": ["x\\udfff", {"k": "\\ud83d\\ude00 ok"}], "n": 1}')
    cleaned = clean(dirty)
    assert cleaned == {"a\ufffd": ["x\ufffd", {"k": "\U0001f600 ok"}], "n": 1}
    json.dumps(cleaned, ensure_ascii=False).encode("utf-8")  # encodable now


def test_an_oversized_submit_becomes_the_cells_error() -> None:
    caps = Caps(max_answer_chars=100)
    result = parse_result({"op": "result", "id": 1, "final": {"answer": "x" * 500}}, "out", False, caps)
    assert result.final is None and result.error is not None
    assert result.error.type == "AnswerTooLarge" and "rlm.max_answer_chars" in result.error.message
    fits = parse_result({"op": "result", "id": 1, "final": {"answer": "x" * 50}}, "", False, caps)
    assert fits.final == {"answer": "x" * 50} and fits.error is None


def test_error_text_is_capped() -> None:
    caps = Caps(max_output_chars=100)
    error = {"type": "E", "message": "m" * 1000, "traceback": "t" * 1000}
    result = parse_result({"op": "result", "id": 1, "error": error}, "", False, caps)
    assert result.error is not None
    assert len(result.error.message) < 200 and result.error.message.endswith("characters cut]")


def test_oversized_tool_arguments_are_refused_before_the_tool_runs() -> None:
    calls: list[str] = []

    def llm_query(prompt: str) -> str:
        calls.append(prompt)
        return "ok"

    frame = call_host_tool(
        {"llm_query": llm_query},
        {"op": "tool_call", "name": "llm_query", "kwargs": {"prompt": "p" * 5000}},
        Caps(max_tool_input_chars=1000),
    )
    reply = json.loads(frame[HEADER.size :])
    assert reply["ok"] is False and "rlm.max_tool_input_chars" in reply["error"] and calls == []


@pytest.mark.parametrize(
    ("sizes", "max_chars", "kept", "cut"),
    [
        ([10, 10, 10], 100, 3, False),
        ([20, 20, 20], 45, 2, True),  # the newest two fit; no room is left for the oldest
        ([20, 100], 70, 1, True),  # a Turn too big for the room left is cut to fit
        ([100], 50, 1, True),
        ([100], 0, 0, True),
    ],
)
def test_history_keeps_the_newest_turns_that_fit(
    sizes: list[int], max_chars: int, kept: int, cut: bool
) -> None:
    pairs = [{"request": "q" * (n // 2), "answer": "a" * (n // 2)} for n in sizes]
    history, was_cut = bounded(pairs, max_chars)
    assert (len(history), was_cut) == (kept, cut)
    assert sum(len(p["request"]) + len(p["answer"]) for p in history) <= max_chars + 2 * len(CUT_MARK)
    if history:
        assert history[-1] == pairs[-1] or max_chars < sizes[-1]


def nested(depth: int) -> list[object]:
    value: list[object] = []
    for _ in range(depth):
        value = [value]
    return value


def test_forged_deep_values_are_refused_without_recursion_errors() -> None:
    """Past what the REPL sends (100 levels), a value was forged: a tool call is refused and a
    result counts as a broken REPL; neither costs the host a RecursionError."""
    deep = nested(5000)  # json.loads itself manages this; recursing over it would not
    call = {"op": "tool_call", "name": "echo", "kwargs": {"n": deep}}
    reply = call_host_tool({"echo": lambda n: n}, call, Caps())
    decoded = json.loads(reply[HEADER.size :])
    assert decoded["ok"] is False and "levels deep" in decoded["error"]
    with pytest.raises(SandboxCrashed, match="levels deep"):
        parse_result({"op": "result", "id": 1, "final": {"answer": deep}}, "", False, Caps())
    fine = parse_result({"op": "result", "id": 1, "final": {"answer": nested(90)}}, "", False, Caps())
    assert fine.error is None and fine.final == {"answer": nested(90)}


def test_a_frame_too_deep_to_decode_is_a_crashed_repl_not_a_recursion_error() -> None:
    with pytest.raises(SandboxCrashed):
        decode_payload(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}")


def test_failure_messages_never_carry_nul() -> None:
    """PostgreSQL's text columns refuse NUL; a crashed REPL's stderr may hold one."""
    outcome = failure_outcome(SandboxCrashed("REPL died; stderr: a\x00b"))
    assert outcome.failure_message is not None and "\x00" not in outcome.failure_message
    assert "a\ufffdb" in outcome.failure_message
