"""The scripted LM's JSONL script: parsing, per-role cursors, completion text and token counting."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest

from fleet_worker.errors import ScriptExhausted, ScriptInvalid, TurnFailed
from fleet_worker.lm.script import (
    ChildLine,
    RootLine,
    ScriptCursor,
    SubLine,
    completion_text,
    count_tokens,
    load_script,
)

DEMO = Path(__file__).resolve().parents[3] / "config" / "scripts" / "demo.jsonl"


def write(tmp_path: Path, *lines: str | dict[str, Any]) -> Path:
    path = tmp_path / "script.jsonl"
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    path.write_text(text + "\n", encoding="utf-8")
    return path


def root(n: int) -> dict[str, Any]:
    return {"lm": "root", "reasoning": f"r{n}", "code": f"print({n})"}


def sub(n: int) -> dict[str, Any]:
    return {"lm": "sub", "text": f"s{n}"}


def child(n: int) -> dict[str, Any]:
    return {"lm": "child", "reasoning": f"c{n}", "code": f"x = {n}"}


# --- parsing -------------------------------------------------------------------------------------


def test_lines_are_grouped_by_role_in_file_order(tmp_path: Path) -> None:
    path = write(tmp_path, root(1), sub(1), child(1), root(2), sub(2), {**root(3), "delay_s": 0.25})
    script = load_script(path, "demo")

    assert script.name == "demo"
    assert script.lines["root"] == (
        RootLine(reasoning="r1", code="print(1)"),
        RootLine(reasoning="r2", code="print(2)"),
        RootLine(reasoning="r3", code="print(3)", delay_s=0.25),
    )
    assert script.lines["sub"] == (SubLine(text="s1"), SubLine(text="s2"))
    assert script.lines["child"] == (ChildLine(reasoning="c1", code="x = 1"),)


def test_blank_and_whitespace_lines_are_ignored(tmp_path: Path) -> None:
    path = write(tmp_path, "", root(1), "   ", "\t", sub(1), "")
    script = load_script(path, "t")
    assert [len(script.lines[r]) for r in ("root", "sub", "child")] == [1, 1, 0]


def test_crlf_line_endings(tmp_path: Path) -> None:
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(f"{json.dumps(root(1))}\r\n{json.dumps(sub(1))}\r\n".encode())
    script = load_script(path, "t")
    assert script.lines["sub"] == (SubLine(text="s1"),)


def test_empty_file_is_a_script_with_no_lines(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("", encoding="utf-8")
    script = load_script(path, "t")
    assert script.lines == {"root": (), "sub": (), "child": ()}


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param('{"lm":"root","reasoning":"r","code":"c","extra":1}', id="unknown-field-root"),
        pytest.param('{"lm":"sub","text":"t","reasoning":"r"}', id="unknown-field-sub"),
        pytest.param('{"lm":"boss","text":"t"}', id="unknown-role"),
        pytest.param('{"text":"t"}', id="no-role"),
        pytest.param('{"lm":"root","reasoning":"r"}', id="missing-code"),
        pytest.param('{"lm":"sub"}', id="missing-text"),
        pytest.param('{"lm":"root","reasoning":"r","code":1}', id="code-not-str"),
        pytest.param('{"lm":"sub","text":"t","delay_s":-1}', id="negative-delay"),
        pytest.param('{"lm":"sub","text":"t","delay_s":601}', id="delay-too-long"),
        pytest.param('{"lm":"sub","text":"t","delay_s":"1"}', id="delay-not-number"),
        pytest.param('{"lm":"sub","text":"t"', id="truncated-json"),
        pytest.param("lm: sub", id="not-json"),
        pytest.param('["sub","t"]', id="array"),
        pytest.param('"just a string"', id="string"),
        pytest.param('{"lm":"sub","text":"t"} {"lm":"sub","text":"u"}', id="two-objects-one-line"),
    ],
)
def test_invalid_line_names_its_line_number(tmp_path: Path, bad: str) -> None:
    # line 1 valid, line 2 blank (still counted), line 3 valid, line 4 bad
    path = write(tmp_path, root(1), "", sub(1), bad, sub(2))
    with pytest.raises(ScriptInvalid) as info:
        load_script(path, "t")
    message = str(info.value)
    assert message.startswith(f"{path}:4: ")
    assert "\n" not in message
    assert info.value.code == "script_invalid"
    assert isinstance(info.value, TurnFailed)


@pytest.mark.parametrize("delay", [0, 0.0, 1, 600])
def test_delay_bounds_accepted(tmp_path: Path, delay: float) -> None:
    script = load_script(write(tmp_path, {**sub(1), "delay_s": delay}), "t")
    assert script.lines["sub"][0].delay_s == delay


def test_missing_file_is_invalid(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ScriptInvalid) as info:
        load_script(missing, "t")
    assert str(missing) in str(info.value)
    assert "cannot read" in str(info.value)


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85"], ids=["LS", "PS", "NEL"])
def test_unicode_line_separators_inside_strings_are_text(tmp_path: Path, separator: str) -> None:
    path = tmp_path / "unicode.jsonl"
    line = json.dumps({"lm": "sub", "text": f"one{separator}two"}, ensure_ascii=False)
    path.write_text(line + "\n", encoding="utf-8")
    script = load_script(path, "t")
    assert script.lines["sub"] == (SubLine(text=f"one{separator}two"),)


# --- cursors -------------------------------------------------------------------------------------


def test_each_role_consumes_its_own_lines_in_order(tmp_path: Path) -> None:
    cursor = load_script(write(tmp_path, root(1), sub(1), root(2), child(1), sub(2)), "t").cursor()
    assert isinstance(cursor, ScriptCursor)
    assert cursor.next("sub") == SubLine(text="s1")
    assert cursor.next("root") == RootLine(reasoning="r1", code="print(1)")
    assert cursor.next("child") == ChildLine(reasoning="c1", code="x = 1")
    assert cursor.next("sub") == SubLine(text="s2")
    assert cursor.next("root") == RootLine(reasoning="r2", code="print(2)")
    assert cursor.positions == {"root": 2, "sub": 2, "child": 1}


@pytest.mark.parametrize(("role", "available"), [("root", 2), ("sub", 1), ("child", 0)])
def test_role_that_runs_out_raises_script_exhausted(tmp_path: Path, role: Any, available: int) -> None:
    cursor = load_script(write(tmp_path, root(1), root(2), sub(1)), "demo").cursor()
    for _ in range(available):
        cursor.next(role)
    for _ in range(2):  # stays exhausted
        with pytest.raises(ScriptExhausted) as info:
            cursor.next(role)
        assert str(info.value) == (f"scripted/demo: the script has no more `{role}` lines ({available} used)")
        assert info.value.code == "script_exhausted"
    other = "sub" if role == "root" else "root"
    assert isinstance(cursor.next(other), RootLine | SubLine)  # other roles are unaffected
    assert cursor.positions[role] == available


def test_exhausting_one_role_leaves_the_others(tmp_path: Path) -> None:
    cursor = load_script(write(tmp_path, root(1), sub(1)), "t").cursor()
    cursor.next("sub")
    with pytest.raises(ScriptExhausted):
        cursor.next("sub")
    assert cursor.next("root") == RootLine(reasoning="r1", code="print(1)")


def test_cursors_are_independent(tmp_path: Path) -> None:
    script = load_script(write(tmp_path, root(1), root(2)), "t")
    first, second = script.cursor(), script.cursor()
    assert first.next("root").reasoning == "r1"  # type: ignore[union-attr]
    assert first.next("root").reasoning == "r2"  # type: ignore[union-attr]
    assert second.next("root").reasoning == "r1"  # type: ignore[union-attr]


def test_cursor_hands_each_line_out_once_across_threads(tmp_path: Path) -> None:
    count = 200
    cursor = load_script(write(tmp_path, *(sub(n) for n in range(count))), "t").cursor()
    taken: list[str] = []
    exhausted: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        while True:
            try:
                line = cursor.next("sub")
            except ScriptExhausted:
                with lock:
                    exhausted.append(1)
                return
            with lock:
                taken.append(line.text)  # type: ignore[union-attr]

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(taken) == sorted(f"s{n}" for n in range(count))
    assert len(exhausted) == 8


# --- completion text and usage -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (SubLine(text="plain answer\nwith [[ ## marks ## ]]"), "plain answer\nwith [[ ## marks ## ]]"),
        (SubLine(text=""), ""),
        (
            RootLine(reasoning="think", code="print(1)\nSUBMIT(answer='x')"),
            "[[ ## reasoning ## ]]\nthink\n\n[[ ## code ## ]]\nprint(1)\nSUBMIT(answer='x')\n\n"
            "[[ ## completed ## ]]",
        ),
        (
            ChildLine(reasoning="sub think", code="SUBMIT(1)", delay_s=3),
            "[[ ## reasoning ## ]]\nsub think\n\n[[ ## code ## ]]\nSUBMIT(1)\n\n[[ ## completed ## ]]",
        ),
    ],
    ids=["sub", "sub-empty", "root", "child"],
)
def test_completion_text(line: Any, expected: str) -> None:
    assert completion_text(line) == expected


@pytest.mark.parametrize(
    ("text", "tokens"),
    [("", 0), ("abc", 0), ("abcd", 1), ("abcdefg", 1), ("a" * 8, 2), ("a" * 4001, 1000), ("ünï✓", 1)],
)
def test_count_tokens_is_chars_over_four(text: str, tokens: int) -> None:
    assert count_tokens(text) == tokens


# --- the shipped demo ----------------------------------------------------------------------------


def test_shipped_demo_script() -> None:
    script = load_script(DEMO, "demo")
    scenarios = [script.lines, *(scenario.lines for scenario in script.scenarios)]
    assert len(scenarios) == 4  # the greeting, then slow, a file, arithmetic
    for lines in scenarios:
        codes = [line.code for line in lines["root"]]  # type: ignore[union-attr]
        assert "SUBMIT(" in codes[-1]
        assert all("SUBMIT(" not in code for code in codes[:-1])
        for code in codes:
            compile(code, "<demo>", "exec")  # every cell is valid Python
            assert "```" not in code  # DSPy cuts a code field at a Markdown fence
        llm_calls = sum(code.count("llm_query(") for code in codes)
        assert len(lines["sub"]) >= llm_calls, "every llm_query in the demo needs a sub line"


@pytest.mark.parametrize(
    ("request_text", "first_reasoning"),
    [
        ("Say hello to the fleet", "I should look at the request"),
        ("What is 37 * 91?", "This is arithmetic."),
        ("(2 + 3) ** 2 - 4 / 8", "This is arithmetic."),
        ("Summarise my file", "The user points at an attached file."),
        ("Read my file", "The user points at an attached file."),
        ("Run a slow task", "The user asked for a slow task."),
        ("Run a SLOW task on file 2*3", "The user asked for a slow task."),  # first match wins
    ],
)
def test_the_demo_picks_its_scenario_by_the_request(request_text: str, first_reasoning: str) -> None:
    cursor = load_script(DEMO, "demo").cursor(request_text)
    assert cursor.next("root").reasoning.startswith(first_reasoning)  # type: ignore[union-attr]


# --- scenarios -----------------------------------------------------------------------------------


def when(pattern: str) -> dict[str, Any]:
    return {"lm": "when", "match": pattern}


def test_a_request_gets_the_first_scenario_that_matches_else_the_lines_before_any_when(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, root(1), sub(1), when("(?i)apple"), root(2), sub(2), when("apple|pear"), root(3))
    script = load_script(path, "t")

    default, apple, pear = script.cursor("plum"), script.cursor("an APPLE"), script.cursor("pear")
    assert default.next("root") == RootLine(reasoning="r1", code="print(1)")
    assert default.next("sub") == SubLine(text="s1")
    assert apple.next("root") == RootLine(reasoning="r2", code="print(2)")
    assert apple.next("sub") == SubLine(text="s2")
    with pytest.raises(ScriptExhausted):  # a scenario's roles hold only its own lines
        apple.next("root")
    assert pear.next("root") == RootLine(reasoning="r3", code="print(3)")
    with pytest.raises(ScriptExhausted):
        pear.next("sub")
    assert script.cursor().next("root") == RootLine(reasoning="r1", code="print(1)")


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param('{"lm":"when","match":"(unclosed"}', id="bad-regex"),
        pytest.param('{"lm":"when"}', id="no-match"),
        pytest.param('{"lm":"when","match":"a","code":"x"}', id="unknown-field"),
    ],
)
def test_an_invalid_when_line_names_its_line_number(tmp_path: Path, bad: str) -> None:
    path = write(tmp_path, root(1), bad)
    with pytest.raises(ScriptInvalid) as info:
        load_script(path, "t")
    assert str(info.value).startswith(f"{path}:2: ")
    assert "\n" not in str(info.value)


def test_a_separate_sub_script_gets_its_own_cursor(tmp_path: Path) -> None:
    """`llm.sub.script` naming another file than the root's is honoured (it used to be ignored)."""
    from fleet_shared.config import load_settings
    from fleet_worker.program import cursors

    root_file = tmp_path / "root.jsonl"
    sub_file = tmp_path / "sub.jsonl"
    root_file.write_text(
        '{"lm": "root", "reasoning": "r", "code": "x = 1"}\n{"lm": "sub", "text": "from root file"}\n'
    )
    sub_file.write_text('{"lm": "sub", "text": "from sub file"}\n')
    repo = Path(__file__).resolve().parents[3]
    settings = load_settings(
        {"FLEET_CONFIG": str(repo / "config" / "fleet.toml"), "FLEET_REDIS_URL": "redis://x"}
    )
    root = msgspec.structs.replace(settings.root_lm, script_path=root_file)
    sub = msgspec.structs.replace(settings.sub_lm, script_path=sub_file)
    separate = msgspec.structs.replace(settings, root_lm=root, sub_lm=sub)
    root_cursor, sub_cursor = cursors({}, separate, "go")
    assert root_cursor is not None and sub_cursor is not None and root_cursor is not sub_cursor
    assert getattr(sub_cursor.next("sub"), "text", None) == "from sub file"
    same = msgspec.structs.replace(
        settings, root_lm=root, sub_lm=msgspec.structs.replace(sub, script_path=root_file)
    )
    shared_root, shared_sub = cursors({}, same, "go")
    assert shared_root is shared_sub
    assert getattr(shared_sub.next("sub"), "text", None) == "from root file"
