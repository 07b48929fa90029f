"""What fleet_cli.granian_compat assumes of Granian's logging: a Granian upgrade that renames its
server logger fails here, not as unformatted log lines in production."""

from __future__ import annotations

from fleet_cli.granian_compat import (
    GRANIAN_ACCESS_LOGGER,
    GRANIAN_LOGS_THROUGH_STRUCTLOG,
    GRANIAN_SERVER_LOGGER,
)


def test_granian_logs_on_the_loggers_fleet_reroutes() -> None:
    from granian import log as granian_log

    assert GRANIAN_SERVER_LOGGER in granian_log.LOGGING_CONFIG["loggers"]
    assert granian_log.logger.name == GRANIAN_SERVER_LOGGER
    assert GRANIAN_ACCESS_LOGGER in granian_log.LOGGING_CONFIG["loggers"]
    rerouted = GRANIAN_LOGS_THROUGH_STRUCTLOG["loggers"]
    assert set(rerouted) == {GRANIAN_SERVER_LOGGER, GRANIAN_ACCESS_LOGGER}
    assert all(entry["propagate"] and not entry["handlers"] for entry in rerouted.values())
