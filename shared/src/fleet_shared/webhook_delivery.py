"""Sending webhook deliveries: every gateway and worker with FLEET_WEBHOOK_SECRET runs this loop.

Each pass takes the deliveries that are due (fleet_shared.db.webhooks: one taker per attempt),
posts each body signed the Standard Webhooks way (`webhook-id`, `webhook-timestamp`,
`webhook-signature`: HMAC-SHA256 of `id.timestamp.body`), records the attempt, and either
finishes the delivery or sets its next try: after `first_retry_seconds`, doubling up to an hour,
for `give_up_seconds` after the Run ended.

Delivery is at least once: a process that dies after the receiver answered but before the
attempt was recorded leaves it to be sent again (the same `webhook-id`) once its lease is up.
A 2xx answer delivers; 410 Gone, or a target the policy refuses, fails at once; anything else
(another status, a timeout, a refused connection) is tried again.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import anyio
import httpcore
import structlog
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from standardwebhooks import Webhook

from fleet_shared.config import Secret, Settings
from fleet_shared.config_file import WebhooksSection
from fleet_shared.db import webhooks
from fleet_shared.db.engine import run_whole
from fleet_shared.db.models import utcnow
from fleet_shared.db.webhooks import DELIVERED, FAILED, PENDING, Attempted, Taken
from fleet_shared.shutdown import pause
from fleet_shared.webhook_targets import (
    Resolver,
    TargetPolicy,
    TargetRefused,
    connection_pool,
    system_resolve,
)

log = structlog.get_logger(__name__)
BATCH = 20  # deliveries taken per pass; each is posted concurrently with the others
# An attempt's lease: twice its timeout and this. A process that dies mid-attempt leaves the
# delivery to another once the lease is up (the receiver may then see the same webhook-id again).
LEASE_MARGIN_SECONDS = 5.0
MAX_RETRY_SECONDS = 3_600.0
USER_AGENT = b"fleet-webhooks/1"
MAX_ERROR_CHARS = 500


def retry_delay(first_seconds: float, failures: int) -> float:
    """The wait after the `failures`-th failed attempt: doubling from `first_seconds`, capped."""
    return float(min(MAX_RETRY_SECONDS, first_seconds * 2 ** min(failures - 1, 30)))


def next_step(
    section: WebhooksSection, taken: Taken, status: int | None, permanent: bool, now: datetime
) -> tuple[str, datetime | None]:
    """Delivered, failed for good, or pending again (when)."""
    if status is not None and 200 <= status < 300:
        return DELIVERED, None
    if permanent or status == 410:
        return FAILED, None
    retry_at = now + timedelta(seconds=retry_delay(section.first_retry_seconds, taken.attempt))
    created = taken.created_at if taken.created_at.tzinfo else taken.created_at.replace(tzinfo=now.tzinfo)
    if retry_at > created + timedelta(seconds=section.give_up_seconds):
        return FAILED, None
    return PENDING, retry_at


@dataclass
class Deliverer:
    db_sessions: async_sessionmaker[AsyncSession]
    section: WebhooksSection
    secret: Secret
    owner: str  # who delivers, for the logs
    resolve: Resolver = system_resolve
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    failures: int = 0

    def __post_init__(self) -> None:
        self.policy = TargetPolicy.of(self.section)
        self.pool = connection_pool(self.policy, self.resolve)
        self.signer = Webhook(self.secret.reveal())

    async def run_forever(self) -> None:
        """A pass every `poll_seconds` until `stopping` is set; the pass under way finishes."""
        try:
            while not await pause(self.stopping, self.section.poll_seconds):
                try:
                    await self.deliver_due()
                    self.failures = 0
                except (SQLAlchemyError, OSError) as exc:
                    self.failures += 1
                    if self.failures % 60 == 1:
                        log.warning(
                            "webhook.pass_failed", error_type=type(exc).__name__, failures=self.failures
                        )
        finally:
            await self.pool.aclose()

    async def deliver_due(self) -> int:
        """One pass: how many attempts it made."""
        due = await run_whole(self.db_sessions, functools.partial(webhooks.due_on, now=utcnow(), limit=BATCH))
        lease = timedelta(seconds=2 * self.section.timeout_seconds + LEASE_MARGIN_SECONDS)
        taken = []
        for delivery_id, due_at in due:
            take = functools.partial(webhooks.take_on, delivery_id=delivery_id, due=due_at, lease=lease)
            got = await run_whole(self.db_sessions, take)
            if got is not None:
                taken.append(got)
        await asyncio.gather(*(self.attempt(t) for t in taken))
        return len(taken)

    async def attempt(self, taken: Taken) -> None:
        started, clock = utcnow(), time.monotonic()
        status: int | None = None
        error: str | None = None
        permanent = False
        try:
            self.policy.check_url(taken.url)  # the policy may have changed since it was accepted
            status = await self.post(taken)
        except TargetRefused as exc:
            error, permanent = str(exc), True
        except (httpcore.TimeoutException, TimeoutError):
            error = f"no answer within {self.section.timeout_seconds:g} s"
        except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        outcome, retry_at = next_step(self.section, taken, status, permanent, utcnow())
        attempted = Attempted(
            started_at=started,
            duration_ms=int((time.monotonic() - clock) * 1000),
            status_code=status,
            error=error,
            outcome=outcome,
            retry_at=retry_at,
        )
        finish = functools.partial(webhooks.finish_attempt_on, taken=taken, attempted=attempted)
        recorded = await run_whole(self.db_sessions, finish)
        log.info(
            "webhook.attempted",
            delivery_id=taken.id,
            attempt=taken.attempt,
            status_code=status,
            outcome=outcome,
            recorded=recorded,
            error=error,
        )

    async def post(self, taken: Taken) -> int:
        """POST the body, signed now; the answer's status (its body is never read)."""
        timestamp = datetime.fromtimestamp(int(time.time()), tz=UTC)
        body = taken.body.encode()
        signature = self.signer.sign(taken.id, timestamp, body)
        headers = [
            (b"content-type", b"application/json"),
            (b"user-agent", USER_AGENT),
            (b"webhook-id", taken.id.encode()),
            (b"webhook-timestamp", str(int(timestamp.timestamp())).encode()),
            (b"webhook-signature", signature.encode()),
        ]
        seconds = self.section.timeout_seconds
        timeouts = {"connect": seconds, "read": seconds, "write": seconds, "pool": seconds}
        with anyio.fail_after(seconds):
            async with self.pool.stream(
                "POST", taken.url, headers=headers, content=body, extensions={"timeout": timeouts}
            ) as response:
                return int(response.status)


def deliverer_for(
    settings: Settings, db_sessions: async_sessionmaker[AsyncSession], owner: str
) -> Deliverer | None:
    """This process's deliverer; None without FLEET_WEBHOOK_SECRET (it could sign nothing)."""
    if settings.webhook_secret is None:
        return None
    return Deliverer(db_sessions, settings.profile.webhooks, settings.webhook_secret, owner)
