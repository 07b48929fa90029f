"""Each LM call as the worker counts it: calls and tokens by model and role (fleet_worker.metrics),
the tenant's tokens for the day (fleet_worker.tenant_tokens), and, with tracing on, its
`lm.call` span (fleet_worker.turn_trace)."""

from __future__ import annotations

from typing import Any

from dspy.utils.callback import BaseCallback

from fleet_worker import metrics
from fleet_worker.lm.script import Role
from fleet_worker.tenant_tokens import TenantTokens
from fleet_worker.turn_trace import CURRENT_LM_CALL, TurnTrace


class LMCallMeter(BaseCallback):
    """On one LM: counts its calls and marks them (model, role) for MeteredUsage's token count,
    and with tracing on makes each call an `lm.call` span."""

    def __init__(self, model: str, role: Role, trace: TurnTrace | None = None) -> None:
        self.model, self.role, self.trace = model, role, trace
        self.spans: dict[str, Any] = {}  # by DSPy's call id, while the call runs

    def on_lm_start(self, call_id: str, instance: Any, inputs: dict[str, Any]) -> None:
        metrics.lm_call_started(self.model, self.role)
        if self.trace is not None:
            span = self.spans[call_id] = self.trace.lm_started(self.model, self.role)
            CURRENT_LM_CALL.set((self.trace, span, self.model))

    def on_lm_end(self, call_id: str, outputs: Any | None, exception: Exception | None = None) -> None:
        metrics.lm_call_ended()
        span = self.spans.pop(call_id, None)
        if span is not None and self.trace is not None:
            CURRENT_LM_CALL.set(None)
            self.trace.lm_ended(span, None if exception is None else type(exception).__name__)


class MeteredUsage:
    """The Turn's usage tracker as DSPy sees it: each call's usage goes to the tracker, to the
    token counters, to the tenant's count for the day and to the call's span (DSPy reports it in
    the calling context, between start and end)."""

    def __init__(self, tracker: Any, tokens: TenantTokens | None = None) -> None:
        self.tracker = tracker
        self.tokens = tokens

    def add_usage(self, lm: str, usage_entry: dict[str, Any]) -> None:
        self.tracker.add_usage(lm, usage_entry)
        counted = metrics.count_lm_usage(lm, usage_entry)
        if self.tokens is not None:
            self.tokens.add(counted)
        traced = CURRENT_LM_CALL.get()
        if traced is not None:
            trace, span, model = traced
            trace.lm_usage(span, model, usage_entry)

    def __getattr__(self, name: str) -> Any:  # the rest of the tracker (get_total_tokens, ...)
        return getattr(self.tracker, name)
