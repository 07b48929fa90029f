"""Tracing is set up by the standard OTEL_* variables alone, and off it costs nothing: the SDK is
not imported and no exporter thread runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from opentelemetry import trace

from fleet_shared.tracing import context_of, inbound, tracing_requested

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        (ENDPOINT, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        ({**ENDPOINT, "OTEL_SDK_DISABLED": "true"}, False),
        ({**ENDPOINT, "OTEL_SDK_DISABLED": "false"}, True),
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}, False),
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "console"}, False),  # not an exporter fleet ships
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, False),
    ],
)
def test_tracing_is_on_only_when_the_environment_names_an_endpoint(env: dict[str, str], on: bool) -> None:
    assert tracing_requested(env) is on


PROBE = """
import json, sys, threading
from fleet_shared.tracing import configure_tracing, start_span, tracer
on = configure_tracing("probe")
start_span("probe", None).end()
print(json.dumps({
    "on": on,
    "sdk": "opentelemetry.sdk" in sys.modules,
    "threads": sorted(t.name for t in threading.enumerate()),
    "tracer": type(tracer()).__name__,
}))
"""


def probe(extra: dict[str, str]) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | extra
    argv = [sys.executable, "-c", PROBE]
    done = subprocess.run(argv, check=False, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_off_the_sdk_is_never_imported_and_no_exporter_thread_runs() -> None:
    off = probe({})
    assert off == {"on": False, "sdk": False, "threads": ["MainThread"], "tracer": "ProxyTracer"}


def test_on_an_exporter_thread_runs() -> None:  # the probe above can see one
    # Nothing listens at the endpoint: the span exported at exit is refused at once, on loopback.
    on = probe({**ENDPOINT, "OTEL_BSP_SCHEDULE_DELAY": "60000", "OTEL_EXPORTER_OTLP_TIMEOUT": "1"})
    assert on["on"] is True and on["sdk"] is True
    assert any(str(name).startswith("OtelBatchSpan") for name in on["threads"]), on["threads"]


@pytest.mark.parametrize("value", [None, "", "00-zz-00-01", "00-" + "0" * 32 + "-" + "0" * 16 + "-01"])
def test_a_missing_or_malformed_traceparent_starts_a_new_trace(value: str | None) -> None:
    assert context_of(value) is None


def test_a_traceparent_names_its_parent() -> None:
    parent = context_of("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    assert parent is not None


CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"  # sampled flag off


def test_an_untrusted_caller_is_linked_and_cannot_pick_the_trace_or_its_sampling() -> None:
    parent, links = inbound(CALLER, trusted=False)
    assert parent is None  # a trace of fleet's own, sampled by the operator's sampler
    assert [format(link.context.trace_id, "032x") for link in links] == ["4bf92f3577b34da6a3ce929d0e0e4736"]


def test_a_trusted_caller_is_continued() -> None:
    parent, links = inbound(CALLER, trusted=True)
    assert parent is not None and links == []
    context = trace.get_current_span(parent).get_span_context()
    assert format(context.span_id, "016x") == "00f067aa0ba902b7" and not context.trace_flags.sampled


@pytest.mark.parametrize("trusted", [False, True])
def test_no_or_a_malformed_caller_context_is_a_new_trace(trusted: bool) -> None:
    assert inbound(None, trusted) == (None, []) and inbound("garbage", trusted) == (None, [])
