"""structlog setup, once per process: JSON lines, contextvars-bound ids, secrets redacted."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

from fleet_shared.config import ObservabilitySection, redact_url

SECRET_KEY = re.compile(r"(api_?key|token|secret|password|authorization|cookie)", re.IGNORECASE)
REDACTED = "[redacted]"


def redact_secrets(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Blank values under secret-looking keys and passwords inside URLs."""
    for key, value in list(event_dict.items()):
        if SECRET_KEY.search(key) and value not in (None, "", False):
            event_dict[key] = REDACTED
        elif isinstance(value, str) and "://" in value:
            event_dict[key] = redact_url(value)
    return event_dict


def configure_logging(section: ObservabilitySection, *, process: str) -> None:
    level = getattr(logging, section.log_level.upper())
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if section.log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        redact_secrets,
    ]
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.dict_tracebacks,
            renderer,
        ],
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
