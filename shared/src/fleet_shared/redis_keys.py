"""Redis key names: one prefix and pure functions, so every key fleet writes is listed here."""

PREFIX = "fleet"
EVENTS_CHANNEL = f"{PREFIX}:events"  # pub/sub: every Run's events, as encoded Runtime Events
EVENT_LOG_TTL_SECONDS = 24 * 3600  # how long a Run's stream log outlives its last write
WORKER_HEARTBEAT_PATTERN = f"{PREFIX}:worker:*:heartbeat"


def run_events(run_id: str) -> str:
    """The Redis Stream that logs a Run's events in order; the source of truth for replay."""
    return f"{PREFIX}:run:{run_id}:events"


def run_lease(run_id: str) -> str:
    return f"{PREFIX}:run:{run_id}:lease"


def run_cancel(run_id: str) -> str:
    return f"{PREFIX}:run:{run_id}:cancel"


def worker_heartbeat(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}:heartbeat"
