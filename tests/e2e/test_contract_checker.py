"""The contract checker itself (contract.py): it accepts a good stream and names each broken rule.

Pure and fast (no processes): a checker that passes everything would make the suite worthless.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.e2e.contract import Frames, check_error, check_history, check_stream

RUN = "6f1c5a52-4f0e-4a43-9d43-0d7f2f6d3c11"
HEADERS = httpx.Headers(
    {"content-type": "text/event-stream", "x-vercel-ai-ui-message-stream": "v1", "x-fleet-run-id": RUN}
)
START = {"type": "start", "messageId": RUN, "messageMetadata": {"runId": RUN, "delivery": "live"}}
STATUS = {"type": "data-status", "data": {"phase": "execution", "status": "started"}, "transient": True}
TEXT = [
    {"type": "text-start", "id": "t"},
    {"type": "text-delta", "id": "t", "delta": "hi"},
    {"type": "text-end", "id": "t"},
]
STOP = {"type": "finish", "finishReason": "stop", "messageMetadata": {"runId": RUN}}
ERROR = {"type": "error", "errorText": "script_exhausted: out of lines"}


def frames(*chunks: dict[str, Any], start_id: str = "0.0.1") -> Frames:
    out: Frames = [(start_id, json.dumps(chunks[0]))]
    out += [(f"{seq}.0", json.dumps(chunk)) for seq, chunk in enumerate(chunks[1:], start=1)]
    return [*out, (None, "[DONE]")]


def test_a_good_stream_passes() -> None:
    check_stream(frames(START, STATUS, *TEXT, STOP), HEADERS, delivery="live")
    check_stream(frames(START, ERROR, {"type": "finish", "finishReason": "error"}), HEADERS, delivery="live")
    check_stream(frames(START, {"type": "abort", "reason": "Turn cancelled"}), HEADERS, delivery="live")


BROKEN: dict[str, tuple[Frames, str]] = {
    "no DONE": (frames(START, STOP)[:-1], r"exactly one \[DONE\]"),
    "two DONE": ([*frames(START, STOP), (None, "[DONE]")], r"exactly one \[DONE\]"),
    "a null": (frames(START, {**STOP, "messageMetadata": {"runId": None}}), "null at"),
    "text before start": (frames({"type": "text-start", "id": "t"}, START, STOP, start_id="0.0.0"), "before"),
    "foreign messageId": (frames({**START, "messageId": "x"}, STOP), "messageId"),
    "metadata not an object": (frames({**START, "messageMetadata": "x"}, STOP), "object"),
    "bad finishReason": (frames(START, {"type": "finish", "finishReason": "length"}), "finishReason"),
    "error finish without error": (frames(START, {"type": "finish", "finishReason": "error"}), "error chunk"),
    "two errors": (frames(START, ERROR, ERROR, {"type": "finish", "finishReason": "error"}), "exactly one"),
    "chunk after abort": (frames(START, {"type": "abort", "reason": "x"}, STATUS), "nothing but"),
    "no terminal": (frames(START, *TEXT), "terminal"),
    "status without phase": (frames(START, {"type": "data-status", "data": {"status": "x"}}, STOP), "phase"),
    "status without text": (frames(START, {"type": "data-status", "data": {"phase": "x"}}, STOP), "status"),
    "wrong data keys": (
        frames(START, {"type": "data-attachment", "data": {"attachmentId": "a"}}, STOP),
        "keys",
    ),
    "unknown chunk": (frames(START, {"type": "tool-call"}, STOP), "undocumented"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_each_broken_rule_is_named(name: str) -> None:
    broken, words = BROKEN[name]
    with pytest.raises(AssertionError, match=words):
        check_stream(broken, HEADERS, delivery="live")


def test_headers_and_delivery_are_checked() -> None:
    good = frames(START, STOP)
    for header in ("x-vercel-ai-ui-message-stream", "x-fleet-run-id"):
        headers = HEADERS.copy()
        del headers[header]
        with pytest.raises(AssertionError):
            check_stream(good, headers, delivery="live")
    with pytest.raises(AssertionError):
        check_stream(good, HEADERS, delivery="replay")


def message(role: str, parts: list[dict[str, Any]], **metadata: Any) -> dict[str, Any]:
    return {"id": metadata.get("runId", "u-1"), "role": role, "parts": parts, "metadata": metadata}


def test_history_rules() -> None:
    text = {"type": "text", "text": "hi"}
    check_history([message("user", [text]), message("assistant", [text], runId=RUN)])
    for items, words in (
        ([message("assistant", [text])], "runId"),
        ([message("assistant", [{"type": "file", "url": "x"}], runId=RUN)], "not allowed"),
        ([message("assistant", [{"type": "data-skill", "data": {"skillId": "s"}}], runId=RUN)], "keys"),
        ([message("assistant", [{"type": "text", "text": None}], runId=RUN)], "null"),
    ):
        with pytest.raises(AssertionError, match=words):
            check_history(items)


def test_error_envelope_rules() -> None:
    def answer(body: Any, **headers: str) -> httpx.Response:
        return httpx.Response(404, json=body, headers=headers)

    check_error(answer({"code": "not_found", "message": "gone"}, **{"x-request-id": "r"}), 404, "not_found")
    for response in (
        answer({"code": "not_found", "message": "gone"}),
        answer({"code": "not_found", "message": "gone", "detail": "x"}, **{"x-request-id": "r"}),
        answer({"error": "gone"}, **{"x-request-id": "r"}),
    ):
        with pytest.raises(AssertionError):
            check_error(response, 404, "not_found")
