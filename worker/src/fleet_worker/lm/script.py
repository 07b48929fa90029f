"""The scripted LM's JSONL script (docs/configuration.md): parsing, scenarios, per-Run cursors,
and usage counting."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from fleet_worker.errors import ScriptExhausted, ScriptInvalid

Role = Literal["root", "sub", "child"]
Delay = Annotated[float, msgspec.Meta(ge=0, le=600)]


class ActionLine(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="lm"):
    """One root or child action: reasoning plus the code the REPL runs."""

    reasoning: str
    code: str
    delay_s: Delay = 0.0


class RootLine(ActionLine, tag="root"):
    pass


class ChildLine(ActionLine, tag="child"):
    pass


class SubLine(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="lm", tag="sub"):
    """One `llm_query` answer."""

    text: str
    delay_s: Delay = 0.0


class WhenLine(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="lm", tag="when"):
    """Opens a scenario: the lines after it, up to the next `when`, serve a Run whose request
    the regular expression `match` finds (`re.search`)."""

    match: str


ScriptLine = RootLine | SubLine | ChildLine
LINE_DECODER = msgspec.json.Decoder(ScriptLine | WhenLine)
RoleLines = dict[str, tuple[ScriptLine, ...]]


class Scenario(msgspec.Struct, frozen=True):
    pattern: re.Pattern[str]
    lines: RoleLines


class Script(msgspec.Struct, frozen=True):
    """`lines` is the default scenario (the lines before any `when`); `scenarios` are tried in
    file order, and the first whose pattern finds the request serves the Run."""

    name: str
    lines: RoleLines
    scenarios: tuple[Scenario, ...] = ()

    def cursor(self, request: str = "") -> ScriptCursor:
        chosen = next((s.lines for s in self.scenarios if s.pattern.search(request)), self.lines)
        return ScriptCursor(self, chosen)


def load_script(path: Path, name: str) -> Script:
    """Parse every line up front, so a bad script fails with its line number before any Run."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScriptInvalid(f"cannot read scripted LM file {path}: {exc.strerror}") from None
    default: dict[str, list[ScriptLine]] = {"root": [], "sub": [], "child": []}
    scenarios: list[tuple[re.Pattern[str], dict[str, list[ScriptLine]]]] = []
    current = default
    # Split on newlines only: JSON strings may hold U+2028 and friends, which splitlines() breaks on.
    for number, line_text in enumerate(text.split("\n"), start=1):
        raw = line_text.removesuffix("\r")
        if not raw.strip():
            continue
        try:
            line = LINE_DECODER.decode(raw)
            if isinstance(line, WhenLine):
                current = {"root": [], "sub": [], "child": []}
                scenarios.append((re.compile(line.match), current))
                continue
        except (msgspec.DecodeError, re.error) as exc:
            raise ScriptInvalid(f"{path}:{number}: {exc}") from None
        current[line_role(line)].append(line)
    return Script(
        name,
        frozen_lines(default),
        tuple(Scenario(pattern, frozen_lines(lines)) for pattern, lines in scenarios),
    )


def frozen_lines(by_role: dict[str, list[ScriptLine]]) -> RoleLines:
    return {role: tuple(lines) for role, lines in by_role.items()}


def line_role(line: ScriptLine) -> Role:
    match line:
        case RootLine():
            return "root"
        case SubLine():
            return "sub"
        case ChildLine():
            return "child"


class ScriptCursor:
    """One Run's position in its scenario's lines: each role consumes its own, in order."""

    def __init__(self, script: Script, lines: RoleLines) -> None:
        self.script, self.lines = script, lines
        self.positions: dict[str, int] = {"root": 0, "sub": 0, "child": 0}
        self.lock = threading.Lock()  # llm_query_batched calls from several threads

    def next(self, role: Role) -> ScriptLine:
        with self.lock:
            lines = self.lines[role]
            index = self.positions[role]
            if index >= len(lines):
                raise ScriptExhausted(
                    f"scripted/{self.script.name}: the script has no more `{role}` lines ({len(lines)} used)"
                )
            self.positions[role] = index + 1
            return lines[index]


def completion_text(line: ScriptLine, *, extract: bool = False) -> str:
    """What the LM 'says': actions in DSPy's chat-adapter field format, sub answers verbatim.

    `extract`: DSPy asks for the final answer itself (the RLM used all its iterations): the
    line's `reasoning` is that answer (docs/configuration.md, the scripted LM)."""
    match line:
        case SubLine(text=text):
            return text
        case RootLine() | ChildLine() if extract:
            return f"[[ ## answer ## ]]\n{line.reasoning}\n\n[[ ## completed ## ]]"
        case RootLine() | ChildLine():
            return (
                f"[[ ## reasoning ## ]]\n{line.reasoning}\n\n"
                f"[[ ## code ## ]]\n{line.code}\n\n"
                "[[ ## completed ## ]]"
            )


def asks_for_the_answer(system: str) -> bool:
    """Whether a request's instructions ask for the final `answer` rather than an action."""
    fields = system.partition("output fields are:")[2].partition("All interactions")[0]
    return "`answer`" in fields and "`code`" not in fields


def count_tokens(text: str) -> int:
    """The scripted LM's usage rule: characters / 4."""
    return len(text) // 4
