"""`fleet`: the process commands (up, gateway, worker, db, daytona, doctor). Each loads the config once."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import sys
from collections.abc import Sequence
from typing import Any

import structlog
from redis.exceptions import RedisError

from fleet_shared.config import Settings, config_summary, load_settings
from fleet_shared.errors import ConfigError
from fleet_shared.logging import configure_logging

# Granian's own loggers hand their records to the root logger, which renders JSON like ours.
GRANIAN_LOGS_THROUGH_STRUCTLOG = {
    "loggers": {
        name: {"handlers": [], "level": "INFO", "propagate": True} for name in ("_granian", "granian.access")
    }
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleet", description="fleet: a runtime for RLMs")
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="the embedded stack: Redis, SQLite, gateway and workers")
    up.add_argument("--profile", help="config profile (default: the file's default_profile)")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--workers", type=int, default=1, help="worker processes")

    gateway = commands.add_parser("gateway", help="serve the HTTP gateway with Granian")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=8000)
    gateway.add_argument("--workers", type=int, default=1, help="Granian worker processes")
    gateway.add_argument(
        "--allow-non-loopback-bind",
        action="store_true",
        help="allow binding to an address other than loopback",
    )

    worker = commands.add_parser("worker", help="run one arq worker process")
    worker.add_argument("--concurrency", type=int, help="Turns at once (default: worker.concurrency)")
    worker.add_argument("--burst", action="store_true", help="exit when the queue is empty")

    daytona = commands.add_parser("daytona", help="Daytona sandboxes (sandbox.provider = daytona)")
    daytona_commands = daytona.add_subparsers(dest="daytona_command", required=True)
    daytona_commands.add_parser("snapshot", help="build the REPL's snapshot (sandbox.daytona.snapshot)")
    daytona_commands.add_parser("sweep", help="delete the sandboxes of idle sessions now")

    doctor = commands.add_parser("doctor", help="live checks of what this profile depends on")
    doctor_commands = doctor.add_subparsers(dest="doctor_command", required=True)
    doctor_commands.add_parser("daytona", help="create a disposable sandbox, run a cell, delete it")

    db = commands.add_parser("db", help="database schema")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    db_commands.add_parser("upgrade", help="migrate the database to head")
    db_commands.add_parser("check", help="exit 1 unless the database is at head")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = dispatch(args)
    except ConfigError as exc:
        print(f"fleet: config error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


def dispatch(args: argparse.Namespace) -> int:
    if args.command == "up":
        from fleet_cli.embedded import run_embedded

        return run_embedded(profile=args.profile, host=args.host, port=args.port, workers=args.workers)
    if args.command == "gateway":
        return run_gateway(args.host, args.port, args.workers, args.allow_non_loopback_bind)
    if args.command == "worker":
        return run_worker(args.concurrency, args.burst)
    if args.command in ("daytona", "doctor"):
        from fleet_cli.daytona import run_daytona

        return run_daytona(args.daytona_command if args.command == "daytona" else "doctor")
    return run_db(args.db_command)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def run_gateway(host: str, port: int, workers: int, allow_non_loopback: bool) -> int:
    if not is_loopback(host) and not allow_non_loopback:
        print(
            f"fleet: refusing to bind {host}: it is not a loopback address "
            "(pass --allow-non-loopback-bind to expose the gateway)",
            file=sys.stderr,
        )
        return 2
    settings = load_settings()  # fail here, with one line, before Granian starts workers
    from fleet_cli.embedded import port_is_free

    if not port_is_free(host, port):  # Granian's SO_REUSEPORT would otherwise share it silently
        print(f"fleet: {host}:{port} is already in use", file=sys.stderr)
        return 2
    configure_logging(settings.profile.observability, process="gateway")
    structlog.get_logger("fleet").info("gateway.starting", host=host, port=port, **config_summary(settings))
    from granian import Granian

    Granian(
        "fleet_gateway.serve:app",
        address=host,
        port=port,
        interface="asgi",  # type: ignore[arg-type]
        workers=workers,
        # Granian waits for open connections before it stops; SSE streams would hold it forever.
        workers_kill_timeout=settings.profile.gateway.shutdown_grace_seconds,
        log_access=False,
        log_dictconfig=GRANIAN_LOGS_THROUGH_STRUCTLOG,
    ).serve()
    return 0


def run_worker(concurrency: int | None, burst: bool) -> int:
    settings = load_settings()
    if concurrency is not None:
        settings = with_concurrency(settings, concurrency)
    configure_logging(settings.profile.observability, process="worker")
    structlog.get_logger("fleet").info("worker.starting", **config_summary(settings))
    from fleet_worker.app import build_worker
    from fleet_worker.sandbox.errors import SandboxUnavailable

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # arq's Worker binds the current loop and its signal handlers
    try:
        worker = build_worker(settings, burst=burst)
    except SandboxUnavailable as exc:
        print(f"fleet: {exc}", file=sys.stderr)
        return 2
    stop_signals: list[object] = []
    worker.on_stop = stop_signals.append
    try:
        loop.run_until_complete(serve_through_outages(worker, stop_signals))
    finally:
        loop.run_until_complete(close_worker(worker))
    return 0


async def serve_through_outages(worker: Any, stop_signals: list[object]) -> None:
    """arq's poll loop, started again on the same worker whenever Redis fails it. Running Turns
    keep going meanwhile (they ride out Redis faults on their own), and new jobs are picked up as
    soon as Redis is back: nothing waits for the longest Turn."""
    log = structlog.get_logger("fleet")
    delay = 1.0
    while not stop_signals:
        try:
            await worker.async_run()
            return
        except asyncio.CancelledError:
            return  # SIGTERM: arq cancelled its poll loop after the drain
        except (RedisError, OSError) as exc:
            if stop_signals:
                return
            log.warning("worker.redis_unavailable", error_type=type(exc).__name__, retry_in=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)


async def close_worker(worker: Any) -> None:
    """arq's close (it waits for running jobs); if Redis is down for its last write, close our own
    resources anyway."""
    try:
        await worker.close()
    except (RedisError, OSError):
        if worker.on_shutdown is not None:
            await worker.on_shutdown(worker.ctx)


def with_concurrency(settings: Settings, concurrency: int) -> Settings:
    import msgspec

    if concurrency < 1:
        raise ConfigError("--concurrency must be at least 1")
    profile = settings.profile
    worker = msgspec.structs.replace(profile.worker, concurrency=concurrency)
    return msgspec.structs.replace(settings, profile=msgspec.structs.replace(profile, worker=worker))


def run_db(command: str) -> int:
    settings = load_settings(db_only_env())
    from fleet_shared.db import migrate
    from fleet_shared.db.engine import HEAD_REVISION, create_engine, current_revision

    if command == "upgrade":
        from fleet_shared.skills import seed_skills

        migrate.upgrade(settings.database_url)
        print(f"fleet: database at {HEAD_REVISION}")
        seeded = seed_skills(settings.database_url, settings.skills_dir)
        print(
            f"fleet: skills from {settings.skills_dir}: {len(seeded.inserted)} added, "
            f"{len(seeded.updated)} updated, {len(seeded.unchanged)} unchanged"
        )
        return 0

    async def check() -> str | None:
        engine = create_engine(settings.database_url)
        try:
            return await current_revision(engine)
        finally:
            await engine.dispose()

    revision = asyncio.run(check())
    if revision != HEAD_REVISION:
        print(f"fleet: database at {revision or 'nothing'}, head is {HEAD_REVISION}: run `fleet db upgrade`")
        return 1
    print(f"fleet: database at head ({HEAD_REVISION})")
    return 0


def db_only_env() -> dict[str, str]:
    """`fleet db` needs no Redis; give the loader a placeholder so it does not ask for one."""
    env = dict(os.environ)
    env.setdefault("FLEET_REDIS_URL", "redis://unused")
    return env


if __name__ == "__main__":
    main()
