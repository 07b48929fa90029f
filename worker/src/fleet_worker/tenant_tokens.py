"""One Turn's view of its tenant's LM tokens today (fleet_shared.tenant_usage), and the stop when
they reach `quotas.lm_tokens_per_day`.

Each LM call's tokens are added on the program's threads and sent to Redis without waiting (the
event loop sends them). The view is the tenant's count as Redis last answered it, plus what this
Turn added since, unanswered: exact for this Turn's own calls. A check on a view older than
`fresh_seconds` first reads the count again (a program thread waits at most READ_TIMEOUT for it),
so the tenant's other Turns are seen within that time. A call already in flight when the count
is reached is not recalled: a tenant passes its limit by what its Turns had in flight, and by
what calls started within `fresh_seconds` of the count being reached added."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import structlog
from redis.asyncio import Redis

from fleet_shared.tenant_usage import add_lm_tokens, lm_tokens_today, utc_day
from fleet_worker import metrics

log = structlog.get_logger(__name__)
READ_TIMEOUT = 0.5  # seconds a check, or the read before the program starts, waits for Redis


@dataclass
class TenantTokens:
    redis: Redis
    loop: asyncio.AbstractEventLoop
    tenant: str
    limit: int  # 0: none, and the count is only kept (GET /api/usage)
    labelled: bool = False  # observability.metrics_tenant_label: count them by tenant too
    day: int = field(default_factory=utc_day)
    seen: int = 0  # the tenant's count on `day`, as Redis last told it
    unanswered: int = 0  # what this Turn added that Redis has not confirmed yet
    warned: bool = False  # the Turn's one `quota_exhausted` warning was sent
    fresh_seconds: float = 1.0  # a view older than this is read again before a check
    read_at: float = 0.0  # time.monotonic() of the view's last refresh (or failed attempt)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    async def refresh(self) -> None:
        """Read the count before the program starts, so its first call already sees the others'."""
        if not self.limit:
            return
        day = utc_day()
        self.read_at = time.monotonic()
        try:
            total = await asyncio.wait_for(lm_tokens_today(self.redis, self.tenant, day), READ_TIMEOUT)
        except Exception as exc:  # a Redis outage fails no Turn: the count resumes with it
            log.warning("turn.lm_tokens_unread", error_type=type(exc).__name__)
            return
        self.answered(day, total, 0)

    def read_again(self) -> None:
        """On a program's thread: the count as Redis has it now (never on the loop's own thread,
        which would wait for itself)."""
        try:
            asyncio.get_running_loop()
            return
        except RuntimeError:
            pass
        self.read_at = time.monotonic()  # a loop too busy to answer is not asked again at once
        asyncio.run_coroutine_threadsafe(self.refresh(), self.loop).result(2 * READ_TIMEOUT)

    def add(self, tokens: int) -> Future[int] | None:
        """One call's tokens (any thread); Redis is told in the background (the future: when
        it has answered, and this view taken the answer in)."""
        if tokens <= 0:
            return None
        if self.labelled:
            metrics.count_tenant_lm_tokens(self.tenant, tokens)
        day = utc_day()
        with self.lock:
            self.unanswered += tokens
        try:
            sent = asyncio.run_coroutine_threadsafe(
                add_lm_tokens(self.redis, self.tenant, tokens, day), self.loop
            )
        except RuntimeError:  # the loop has closed: the worker is gone, and so is this Turn
            return None
        sent.add_done_callback(lambda done: self.told(done, day, tokens))
        return sent

    def told(self, done: Future[int], day: int, tokens: int) -> None:
        if done.cancelled() or done.exception() is not None:
            error = "cancelled" if done.cancelled() else type(done.exception()).__name__
            log.warning("turn.lm_tokens_uncounted", tokens=tokens, error_type=error)
            with self.lock:
                self.unanswered -= tokens
            return
        self.answered(day, done.result(), tokens)

    def answered(self, day: int, total: int, tokens: int) -> None:
        with self.lock:
            self.unanswered -= tokens
            if day > self.day:  # a new UTC day: yesterday's count no longer applies
                self.day, self.seen = day, total
            elif day == self.day:
                self.seen = max(self.seen, total)

    def exhausted(self) -> bool:
        if not self.limit:
            return False
        if time.monotonic() - self.read_at > self.fresh_seconds:
            try:
                self.read_again()
            except Exception as exc:  # the loop is gone or stuck: judge by the view we have
                log.warning("turn.lm_tokens_unread", error_type=type(exc).__name__)
        with self.lock:
            return self.seen + self.unanswered >= self.limit and self.day == utc_day()

    @property
    def spent(self) -> str:
        """Why the Turn stopped, for people."""
        return f"the tenant used its {self.limit} LM tokens for today (quotas.lm_tokens_per_day)"

    def first_warning(self) -> bool:
        """True once per Turn: whoever stops first says why."""
        with self.lock:
            first, self.warned = not self.warned, True
        return first
