"""The only module that imports dspy: LMs, the RLM program, and callbacks → Runtime Events.

It uses public DSPy API only: `dspy.RLM`, `dspy.LM(engine=...)`, `BaseCallback`, the
`CodeInterpreter` protocol and `interpreter_factory`. `tests/unit/worker/test_dspy_contract.py`
fails loudly if an upgrade changes what we rely on.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import dspy
from dspy.lm15 import Message, Response, TextPart, Usage, response_to_events
from dspy.primitives.code_interpreter import CodeExecutionError, CodeInterpreterError, FinalOutput
from dspy.utils.callback import BaseCallback

from fleet_shared.config import ResolvedLM
from fleet_shared.events import (
    CellOutput,
    CodeCell,
    IterationFinished,
    IterationStarted,
    LMQueryFinished,
    LMQueryStarted,
    Reasoning,
    RunEvent,
    Warning,
)
from fleet_worker.errors import TurnStopped
from fleet_worker.lm.script import Role, ScriptCursor, asks_for_the_answer, completion_text, count_tokens
from fleet_worker.sandbox.errors import CellFailed, SandboxCrashed
from fleet_worker.sandbox.provider import Repl
from fleet_worker.sandbox.workspace import HOST_PATHS

LM_TOOLS = ("llm_query", "llm_query_batched", "rlm_query")
PROMPT_PREVIEW_CHARS = 4000


class TurnSignature(dspy.Signature):
    """Answer the user's request. Use the REPL: plain Python first, then `llm_query`, then
    `llm_query_batched`; verify what you computed, then call SUBMIT once.

    The REPL's working folder is /workspace, which belongs to this session and outlives the
    Turn: `memory/` holds notes you left for later Turns (read it first, write what is worth
    keeping), `skills/` holds skill cards, `attachments/` the files the user attached, and every
    file you write under `artifacts/` is delivered to the user as a download."""

    request: str = dspy.InputField(desc="the user's message for this Turn")
    history: dspy.History = dspy.InputField(desc="earlier Turns of this session")
    attachments: list[str] = dspy.InputField(
        desc="files the user attached, staged under /workspace/attachments/"
    )
    answer: str = dspy.OutputField(desc="the reply shown to the user")


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
        text = completion_text(line, extract=self.role == "root" and asks_for_the_answer(system))
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


def build_lm(lm: ResolvedLM, role: Role, cursor: ScriptCursor | None, stop: threading.Event) -> dspy.LM:
    """A fresh LM per Turn: scripted from the cursor, or any LiteLLM model via env settings."""
    if lm.scripted:
        assert cursor is not None
        engine = ScriptedEngine(cursor, role, lm.name, stop)
        return dspy.LM(lm.name, engine=engine, cache=False, num_retries=0)
    return dspy.LM(lm.name, cache=False, **provider_kwargs(lm))


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


# --- observing a Run ----------------------------------------------------------------------------


@dataclass
class TurnObserver:
    """Turns what DSPy and the sandbox report into Runtime Events, from the RLM's thread."""

    emit: Callable[[RunEvent], None]
    run_id: str
    stop: threading.Event
    max_output_chars: int
    max_llm_calls: int = 1_000_000  # mirrors DSPy's budget, so refused calls make no events
    iteration: int = 0
    step_open: bool = False
    pending_cell: bool = False
    lm_calls: int = 0
    charged: int = 0  # prompts sent to the sub-LM so far (a batch charges one per prompt)
    budget_warned: bool = False
    action_calls: set[str] = field(default_factory=set)
    usage_tracker: Any = None  # dspy's UsageTracker for this Turn, once the program runs

    def usage_snapshot(self) -> dict[str, dict[str, int]]:
        """Tokens observed so far; safe to call from the event loop while the program runs."""
        tracker = self.usage_tracker
        if tracker is None:
            return {}
        for _ in range(3):  # the program's thread may add an entry while we sum them
            try:
                return normalize_usage(tracker.get_total_tokens())
            except RuntimeError:
                continue
        return {}

    def check_stop(self) -> None:
        if self.stop.is_set():
            raise TurnStopped("the Turn was stopped")

    def action_started(self, call_id: str) -> None:
        self.check_stop()
        self.finish_step()
        self.action_calls.add(call_id)
        self.pending_cell = False
        self.iteration += 1
        self.step_open = True
        self.emit(IterationStarted(run_id=self.run_id, iteration=self.iteration))

    def action_finished(self, call_id: str, outputs: Any) -> None:
        if call_id not in self.action_calls or outputs is None:
            return
        self.action_calls.discard(call_id)
        reasoning = getattr(outputs, "reasoning", None)
        if reasoning:
            part = f"reasoning-{self.iteration}"
            self.emit(Reasoning(run_id=self.run_id, part_id=part, text=str(reasoning)))
        self.pending_cell = True

    def cell_started(self, code: str) -> str | None:
        """The id of the cell the model asked for, or None for DSPy's own setup code."""
        if not self.pending_cell:
            return None
        self.pending_cell = False
        call_id = f"cell-{self.iteration}"
        self.emit(CodeCell(run_id=self.run_id, call_id=call_id, code=code))
        return call_id

    def cell_finished(self, call_id: str, stdout: str, truncated: bool, error: str | None) -> None:
        self.emit(
            CellOutput(run_id=self.run_id, call_id=call_id, stdout=stdout, truncated=truncated, error=error)
        )
        self.finish_step()

    def finish_step(self) -> None:
        if self.step_open:
            self.step_open = False
            self.emit(IterationFinished(run_id=self.run_id, iteration=self.iteration))

    def max_iters_reached(self, max_iters: int) -> None:
        """The answer that follows is DSPy's extract fallback: said so, once, before it."""
        self.finish_step()
        message = (
            f"the RLM used all {max_iters} iterations without SUBMIT; the answer below was "
            "extracted from its work so far (rlm.max_iters)"
        )
        self.emit(Warning(run_id=self.run_id, code="max_iters", message=message))

    def warn_budget_once(self) -> None:
        if not self.budget_warned:
            self.budget_warned = True
            message = f"the Turn used its {self.max_llm_calls} sub-LM calls; later calls were refused"
            self.emit(Warning(run_id=self.run_id, code="llm_budget_exhausted", message=message))

    def wrap_lm_tool(self, name: str, tool: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(tool)  # keeps the signature: the sandbox maps positional args by it
        def observed(**kwargs: Any) -> Any:
            self.check_stop()
            prompts = kwargs.get("prompts")
            needed = len(prompts) if isinstance(prompts, list) else 1
            if self.charged + needed > self.max_llm_calls:
                self.warn_budget_once()
                return tool(**kwargs)  # DSPy refuses it and tells the cell why; no events each
            self.charged += needed
            self.lm_calls += 1
            call_id = f"{name}-{self.iteration}-{self.lm_calls}"
            self.emit(lm_query_started(self.run_id, call_id, name, kwargs))
            try:
                result = tool(**kwargs)
            except Exception as exc:
                self.emit(LMQueryFinished(run_id=self.run_id, call_id=call_id, error=str(exc)))
                raise
            self.emit(lm_query_finished(self.run_id, call_id, result, self.max_output_chars))
            return result

        return observed


def lm_query_started(run_id: str, call_id: str, name: str, kwargs: dict[str, Any]) -> LMQueryStarted:
    prompts = kwargs.get("prompts")
    if isinstance(prompts, list):
        return LMQueryStarted(run_id=run_id, call_id=call_id, tool=name, prompt_count=len(prompts))  # type: ignore[arg-type]
    prompt = str(kwargs.get("prompt", ""))[:PROMPT_PREVIEW_CHARS]
    return LMQueryStarted(run_id=run_id, call_id=call_id, tool=name, prompt=prompt)  # type: ignore[arg-type]


def lm_query_finished(run_id: str, call_id: str, result: Any, cap: int) -> LMQueryFinished:
    if isinstance(result, list):
        return LMQueryFinished(run_id=run_id, call_id=call_id, texts=[str(t)[:cap] for t in result])
    return LMQueryFinished(run_id=run_id, call_id=call_id, text=str(result)[:cap])


class DspyCallbacks(BaseCallback):
    """Public DSPy callbacks: the root action predictor marks iteration boundaries."""

    def __init__(self, observer: TurnObserver, program: dspy.RLM) -> None:
        self.observer = observer
        self.program = program

    def on_module_start(self, call_id: str, instance: Any, inputs: dict[str, Any]) -> None:
        if instance is self.program.generate_action:
            self.observer.action_started(call_id)
            return
        self.observer.check_stop()
        if instance is self.program.extract:  # every iteration used, no SUBMIT: DSPy extracts
            self.observer.max_iters_reached(self.program.max_iters)

    def on_module_end(self, call_id: str, outputs: Any | None, exception: Exception | None = None) -> None:
        self.observer.action_finished(call_id, outputs)

    def on_lm_start(self, call_id: str, instance: Any, inputs: dict[str, Any]) -> None:
        self.observer.check_stop()


# --- the sandbox as a dspy CodeInterpreter ------------------------------------------------------


class SandboxInterpreter:
    """dspy's CodeInterpreter protocol over one sandbox REPL session."""

    def __init__(self, session: Repl, observer: TurnObserver) -> None:
        self.session = session
        self.observer = observer
        self.tool_table: dict[str, Callable[..., Any]] = {}
        self.output_fields: list[dict[str, Any]] | None = None

    @property
    def tools(self) -> dict[str, Callable[..., Any]]:
        return self.tool_table

    def start(self) -> None:
        self.session.start()

    def shutdown(self) -> None:
        self.session.shutdown()

    def execute(self, code: str, variables: dict[str, Any] | None = None) -> Any:
        self.observer.check_stop()
        call_id = self.observer.cell_started(code)
        tools = {
            name: self.observer.wrap_lm_tool(name, tool) if name in LM_TOOLS else tool
            for name, tool in self.tool_table.items()
        }
        fields = [f["name"] for f in self.output_fields] if self.output_fields else None
        try:
            result = self.session.execute(code, variables or {}, tools, fields)
        except CellFailed as exc:  # timed out, interrupted, or its REPL died: told to the RLM
            message = HOST_PATHS.scrub(str(exc))
            self.report(call_id, exc.stdout, exc.truncated, message)
            if self.observer.stop.is_set():
                raise TurnStopped(message) from None
            combined = f"{exc.stdout}\n{message}" if exc.stdout else message
            raise CodeExecutionError(combined) from None
        except SandboxCrashed as exc:  # no REPL could be started at all
            message = HOST_PATHS.scrub(str(exc))
            self.report(call_id, "", False, message)
            raise CodeInterpreterError(message) from None
        if result.error is not None:
            detail = result.error.traceback or f"{result.error.type}: {result.error.message}"
            self.report(call_id, result.stdout, result.truncated, detail)
            if result.error.type == "SyntaxError":
                raise SyntaxError(result.error.message)
            combined = f"{result.stdout}\n{detail}" if result.stdout else detail
            raise CodeExecutionError(combined)
        self.report(call_id, result.stdout, result.truncated, None)
        if result.final is not None:
            return FinalOutput(result.final)
        return result.stdout

    def report(self, call_id: str | None, stdout: str, truncated: bool, error: str | None) -> None:
        if call_id is not None:
            self.observer.cell_finished(
                call_id, stdout, truncated, None if error is None else HOST_PATHS.scrub(error)
            )


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


def run_program(
    *,
    request: str,
    history: list[dict[str, str]],
    attachments: list[str] | None = None,
    root_lm: dspy.LM,
    sub_lm: dspy.LM,
    limits: ProgramLimits,
    observer: TurnObserver,
    interpreter_factory: Callable[[], Repl],
) -> ProgramResult:
    """Run one fresh dspy.RLM to completion, synchronously (the caller puts it in a thread)."""
    program = dspy.RLM(
        TurnSignature,
        max_iters=limits.max_iters,
        max_llm_calls=limits.max_llm_calls,
        max_output_chars=limits.max_output_chars,
        sub_lm=sub_lm,
    )

    def factory() -> SandboxInterpreter:
        return SandboxInterpreter(interpreter_factory(), observer)

    callbacks = [DspyCallbacks(observer, program)]
    # trace=[] and disable_history=True: DSPy would otherwise append every predictor call to the
    # process-wide dspy.settings.trace and every LM call to the global LM history (10,000 entries
    # each), keeping each Turn's signature classes, prompts and predictions alive.
    with (
        dspy.context(lm=root_lm, callbacks=callbacks, track_usage=True, trace=[], disable_history=True),
        dspy.track_usage() as tracker,
    ):
        observer.usage_tracker = tracker
        prediction = program(
            request=request,
            history=dspy.History(messages=history),
            attachments=attachments or [],
            interpreter_factory=factory,
        )
    observer.finish_step()
    return ProgramResult(
        answer=str(prediction.answer),
        iterations=observer.iteration,
        lm_usage=observer.usage_snapshot(),
    )


def normalize_usage(raw: dict[str, Any]) -> dict[str, dict[str, int]]:
    return {
        model: {
            "prompt_tokens": int((entry or {}).get("prompt_tokens") or 0),
            "completion_tokens": int((entry or {}).get("completion_tokens") or 0),
        }
        for model, entry in raw.items()
    }


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
