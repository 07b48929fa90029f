"""structlog setup, once per process: JSON lines, contextvars-bound ids, secrets redacted."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog
from structlog.tracebacks import ExceptionDictTransformer

from fleet_shared.config import ObservabilitySection
from fleet_shared.redaction import redact_text
from fleet_shared.tracing import add_trace_ids

SECRET_KEY = re.compile(r"(api_?key|token|secret|password|authorization|cookie)", re.IGNORECASE)
REDACTED = "[redacted]"


def redact_secrets(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Blank values under secret-looking keys, and mask secrets inside text (URL passwords,
    secret query parameters, bearer tokens, Authorization values), at any depth (a rendered
    traceback's messages included)."""
    for key, value in list(event_dict.items()):
        event_dict[key] = redacted(key, value)
    return event_dict


def redacted(key: str, value: Any) -> Any:
    if SECRET_KEY.search(key) and value not in (None, "", False):
        return REDACTED
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: redacted(str(k), v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redacted("", v) for v in value]
    return value


# Tracebacks without frame locals: locals hold request headers (a bearer token), a user's text, an
# answer, the settings. Only the call stack and the exception's message are kept: as data in JSON,
# as plain text for the console renderer (which cannot print the data form).
render_exceptions = structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False))
render_exceptions_as_text = structlog.processors.ExceptionRenderer()


def log_renderers(log_format: str, stream: Any) -> tuple[Any, Any]:
    """(exception renderer, renderer): JSON lines for machines; the console renderer for a person
    at a terminal (colours only there, so a piped `console` log stays plain text)."""
    is_terminal = bool(getattr(stream, "isatty", None) and stream.isatty())
    if log_format == "json" or (log_format == "auto" and not is_terminal):
        return render_exceptions, structlog.processors.JSONRenderer()
    return render_exceptions_as_text, structlog.dev.ConsoleRenderer(colors=is_terminal, pad_event_to=32)


def configure_logging(section: ObservabilitySection, *, process: str) -> None:
    level = getattr(logging, section.log_level.upper())
    exceptions, renderer = log_renderers(section.log_format, sys.stderr)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        add_trace_ids,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        exceptions,
        redact_secrets,
    ]
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Route the standard library's loggers (arq, granian, alembic) through the same renderer.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "LiteLLM", "litellm", "asyncio"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
    structlog.contextvars.bind_contextvars(process=process)
