"""The DSPy API fleet relies on, and `dspy_adapter` driving a real `dspy.RLM` with no sandbox.

If a dspy upgrade breaks one of the `test_dspy_*` tests, `fleet_worker/dspy_adapter.py` needs
attention before the upgrade can land.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import dspy
import pytest
from dspy.primitives import facade

from fleet_shared.config import ResolvedLM, Secret
from fleet_shared.events import (
    CellOutput,
    CodeCell,
    IterationFinished,
    IterationStarted,
    LMQueryFinished,
    LMQueryStarted,
    Reasoning,
    RunEvent,
)
from fleet_worker import dspy_adapter
from fleet_worker.dspy_adapter import (
    ProgramLimits,
    ProgramResult,
    TurnObserver,
    build_lm,
    provider_kwargs,
    run_program,
)
from fleet_worker.dspy_compat import INITIAL_ATTRIBUTES, FleetRLM
from fleet_worker.errors import ScriptExhausted, TurnStopped
from fleet_worker.lm.script import ScriptCursor, completion_text, count_tokens, load_script
from fleet_worker.sandbox import repl_main
from fleet_worker.sandbox.boundary import Caps, CellResult, call_host_tool, parse_result
from fleet_worker.sandbox.protocol import HEADER, decode_payload, encode_frame
from fleet_worker.sandbox.session import tool_params

# --- the public DSPy API we rely on ------------------------------------------------------------


def test_dspy_rlm_constructor_and_forward() -> None:
    params = inspect.signature(dspy.RLM.__init__).parameters
    for name in ("max_iters", "max_llm_calls", "max_output_chars", "sub_lm"):
        assert name in params, f"dspy.RLM() lost the {name!r} argument"

    sub_lm = dspy.LM("openai/gpt-4o-mini", cache=False)
    program = dspy.RLM(
        dspy_adapter.TurnSignature, max_iters=3, max_llm_calls=4, max_output_chars=500, sub_lm=sub_lm
    )
    assert (program.max_iters, program.max_llm_calls, program.max_output_chars) == (3, 4, 500)
    assert program.sub_lm is sub_lm
    assert isinstance(program.generate_action, dspy.Predict)

    forward = inspect.signature(dspy.RLM.forward).parameters
    assert "interpreter_factory" in forward
    assert forward["interpreter_factory"].kind is inspect.Parameter.KEYWORD_ONLY


def test_dspy_lm_accepts_a_custom_engine() -> None:
    class Engine:
        def __init__(self) -> None:
            self.requests: list[Any] = []

        def complete(self, request: Any) -> Any:
            self.requests.append(request)
            return dspy.lm15.Response(
                id=None,
                model="custom/echo",
                message=dspy.lm15.Message.assistant([dspy.lm15.TextPart("pong")]),
                finish_reason="stop",
                usage=dspy.lm15.Usage(input_tokens=1, output_tokens=1, total_tokens=2),
            )

        def stream(self, request: Any) -> Any:
            return iter(dspy.lm15.response_to_events(self.complete(request)))

        def close(self) -> None:
            return None

    engine = Engine()
    lm = dspy.LM("custom/echo", engine=engine, cache=False, num_retries=0)
    assert lm.model == "custom/echo"
    assert lm("ping") == ["pong"]
    assert len(engine.requests) == 1
    assert any("ping" in (m.text or "") for m in engine.requests[0].messages)


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("on_module_start", ["call_id", "instance", "inputs"]),
        ("on_module_end", ["call_id", "outputs", "exception"]),
        ("on_lm_start", ["call_id", "instance", "inputs"]),
    ],
)
def test_dspy_base_callback(method: str, params: list[str]) -> None:
    from dspy.utils.callback import BaseCallback

    hook = getattr(BaseCallback, method)
    assert list(inspect.signature(hook).parameters)[1:] == params


@pytest.mark.parametrize(
    ("module", "names"),
    [
        ("dspy.primitives.code_interpreter", ["CodeExecutionError", "CodeInterpreterError", "FinalOutput"]),
        ("dspy.lm15", ["Message", "Response", "TextPart", "Usage", "response_to_events"]),
        ("dspy", ["RLM", "LM", "Signature", "InputField", "OutputField", "History", "Predict", "context"]),
        ("dspy", ["LMError"]),
    ],
)
def test_dspy_names_exist(module: str, names: list[str]) -> None:
    import importlib

    mod = importlib.import_module(module)
    missing = [name for name in names if not hasattr(mod, name)]
    assert not missing, f"{module} no longer has {missing}"


def test_dspy_history_and_final_output() -> None:
    from dspy.primitives.code_interpreter import FinalOutput

    history = dspy.History(messages=[{"request": "a", "answer": "b"}])
    assert history.messages == [{"request": "a", "answer": "b"}]
    assert FinalOutput({"answer": "x"}).output == {"answer": "x"}


def test_dspy_lm_errors_are_recognised() -> None:
    assert dspy_adapter.is_lm_error(dspy.utils.exceptions.LMUnexpectedError("boom")) is True
    assert dspy_adapter.is_lm_error(ValueError("boom")) is False


# --- the real provider boundary -----------------------------------------------------------------


def resolved(name: str = "openai/gpt-4o-mini", **overrides: Any) -> ResolvedLM:
    fields: dict[str, Any] = {
        "name": name,
        "scripted": False,
        "script_path": None,
        "api_key": None,
        "base_url": None,
        "num_retries": 3,
        "temperature": None,
        "max_tokens": None,
        **overrides,
    }
    return ResolvedLM(**fields)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, {"num_retries": 3, "timeout": 120}),
        (
            {
                "api_key": Secret("sk-test-123"),
                "base_url": "http://127.0.0.1:11434/v1",
                "num_retries": 5,
                "temperature": 0.2,
                "max_tokens": 512,
                "request_timeout": 30.0,
            },
            {
                "api_key": "sk-test-123",
                "api_base": "http://127.0.0.1:11434/v1",
                "num_retries": 5,
                "temperature": 0.2,
                "max_tokens": 512,
                "timeout": 30.0,
            },
        ),
        ({"num_retries": 0, "temperature": 0.0}, {"num_retries": 0, "temperature": 0.0, "timeout": 120}),
        ({"base_url": ""}, {"num_retries": 3, "timeout": 120}),
    ],
    ids=["bare", "everything", "zero-values-kept", "empty-base-url"],
)
def test_provider_kwargs(overrides: dict[str, Any], expected: dict[str, Any]) -> None:
    assert provider_kwargs(resolved(**overrides)) == expected


def test_build_lm_for_a_provider_model_makes_no_network_call(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        attempts.append(args)
        raise OSError("network disabled in unit tests")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)

    lm = build_lm(
        resolved(api_key=Secret("sk-test"), base_url="http://127.0.0.1:9/v1", num_retries=2, temperature=0.1),
        "root",
        None,
        threading.Event(),
    )
    assert isinstance(lm, dspy.LM)
    assert lm.model == "openai/gpt-4o-mini"
    assert lm.num_retries == 2
    assert lm.kwargs["api_key"] == "sk-test"
    assert lm.kwargs["api_base"] == "http://127.0.0.1:9/v1"
    assert lm.kwargs["temperature"] == 0.1
    assert attempts == []


# --- scripted LMs --------------------------------------------------------------------------------


def write_script(tmp_path: Path, *lines: dict[str, Any]) -> Path:
    path = tmp_path / "script.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def scripted(path: Path) -> tuple[ResolvedLM, ScriptCursor]:
    lm = resolved("scripted/test", scripted=True, script_path=path, num_retries=0)
    return lm, load_script(path, "test").cursor()


def test_scripted_lm_answers_from_its_role(tmp_path: Path) -> None:
    path = write_script(
        tmp_path,
        {"lm": "root", "reasoning": "r", "code": "print(1)"},
        {"lm": "sub", "text": "first sub answer"},
        {"lm": "sub", "text": "second sub answer"},
    )
    lm, cursor = scripted(path)
    stop = threading.Event()
    sub = build_lm(lm, "sub", cursor, stop)
    root = build_lm(lm, "root", cursor, stop)
    assert sub.model == "scripted/test"
    assert sub("q") == ["first sub answer"]
    assert root("go") == [completion_text(load_script(path, "test").lines["root"][0])]
    assert sub("q") == ["second sub answer"]
    assert cursor.positions == {"root": 1, "sub": 2, "child": 0}


def test_scripted_lm_exhaustion_keeps_script_exhausted_as_the_cause(tmp_path: Path) -> None:
    lm, cursor = scripted(write_script(tmp_path, {"lm": "root", "reasoning": "r", "code": "x"}))
    sub = build_lm(lm, "sub", cursor, threading.Event())
    with pytest.raises(Exception) as info:
        sub("q")
    assert find_cause(info.value, ScriptExhausted) is not None


def test_scripted_delay_is_cut_short_by_stop(tmp_path: Path) -> None:
    lm, cursor = scripted(write_script(tmp_path, {"lm": "sub", "text": "late", "delay_s": 30}))
    stop = threading.Event()
    stop.set()
    sub = build_lm(lm, "sub", cursor, stop)
    started = time.monotonic()
    with pytest.raises(BaseException) as info:
        sub("q")
    assert time.monotonic() - started < 5
    assert find_cause(info.value, TurnStopped) is not None


def find_cause(exc: BaseException | None, kind: type[BaseException]) -> BaseException | None:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


# --- run_program with an in-process session ------------------------------------------------------


class InProcessChannel:
    """The REPL's view of the host, without pipes: tool calls go through the real host codec."""

    def __init__(self) -> None:
        self.tools: Mapping[str, Callable[..., Any]] = {}

    def call_tool(self, name: str, kwargs: dict[str, Any]) -> Any:
        frame = call_host_tool(self.tools, {"op": "tool_call", "name": name, "kwargs": kwargs}, Caps())
        reply = decode_payload(frame[HEADER.size :])
        if reply.get("ok"):
            return reply.get("value")
        raise RuntimeError(str(reply.get("error")))


class InMemorySession:
    """A ReplSession stand-in: the sandbox's own REPL driver, run in this process, no jail.

    Requests and results take the same JSON round trip as over the real frame channel.
    """

    def __init__(self, max_output_chars: int = 10_000) -> None:
        self.max_output_chars = max_output_chars
        self.channel = InProcessChannel()
        self.repl: repl_main.Repl | None = None
        self.started = 0
        self.closed = False
        self.cells: list[str] = []

    def start(self) -> None:
        assert not self.closed, "start() after shutdown()"
        if self.repl is None:
            self.started += 1
            self.repl = repl_main.Repl(self.channel)  # type: ignore[arg-type]

    def execute(
        self,
        code: str,
        variables: Mapping[str, Any],
        tools: Mapping[str, Callable[..., Any]],
        output_fields: Sequence[str] | None,
    ) -> CellResult:
        self.start()
        assert self.repl is not None
        self.cells.append(code)
        self.channel.tools = dict(tools)
        request = {
            "op": "execute",
            "id": len(self.cells),
            "code": code,
            "variables": dict(variables),
            "tools": {name: tool_params(tool) for name, tool in tools.items()},
            "output_fields": list(output_fields) if output_fields is not None else None,
            "max_output_chars": self.max_output_chars,
        }
        # Output is the host's to capture (the real REPL writes it to a pipe the host reads).
        captured = io.StringIO()
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            reply = self.repl.execute(decode_payload(encode_frame(request)[HEADER.size :]))
        text = captured.getvalue()
        stdout, truncated = text[: self.max_output_chars], len(text) > self.max_output_chars
        message = json.loads(json.dumps(reply, default=repl_main.jsonable))
        return parse_result(message, stdout, truncated, Caps(max_output_chars=self.max_output_chars))

    def interrupt(self) -> None:
        return None

    def shutdown(self) -> None:
        self.closed = True
        self.repl = None


class Harness:
    def __init__(self, tmp_path: Path, *lines: dict[str, Any], stop_after: type | None = None) -> None:
        self.path = write_script(tmp_path, *lines)
        self.lm, self.cursor = scripted(self.path)
        self.stop = threading.Event()
        self.events: list[RunEvent] = []
        self.sessions: list[InMemorySession] = []
        self.stop_after = stop_after
        self.observer = TurnObserver(emit=self.emit, run_id="run_t", stop=self.stop, max_output_chars=10_000)

    def emit(self, event: RunEvent) -> None:
        self.events.append(event)
        if self.stop_after is not None and isinstance(event, self.stop_after):
            self.stop.set()

    def interpreter_factory(self) -> InMemorySession:
        session = InMemorySession()
        self.sessions.append(session)
        return session

    def run(
        self, request: str = "please say hi", history: list[dict[str, str]] | None = None
    ) -> ProgramResult:
        return run_program(
            request=request,
            history=history or [],
            root_lm=build_lm(self.lm, "root", self.cursor, self.stop),
            sub_lm=build_lm(self.lm, "sub", self.cursor, self.stop),
            limits=ProgramLimits(max_iters=6, max_llm_calls=10, max_output_chars=10_000),
            observer=self.observer,
            interpreter_factory=self.interpreter_factory,
        )


KEYWORD_SCRIPT: list[dict[str, Any]] = [
    {"lm": "root", "reasoning": "Measure the request.", "code": "words = request.split()\nprint(len(words))"},
    {
        "lm": "root",
        "reasoning": "Ask sub-LMs.",
        "code": "reply = llm_query(prompt='greet: ' + request)\n"
        "many = llm_query_batched(prompts=['a', 'b'])\n"
        "print(reply, sorted(many))",
    },
    {"lm": "root", "reasoning": "Oops.", "code": "print('before')\n1 / 0"},
    {"lm": "root", "reasoning": "Submit.", "code": "SUBMIT(answer=f'{reply} ({len(words)} words)')"},
    {"lm": "sub", "text": "Hello there, friend!"},
    {"lm": "sub", "text": "batched answer A"},
    {"lm": "sub", "text": "batched answer B"},
]


def test_run_program_keeps_nothing_process_wide(tmp_path: Path) -> None:
    """A Turn leaves no predictor trace or LM history behind: DSPy keeps both process-wide (up to
    10,000 entries each), and they held every Turn's signature classes and prompts alive."""
    harness = Harness(tmp_path, *KEYWORD_SCRIPT)
    root_lm = build_lm(harness.lm, "root", harness.cursor, harness.stop)
    sub_lm = build_lm(harness.lm, "sub", harness.cursor, harness.stop)
    trace_before = len(dspy.settings.trace)
    run_program(
        request="please say hi",
        history=[],
        root_lm=root_lm,
        sub_lm=sub_lm,
        limits=ProgramLimits(max_iters=6, max_llm_calls=10, max_output_chars=10_000),
        observer=harness.observer,
        interpreter_factory=harness.interpreter_factory,
    )
    assert len(dspy.settings.trace) == trace_before
    assert root_lm.history == [] and sub_lm.history == []


def test_run_program_end_to_end_in_process(tmp_path: Path) -> None:
    harness = Harness(tmp_path, *KEYWORD_SCRIPT)
    result = harness.run(history=[{"request": "earlier", "answer": "before"}])

    assert result.answer == "Hello there, friend! (3 words)"
    assert result.iterations == 4
    assert harness.cursor.positions == {"root": 4, "sub": 3, "child": 0}

    # usage: completion tokens are exactly the scripted rule over every line the run consumed
    expected_completion = sum(
        count_tokens(completion_text(line))
        for role in ("root", "sub")
        for line in harness.cursor.script.lines[role]
    )
    assert result.lm_usage["scripted/test"]["completion_tokens"] == expected_completion
    assert result.lm_usage["scripted/test"]["prompt_tokens"] > 0

    events = harness.events
    assert [type(e) for e in events] == [
        IterationStarted,
        Reasoning,
        CodeCell,
        CellOutput,
        IterationFinished,
        IterationStarted,
        Reasoning,
        CodeCell,
        LMQueryStarted,
        LMQueryFinished,
        LMQueryStarted,
        LMQueryFinished,
        CellOutput,
        IterationFinished,
        IterationStarted,
        Reasoning,
        CodeCell,
        CellOutput,
        IterationFinished,
        IterationStarted,
        Reasoning,
        CodeCell,
        CellOutput,
        IterationFinished,
    ]
    assert {e.run_id for e in events} == {"run_t"}
    assert [e.iteration for e in events if isinstance(e, IterationStarted)] == [1, 2, 3, 4]
    assert [(e.part_id, e.text) for e in events if isinstance(e, Reasoning)] == [
        ("reasoning-1", "Measure the request."),
        ("reasoning-2", "Ask sub-LMs."),
        ("reasoning-3", "Oops."),
        ("reasoning-4", "Submit."),
    ]
    cells = [e for e in events if isinstance(e, CodeCell)]
    assert [c.call_id for c in cells] == ["cell-1", "cell-2", "cell-3", "cell-4"]
    assert [c.code for c in cells] == [line["code"] for line in KEYWORD_SCRIPT[:4]]

    outputs = {e.call_id: e for e in events if isinstance(e, CellOutput)}
    assert outputs["cell-1"].stdout == "3\n"
    assert outputs["cell-1"].error is None
    assert outputs["cell-2"].stdout == "Hello there, friend! ['batched answer A', 'batched answer B']\n"
    assert outputs["cell-3"].stdout == "before\n"
    assert outputs["cell-3"].error is not None
    assert "ZeroDivisionError" in outputs["cell-3"].error
    assert outputs["cell-4"].error is None

    started = [e for e in events if isinstance(e, LMQueryStarted)]
    finished = [e for e in events if isinstance(e, LMQueryFinished)]
    assert [(s.call_id, s.tool, s.prompt, s.prompt_count) for s in started] == [
        ("llm_query-2-1", "llm_query", "greet: please say hi", None),
        ("llm_query_batched-2-2", "llm_query_batched", None, 2),
    ]
    assert finished[0].call_id == "llm_query-2-1"
    assert finished[0].text == "Hello there, friend!"
    assert finished[1].call_id == "llm_query_batched-2-2"
    assert sorted(finished[1].texts or []) == ["batched answer A", "batched answer B"]

    # one fresh session per Turn, started, and shut down at the end
    assert len(harness.sessions) == 1
    assert harness.sessions[0].started == 1
    assert harness.sessions[0].closed is True


def test_the_repl_starts_with_the_first_cell_not_before_the_first_lm_call(tmp_path: Path) -> None:
    # dspy calls the interpreter's start() before its first LM call. fleet's REPL is already
    # starting (from the lease) or warm, so start() must not wait: the REPL's start then
    # overlaps that LM call instead of preceding it.
    harness = Harness(tmp_path, *KEYWORD_SCRIPT)
    root_lines_at_start: list[int] = []

    class RecordingSession(InMemorySession):
        def start(self) -> None:
            root_lines_at_start.append(harness.cursor.positions["root"])
            super().start()

    def factory() -> InMemorySession:
        session = RecordingSession()
        harness.sessions.append(session)
        return session

    harness.interpreter_factory = factory  # type: ignore[method-assign]
    assert harness.run().answer == "Hello there, friend! (3 words)"
    assert root_lines_at_start and root_lines_at_start[0] == 1  # after the first root LM call


def test_fleet_rlm_shares_its_signatures_and_prompts_what_dspy_would() -> None:
    # FleetRLM builds signatures once per shape (dspy_compat.py); each RLM is still its own module.
    def same(ours: Any, theirs: Any) -> None:
        assert ours.instructions == theirs.instructions
        assert list(ours.input_fields) == list(theirs.input_fields)
        assert list(ours.output_fields) == list(theirs.output_fields)

    first, second = (FleetRLM(dspy_adapter.TurnSignature, max_iters=3, max_llm_calls=5) for _ in range(2))
    plain = dspy.RLM(dspy_adapter.TurnSignature, max_iters=3, max_llm_calls=5)
    assert first is not second and first.generate_action is not second.generate_action
    assert first.generate_action.signature is second.generate_action.signature
    assert first.extract.signature is second.extract.signature
    same(second.generate_action.signature, plain.generate_action.signature)
    same(second.extract.signature, plain.extract.signature)
    for name in INITIAL_ATTRIBUTES:
        assert getattr(second, name) == getattr(plain, name)

    # fleet's REPL hosts no dspy sub-agents: dspy derives the action signature per iteration.
    def factory() -> None:
        return None

    derived = first._action_signature_for_current_factory(factory, "")
    assert second._action_signature_for_current_factory(factory, "") is derived
    same(derived, plain._action_signature_for_current_factory(factory, ""))
    assert derived.instructions != first.generate_action.signature.instructions

    other = FleetRLM(
        dspy_adapter.TurnSignature, max_iters=3, max_llm_calls=9
    )  # another budget, another prompt
    assert other.generate_action.signature is not first.generate_action.signature
    same(
        other.generate_action.signature,
        dspy.RLM(dspy_adapter.TurnSignature, max_llm_calls=9).generate_action.signature,
    )


def test_a_turn_sets_up_no_dspy_facade_and_logs_no_warning_about_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # fleet's REPL hosts no dspy sub-agents. dspy would try to install its facade each Turn, be
    # refused, and log a warning: FleetRLM skips the attempt with the same outcome.
    harness = Harness(tmp_path, *KEYWORD_SCRIPT)
    with caplog.at_level(logging.WARNING, logger="dspy"):
        assert harness.run().answer == "Hello there, friend! (3 words)"
    assert not [r for r in caplog.records if "sub-agents" in r.getMessage()]
    repl = SimpleNamespace(tools={"CONSTRUCT": 1, "llm_query": 2})
    repl.tools.update({facade.CONSTRUCT_TOOL: 3, facade.CALL_TOOL: 4})
    rlm = FleetRLM(dspy_adapter.TurnSignature, max_iters=3, max_llm_calls=5)
    assert rlm._setup_facade(repl, None, lambda: None) == ""  # what dspy returns when refused
    assert set(repl.tools) == {"CONSTRUCT", "llm_query"}


def test_run_program_script_exhausted(tmp_path: Path) -> None:
    harness = Harness(tmp_path, {"lm": "root", "reasoning": "look", "code": "print('no submit')"})
    with pytest.raises(Exception) as info:
        harness.run()
    assert find_cause(info.value, ScriptExhausted) is not None
    assert harness.sessions[0].closed is True


@pytest.mark.parametrize(("name", "params"), [("llm_query", ["prompt"]), ("llm_query_batched", ["prompts"])])
def test_wrapped_lm_tool_keeps_positional_parameters(name: str, params: list[str]) -> None:
    """The sandbox maps positional args by the host tool's signature; the wrapper must keep it."""

    def llm_query(prompt: str) -> str:
        return prompt

    def llm_query_batched(prompts: list[str]) -> list[str]:
        return prompts

    tool = {"llm_query": llm_query, "llm_query_batched": llm_query_batched}[name]
    observer = TurnObserver(emit=lambda e: None, run_id="r", stop=threading.Event(), max_output_chars=100)
    assert tool_params(observer.wrap_lm_tool(name, tool)) == params


def test_run_program_with_the_shipped_demo_script(tmp_path: Path) -> None:
    """The demo calls `llm_query(...)` positionally, as models do."""
    demo = Path(__file__).resolve().parents[3] / "config" / "scripts" / "demo.jsonl"
    lines = [json.loads(line) for line in demo.read_text(encoding="utf-8").splitlines() if line.strip()]
    harness = Harness(tmp_path, *lines)
    result = harness.run(request="please say hi")
    errors = [e.error for e in harness.events if isinstance(e, CellOutput) and e.error]
    assert errors == []
    assert "(Your request had 3 words.)" in result.answer
    assert result.answer.endswith("run `uv run fleet up --profile local`.")  # how to connect a model
    started = [e for e in harness.events if isinstance(e, LMQueryStarted)]
    assert [(e.tool, e.prompt) for e in started] == [
        ("llm_query", "Write one friendly sentence acknowledging this request: please say hi")
    ]


def test_stop_prevents_any_further_lm_call(tmp_path: Path) -> None:
    harness = Harness(tmp_path, *KEYWORD_SCRIPT, stop_after=CellOutput)
    with pytest.raises(BaseException) as info:
        harness.run()
    assert find_cause(info.value, TurnStopped) is not None
    assert harness.cursor.positions["root"] == 1, "a root LM call was made after the Turn was stopped"


def test_stop_ends_the_run_with_turn_stopped(tmp_path: Path) -> None:
    """What holds today: the run does end with TurnStopped, before the next cell runs."""
    harness = Harness(tmp_path, *KEYWORD_SCRIPT, stop_after=CellOutput)
    with pytest.raises(BaseException) as info:
        harness.run()
    assert find_cause(info.value, TurnStopped) is not None
    assert [e.call_id for e in harness.events if isinstance(e, CodeCell)] == ["cell-1"]
    assert harness.sessions[0].closed is True
