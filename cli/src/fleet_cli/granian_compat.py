"""The private name of Granian that fleet uses, pinned to granian 2.8 (gateway/pyproject.toml) and
checked by `tests/unit/cli/test_granian_contract.py`.

Granian logs its server messages on a logger named `_granian` (granian.log), and its access
log on `granian.access`. fleet hands both to the root logger, which renders JSON as fleet's own
records do; without the first, a gateway's start-up and errors would print in Granian's format.
"""

GRANIAN_SERVER_LOGGER = "_granian"
GRANIAN_ACCESS_LOGGER = "granian.access"

# Granian's own loggers hand their records to the root logger, which renders JSON like ours.
GRANIAN_LOGS_THROUGH_STRUCTLOG = {
    "loggers": {
        name: {"handlers": [], "level": "INFO", "propagate": True}
        for name in (GRANIAN_SERVER_LOGGER, GRANIAN_ACCESS_LOGGER)
    }
}
