"""A Run's lease: a Redis key holding the owner's token, with a short TTL the owner keeps renewing.

- If the worker dies (even by SIGKILL) the key lapses within `worker.lease_seconds`, and a
  sweeper (in any worker or gateway) takes the lease, then the Run, and settles it `worker_lost`.
- If the key vanished (Redis lost its data, or stalled past the TTL), the owner takes it back, but
  only while the DB still names its attempt, and only if no later attempt ever held the lease
  (the TAKE script's fence): a sweeper that took the Run over can never be undone.
- If someone else holds it, this worker was swept: `lost` is set and the Turn must stop.
- Each renewal also reads the Run's cancel flag, so a cancel is seen within a third of a TTL
  even if its pub/sub notice was missed: `cancel_requested` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from types import TracebackType

import structlog
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError

from fleet_shared.event_log import LeaseCheck, RunLog

log = structlog.get_logger(__name__)
RENEWALS_PER_TTL = 3  # a renewal or two may fail (a blip) before the lease lapses


class RunLease:
    def __init__(
        self,
        runlog: RunLog,
        run_id: str,
        token: str,
        seconds: float,
        still_ours: Callable[[], Awaitable[bool]],
    ) -> None:
        self.runlog = runlog
        self.run_id = run_id
        self.token = token
        self.ttl_ms = int(seconds * 1000)
        self.still_ours = still_ours
        self.lost = asyncio.Event()
        self.cancel_requested = asyncio.Event()
        self.checking = asyncio.Lock()  # the renewer and the event sink may both ask at once
        self.renewer: asyncio.Task[None] | None = None
        self.on_regained: Callable[[], None] = lambda: None  # the event sink refills the log

    async def __aenter__(self) -> RunLease:
        # The DB claim (attempt + 1) made this worker the owner; an earlier holder is stale. If the
        # take fails, a sweeper already took the Run over while this claim was slow: stop at once.
        try:
            if not await self.runlog.take_lease(self.run_id, self.token, self.ttl_ms):
                log.warning("lease.taken_before_start")
                self.lost.set()
        except (RedisError, OSError) as exc:
            # Redis is away: the renewer takes the lease as soon as it is back (a sweeper could
            # not take the Run meanwhile either), and the event sink holds the events till then.
            log.warning("lease.not_taken_yet", error_type=type(exc).__name__)
        self.renewer = asyncio.create_task(self.renew_forever(), name=f"fleet-lease-{self.run_id}")
        return self

    async def __aexit__(
        self, _type: type[BaseException] | None, _exc: BaseException | None, _tb: TracebackType | None
    ) -> None:
        if self.renewer is not None:
            self.renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.renewer
        with contextlib.suppress(RedisError, OSError):
            await self.runlog.release_lease(self.run_id, self.token)

    def request_cancel(self) -> None:
        self.cancel_requested.set()

    async def renew_forever(self) -> None:
        while not self.lost.is_set():
            await asyncio.sleep(self.ttl_ms / 1000 / RENEWALS_PER_TTL)
            try:
                await self.verify()
            except (RedisError, OSError, SQLAlchemyError) as exc:
                # Redis or the DB is away: try again next time (a sweeper cannot act without both).
                log.warning("lease.renew_failed", error_type=type(exc).__name__)

    async def verify(self) -> bool:
        """Renew the lease, or take it back if Redis lost it; False once it belongs to another.

        Raises RedisError or a DB error when it cannot tell; the caller asks again later."""
        async with self.checking:
            return await self.check()

    async def check(self) -> bool:
        check = await self.runlog.renew_lease(self.run_id, self.token, self.ttl_ms)
        if check is LeaseCheck.CANCEL_REQUESTED:
            self.cancel_requested.set()
        if check in (LeaseCheck.HELD, LeaseCheck.CANCEL_REQUESTED):
            return True
        if check is LeaseCheck.MISSING and await self.take_back():
            return True
        if not self.lost.is_set():
            log.warning("lease.lost", holder_changed=check is LeaseCheck.TAKEN)
            self.lost.set()
        return False

    async def take_back(self) -> bool:
        """Raises if the DB cannot say whose the Run is; so could no sweeper, which needs it too."""
        if await self.still_ours() and await self.runlog.take_lease(self.run_id, self.token, self.ttl_ms):
            log.warning("lease.taken_back")
            self.on_regained()
            return True
        return False
