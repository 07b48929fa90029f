"""What DSPy and the sandbox report, turned into Runtime Events, and the REPL's LM tools metered
by the Turn's one call budget (fleet_worker.budget). Runs on the RLM's thread; no dspy import."""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from fleet_shared.events import (
    AnswerDelta,
    CellOutput,
    CodeCell,
    CodeDelta,
    IterationFinished,
    IterationStarted,
    LMQueryFinished,
    LMQueryStarted,
    Reasoning,
    ReasoningDelta,
    RunEvent,
    RunWarning,
)
from fleet_shared.transcript import OUTPUT_CUT_NOTE, failed_cell_text
from fleet_worker.approvals import ApprovalGate
from fleet_worker.budget import CallBudget, LLMBudgetExhausted
from fleet_worker.errors import TurnStopped
from fleet_worker.streamed_parts import (
    ANSWER_PART,
    CELL_PREFIX,
    REASONING_PREFIX,
    StreamedCode,
    StreamedParts,
    closing,
)
from fleet_worker.tenant_tokens import TenantTokens

PROMPT_PREVIEW_CHARS = 4000
UNRUN_CELL_TEXT = "this code was not run: the step's action could not be taken as a Python cell"
UNLIMITED = 1_000_000


def raise_it(exc: Exception) -> str:
    raise exc


@dataclass
class TurnObserver:
    """One RLM's view of its Turn: events out, stop checks, and budgeted LM tools. A child RLM
    has its own, `quiet` (only its progress is streamed) and on its budget slice."""

    emit: Callable[[RunEvent], None]
    run_id: str
    stop: threading.Event
    max_output_chars: int
    budget: CallBudget = field(default_factory=lambda: CallBudget(UNLIMITED))
    batch_concurrency: int = 4
    # An LM failure of one batched prompt, as the text in its place (DSPy's own batched call
    # does the same); anything else is raised. The adapter gives the scrubbed description.
    describe_failure: Callable[[Exception], str] = raise_it
    quiet: bool = False
    iteration: int = 0
    step_open: bool = False
    pending_cell: bool = False
    lm_calls: int = 0
    budget_warned: bool = False
    action_calls: set[str] = field(default_factory=set)
    usage_tracker: Any = None  # dspy's UsageTracker for this Turn, once the program runs
    tokens: TenantTokens | None = None  # the tenant's LM tokens today, shared with its children
    # Around each sub-LM call and child RLM: the adapter's context that keeps them off the root's
    # token stream (only the root's actions stream).
    unstreamed: Callable[[], AbstractContextManager[Any]] = nullcontext
    # The program's own error and its cause, as the program raised it (the adapter's stream
    # re-raises the error without its cause).
    program_failure: tuple[BaseException, BaseException | None] | None = None
    streaming: StreamedParts = field(default_factory=StreamedParts)
    code: StreamedCode | None = None  # the streaming cell's code field, as far as it came
    # The root RLM's: each of its cells passes it before it runs (a child RLM's cells do not).
    approvals: ApprovalGate | None = None

    def usage_snapshot(self) -> dict[str, dict[str, int]]:
        """Tokens observed so far; safe to call from the event loop while the program runs."""
        tracker = self.usage_tracker
        if tracker is None:
            return {}
        for _ in range(3):  # the program's thread may add an entry while we sum them
            try:
                calls = {lm: len(entries) for lm, entries in tracker.usage_data.items()}
                return normalize_usage(tracker.get_total_tokens(), calls)
            except RuntimeError:
                continue
        return {}

    def send(self, event: RunEvent) -> None:
        if not self.quiet:
            self.emit(event)

    def check_stop(self) -> None:
        if self.stop.is_set():
            raise TurnStopped("the Turn was stopped")

    def check_quota(self) -> None:
        """At each LM call's start: once the tenant's tokens for today reach its quota, the whole
        Turn stops (its children and batched prompts too), with one `quota_exhausted` warning."""
        tokens = self.tokens
        if tokens is None or not tokens.exhausted():
            return
        if tokens.first_warning():
            message = f"{tokens.spent}; the Turn stopped at its next LM call"
            self.emit(RunWarning(run_id=self.run_id, code="quota_exhausted", message=message))
        self.stop.set()
        raise TurnStopped("the tenant's LM tokens for today are used up")

    def action_started(self, call_id: str) -> None:
        self.check_stop()
        self.finish_step()
        self.action_calls.add(call_id)
        self.pending_cell = False
        self.iteration += 1
        self.step_open = True
        self.send(IterationStarted(run_id=self.run_id, iteration=self.iteration))

    def action_finished(self, call_id: str, outputs: Any) -> None:
        if call_id not in self.action_calls or outputs is None:
            return
        self.action_calls.discard(call_id)
        reasoning = getattr(outputs, "reasoning", None)
        part = self.reasoning_part
        sent = self.streaming.end(part, self.send_delta)  # ended already, unless its end came late
        if reasoning:
            text = str(reasoning)
            self.send(Reasoning(run_id=self.run_id, part_id=part, text=text, **closing(text, sent)))
        self.pending_cell = True

    @property
    def reasoning_part(self) -> str:
        return f"{REASONING_PREFIX}{self.iteration}"

    def stream_delta(self, text: str) -> None:
        """Text of the part whose LM call is in flight, as its tokens arrive (the stream's reader,
        between the part's `stream_began` and `stream_ended`)."""
        if not self.quiet and text:
            self.streaming.add(text, self.send_delta)

    def code_delta(self, text: str) -> None:
        """Code of the step whose LM call is in flight (after its reasoning, on the same marks),
        without its markdown fence: the cell's CodeCell follows with the code it runs."""
        # The step is read outside the lock: only this thread (the stream's reader) opens one, and
        # add() drops the chunk under the lock if the step has ended meanwhile.
        step = self.streaming.part_id
        if self.quiet or not text or step is None or not step.startswith(REASONING_PREFIX):
            return
        if self.streaming.budget <= 0:  # no more deltas this Turn: the cell comes whole
            return
        call_id = CELL_PREFIX + step.removeprefix(REASONING_PREFIX)
        if self.code is None or self.code.call_id != call_id:
            self.code = StreamedCode(call_id)
        shown = self.code.feed(text)
        if shown:
            self.streaming.add(shown, self.send_delta, into=call_id)

    def stream_began(self, part_id: str) -> None:
        self.streaming.begin(part_id, self.send_delta)

    def stream_ended(self, part_id: str) -> None:
        self.streaming.end(part_id, self.send_delta)

    def send_delta(self, part_id: str, delta: str) -> None:
        if part_id == ANSWER_PART:
            self.send(AnswerDelta(run_id=self.run_id, part_id=part_id, delta=delta))
        elif part_id.startswith(CELL_PREFIX):
            self.send(CodeDelta(run_id=self.run_id, call_id=part_id, delta=delta))
        else:
            self.send(ReasoningDelta(run_id=self.run_id, part_id=part_id, delta=delta))

    @property
    def streamed_answer(self) -> str | None:
        """What the answer's deltas carried (DSPy's extract fallback on the stream), or None."""
        return self.streaming.sent.get(ANSWER_PART)

    def cell_started(self, code: str) -> str | None:
        """The id of the cell the model asked for, or None for DSPy's own setup code."""
        if not self.pending_cell:
            return None
        self.pending_cell = False
        call_id = f"{CELL_PREFIX}{self.iteration}"
        self.send(CodeCell(run_id=self.run_id, call_id=call_id, code=code))
        return call_id

    def cell_finished(self, call_id: str, stdout: str, truncated: bool, error: str | None) -> None:
        self.send(
            CellOutput(run_id=self.run_id, call_id=call_id, stdout=stdout, truncated=truncated, error=error)
        )
        self.finish_step()

    def finish_step(self) -> None:
        self.settle_unrun_cell()
        if self.step_open:
            self.step_open = False
            self.send(IterationFinished(run_id=self.run_id, iteration=self.iteration))

    def settle_unrun_cell(self) -> None:
        """A step whose code streamed but never ran (DSPy could not take it as Python: no cell
        started) ends its cell here, as it was shown, so the stream and the history agree."""
        call_id = f"{CELL_PREFIX}{self.iteration}"
        shown = self.streaming.sent.get(call_id)
        if not self.pending_cell or shown is None:
            return
        self.pending_cell = False
        self.send(CodeCell(run_id=self.run_id, call_id=call_id, code=shown))
        self.send(CellOutput(run_id=self.run_id, call_id=call_id, stdout="", error=UNRUN_CELL_TEXT))

    def max_iters_reached(self, max_iters: int) -> None:
        """The answer that follows is DSPy's extract fallback: said so, once, before it."""
        self.finish_step()
        message = (
            f"the RLM used all {max_iters} iterations without SUBMIT; the answer below was "
            "extracted from its work so far (rlm.max_iters)"
        )
        self.send(RunWarning(run_id=self.run_id, code="max_iters", message=message))

    def refuse(self, needed: int, what: str) -> LLMBudgetExhausted:
        """The error the cell sees, after one `llm_budget_exhausted` warning per Turn."""
        refusal = self.budget.refusal(needed, what)
        if not self.budget_warned:
            self.budget_warned = True
            message = (
                f"the Turn used its {self.budget.limit} LM calls (rlm.max_llm_calls); "
                "later sub-LM and child calls were refused"
            )
            self.send(RunWarning(run_id=self.run_id, code="llm_budget_exhausted", message=message))
        return refusal

    # --- the REPL's LM tools --------------------------------------------------------------------

    def lm_tools(self, table: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
        """The cell's tools, with `llm_query` / `llm_query_batched` admitted by the budget first
        and each call streamed as one tool part; `rlm_query` is only streamed (the child runner
        admits its slice). The batch is ours, over DSPy's `llm_query`, to bound its concurrency."""
        tools = dict(table)
        single = table.get("llm_query")
        if single is not None:
            tools["llm_query"] = self.wrap_lm_tool("llm_query", single)
            if "llm_query_batched" in table:
                tools["llm_query_batched"] = self.batched_tool(single)
        if "rlm_query" in table:
            tools["rlm_query"] = self.wrap_lm_tool("rlm_query", table["rlm_query"])
        return tools

    def wrap_lm_tool(self, name: str, tool: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(tool)  # keeps the signature: the sandbox maps positional args by it
        def observed(**kwargs: Any) -> Any:
            self.check_stop()
            if name == "llm_query":
                prompt = kwargs.get("prompt")
                if not isinstance(prompt, str) or not prompt:
                    raise TypeError("llm_query takes one non-empty prompt string")  # costs nothing
                if not self.budget.admit(1):
                    raise self.refuse(1, "llm_query")
            return self.streamed(name, kwargs, lambda: self.sanitized_call(tool, kwargs))

        return observed

    def sanitized_call(self, tool: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        """An LM failure reaches the cell (and the stream) as DSPy's code and status only, never
        the provider's text, which may carry a base URL or hints meant for the operator."""
        try:
            with self.unstreamed():
                return tool(**kwargs)
        except Exception as exc:
            try:
                message = self.describe_failure(exc)
            except Exception:
                raise exc from None
            raise RuntimeError(message) from None

    def streamed(self, name: str, kwargs: dict[str, Any], call: Callable[[], Any]) -> Any:
        self.lm_calls += 1
        call_id = f"{name}-{self.iteration}-{self.lm_calls}"
        self.send(lm_query_started(self.run_id, call_id, name, kwargs))
        try:
            result = call()
        except BaseException as exc:
            self.send(LMQueryFinished(run_id=self.run_id, call_id=call_id, error=str(exc)))
            raise
        self.send(lm_query_finished(self.run_id, call_id, result, self.max_output_chars))
        return result

    def batched_tool(self, single: Callable[..., Any]) -> Callable[..., list[str]]:
        def llm_query_batched(prompts: list[str]) -> list[str]:
            """Query the sub-LM with several prompts concurrently; the answers in prompt order."""
            self.check_stop()
            if not isinstance(prompts, list) or not all(isinstance(p, str) and p for p in prompts):
                raise TypeError("llm_query_batched takes a list of non-empty prompt strings")
            if not prompts:
                return []
            if not self.budget.admit(len(prompts)):
                raise self.refuse(len(prompts), f"llm_query_batched of {len(prompts)} prompts")
            call = functools.partial(self.run_batch, single, prompts)
            return self.streamed("llm_query_batched", {"prompts": prompts}, call)  # type: ignore[no-any-return]

        return llm_query_batched

    def run_batch(self, query_lm: Callable[..., Any], prompts: list[str]) -> list[str]:
        """At most `batch_concurrency` prompts in flight (rlm.batch_concurrency), each in a copy
        of this thread's context, so the Turn's dspy settings and usage tracker apply."""

        def one(prompt: str) -> str:
            if self.stop.is_set():
                return "[ERROR] the Turn was stopped"
            try:
                return str(query_lm(prompt=prompt))
            except Exception as exc:
                return f"[ERROR] {self.describe_failure(exc)}"

        workers = max(1, min(self.batch_concurrency, len(prompts)))
        with self.unstreamed():  # the prompts' contexts are copies of this one
            contexts = [contextvars.copy_context() for _ in prompts]
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llm-batch") as pool:
            futures = [pool.submit(context.run, one, p) for context, p in zip(contexts, prompts, strict=True)]
            return [future.result() for future in futures]


def fit_output(stdout: str, truncated: bool, error: str, limit: int) -> tuple[str, bool]:
    """A failed cell's output, cut at its end so that `failed_cell_text` of it and its error stays
    within `limit` (rlm.max_output_chars). The error is never cut here: it has its own cap."""
    if len(failed_cell_text(stdout, truncated, error)) <= limit:
        return stdout, truncated
    room = limit - len(error) - len(OUTPUT_CUT_NOTE) - len("\n\n")  # a break after each of output, note
    return stdout[: max(room, 0)], True


def lm_query_started(run_id: str, call_id: str, name: str, kwargs: dict[str, Any]) -> LMQueryStarted:
    prompts = kwargs.get("prompts")
    if isinstance(prompts, list):
        return LMQueryStarted(run_id=run_id, call_id=call_id, tool=name, prompt_count=len(prompts))  # type: ignore[arg-type]
    text = kwargs.get("prompt", kwargs.get("task", ""))
    prompt = str(text)[:PROMPT_PREVIEW_CHARS]
    return LMQueryStarted(run_id=run_id, call_id=call_id, tool=name, prompt=prompt)  # type: ignore[arg-type]


def lm_query_finished(run_id: str, call_id: str, result: Any, cap: int) -> LMQueryFinished:
    if isinstance(result, list):
        return LMQueryFinished(run_id=run_id, call_id=call_id, texts=[str(t)[:cap] for t in result])
    return LMQueryFinished(run_id=run_id, call_id=call_id, text=str(result)[:cap])


def normalize_usage(raw: dict[str, Any], calls: dict[str, int] | None = None) -> dict[str, dict[str, int]]:
    """Tokens per model, and the calls that reported them (one usage entry each)."""
    return {
        model: {
            "prompt_tokens": int((entry or {}).get("prompt_tokens") or 0),
            "completion_tokens": int((entry or {}).get("completion_tokens") or 0),
            "calls": (calls or {}).get(model, 0),
        }
        for model, entry in raw.items()
    }
