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
BATCH = 20  # attempts one process has under way at once
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


def expired(section: WebhooksSection, taken: Taken, now: datetime) -> bool:
    """Past its window before an attempt (no process held the secret, or all were down)."""
    created = taken.created_at if taken.created_at.tzinfo else taken.created_at.replace(tzinfo=now.tzinfo)
    return now > created + timedelta(seconds=section.give_up_seconds)


@dataclass
class Deliverer:
    db_sessions: async_sessionmaker[AsyncSession]
    section: WebhooksSection
    secret: Secret
    owner: str  # who delivers, for the logs
    resolve: Resolver = system_resolve
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    failures: int = 0
    in_flight: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.policy = TargetPolicy.of(self.section)
        self.pool = connection_pool(self.policy, self.resolve)
        self.signer = Webhook(self.secret.reveal())

    async def run_forever(self) -> None:
        """A pass every `poll_seconds` until `stopping` is set; attempts under way then get their
        timeout to finish."""
        try:
            while not await pause(self.stopping, self.section.poll_seconds):
                try:
                    await self.start_due()
                    self.failures = 0
                except Exception as exc:  # the database away, or a bug: the loop goes on
                    self.failures += 1
                    if self.failures % 60 == 1:
                        kind = type(exc).__name__
                        log.warning("webhook.pass_failed", error_type=kind, failures=self.failures)
        finally:
            if self.in_flight:
                await asyncio.wait(self.in_flight, timeout=self.section.timeout_seconds + 1)
            await self.pool.aclose()

    async def deliver_due(self) -> int:
        """One pass, waiting for its attempts: how many it made."""
        started = await self.start_due()
        await asyncio.gather(*started)
        return len(started)

    async def start_due(self) -> list[asyncio.Task[None]]:
        """Take the due deliveries this process has room for and start their attempts (a slow
        target holds one of BATCH places, never the others' turn)."""
        room = BATCH - len(self.in_flight)
        if room <= 0:
            return []
        due = await run_whole(self.db_sessions, functools.partial(webhooks.due_on, now=utcnow(), limit=room))
        lease = timedelta(seconds=2 * self.section.timeout_seconds + LEASE_MARGIN_SECONDS)
        started = []
        for delivery_id, due_at in due:
            take = functools.partial(webhooks.take_on, delivery_id=delivery_id, due=due_at, lease=lease)
            taken = await run_whole(self.db_sessions, take)
            if taken is not None:
                task = asyncio.create_task(self.attempt(taken), name=f"fleet-webhook-{taken.id}")
                self.in_flight.add(task)
                task.add_done_callback(self.in_flight.discard)
                started.append(task)
        return started

    async def attempt(self, taken: Taken) -> None:
        """One attempt, recorded. The attempt list says what a tenant may know (a status code, or
        a short reason); the detail (addresses, exceptions) goes to the operator's log only."""
        started, clock = utcnow(), time.monotonic()
        status: int | None = None
        error: str | None = None
        detail: str | None = None
        permanent = False
        try:
            if expired(self.section, taken, started):
                error, permanent = "given up: the Run ended longer ago than webhooks.give_up_seconds", True
            else:
                self.policy.check_url(taken.url)  # the policy may have changed since it was accepted
                status = await self.post(taken)
        except TargetRefused as exc:
            error, detail, permanent = "refused: the target is not one webhooks may reach", str(exc), True
        except (httpcore.TimeoutException, TimeoutError):
            error = f"no answer within {self.section.timeout_seconds:g} s"
        except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol, OSError) as exc:
            error, detail = "the connection failed", f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        except Exception as exc:  # never let one target stop the loop: fail it, log it
            error, permanent = "the attempt failed inside fleet", True
            log.error(
                "webhook.attempt_crashed", delivery_id=taken.id, error_type=type(exc).__name__, exc_info=exc
            )
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
            detail=detail,
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
