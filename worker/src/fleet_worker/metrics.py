"""The worker's Prometheus metrics: time in queue, Turns by outcome and duration, sandbox leases,
LM calls and tokens. Served by fleet_worker.metrics_http; docs/metrics.md lists them all.

Labels stay bounded: outcomes are the few Turn statuses, the provider is `local` or `daytona`,
models are the names in the config, roles are root/sub/child.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from prometheus_client import Counter, Histogram

# Seconds: from a fraction of a second (a warm sandbox, a quick Turn) to the longest Turns.
TURN_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)
QUEUE_WAIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
LEASE_WAIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

QUEUE_WAIT = Histogram(
    "fleet_queue_wait_seconds",
    "From a Turn's enqueue to a worker starting it",
    buckets=QUEUE_WAIT_BUCKETS,
)
TURNS = Counter("fleet_turns", "Turns this worker settled, by outcome", ["outcome"])
TURN_DURATION = Histogram(
    "fleet_turn_duration_seconds",
    "From a worker claiming a Turn to its settlement, by outcome",
    ["outcome"],
    buckets=TURN_BUCKETS,
)
LEASE_WAIT = Histogram(
    "fleet_sandbox_lease_wait_seconds",
    "From asking for a Turn's sandbox to having it",
    ["provider"],
    buckets=LEASE_WAIT_BUCKETS,
)
LEASE_HELD = Histogram(
    "fleet_sandbox_lease_seconds",
    "How long a Turn held its sandbox",
    ["provider"],
    buckets=TURN_BUCKETS,
)
LM_CALLS = Counter("fleet_lm_calls", "LM calls started, by configured model and role", ["model", "role"])
LM_TOKENS = Counter(
    "fleet_lm_tokens",
    "LM tokens the provider reported, by configured model, role and kind (prompt/completion)",
    ["model", "role", "kind"],
)
# observability.metrics_tenant_label: the same, by tenant. Off by default: a series per tenant.
TENANT_TURNS = Counter(
    "fleet_tenant_turns", "Turns this worker settled, by tenant and outcome", ["tenant", "outcome"]
)
TENANT_LM_TOKENS = Counter("fleet_tenant_lm_tokens", "LM tokens the provider reported, by tenant", ["tenant"])
TOKEN_KINDS = {"prompt_tokens": "prompt", "completion_tokens": "completion"}


def observe_queue_wait(enqueue_time: datetime | None) -> None:
    """arq's `enqueue_time` (job ctx) to now; a missing or future time is not observed."""
    if enqueue_time is None:
        return
    waited = (datetime.now(UTC) - enqueue_time).total_seconds()
    if waited >= 0:
        QUEUE_WAIT.observe(waited)


def observe_turn(outcome: str, started: float, tenant: str | None = None) -> None:
    """A Turn settled with `outcome` (its status, or `fenced`); `started` is time.monotonic().
    With a `tenant` (observability.metrics_tenant_label), it is counted by tenant as well."""
    TURNS.labels(outcome=outcome).inc()
    if tenant is not None:
        TENANT_TURNS.labels(tenant=tenant, outcome=outcome).inc()
    TURN_DURATION.labels(outcome=outcome).observe(time.monotonic() - started)


def observe_lease_wait(provider: str, asked: float, granted: float | None = None) -> float:
    """The sandbox arrived (at `granted`, default now: time.monotonic()); returns when."""
    now = time.monotonic() if granted is None else granted
    LEASE_WAIT.labels(provider=provider).observe(now - asked)
    return now


def observe_lease_held(provider: str, since: float) -> None:
    LEASE_HELD.labels(provider=provider).observe(time.monotonic() - since)


# --- LM calls -----------------------------------------------------------------------------------
# The dspy adapter marks which LM (configured model, role) is calling in this context when a call
# starts; DSPy reports each call's usage in the same context, where it is counted.

CURRENT_LM: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "fleet_current_lm", default=None
)


def lm_call_started(model: str, role: str) -> None:
    LM_CALLS.labels(model=model, role=role).inc()
    CURRENT_LM.set((model, role))


def lm_call_ended() -> None:
    CURRENT_LM.set(None)


def count_lm_usage(reported_model: str, usage: Mapping[str, Any]) -> int:
    """Tokens of one call, counted and returned; outside a marked call (not ours) the model is
    DSPy's and the role `unknown`."""
    model, role = CURRENT_LM.get() or (reported_model, "unknown")
    counted = 0
    for key, kind in TOKEN_KINDS.items():
        value = usage.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            LM_TOKENS.labels(model=model, role=role, kind=kind).inc(value)
            counted += value
    return counted


def count_tenant_lm_tokens(tenant: str, tokens: int) -> None:
    TENANT_LM_TOKENS.labels(tenant=tenant).inc(tokens)
