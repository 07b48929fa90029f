"""Redis key names: one prefix and pure functions, so every key fleet writes is listed here.

Every key of one Run carries the hash tag `{<run_id>}`, so that on a Redis Cluster they share a
slot and the Lua scripts that touch several of them stay single-slot.

The job queue (arq) owns its own keys (the queue, job records, `<queue>:health-check`); see
`fleet_shared.jobs`.
"""

import hashlib

PREFIX = "fleet"
EVENT_LOG_TTL_SECONDS = 24 * 3600  # how long a Run's stream log outlives its last write
CANCEL_FLAG_TTL_SECONDS = 24 * 3600  # longer than any Turn may run


def events_channel(db: int) -> str:
    """Pub/sub carrying every Run's encoded events. Channels ignore the DB number, so it is named
    in the channel: deployments sharing one Redis on different DBs never hear each other."""
    return f"{PREFIX}:events:db{db}"


def control_channel(db: int) -> str:
    """Pub/sub carrying cancel notices (a run id each) from gateways to workers."""
    return f"{PREFIX}:control:db{db}"


def run_events(run_id: str) -> str:
    """The Redis Stream that logs a Run's events in order; the source of truth while it runs."""
    return f"{PREFIX}:run:{{{run_id}}}:events"


def run_lease(run_id: str) -> str:
    """Held (with a short TTL, renewed) by whoever owns the Run; its value is the owner's token.

    Only the holder may append to the Run's event log, so a stalled worker that lost the lease
    can never put a late event on the wire."""
    return f"{PREFIX}:run:{{{run_id}}}:lease"


def run_fence(run_id: str) -> str:
    """The highest attempt that ever held the Run's lease; an earlier one can never take it again."""
    return f"{PREFIX}:run:{{{run_id}}}:fence"


def run_approval(run_id: str, approval_id: str) -> str:
    """A cell waiting for approval: `pending` while it waits, then the decision (JSON) a gateway
    wrote, or `timed_out`; the worker waiting on it polls it (fleet_worker.approvals)."""
    return f"{PREFIX}:run:{{{run_id}}}:approval:{approval_id}"


def run_cancel(run_id: str) -> str:
    """Set when a client asks to cancel a running Run; the owner sees it when it renews."""
    return f"{PREFIX}:run:{{{run_id}}}:cancel"


WORKER_SANDBOX_TTL_SECONDS = 30


def worker_sandbox(worker_id: str) -> str:
    """What isolation a live worker's sandboxes get (its mode line); expires with the worker."""
    return f"{PREFIX}:worker:{worker_id}:sandbox"


WORKER_SANDBOX_PATTERN = f"{PREFIX}:worker:*:sandbox"


def sweeper() -> str:
    """Held for one sweep interval by the process that sweeps for lost Runs this time."""
    return f"{PREFIX}:sweeper"


def gc_lock(queue: str) -> str:
    """Held (with a TTL, renewed) by the one gc running for the deployment that uses `queue`."""
    return f"{PREFIX}:gc:{queue}:lock"


def gc_done(queue: str) -> str:
    """Set (expiring) when a gc has finished: workers' schedules skip their turn while it lives."""
    return f"{PREFIX}:gc:{queue}:done"


def tenant_turns_in_minute(tenant: str, minute: int) -> str:
    """How many Turns a tenant started in one clock minute (`quotas.turns_per_minute`). The
    tenant's name is hashed: a JWT claim may hold anything, a key name should not."""
    digest = hashlib.sha256(tenant.encode()).hexdigest()[:32]
    return f"{PREFIX}:quota:turns:{digest}:{minute}"


def tenant_lm_tokens_on_day(tenant: str, day: int) -> str:
    """The LM tokens a tenant's Turns used on one UTC day (`quotas.lm_tokens_per_day`)."""
    digest = hashlib.sha256(tenant.encode()).hexdigest()[:32]
    return f"{PREFIX}:quota:lm_tokens:{digest}:{day}"
