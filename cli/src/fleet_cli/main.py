"""`fleet`: the process commands (up, cli, gateway, worker, db, eval, program, sandbox, daytona,
doctor, gc)."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

import structlog

from fleet_cli import quality
from fleet_cli.granian_compat import GRANIAN_LOGS_THROUGH_STRUCTLOG
from fleet_cli.sides import refuse_without
from fleet_shared.auth_settings import is_loopback
from fleet_shared.config import Settings, config_summary, load_settings
from fleet_shared.config_file import BIND_HOST_PATTERN
from fleet_shared.errors import ConfigError
from fleet_shared.logging import configure_logging
from fleet_shared.tokens_file import load_tokens, mint_token
from fleet_shared.tracing import configure_tracing


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleet", description="fleet: a runtime for RLMs")
    parser.add_argument("--version", action="version", version=f"fleet {version('fleet-cli')}")
    commands = parser.add_subparsers(dest="command", metavar="command")

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        """A subcommand whose `--help` starts with the line `fleet --help` lists for it."""
        return commands.add_parser(name, help=summary, description=summary)

    up = command("up", "the embedded stack: Redis, SQLite, gateway and workers")
    up.add_argument("--profile", help="config profile (default: the file's default_profile)")
    listen_address(up)
    up.add_argument("--workers", type=int, default=1, help="worker processes (default: %(default)s)")

    cli = command(
        "cli", "the terminal client, on the embedded stack (or on a running gateway with --api-url)"
    )
    cli.add_argument("--profile", help="config profile for the embedded stack")
    listen_address(cli)
    cli.add_argument("--api-url", help="use this running gateway instead of starting a stack")
    cli.add_argument("--session", help="continue this session")

    gateway = command("gateway", "serve the HTTP gateway with Granian")
    listen_address(gateway)
    gateway.add_argument(
        "--workers", type=int, default=1, help="Granian worker processes (default: %(default)s)"
    )
    gateway.add_argument(
        "--allow-non-loopback-bind",
        action="store_true",
        help="allow binding to an address other than loopback",
    )
    gateway.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve /api off loopback without an API token (a trusted proxy authenticates)",
    )

    worker = command("worker", "run one worker process (it takes Turns from the job queue)")
    worker.add_argument("--concurrency", type=int, help="Turns at once (default: worker.concurrency)")
    worker.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    worker.add_argument(
        "--metrics-host", help="address of /metrics and /health (default: worker.metrics_host)"
    )
    worker.add_argument(
        "--metrics-port",
        type=int,
        help="port of /metrics and /health, 0 for none (default: worker.metrics_port)",
    )

    quality.add_commands(command)

    daytona = command("daytona", "Daytona sandboxes (sandbox.provider = daytona)")
    daytona_commands = daytona.add_subparsers(dest="daytona_command", required=True)
    daytona_commands.add_parser("snapshot", help="build the REPL's snapshot (sandbox.daytona.snapshot)")
    daytona_commands.add_parser("sweep", help="delete the sandboxes of idle sessions now")

    doctor = command(
        "doctor", "check the config, database, Redis, sandbox and provider; print a fix for each failure"
    )
    doctor.add_argument("--json", action="store_true", help="print the checks as one JSON document")
    doctor_commands = doctor.add_subparsers(dest="doctor_command", required=False)
    doctor_commands.add_parser("daytona", help="create a disposable sandbox, run a cell, delete it")

    gc = command("gc", "remove stored objects and manifests nothing refers to, older than a grace period")
    gc.add_argument("--dry-run", action="store_true", help="print what would be removed; remove nothing")
    gc.add_argument(
        "--grace-seconds",
        type=float,
        help="remove only what is older than this (default: storage.gc_grace_seconds)",
    )
    gc.add_argument(
        "--no-lock",
        action="store_true",
        help="run without Redis and its lock (only when no other gc can run: no worker is up)",
    )

    token = command("token", "API tokens for gateway.auth.mode = tokens")
    token_commands = token.add_subparsers(dest="token_command", required=True)
    mint = token_commands.add_parser(
        "mint", help="add a token for a tenant and user to the tokens file; print the token once"
    )
    mint.add_argument("--tenant", required=True, help="the tenant the token's caller belongs to")
    mint.add_argument("--user", required=True, help="the caller's user id within the tenant")
    mint.add_argument(
        "--scopes", default="", help="comma-separated: admin, sessions:read:all (default: none)"
    )
    mint.add_argument("--file", help="the tokens file (default: the profile's gateway.auth.tokens_file)")

    db = command("db", "the database schema: migrate it, or check it is current")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    db_commands.add_parser("upgrade", help="migrate the database to head")
    db_commands.add_parser("check", help="exit 1 unless the database is at head")
    return parser


def listen_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare `fleet`: what it can do
        parser.print_help()
        sys.exit(0)
    try:
        code = dispatch(args)
    except ConfigError as exc:
        print(f"fleet: config error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


# The sides of fleet each command needs (fleet-cli's extras); `fleet db`, `fleet doctor` and
# `fleet gc` run on any install.
COMMAND_SIDES = {
    "up": ("gateway", "worker", "embedded"),
    "cli": ("gateway", "worker", "embedded"),
    "gateway": ("gateway",),
    "worker": ("worker",),
    "daytona": ("worker",),
    "sandbox": ("worker",),
    "optimize": ("worker",),  # dspy.GEPA
}


def dispatch(args: argparse.Namespace) -> int:
    needs = COMMAND_SIDES.get(args.command, ())
    if args.command == "doctor" and args.doctor_command == "daytona":
        needs = ("worker",)
    refusal = refuse_without(args.command, *needs)
    if refusal is not None:
        return refusal
    if args.command == "up":
        from fleet_cli.embedded import run_embedded

        return run_embedded(profile=args.profile, host=args.host, port=args.port, workers=args.workers)
    if args.command == "cli":
        from fleet_cli.client import run_cli

        return run_cli(
            profile=args.profile, host=args.host, port=args.port, api_url=args.api_url, session=args.session
        )
    if args.command == "gateway":
        return run_gateway(
            args.host, args.port, args.workers, args.allow_non_loopback_bind, args.allow_unauthenticated
        )
    if args.command == "worker":
        return run_worker(args.concurrency, args.burst, args.metrics_host, args.metrics_port)
    if args.command == "daytona" or (args.command == "doctor" and args.doctor_command == "daytona"):
        from fleet_cli.daytona import run_daytona

        return run_daytona(args.daytona_command if args.command == "daytona" else "doctor")
    if args.command in quality.COMMANDS:
        return quality.run_command(args, db_only_env())
    if args.command == "doctor":
        from fleet_cli.doctor import run_doctor

        return run_doctor(as_json=args.json)
    if args.command == "gc":
        from fleet_cli.gc import run_gc

        return run_gc(dry_run=args.dry_run, grace_seconds=args.grace_seconds, lock=not args.no_lock)
    if args.command == "token":
        return run_mint(args.file, args.tenant, args.user, args.scopes)
    return run_db(args.db_command)


def run_mint(file: str | None, tenant: str, user: str, scopes: str) -> int:
    """Appends the token's hash to the file and prints the token, which is kept nowhere else."""
    path = Path(file) if file else load_settings(lm_credentials=False).tokens_file
    if path is None:
        raise ConfigError("no tokens file: pass --file, or set gateway.auth.mode = tokens and tokens_file")
    wanted = tuple(scope.strip() for scope in scopes.split(",") if scope.strip())
    print(mint_token(path, tenant=tenant, user=user, scopes=wanted))
    print(f"fleet: added to {path}; the gateway reads it at start", file=sys.stderr)
    return 0


def bind_refusal(host: str, allow_non_loopback: bool) -> str | None:
    """Why the gateway must not bind `host`, or None: off loopback it needs the explicit flag."""
    if is_loopback(host) or allow_non_loopback:
        return None
    return (
        f"refusing to bind {host}: it is not a loopback address "
        "(pass --allow-non-loopback-bind to expose the gateway)"
    )


def auth_refusal(host: str, allow_unauthenticated: bool, settings: Settings) -> str | None:
    """Why the gateway must not serve /api on `host`, or None: off loopback it needs an API token
    unless the operator says a proxy in front authenticates."""
    if is_loopback(host) or settings.auth_required or allow_unauthenticated:
        return None
    return (
        f"refusing to serve /api on {host} without an API token: set "
        f"{settings.profile.gateway.auth.token_env}, or pass --allow-unauthenticated when a proxy "
        "in front authenticates"
    )


def run_gateway(
    host: str, port: int, workers: int, allow_non_loopback: bool, allow_unauthenticated: bool = False
) -> int:
    refusal = bind_refusal(host, allow_non_loopback)
    if refusal is None:
        settings = load_settings(
            lm_credentials=False
        )  # fail here, with one line, before Granian starts workers
        refusal = auth_refusal(host, allow_unauthenticated, settings)
        if settings.tokens_file is not None:
            load_tokens(settings.tokens_file)  # a bad file: one line here, not a crash in each worker
    if refusal is not None:
        print(f"fleet: {refusal}", file=sys.stderr)
        return 2
    from fleet_cli.embedded import port_is_free

    if not port_is_free(host, port):  # Granian's SO_REUSEPORT would otherwise share it silently
        print(f"fleet: {host}:{port} is already in use", file=sys.stderr)
        return 2
    configure_logging(settings.profile.observability, process="gateway")
    structlog.get_logger("fleet").info("gateway.starting", host=host, port=port, **config_summary(settings))
    from granian import Granian

    from fleet_cli.metrics_dir import multiprocess_metrics

    # Several processes: their metrics go to files in a fresh directory, set before they start.
    with multiprocess_metrics(workers):
        Granian(
            "fleet_gateway.serve:app",
            address=host,
            port=port,
            interface="asgi",  # type: ignore[arg-type]
            workers=workers,
            # Granian waits for open connections before it stops; SSE streams would hold it forever.
            workers_kill_timeout=settings.profile.gateway.shutdown_grace_seconds,
            backlog=2048,
            backpressure=open_files_for(settings.profile.gateway.max_concurrent_requests),
            log_access=False,
            log_dictconfig=GRANIAN_LOGS_THROUGH_STRUCTLOG,
        ).serve()
    return 0


# Descriptors a gateway process needs besides its client connections (Redis, DB, logs, Python).
SPARE_FILES = 256


def open_files_for(connections: int) -> int:
    """Raise this process's open-files limit (Granian's processes inherit it) toward what
    `connections` need, and return how many connections it allows: a stream past the limit would
    fail to be accepted instead of waiting."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + SPARE_FILES
    ceiling = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < ceiling:
        resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
        soft = ceiling
    allowed = connections if soft == resource.RLIM_INFINITY else soft - SPARE_FILES
    return max(64, min(connections, allowed))


def run_worker(
    concurrency: int | None, burst: bool, metrics_host: str | None = None, metrics_port: int | None = None
) -> int:
    from fleet_worker.metrics_http import serving_metrics, with_metrics_address

    if metrics_host is not None and not re.match(BIND_HOST_PATTERN, metrics_host):
        print(
            f"fleet: --metrics-host {metrics_host!r} is not an address (blank binds every interface)",
            file=sys.stderr,
        )
        return 2
    settings = load_settings()
    if concurrency is not None:
        settings = with_concurrency(settings, concurrency)
    settings = with_metrics_address(settings, metrics_host, metrics_port)
    configure_logging(settings.profile.observability, process="worker")
    configure_tracing("worker")
    structlog.get_logger("fleet").info("worker.starting", **config_summary(settings))
    from fleet_worker.app import build_worker
    from fleet_worker.sandbox.errors import SandboxUnavailable

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # the job worker binds the current loop and its signal handlers
    try:
        worker = build_worker(settings, burst=burst)
    except SandboxUnavailable as exc:
        print(f"fleet: {exc}", file=sys.stderr)
        return 2
    # Live (the heartbeat) before the queue first reaches Redis: a worker waiting for Redis is not stuck.
    with serving_metrics(settings, loop):
        try:
            loop.run_until_complete(worker.serve_through_outages())
        finally:
            loop.run_until_complete(worker.close())
    return 0


def with_concurrency(settings: Settings, concurrency: int) -> Settings:
    import msgspec

    if concurrency < 1:
        raise ConfigError("--concurrency must be at least 1")
    profile = settings.profile
    worker = msgspec.structs.replace(profile.worker, concurrency=concurrency)
    return msgspec.structs.replace(settings, profile=msgspec.structs.replace(profile, worker=worker))


def run_db(command: str) -> int:
    settings = load_settings(db_only_env(), lm_credentials=False)
    from fleet_shared.db import migrate
    from fleet_shared.db.engine import HEAD_REVISION, create_engine, current_revision, schema_state

    if command == "upgrade":
        from fleet_shared.skills import seed_skills

        migrate.upgrade(settings.database_url)
        print(f"fleet: database at {HEAD_REVISION}")
        seeded = seed_skills(settings.database_url, settings.skills_dir)
        print(
            f"fleet: skills from {settings.skills_dir}: {len(seeded.inserted)} added, "
            f"{len(seeded.updated)} updated, {len(seeded.unchanged)} unchanged"
        )
        from fleet_shared.db.programs import seed_program

        program = seed_program(settings.database_url)
        said = {
            "active": "added, active",
            "candidate": "added as a candidate (`fleet program activate` makes it active)",
            "present": "already there",
        }
        print(f"fleet: the shipped program version {program.version_id}: {said[program.outcome]}")
        return 0

    async def check() -> str | None:
        engine = create_engine(settings.database_url)
        try:
            return await current_revision(engine)
        finally:
            await engine.dispose()

    revision = asyncio.run(check())
    state = schema_state(revision)
    if state == "ahead":
        print(f"fleet: database at {revision}, newer than this release's head ({HEAD_REVISION})")
        return 1
    if state != "head":
        print(f"fleet: database at {revision or 'nothing'}, head is {HEAD_REVISION}: run `fleet db upgrade`")
        return 1
    print(f"fleet: database at head ({HEAD_REVISION})")
    return 0


def db_only_env() -> dict[str, str]:
    """`fleet db` and `fleet sandbox` need no Redis; the loader gets a placeholder instead."""
    env = dict(os.environ)
    env.setdefault("FLEET_REDIS_URL", "redis://unused")
    return env


if __name__ == "__main__":
    main()
