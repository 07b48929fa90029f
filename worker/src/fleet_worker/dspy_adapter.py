"""LMs, the RLM program, and callbacks → Runtime Events. With `dspy_compat.py` (what fleet takes
from dspy's private names), `dspy_stream.py` (the program on DSPy's token stream) and
`lm_meter.py` (each LM call's counters and span), the only modules that import dspy.

It uses public DSPy API: `dspy.RLM`, `dspy.LM(engine=...)`, `BaseCallback`, the
`CodeInterpreter` protocol and `interpreter_factory`. `tests/unit/worker/test_dspy_contract.py`
fails loudly if an upgrade changes what we rely on.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import dspy
from dspy.lm15 import Message, Response, TextPart, Usage, response_to_events
from dspy.primitives.code_interpreter import CodeExecutionError, CodeInterpreterError, FinalOutput
from dspy.utils.callback import BaseCallback

from fleet_shared.config import ResolvedLM
from fleet_shared.program_text import SHIPPED_INSTRUCTIONS
from fleet_shared.transcript import failed_cell_text
from fleet_worker.dspy_compat import FACADE_SETUP_VARIABLE, FleetRLM
from fleet_worker.dspy_stream import run_streamed, step_began, step_ended
from fleet_worker.errors import TurnStopped
from fleet_worker.lm.script import Role, ScriptCursor, asks_for_the_answer, completion_text, count_tokens
from fleet_worker.lm_meter import LMCallMeter, MeteredUsage
from fleet_worker.observer import TurnObserver, fit_output
from fleet_worker.sandbox.errors import CellFailed, SandboxCrashed
from fleet_worker.sandbox.provider import Repl
from fleet_worker.sandbox.workspace import HOST_PATHS
from fleet_worker.streamed_parts import ANSWER_PART
from fleet_worker.turn_trace import TurnTrace


class TurnSignature(dspy.Signature):
    # The shipped program version's text; a Run's own version replaces it (signature_for).
    __doc__ = SHIPPED_INSTRUCTIONS

    request: str = dspy.InputField(desc="the user's message for this Turn")
    history: dspy.History = dspy.InputField(desc="earlier Turns of this session")
    skills: list[str] = dspy.InputField(
        desc="skill cards selected for this Turn (their full text is in /workspace/skills/)"
    )
    attachments: list[str] = dspy.InputField(
        desc="files the user attached, staged under /workspace/attachments/"
    )
    answer: str = dspy.OutputField(desc="the reply shown to the user")


class ChildSignature(dspy.Signature):
    """You are a child RLM, started by a parent RLM's `rlm_query` for one subtask. Your REPL is
    a fresh, empty sandbox: everything you need is in `task`. Use plain Python, `llm_query` and
    `llm_query_batched` (you cannot start children), keep within your share of the LM budget,
    and SUBMIT one concise answer for the parent."""

    task: str = dspy.InputField(desc="the subtask, with all the context it needs")
    answer: str = dspy.OutputField(desc="the result, for the parent RLM")


# --- LMs ----------------------------------------------------------------------------------------


class ScriptedEngine:
    """A dspy engine that answers from a Run's script cursor, for one role."""

    def __init__(self, cursor: ScriptCursor, role: Role, model: str, stop: threading.Event) -> None:
        self.cursor, self.role, self.model, self.stop = cursor, role, model, stop

    def complete(self, request: Any) -> Response:
        line = self.cursor.next(self.role)
        if line.delay_s and self.stop.wait(line.delay_s):
            raise TurnStopped("the Turn was stopped during a scripted delay")
        system = request.system if isinstance(request.system, str) else str(request.system or "")
        text = completion_text(line, extract=self.role != "sub" and asks_for_the_answer(system))
        prompt = "".join(m.text or "" for m in request.messages)
        usage = Usage(
            input_tokens=count_tokens(prompt),
            output_tokens=count_tokens(text),
            total_tokens=count_tokens(prompt) + count_tokens(text),
        )
        return Response(
            id=None,
            model=self.model,
            message=Message.assistant([TextPart(text)]),
            finish_reason="stop",
            usage=usage,
        )

    def stream(self, request: Any) -> Iterator[Any]:
        return iter(response_to_events(self.complete(request)))

    def close(self) -> None:
        return None


def build_lm(
    lm: ResolvedLM,
    role: Role,
    cursor: ScriptCursor | None,
    stop: threading.Event,
    trace: TurnTrace | None = None,
) -> dspy.LM:
    """A fresh LM per Turn: scripted from the cursor, or any LiteLLM model via env settings."""
    meter = [LMCallMeter(lm.name, role, trace)]
    if lm.scripted:
        assert cursor is not None
        engine = ScriptedEngine(cursor, role, lm.name, stop)
        return dspy.LM(lm.name, engine=engine, cache=False, num_retries=0, callbacks=meter)
    return dspy.LM(lm.name, cache=False, callbacks=meter, **provider_kwargs(lm))


def provider_kwargs(lm: ResolvedLM) -> dict[str, Any]:
    """The LiteLLM/OpenAI-compatible settings; the key is revealed only here, into the client."""
    kwargs: dict[str, Any] = {"num_retries": lm.num_retries, "timeout": lm.request_timeout}
    if lm.api_key is not None:
        kwargs["api_key"] = lm.api_key.reveal()
    if lm.base_url:
        kwargs["api_base"] = lm.base_url
    if lm.temperature is not None:
        kwargs["temperature"] = lm.temperature
    if lm.max_tokens is not None:
        kwargs["max_tokens"] = lm.max_tokens
    return kwargs


# --- DSPy callbacks -----------------------------------------------------------------------------


class DspyCallbacks(BaseCallback):
    """Public DSPy callbacks: the root action predictor marks iteration boundaries, and each call
    of the RLM's own LM (its actions, the extract fallback) is charged to its budget."""

    def __init__(self, observer: TurnObserver, program: dspy.RLM, lm: dspy.LM) -> None:
        self.observer = observer
        self.program = program
        self.lm = lm
        self.program_call: str | None = None
        self.extract_call: str | None = None

    def on_module_start(self, call_id: str, instance: Any, inputs: dict[str, Any]) -> None:
        if instance is self.program:
            self.program_call = call_id
        if instance is self.program.generate_action:
            self.observer.action_started(call_id)
            step_began(self.observer.reasoning_part)
            return
        self.observer.check_stop()
        if instance is self.program.extract:  # every iteration used, no SUBMIT: DSPy extracts
            self.observer.max_iters_reached(self.program.max_iters)
            self.extract_call = call_id
            step_began(ANSWER_PART)

    def on_module_end(self, call_id: str, outputs: Any | None, exception: Exception | None = None) -> None:
        if exception is not None and call_id == self.program_call:
            self.observer.program_failure = (exception, exception.__cause__)
        if call_id in self.observer.action_calls:
            step_ended(self.observer.reasoning_part)
        elif call_id == self.extract_call:
            step_ended(ANSWER_PART)
        self.observer.action_finished(call_id, outputs)

    def on_lm_start(self, call_id: str, instance: Any, inputs: dict[str, Any]) -> None:
        self.observer.check_stop()
        self.observer.check_quota()
        if instance is self.lm:  # sub-LM calls were admitted by their tool, before the call
            self.observer.budget.charge(1)


# --- the sandbox as a dspy CodeInterpreter ------------------------------------------------------


class SandboxInterpreter:
    """dspy's CodeInterpreter protocol over one sandbox REPL session."""

    def __init__(self, session: Repl, observer: TurnObserver) -> None:
        self.session = session
        self.observer = observer
        self.tool_table: dict[str, Callable[..., Any]] = {}
        self.output_fields: list[dict[str, Any]] | None = None

    @classmethod
    def on(cls, factory: Callable[[], Repl], observer: TurnObserver) -> SandboxInterpreter:
        return cls(factory(), observer)

    @property
    def tools(self) -> dict[str, Callable[..., Any]]:
        return self.tool_table

    def start(self) -> None:
        """Does not wait for the REPL. dspy calls this before its first LM call; the REPL is
        already starting (from the lease) or warm, and the first cell waits for it, so its start
        overlaps that LM call. A REPL that cannot start fails that cell with CodeInterpreterError,
        which ends the program: the price of a broken sandbox is one LM call."""

    def shutdown(self) -> None:
        self.session.shutdown()

    def execute(self, code: str, variables: dict[str, Any] | None = None) -> Any:
        self.observer.check_stop()
        if variables and FACADE_SETUP_VARIABLE in variables:
            # DSPy then runs without sandboxed sub-agents, and its prompt does not offer them.
            raise CodeExecutionError("fleet does not bridge dspy sub-agents into the sandbox")
        try:  # the REPL may still be starting: wait here, where a stop is still heard after
            self.session.start()
        except SandboxCrashed as exc:
            raise CodeInterpreterError(HOST_PATHS.scrub(str(exc))) from None
        self.observer.check_stop()
        call_id = self.observer.cell_started(code)
        gate = self.observer.approvals
        refused = gate.review(call_id, code) if gate is not None and call_id is not None else None
        if refused is not None:  # not run: the RLM is told why, as the cell's error
            raise CodeExecutionError(self.report(call_id, "", False, refused))
        tools = self.observer.lm_tools(self.tool_table)
        fields = [f["name"] for f in self.output_fields] if self.output_fields else None
        try:
            result = self.session.execute(code, variables or {}, tools, fields)
        except CellFailed as exc:  # timed out, interrupted, or its REPL died: told to the RLM
            message = HOST_PATHS.scrub(str(exc))
            told = self.report(call_id, exc.stdout, exc.truncated, message)
            if self.observer.stop.is_set():
                raise TurnStopped(message) from None
            raise CodeExecutionError(told) from None
        except SandboxCrashed as exc:  # no REPL could be started at all
            message = HOST_PATHS.scrub(str(exc))
            self.report(call_id, "", False, message)
            raise CodeInterpreterError(message) from None
        if result.error is not None:
            detail = result.error.traceback or f"{result.error.type}: {result.error.message}"
            told = self.report(call_id, result.stdout, result.truncated, detail)
            if result.error.type == "SyntaxError":
                raise SyntaxError(result.error.message)
            raise CodeExecutionError(told)
        self.report(call_id, result.stdout, result.truncated, None)
        if result.final is not None:
            return FinalOutput(result.final)
        return result.stdout

    def report(self, call_id: str | None, stdout: str, truncated: bool, error: str | None) -> str:
        """Streams how the cell ended (unless it is DSPy's own setup code, with no call id). For a
        failed cell, returns what the RLM is told: the same text as the client's `errorText`."""
        if error is not None:
            error = HOST_PATHS.scrub(error)
            stdout, truncated = fit_output(stdout, truncated, error, self.observer.max_output_chars)
        if call_id is not None:
            self.observer.cell_finished(call_id, stdout, truncated, error)
        return stdout if error is None else failed_cell_text(stdout, truncated, error)


# --- the program --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProgramLimits:
    max_iters: int
    max_llm_calls: int
    max_output_chars: int


@dataclass(frozen=True)
class ProgramResult:
    answer: str
    iterations: int
    lm_usage: dict[str, dict[str, int]]
    streamed_answer: str | None = None  # what AnswerDelta events carried of it, if any


@functools.lru_cache(maxsize=16)
def signature_for(instructions: str | None) -> type[dspy.Signature]:
    """The Turn's signature with a program version's instructions (None: the shipped ones); one
    class per text, so Turns on the same version share it."""
    if instructions is None or instructions == SHIPPED_INSTRUCTIONS:
        return TurnSignature
    signature: type[dspy.Signature] = TurnSignature.with_instructions(instructions)
    return signature


def new_rlm(
    signature: type[dspy.Signature],
    limits: ProgramLimits,
    sub_lm: dspy.LM,
    tools: list[Callable[..., Any]] | None,
) -> dspy.RLM:
    return FleetRLM(
        signature,
        max_iters=limits.max_iters,
        max_llm_calls=limits.max_llm_calls,
        max_output_chars=limits.max_output_chars,
        sub_lm=sub_lm,
        tools=tools or None,
    )


def run_program(
    *,
    request: str,
    history: list[dict[str, str]],
    attachments: list[str] | None = None,
    skills: list[str] | None = None,
    root_lm: dspy.LM,
    sub_lm: dspy.LM,
    limits: ProgramLimits,
    observer: TurnObserver,
    interpreter_factory: Callable[[], Repl],
    tools: list[Callable[..., Any]] | None = None,
    stream: bool = True,
    instructions: str | None = None,
) -> ProgramResult:
    """Run one fresh dspy.RLM to completion, synchronously (the caller puts it in a thread).
    `tools` holds `rlm_query` when child RLMs are enabled. `stream`: on DSPy's token stream
    (dspy_stream), for an LM whose tokens take time to come; the scripted LM's come at once."""
    program = new_rlm(signature_for(instructions), limits, sub_lm, tools)
    # trace=[] and disable_history=True: DSPy would otherwise append every predictor call to the
    # process-wide dspy.settings.trace and every LM call to the global LM history (10,000 entries
    # each), keeping each Turn's signature classes, prompts and predictions alive.
    with (
        dspy.context(
            lm=root_lm,
            callbacks=[DspyCallbacks(observer, program, root_lm)],
            track_usage=True,
            trace=[],
            disable_history=True,
        ),
        dspy.track_usage() as tracker,
        dspy.context(usage_tracker=MeteredUsage(tracker, observer.tokens)),
    ):
        observer.usage_tracker = tracker
        run = functools.partial(run_streamed, program, observer) if stream else program
        prediction = run(
            request=request,
            history=dspy.History(messages=history),
            skills=skills or [],
            attachments=attachments or [],
            interpreter_factory=functools.partial(SandboxInterpreter.on, interpreter_factory, observer),
        )
    observer.finish_step()
    return ProgramResult(
        answer=str(prediction.answer),
        iterations=observer.iteration,
        lm_usage=observer.usage_snapshot(),
        streamed_answer=observer.streamed_answer,
    )


def run_child_program(
    *,
    task: str,
    root_lm: dspy.LM,
    sub_lm: dspy.LM,
    limits: ProgramLimits,
    observer: TurnObserver,
    interpreter_factory: Callable[[], Repl],
) -> str:
    """One child RLM, on the thread of the parent's `rlm_query`: no tools (so no grandchildren),
    its own callbacks, and the parent's usage tracker (its tokens are the Turn's)."""
    program = new_rlm(ChildSignature, limits, sub_lm, None)
    callbacks = [DspyCallbacks(observer, program, root_lm)]
    with dspy.context(lm=root_lm, callbacks=callbacks, trace=[], disable_history=True):
        prediction = program(
            task=task,
            interpreter_factory=functools.partial(SandboxInterpreter.on, interpreter_factory, observer),
        )
    return str(prediction.answer)


def describe_batch_failure(exc: Exception) -> str:
    """One failed prompt of `llm_query_batched`, as the text in its place (LM errors only)."""
    if isinstance(exc, dspy.LMError):
        return lm_error_message(exc)
    raise exc


def is_lm_error(exc: BaseException) -> bool:
    return isinstance(exc, dspy.LMError)


def lm_error_message(exc: BaseException) -> str:
    """What a user may see of an LM failure: DSPy's stable code, the HTTP status and the model.

    Never the provider's own text: it can carry a base URL with credentials, or hints meant for
    the operator (env var names). The worker's log has the full error."""
    code = getattr(exc, "code", None) or "lm_error"
    details = [str(code)]
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        details.append(f"HTTP {status}")
    model = getattr(exc, "model", None)
    if model:
        details.append(f"model {model}")
    return f"the LM call failed ({', '.join(details)})"
