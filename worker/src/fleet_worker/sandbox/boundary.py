"""What crosses back from a sandbox, treated as hostile: checked, capped and cleaned on the host.

Every string that comes out (a tool call's arguments, a cell's error, SUBMIT's values) has its
lone surrogates replaced, so nothing downstream (events, the DB) can choke on it; sizes are
capped here, before anything reaches an event or the database.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleet_worker.sandbox.errors import FrameTooLarge, SandboxCrashed
from fleet_worker.sandbox.protocol import encode_frame

if TYPE_CHECKING:
    from fleet_shared.config import RLMSection

LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# The REPL refuses values nested deeper than 100 levels (repl_main.MAX_NESTING); anything
# deeper here was forged past it. The margin covers the frame's own envelope.
MAX_NESTING = 104
MAX_KILLED = 64  # pids of killed processes a result may name (repl_main.MAX_KILLED)


class TooDeep(ValueError):
    """A value from the sandbox nests deeper than the REPL ever sends."""


@dataclass(frozen=True)
class Caps:
    """Sizes the host enforces on what a cell sends back (`rlm.*` in the config)."""

    max_output_chars: int = 10_000  # a cell's stdout+stderr, and each field of its error
    max_answer_chars: int = 100_000  # SUBMIT's values, as JSON
    max_tool_input_chars: int = 100_000  # one host tool call's arguments, as JSON

    @classmethod
    def from_rlm(cls, rlm: RLMSection) -> Caps:
        """The caps the profile's `rlm` table sets."""
        return cls(
            max_output_chars=rlm.max_output_chars,
            max_answer_chars=rlm.max_answer_chars,
            max_tool_input_chars=rlm.max_tool_input_chars,
        )


@dataclass(frozen=True)
class CellError:
    """An exception raised by a cell, as the REPL reported it."""

    type: str
    message: str
    traceback: str


@dataclass(frozen=True)
class CellResult:
    """What one cell produced: its output (read on the host), plus SUBMIT's values or its error."""

    stdout: str
    truncated: bool
    final: dict[str, Any] | None
    error: CellError | None


def clean(value: Any, depth: int = 0) -> Any:
    """The value with every string's lone surrogates replaced by U+FFFD; TooDeep past
    MAX_NESTING levels (so the recursion here stays far from Python's limit)."""
    if isinstance(value, str):
        return value if value.isascii() else LONE_SURROGATE.sub("\ufffd", value)
    if depth > MAX_NESTING and isinstance(value, dict | list):
        raise TooDeep(f"a value from the sandbox nests more than {MAX_NESTING} levels deep")
    if isinstance(value, dict):
        return {clean(key): clean(item, depth + 1) for key, item in value.items()}
    if isinstance(value, list):
        return [clean(item, depth + 1) for item in value]
    return value


def json_size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, default=str))


def capped(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit} more characters cut]"


def parse_result(
    message: Mapping[str, Any], stdout: str, truncated: bool, caps: Caps, oom_kills: int = 0
) -> CellResult:
    """Turn a result frame (and the output read meanwhile) into a CellResult; a malformed frame
    means a broken REPL. An oversized SUBMIT becomes the cell's error, so the RLM can shorten it.
    `oom_kills`: how many processes the REPL's memory limit killed during the cell."""
    stdout += killed_notes(message.get("killed"), oom_kills, stdout)
    try:
        final, error = clean(message.get("final")), clean(message.get("error"))
    except TooDeep as exc:
        raise SandboxCrashed(f"REPL sent a malformed result: {exc}") from exc
    if final is not None and not isinstance(final, dict):
        raise SandboxCrashed("REPL sent a non-object SUBMIT value")
    if error is not None and not isinstance(error, dict):
        raise SandboxCrashed("REPL sent a malformed cell error")
    cell_error = None
    if error is not None:
        cell_error = CellError(
            type=capped(str(error.get("type", "Exception")), 200),
            message=capped(str(error.get("message", "")), caps.max_output_chars),
            traceback=capped(str(error.get("traceback", "")), caps.max_output_chars),
        )
    if final is not None and (size := json_size(final)) > caps.max_answer_chars:
        message_text = (
            f"SUBMIT's values are {size} characters; the limit is {caps.max_answer_chars} "
            "(rlm.max_answer_chars): submit a shorter answer"
        )
        final, cell_error = None, CellError("AnswerTooLarge", message_text, "")
    return CellResult(stdout=stdout, truncated=truncated, final=final, error=cell_error)


def killed_notes(killed: Any, oom_kills: int, stdout: str) -> str:
    """A line `[process <pid> killed: memory limit]` for each process the REPL saw die by
    SIGKILL (`killed`, pids as the cell knows them) in a cell during which the memory limit
    killed something; nothing otherwise. Outside the output cap: they are few and short."""
    if oom_kills <= 0 or not isinstance(killed, list):
        return ""
    notes = "".join(
        f"[process {pid} killed: memory limit]\n" for pid in killed[:MAX_KILLED] if type(pid) is int
    )
    return f"\n{notes}" if notes and stdout and not stdout.endswith("\n") else notes


def call_host_tool(tools: Mapping[str, Callable[..., Any]], message: Mapping[str, Any], caps: Caps) -> bytes:
    """Run one tool_call on the host and encode its tool_result; tool errors go back to the cell."""
    name = message.get("name")
    try:
        kwargs = clean(message.get("kwargs"))
    except TooDeep as exc:
        kwargs = exc
    tool = tools.get(name) if isinstance(name, str) else None
    reply: dict[str, Any]
    if isinstance(kwargs, TooDeep):
        reply = {"op": "tool_result", "ok": False, "error": str(kwargs)}
    elif tool is None:
        reply = {"op": "tool_result", "ok": False, "error": f"unknown tool {capped(str(name), 100)!r}"}
    elif not isinstance(kwargs, dict):
        reply = {"op": "tool_result", "ok": False, "error": "tool arguments must be an object"}
    elif (size := json_size(kwargs)) > caps.max_tool_input_chars:
        error = (
            f"the arguments to {name} are {size} characters; the limit is {caps.max_tool_input_chars} "
            "(rlm.max_tool_input_chars): send less, or split it up"
        )
        reply = {"op": "tool_result", "ok": False, "error": error}
    else:
        try:
            reply = {"op": "tool_result", "ok": True, "value": tool(**kwargs)}
        except Exception as exc:
            reply = {"op": "tool_result", "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    try:
        return encode_frame(reply)
    except (FrameTooLarge, TypeError, ValueError) as exc:
        error = f"tool {name!r} returned a value that cannot be sent to the sandbox: {exc}"
        return encode_frame({"op": "tool_result", "ok": False, "error": error})
