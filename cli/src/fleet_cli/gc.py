"""`fleet gc`: remove what the blob store and the manifests table hold that nothing refers to
(fleet_shared.blob_gc), once, now. It needs the database, the blob store and (for the lock that
keeps gc runs one at a time across the deployment) Redis; no gateway or worker side."""

from __future__ import annotations

import asyncio
import os
import sys
from datetime import UTC, datetime, timedelta

from fleet_shared.blob_gc import Collected, Collector, collect_once, session_ttl
from fleet_shared.blobs import open_blob_store
from fleet_shared.config import Settings, load_settings
from fleet_shared.db.engine import create_engine, dispose_engine, session_factory
from fleet_shared.logging import configure_logging
from fleet_shared.redis_conn import connect

EXIT_BUSY = 75  # sysexits' EX_TEMPFAIL: another gc is running; try again later


def run_gc(*, dry_run: bool, grace_seconds: float | None, lock: bool) -> int:
    if grace_seconds is not None and grace_seconds < 0:
        print("fleet: --grace-seconds must be 0 or more", file=sys.stderr)
        return 2
    env = dict(os.environ)
    if not lock:  # no Redis is needed, nor read
        env.setdefault("FLEET_REDIS_URL", "redis://unused")
    settings = load_settings(env, lm_credentials=False)
    configure_logging(settings.profile.observability, process="gc")
    grace = settings.profile.storage.gc_grace_seconds if grace_seconds is None else grace_seconds
    older_than = datetime.now(UTC) - timedelta(seconds=grace)
    collected = asyncio.run(collect(settings, older_than=older_than, dry_run=dry_run, lock=lock))
    if collected is None:
        print("fleet gc: another gc is running (it holds the lock); nothing was done")
        return EXIT_BUSY
    print(report(collected))
    if not collected.finished:
        print("fleet gc: stopped before the end (its lock was lost); run it again", file=sys.stderr)
        return 1
    return 0


async def collect(settings: Settings, *, older_than: datetime, dry_run: bool, lock: bool) -> Collected | None:
    engine = create_engine(settings.database_url)
    redis = connect(settings.redis_url) if lock else None
    collector = Collector(
        session_factory(engine),
        open_blob_store(settings),
        older_than=older_than,
        dry_run=dry_run,
        on_removed=print_would_remove if dry_run else None,
        session_ttl=session_ttl(settings.profile.storage),
        redis=redis,
    )
    try:
        return await collect_once(redis, settings.profile.worker.queue_name, collector)
    finally:
        if redis is not None:
            await redis.aclose()
        await dispose_engine(engine)


def print_would_remove(key: str, size: int) -> None:
    print(f"would remove {key}" + (f" ({size} bytes)" if size else ""), flush=True)


def report(collected: Collected) -> str:
    verb = "would remove" if collected.dry_run else "removed"
    objects = collected.workspace_objects
    parts = [
        f"{collected.manifests} manifest(s)",
        f"{objects.count} workspace object(s) ({objects.bytes} bytes)",
        f"{collected.attachments.count} attachment(s) ({collected.attachments.bytes} bytes)",
        f"{collected.artifacts.count} artifact(s) ({collected.artifacts.bytes} bytes)",
    ]
    freed = "would free" if collected.dry_run else "freed"
    line = f"fleet gc: {verb} {', '.join(parts)}; {freed} {collected.freed_bytes} bytes"
    if collected.sessions or collected.sessions_expired:
        expired = f"{collected.sessions_expired} idle past the TTL"
        line += f"; {verb} {collected.sessions} deleted session(s) ({expired})"
    if collected.unknown_keys:
        line += f"; left {collected.unknown_keys} object(s) whose names fleet does not make"
    return line
