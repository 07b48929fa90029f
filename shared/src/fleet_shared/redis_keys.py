"""Redis key names: one prefix and pure functions, so every key fleet writes is listed here.

arq owns its own keys (the queue, job records, `<queue>:health-check`); see `fleet_shared.queue`.
"""

PREFIX = "fleet"
EVENT_LOG_TTL_SECONDS = 24 * 3600  # how long a Run's stream log outlives its last write


def events_channel(db: int) -> str:
    """Pub/sub carrying every Run's encoded events. Channels ignore the DB number, so it is named
    in the channel: deployments sharing one Redis on different DBs never hear each other."""
    return f"{PREFIX}:events:db{db}"


def run_events(run_id: str) -> str:
    """The Redis Stream that logs a Run's events in order; the source of truth while it runs."""
    return f"{PREFIX}:run:{run_id}:events"


def run_lease(run_id: str) -> str:
    """Held (with a short TTL, renewed) by the worker running the Run; its absence means lost."""
    return f"{PREFIX}:run:{run_id}:lease"
