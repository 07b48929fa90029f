"""`fleet doctor [--json]`: checks the config, the database, Redis, the sandbox and provider auth,
prints a fix for each failure, and exits 1 if any check failed.

Every check runs on a daemon thread with a deadline, so a dead or hung server costs a few seconds
at most and the command never hangs. Output goes through `scrub` (doctor_output): no password,
key or token the settings hold can reach it, whatever an error message says.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from redis.exceptions import AuthenticationError, RedisError
from sqlalchemy.exc import SQLAlchemyError

from fleet_cli.doctor_output import render_json, render_text, scrub, secrets_of
from fleet_cli.embedded import REDIS_SOCKET
from fleet_shared.config import (
    DEFAULT_CONFIG_PATH,
    LMSection,
    ObservabilitySection,
    ResolvedLM,
    Settings,
    load_settings,
    redact_url,
)
from fleet_shared.db.engine import HEAD_REVISION, create_engine, current_revision, is_read_only, schema_state
from fleet_shared.doctor import Check, all_passed
from fleet_shared.errors import ConfigError
from fleet_shared.logging import configure_logging
from fleet_shared.redis_conn import connect

DATABASE_SECONDS = 5.0
REDIS_SECONDS = 3.0
# Closing a client after its check: under MARGIN_SECONDS, so a check's allowance in run_bounded
# (its seconds plus the margin) covers the check and the close, and a slow close is no "hang".
CLOSE_SECONDS = 1.0
SANDBOX_SECONDS = 45.0  # two REPL starts and a cell, each bounded by the worker's own timeouts
PROVIDER_SECONDS = 5.0
MARGIN_SECONDS = 2.0  # on top of each check's own timeouts, before its thread is given up on
STORE_SECONDS = 10.0
LATER_CHECKS = ("database", "redis", "store", "sandbox", "provider")


def run_doctor(as_json: bool) -> int:
    """Run every check, print them (a table, or one JSON document) and return the exit code."""
    # The sandbox code logs what the checks report anyway: only errors, and on stderr.
    configure_logging(ObservabilitySection(log_level="error", log_format="json"), process="doctor")
    checks = collect_checks(os.environ)
    print(render_json(checks) if as_json else render_text(checks))
    return 0 if all_passed(checks) else 1


def collect_checks(environ: Mapping[str, str]) -> list[Check]:
    from fleet_cli.sides import installed

    # Only workers call the LM: a gateway-only install may well have no LM key or base URL.
    worker_side = installed("worker")
    config, settings = check_config(environ, lm_credentials=worker_side)
    if settings is None:
        skipped = "not checked: the config did not load"
        return [config, *(Check(name=name, status="skip", detail=skipped) for name in LATER_CHECKS)]
    planned = [
        Planned("database", DATABASE_SECONDS, lambda: [asyncio.run(check_database(settings))]),
        Planned("redis", REDIS_SECONDS, lambda: [asyncio.run(check_redis(settings))]),
        Planned("store", STORE_SECONDS, lambda: [check_store(settings)]),
    ]
    if worker_side:
        planned += [
            Planned("sandbox", SANDBOX_SECONDS, lambda: check_sandbox(settings)),
            Planned("provider", PROVIDER_SECONDS * 2, lambda: check_providers(settings, PROVIDER_SECONDS)),
        ]
    checks = [config, *run_bounded(planned)]
    if not worker_side:
        detail = "the worker side is not installed here (fleet-cli[worker]): run `fleet doctor` on a worker"
        checks += [Check(name=name, status="skip", detail=detail) for name in ("sandbox", "provider")]
    return scrub(checks, secrets_of(settings))


# --- config


def check_config(environ: Mapping[str, str], *, lm_credentials: bool = True) -> tuple[Check, Settings | None]:
    path = environ.get("FLEET_CONFIG") or str(DEFAULT_CONFIG_PATH)
    embedded_redis = running_fleet_up_redis(environ)
    if embedded_redis is not None:
        environ = {**environ, "FLEET_REDIS_URL": embedded_redis}
    try:
        settings = load_settings(environ, lm_credentials=lm_credentials)
    except ConfigError as exc:
        return Check(name="config", status="fail", detail=str(exc), fix=config_fix(str(exc), path)), None
    except OSError as exc:
        detail = f"{path} cannot be read: {exc.strerror}"
        return Check(name="config", status="fail", detail=detail, fix=config_fix("", path)), None
    detail = (
        f"profile {settings.profile_name} from {settings.config_path} (root LM {settings.root_lm.name}, "
        f"sandbox {settings.profile.sandbox.provider}, {settings.database_url.split('://', 1)[0]})"
    )
    if embedded_redis is not None:
        detail += f"; Redis: the running `fleet up`'s Redis ({embedded_redis})"
    return Check(name="config", status="ok", detail=detail), settings


def running_fleet_up_redis(environ: Mapping[str, str]) -> str | None:
    """With no Redis URL given, the socket of a `fleet up` running on the profile's data dir."""
    if environ.get("FLEET_REDIS_URL"):
        return None
    try:
        probe = load_settings({**environ, "FLEET_REDIS_URL": "redis://pending"}, lm_credentials=False)
    except (ConfigError, OSError):
        return None
    if probe.redis_url != "redis://pending":
        return None  # the profile names its own Redis
    sock = probe.data_dir.resolve() / REDIS_SOCKET
    return f"unix://{sock}" if sock.is_socket() else None


MISSING_VARIABLE = re.compile(r"environment variable (\S+) is not set")


def config_fix(message: str, path: str) -> str:
    """The concrete fix for a ConfigError's message (its text names the key or the variable)."""
    if missing := MISSING_VARIABLE.search(message):
        return f"export {missing[1]} (the key named above refers to it)"
    if message.startswith("FLEET_REDIS_URL is not set"):
        return (
            "start `fleet up` in this folder (the doctor then checks its Redis), or export "
            "FLEET_REDIS_URL=redis://HOST:6379/0 or unix:///path/to/redis.sock "
            "(or set storage.redis_url in the profile)"
        )
    if "(set FLEET_CONFIG)" in message:
        return "set FLEET_CONFIG to the path of fleet.toml (the Helm chart mounts /etc/fleet/fleet.toml)"
    if "is not defined (known:" in message:
        return "set FLEET_PROFILE to one of the known profiles, or add that profile to the file"
    if "accepted only from an environment variable" in message:
        return "remove the URL from the file and export it in the variable named above"
    return f"fix the key named above in {path} (FLEET_CONFIG), or the variable it names"


# --- database and Redis


async def check_database(settings: Settings) -> Check:
    """Reachable, and its schema at the head this code expects (as `fleet db check`)."""
    url, shown = settings.database_url, redact_url(settings.database_url)
    missing = missing_sqlite_file(url)
    if missing is not None:  # connecting would create an empty file
        fix = "run `fleet db upgrade` (it creates and migrates the database)"
        return Check(name="database", status="fail", detail=f"no SQLite database at {missing}", fix=fix)
    engine = create_engine(url)
    try:
        async with asyncio.timeout(DATABASE_SECONDS):  # both questions in one allowance
            revision = await current_revision(engine)
            read_only = await is_read_only(engine)
    except TimeoutError:
        detail = f"{shown} did not answer within {DATABASE_SECONDS:g}s"
        return Check(name="database", status="fail", detail=detail, fix=database_fix(shown))
    except (SQLAlchemyError, OSError) as exc:
        detail = f"{shown} is unreachable: {error_line(exc)}"
        return Check(name="database", status="fail", detail=detail, fix=database_fix(shown))
    finally:
        with contextlib.suppress(TimeoutError, SQLAlchemyError, OSError):
            await asyncio.wait_for(engine.dispose(), CLOSE_SECONDS)
    return schema_check(shown, revision, read_only)


def schema_check(shown: str, revision: str | None, read_only: bool) -> Check:
    state = schema_state(revision)
    if state in ("behind", "missing"):
        detail = f"{shown}: schema at {revision or 'nothing'}, this fleet expects {HEAD_REVISION}"
        fix = "run `fleet db upgrade` with the same FLEET_DATABASE_URL (the chart's migration Job runs it)"
        return Check(name="database", status="fail", detail=detail, fix=fix)
    if state == "ahead":
        detail = f"{shown}: schema at {revision}, newer than this fleet's {HEAD_REVISION} (a newer release)"
        return Check(
            name="database", status="warn", detail=detail, fix="upgrade this install to that release"
        )
    if read_only:
        detail = f"{shown}: at head ({HEAD_REVISION}) but read-only (a standby, or a failover in progress)"
        return Check(
            name="database", status="warn", detail=detail, fix="point FLEET_DATABASE_URL at the primary"
        )
    return Check(name="database", status="ok", detail=f"{shown}: schema at head ({HEAD_REVISION})")


def missing_sqlite_file(url: str) -> str | None:
    """The path of a SQLite URL's file when it does not exist (None for anything else)."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:":
        return None
    return None if Path(database).exists() else database


def database_fix(shown: str) -> str:
    return f"start the database, or point FLEET_DATABASE_URL at a reachable one (now {shown})"


async def check_redis(settings: Settings) -> Check:
    shown = redact_url(settings.redis_url)
    fix = f"start Redis, or point FLEET_REDIS_URL at a reachable one (now {shown})"
    try:
        client = connect(settings.redis_url, retries=0, timeout=REDIS_SECONDS)
    except ValueError as exc:
        return Check(name="redis", status="fail", detail=f"{shown} is not a Redis URL: {exc}", fix=fix)
    started = time.monotonic()
    try:
        await asyncio.wait_for(client.ping(), REDIS_SECONDS)
    except TimeoutError:
        detail = f"{shown} did not answer PING within {REDIS_SECONDS:g}s"
        return Check(name="redis", status="fail", detail=detail, fix=fix)
    except AuthenticationError:
        fix = "check the user and password in FLEET_REDIS_URL"
        return Check(name="redis", status="fail", detail=f"{shown} refused the credentials", fix=fix)
    except (RedisError, OSError) as exc:
        return Check(
            name="redis", status="fail", detail=f"{shown} is unreachable: {error_line(exc)}", fix=fix
        )
    finally:
        with contextlib.suppress(TimeoutError, RedisError, OSError):
            await asyncio.wait_for(client.aclose(), CLOSE_SECONDS)
    elapsed_ms = (time.monotonic() - started) * 1000
    return Check(name="redis", status="ok", detail=f"{shown} answered PING in {elapsed_ms:.0f} ms")


# --- the object store


def check_store(settings: Settings) -> Check:
    """Put, read back and delete one small object, as every gateway and worker needs to."""
    from fleet_shared.blobs import open_blob_store

    probe = f"doctor/{uuid.uuid4().hex}"
    fix = (
        "check FLEET_BLOB_URL (or storage.blobs), that the bucket exists, and the AWS_* variables "
        "(endpoint, credentials, AWS_ALLOW_HTTP for a plain-http endpoint)"
    )
    started = time.monotonic()
    try:
        store = open_blob_store(settings)
        with tempfile.NamedTemporaryFile() as source:
            source.write(b"fleet doctor")
            source.flush()
            store.put_file(probe, Path(source.name))
        read = io.BytesIO()
        store.download(probe, read)
        asyncio.run(store.delete(probe))
    except Exception as exc:
        detail = f"{settings.blobs.backend} store {describe_store(settings)} refused: {error_line(exc)}"
        return Check(name="store", status="fail", detail=detail, fix=fix)
    if read.getvalue() != b"fleet doctor":
        return Check(
            name="store", status="fail", detail="an object read back differs from what was put", fix=fix
        )
    elapsed_ms = (time.monotonic() - started) * 1000
    detail = f"{describe_store(settings)}: put, read back and deleted an object in {elapsed_ms:.0f} ms"
    return Check(name="store", status="ok", detail=detail)


def describe_store(settings: Settings) -> str:
    blobs = settings.blobs
    if blobs.backend == "s3":
        return f"s3://{blobs.s3_bucket}/{blobs.s3_prefix}".rstrip("/")
    return f"folder {settings.blobs_dir}"


# --- sandbox


def check_sandbox(settings: Settings) -> list[Check]:
    from fleet_worker.sandbox.doctor import check_sandbox as check_worker_sandbox

    return check_worker_sandbox(settings)


# --- provider auth


def check_providers(settings: Settings, seconds: float) -> list[Check]:
    """The root LM's endpoint, and the sub LM's when it is another endpoint or key.

    The real provider is unreachable from CI: this is tested against a loopback
    OpenAI-compatible server (tests/support/fake_provider.py)."""
    llm = settings.profile.llm
    checks = [check_provider("provider", settings.root_lm, llm.root, seconds)]
    if endpoint(settings.sub_lm) != endpoint(settings.root_lm):
        checks.append(check_provider("provider.sub", settings.sub_lm, llm.sub or llm.root, seconds))
    return checks


def endpoint(lm: ResolvedLM) -> tuple[str | None, str | None]:
    """What the check depends on: the base URL and the key."""
    return lm.base_url, lm.api_key.reveal() if lm.api_key else None


def check_provider(name: str, lm: ResolvedLM, section: LMSection, seconds: float) -> Check:
    """GET <base_url>/models with the key as a bearer token: the cheapest call that needs a
    valid key. Neither the key nor the provider's answer is ever shown."""
    if lm.scripted:
        return Check(name=name, status="skip", detail="scripted LM: nothing to authenticate")
    if lm.base_url is None:
        detail = f"{lm.name} is reached by LiteLLM's provider name: the check needs llm.*.base_url_env"
        return Check(name=name, status="skip", detail=detail)
    shown = redact_url(lm.base_url.rstrip("/"))
    key_env = section.api_key_env
    started = time.monotonic()
    try:
        status = models_status(lm, seconds)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        detail = f"{shown} is unreachable: {type(reason).__name__}: {reason}"
        fix = f"check {section.base_url_env} (now {shown}) and the network path to the provider"
        return Check(name=name, status="fail", detail=detail, fix=fix)
    elapsed_ms = (time.monotonic() - started) * 1000
    if 200 <= status < 300:
        detail = f"{shown}/models accepted the key ({status} in {elapsed_ms:.0f} ms) for {lm.name}"
        return Check(name=name, status="ok", detail=detail)
    if status in (401, 403):
        fix = (
            f"set {key_env} to a key this provider accepts"
            if key_env
            else "the profile sends no key: set llm.*.api_key_env and export that variable"
        )
        return Check(name=name, status="fail", detail=f"{shown}: the key was refused ({status})", fix=fix)
    if status in (404, 405, 429):
        detail = f"{shown}/models answered {status}: the key was not verified"
        return Check(
            name=name, status="warn", detail=detail, fix="send a Turn to verify the provider end to end"
        )
    detail = f"{shown}/models answered {status}"
    fix = f"check {section.base_url_env} (now {shown}) and the provider's status"
    return Check(name=name, status="fail", detail=detail, fix=fix)


class NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is reported as its status: the bearer token never follows it to another host."""

    def redirect_request(self, *_args: object, **_kwargs: object) -> None:
        return None


def models_status(lm: ResolvedLM, seconds: float) -> int:
    """The HTTP status of GET <base_url>/models (credentials in the URL go as basic auth)."""
    parts = urlsplit(lm.base_url or "")
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    netloc += f":{parts.port}" if parts.port else ""
    url = urlunsplit((parts.scheme, netloc, parts.path.rstrip("/") + "/models", "", ""))
    request = urllib.request.Request(url, headers={"Accept": "application/json"}, method="GET")
    if lm.api_key is not None:
        request.add_header("Authorization", f"Bearer {lm.api_key.reveal()}")
    elif parts.username is not None:
        import base64

        userinfo = f"{parts.username}:{parts.password or ''}".encode()
        request.add_header("Authorization", f"Basic {base64.b64encode(userinfo).decode()}")
    opener = urllib.request.build_opener(NoRedirects)
    try:
        with opener.open(request, timeout=seconds) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()  # the body is never read: it may echo the key
        return exc.code


# --- running


@dataclass(frozen=True)
class Planned:
    """A check to run on its own thread; `seconds` bounds it (MARGIN_SECONDS more before it is
    reported as hung)."""

    name: str
    seconds: float
    run: Callable[[], list[Check]]


def run_bounded(planned: list[Planned]) -> list[Check]:
    """Run every check at once, each on a daemon thread (a hung one is left behind, and cannot
    keep the process alive); their results in the planned order."""
    results: dict[str, list[Check]] = {}

    def target(check: Planned) -> None:
        try:
            results[check.name] = check.run()
        except Exception as exc:  # a bug in a check: report it as that check's failure
            detail = f"the check itself failed: {error_line(exc)}"
            results[check.name] = [Check(name=check.name, status="fail", detail=detail)]

    threads = [threading.Thread(target=target, args=(check,), daemon=True) for check in planned]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    checks: list[Check] = []
    for check, thread in zip(planned, threads, strict=True):
        thread.join(max(0.0, started + check.seconds + MARGIN_SECONDS - time.monotonic()))
        if check.name in results:
            checks += results[check.name]
        else:
            detail = f"no answer within {check.seconds + MARGIN_SECONDS:g}s"
            fix = f"the {check.name} is hung; see its section in docs/troubleshooting.md"
            checks.append(Check(name=check.name, status="fail", detail=detail, fix=fix))
    return checks


def error_line(exc: BaseException) -> str:
    """`Type: first line of the message` (a DB driver's own error when SQLAlchemy wraps one)."""
    inner = getattr(exc, "orig", None) or exc
    text = (str(inner).strip().splitlines() or [""])[0][:200]
    return f"{type(inner).__name__}: {text}" if text else type(inner).__name__
