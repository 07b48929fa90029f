"""One Turn's spans on the worker, under the gateway's `turn.submit` (fleet_shared.tracing).

    turn.run ─ turn.prepare, turn.settle                     (the event loop, in turn.py)
             └ rlm.iteration ─ lm.call                       (the root LM's action)
                             ├ sandbox.cell
                             ├ rlm.lm_query ─ lm.call        (llm_query, llm_query_batched)
                             └ rlm.child                     (rlm_query)

Iterations, cells, sub-LM queries and children are read off the Turn's own events, on whatever
thread sends them; LM calls come from the LM's DSPy callback. Spans carry ids, counts, models,
tokens and cost; the request, code and prompts only with `observability.tracing.capture_content`
(redacted as logs are, and cut at CONTENT_CHARS). A span a Turn leaves open (a stop mid-cell, a
child the settlement ended) ends with `turn.run`, marked `unfinished`; once `turn.run` has ended,
a program thread that outlived its Turn opens no more spans.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, use_span

from fleet_shared.events import (
    CellOutput,
    ChildProgress,
    CodeCell,
    IterationFinished,
    IterationStarted,
    LMQueryFinished,
    LMQueryStarted,
    RunEvent,
)
from fleet_shared.redaction import redact_text
from fleet_shared.tracing import child_span, context_of, failed, start_span, tracing_on

ITERATION = "iteration"
CONTENT_CHARS = 4096  # per captured attribute: a batch past the backend's size limit is lost whole
# The LM call in flight in this context: (its Turn's trace, its span, its model).
CURRENT_LM_CALL: ContextVar[tuple[TurnTrace, Span, str] | None] = ContextVar(
    "fleet_current_lm_call", default=None
)
Pricer = Callable[[str, int, int], float | None]


@dataclass
class TurnTrace:
    root: Span
    capture_content: bool = False
    price: Pricer = lambda _model, _prompt, _completion: None
    open: dict[str, Span] = field(default_factory=dict)  # by the event's id, ITERATION for the step
    queries: list[str] = field(default_factory=list)  # open sub-LM queries, oldest first
    # Each open LM call's tokens and cost so far: DSPy reports a retried call's usage per attempt.
    lm_totals: dict[int, tuple[int, int, float | None]] = field(default_factory=dict)
    ended: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def begin(
        cls, traceparent: str | None, attributes: dict[str, Any], capture_content: bool, price: Pricer
    ) -> TurnTrace | None:
        """The Turn's `turn.run`, or None when tracing is off (then nothing here runs)."""
        if not tracing_on():
            return None
        root = start_span("turn.run", context_of(traceparent), attributes, kind=SpanKind.CONSUMER)
        return cls(root, capture_content, price)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with child_span(name, self.root):
            yield

    def content(self, span: Span, key: str, text: str | None) -> None:
        if self.capture_content and text:
            span.set_attribute(key, redact_text(text[:CONTENT_CHARS]))

    def parent(self) -> Span:
        return self.open.get(ITERATION, self.root)

    def watching(self, emit: Callable[[RunEvent], None]) -> Callable[[RunEvent], None]:
        """`emit`, with each event seen first."""

        def observed(event: RunEvent) -> None:
            self.observe(event)
            emit(event)

        return observed

    def observe(self, event: RunEvent) -> None:
        with self.lock:
            if self.ended:
                return
            match event:
                case IterationStarted(iteration=n):
                    self.close(ITERATION)
                    self.open[ITERATION] = start_span("rlm.iteration", self.root, {"fleet.iteration": n})
                case IterationFinished():
                    self.close(ITERATION)
                case CodeCell(call_id=call_id, code=code):
                    cell = self.opened(call_id, "sandbox.cell", {"fleet.call_id": call_id})
                    self.content(cell, "fleet.code", code)
                case CellOutput(call_id=call_id, error=error, truncated=truncated):
                    span = self.open.get(call_id)
                    if span is not None:
                        span.set_attribute("fleet.output_truncated", truncated)
                        if error is not None:
                            failed(span, "cell_error")
                    self.close(call_id)
                case LMQueryStarted(call_id=call_id, tool=tool, prompt=prompt, prompt_count=count):
                    attributes = {
                        "fleet.call_id": call_id,
                        "fleet.tool": tool,
                        "fleet.prompt_count": count or 1,
                    }
                    span = self.opened(call_id, "rlm.lm_query", attributes)
                    self.content(span, "fleet.prompt", prompt)
                    self.queries.append(call_id)
                case LMQueryFinished(call_id=call_id, error=error):
                    span = self.open.get(call_id)
                    if span is not None and error is not None:
                        failed(span, "lm_query_error")
                    self.close(call_id)
                    if call_id in self.queries:
                        self.queries.remove(call_id)
                case ChildProgress(child_id=child_id, state="started"):
                    self.opened(f"child:{child_id}", "rlm.child", {"fleet.child_id": child_id})
                case ChildProgress(child_id=child_id, state=state) if state != "started":
                    span = self.open.get(f"child:{child_id}")
                    if span is not None and state != "completed":
                        failed(span, f"child_{state}")
                    self.close(f"child:{child_id}")
                case _:
                    pass

    def opened(self, key: str, name: str, attributes: dict[str, Any]) -> Span:
        self.close(key)
        span = self.open[key] = start_span(name, self.parent(), attributes)
        return span

    def close(self, key: str) -> None:
        span = self.open.pop(key, None)
        if span is not None:
            span.end()

    # --- LM calls, from the LM's callback on the calling thread ---------------------------------

    def lm_started(self, model: str, role: str) -> Span:
        with self.lock:  # a sub-LM call sits under the query that made it
            if self.ended:
                return INVALID_SPAN
            parent = self.open[self.queries[-1]] if role == "sub" and self.queries else self.parent()
        attributes = {"gen_ai.request.model": model, "fleet.lm_role": role}
        return start_span("lm.call", parent, attributes, kind=SpanKind.CLIENT)

    def lm_usage(self, span: Span, model: str, usage: dict[str, Any]) -> None:
        """One report of the call's usage, added to what it already reported."""
        prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        cost = self.price(model, prompt, completion)
        with self.lock:
            before = self.lm_totals.get(id(span), (0, 0, None))
            cost_so_far = None if cost is None and before[2] is None else (before[2] or 0.0) + (cost or 0.0)
            totals = self.lm_totals[id(span)] = (before[0] + prompt, before[1] + completion, cost_so_far)
        span.set_attributes({"gen_ai.usage.input_tokens": totals[0], "gen_ai.usage.output_tokens": totals[1]})
        if totals[2] is not None:
            span.set_attribute("fleet.cost_usd", totals[2])

    def lm_ended(self, span: Span, error: str | None) -> None:
        with self.lock:
            self.lm_totals.pop(id(span), None)
        if error is not None:
            failed(span, error)
        span.end()

    def end(self, status: str, failure_code: str | None, usage: dict[str, Any]) -> None:
        """`turn.run` ends (once), and with it whatever the Turn left open."""
        with self.lock:
            if self.ended:
                return
            self.ended = True
            for key in list(self.open):
                self.open[key].set_attribute("fleet.unfinished", True)
                self.close(key)
            self.queries.clear()
        self.root.set_attributes({"fleet.status": status, **usage})
        if failure_code is not None:
            failed(self.root, failure_code)
        self.root.end()


def phase(trace: TurnTrace | None, name: str) -> AbstractContextManager[None]:
    """A step of the Turn on the event loop, as a span under `turn.run`."""
    return nullcontext() if trace is None else trace.phase(name)


def current(trace: TurnTrace | None) -> AbstractContextManager[Any]:
    """`turn.run` as the loop's current span: the Turn's log lines carry its trace id."""
    return nullcontext() if trace is None else use_span(trace.root, end_on_exit=False)
