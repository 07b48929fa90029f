"""A real job worker (arq) in burst mode on real Redis, a real DB and real bwrap sandboxes, driven Turn by
Turn; the LM is the scripted LM (no provider is reachable here)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import redis.asyncio as aioredis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from fleet_shared import event_log, redis_keys
from fleet_shared.config import Settings, load_settings
from fleet_shared.config_file import QuotasSection
from fleet_shared.db import claims, queries
from fleet_shared.db.models import Attachment, Skill
from fleet_shared.event_log import Appended, RunLog, lease_token
from fleet_shared.events import RunEvent
from fleet_shared.jobs import ArqJobQueue
from fleet_shared.recovery import Sweeper
from fleet_shared.tenancy import OPERATOR, Principal
from fleet_worker.app import build_worker

REPO = Path(__file__).resolve().parents[2]


def script(tmp: Path, *lines: dict[str, object]) -> Path:
    path = tmp / "script.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


@dataclass
class Harness:
    settings: Settings
    db_sessions: async_sessionmaker[AsyncSession]
    redis: aioredis.Redis

    async def submit(
        self,
        text: str = "hello there",
        *,
        enqueue: bool = True,
        session_id: str | None = None,
        key: str = "k",
        attachments: Sequence[Attachment] = (),
        skills: Sequence[Skill] = (),
        caller: Principal = OPERATOR,
        program_version_id: str | None = None,
    ) -> str:
        """Claim a Turn (in a new session, or `session_id`) and queue it, as the gateway does."""
        async with self.db_sessions() as db:
            if session_id is None:
                session_id = (await queries.create_session(db, "t", caller)).id
            claimed = await claims.claim_turn(
                db,
                caller=caller,
                session_id=session_id,
                idempotency_key=key,
                fingerprint="f",
                text=text,
                model=self.settings.root_lm.name,
                attachments=attachments,
                skills=skills,
                program_version_id=program_version_id,
            )
        assert isinstance(claimed, claims.Claimed)
        if not enqueue:
            return claimed.run.id
        assert await self.jobs().enqueue(claimed.run.id)
        return claimed.run.id

    def jobs(self) -> ArqJobQueue:
        return ArqJobQueue(self.redis, self.settings.profile.worker.queue_name)

    async def work(self) -> None:
        worker = build_worker(self.settings, burst=True)
        try:
            await worker.run()
        finally:
            await worker.close()

    async def events(self, run_id: str) -> list[RunEvent]:
        return await event_log.read_all_after(self.redis, run_id, 0)

    def sweeper(self) -> Sweeper:
        """A sweeper as workers and gateways run it (without the wait after a Redis restart)."""
        return Sweeper(
            db_sessions=self.db_sessions,
            redis=self.redis,
            runlog=RunLog(self.redis),
            lease_seconds=self.settings.profile.worker.lease_seconds,
            owner="test-sweeper",
            jobs=self.jobs(),
            restart_grace=0,
        )

    async def log_as_dead_worker(self, run_id: str, attempt: int, *events: RunEvent) -> None:
        """Events a worker logged under its lease before it died (its lease then lapsed)."""
        runlog, token = RunLog(self.redis), lease_token(attempt, "dead-worker")
        assert await runlog.take_lease(run_id, token, 60_000)
        for event in events:
            assert (await runlog.append(event, token)).status is Appended.APPENDED
        await self.redis.delete(redis_keys.run_lease(run_id))


def make_settings(
    database_url: str,
    redis_url: str,
    work_dir: Path,
    script_path: Path,
    turn_timeout: float = 60,
    local: dict[str, Any] | None = None,
    rlm: dict[str, Any] | None = None,
    storage: dict[str, Any] | None = None,
    quotas: dict[str, Any] | None = None,
) -> Settings:
    settings = load_settings(
        {
            "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"),
            "FLEET_DATABASE_URL": database_url,
            "FLEET_REDIS_URL": redis_url,
            "FLEET_SCRIPTED_LM": str(script_path),
        }
    )
    profile = settings.profile
    runtime = msgspec.structs.replace(profile.runtime, turn_timeout_seconds=turn_timeout)
    # Short polls: the harness's burst workers notice an empty queue (and exit) at their next poll.
    worker = msgspec.structs.replace(
        profile.worker, queue_name=f"fleet:test:{work_dir.name}", poll_delay_seconds=0.02
    )
    local_section = msgspec.structs.replace(
        profile.sandbox.local, **{"cell_timeout_seconds": 2, **(local or {})}
    )
    sandbox = msgspec.structs.replace(profile.sandbox, local=local_section)
    rlm_section = msgspec.structs.replace(profile.rlm, **(rlm or {}))
    storage_section = msgspec.structs.replace(profile.storage, **(storage or {}))
    quotas_section = msgspec.convert(quotas, QuotasSection) if quotas is not None else profile.quotas
    profile = msgspec.structs.replace(
        profile,
        runtime=runtime,
        worker=worker,
        sandbox=sandbox,
        rlm=rlm_section,
        storage=storage_section,
        quotas=quotas_section,
    )
    return msgspec.structs.replace(settings, profile=profile, data_dir=work_dir / ".fleet")


async def script_calls(redis: aioredis.Redis) -> int:
    """How many Lua script calls this Redis has served (INFO commandstats)."""
    stats = await redis.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
