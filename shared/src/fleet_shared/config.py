"""The typed configuration tree, loaded once per process from `config/fleet.toml`."""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from fleet_shared.errors import ConfigError

DEFAULT_CONFIG_PATH = Path("config/fleet.toml")
EnvName = Annotated[str, msgspec.Meta(pattern=r"^[A-Z_][A-Z0-9_]*$")]


class Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base for every config table: unknown keys are errors, values are immutable."""


class RuntimeSection(Section):
    heartbeat_seconds: Annotated[float, msgspec.Meta(ge=1, le=300)] = 10
    turn_timeout_seconds: Annotated[float, msgspec.Meta(gt=0)] = 600


class LMSection(Section):
    """One LM. `model` names it directly; `model_env` names the env var that holds the name.

    `script` (scripted LMs only) is a JSONL file, relative to the config file's folder.
    """

    model: str | None = None
    model_env: EnvName | None = None
    script: str | None = None
    api_key_env: EnvName | None = None
    base_url_env: EnvName | None = None
    num_retries: Annotated[int, msgspec.Meta(ge=0, le=10)] = 3
    # One HTTP request to the provider (a retry gets its own); the Turn settles at its deadline
    # regardless (docs/rlm.md, the provider path).
    request_timeout_seconds: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 120
    temperature: float | None = None
    max_tokens: int | None = None


class LLMSection(Section):
    root: LMSection
    sub: LMSection | None = None


class RLMSection(Section):
    max_iters: Annotated[int, msgspec.Meta(ge=1, le=200)] = 20
    max_llm_calls: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 50
    max_output_chars: Annotated[int, msgspec.Meta(ge=100)] = 10_000
    # Host-side caps on what a Turn can produce (enforced before events and the DB).
    max_answer_chars: Annotated[int, msgspec.Meta(ge=100, le=10_000_000)] = 100_000
    max_tool_input_chars: Annotated[int, msgspec.Meta(ge=100, le=10_000_000)] = 100_000
    max_events: Annotated[int, msgspec.Meta(ge=100, le=1_000_000)] = 5_000
    max_history_turns: Annotated[int, msgspec.Meta(ge=0, le=1_000)] = 20
    max_history_chars: Annotated[int, msgspec.Meta(ge=0, le=10_000_000)] = 50_000
    recursion: bool = False  # `rlm_query` child RLMs (one level; docs/rlm.md)
    max_children: Annotated[int, msgspec.Meta(ge=1, le=32)] = 4
    child_max_iters: Annotated[int, msgspec.Meta(ge=1, le=100)] = 8
    child_max_llm_calls: Annotated[int, msgspec.Meta(ge=2, le=10_000)] = 12
    batch_concurrency: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4


class LocalSandboxSection(Section):
    allow_unisolated: bool = False
    python: str = "auto"
    cell_timeout_seconds: Annotated[float, msgspec.Meta(gt=0)] = 60
    memory_mb: Annotated[int, msgspec.Meta(ge=64)] = 1024
    max_processes: Annotated[int, msgspec.Meta(ge=1)] = 64
    max_file_mb: Annotated[int, msgspec.Meta(ge=1)] = 64
    tmp_mb: Annotated[int, msgspec.Meta(ge=1, le=65_536)] = 256
    workspace_mb: Annotated[int, msgspec.Meta(ge=1)] = 1024
    workspace_files: Annotated[int, msgspec.Meta(ge=10)] = 100_000
    cpus: Annotated[float, msgspec.Meta(gt=0, le=256)] = 1.0
    uid_base: Annotated[int, msgspec.Meta(ge=1000, le=2**31 - 2**17)] = 200_000
    uid_count: Annotated[int, msgspec.Meta(ge=1, le=2**17)] = 65_536
    pool_size: Annotated[int, msgspec.Meta(ge=0, le=256)] = 4
    pool_idle_seconds: Annotated[float, msgspec.Meta(ge=1)] = 300


class DaytonaSection(Section):
    """One Daytona sandbox per session (see docs/daytona.md). Secrets are env var names only."""

    api_key_env: EnvName = "FLEET_DAYTONA_API_KEY"
    api_url_env: EnvName | None = None
    target: str | None = None
    snapshot: str = "fleet-repl"  # `fleet daytona snapshot` builds it
    volume: str = "fleet-workspaces"  # one per deployment; each session mounts its own subpath
    deployment: str = "fleet"  # the `fleet.deployment` label: what the sweep may delete
    cell_timeout_seconds: Annotated[float, msgspec.Meta(gt=0)] = 120
    startup_timeout_seconds: Annotated[float, msgspec.Meta(gt=0)] = 60
    create_timeout_seconds: Annotated[float, msgspec.Meta(gt=0)] = 120
    auto_stop_minutes: Annotated[int, msgspec.Meta(ge=0)] = 15
    idle_minutes: Annotated[float, msgspec.Meta(gt=0)] = 30  # then the sweep deletes the sandbox


class SandboxSection(Section):
    provider: Literal["local", "daytona"] = "local"
    local: LocalSandboxSection = msgspec.field(default_factory=LocalSandboxSection)
    daytona: DaytonaSection | None = None


class BlobSection(Section):
    """Where attachment and artifact bytes live: a folder (embedded stack, or a volume shared by
    gateways and workers), or an S3-compatible bucket. Credentials are env var names only."""

    backend: Literal["local", "s3"] = "local"
    local_dir: str | None = None  # default: <data_dir>/blobs
    s3_bucket: str | None = None
    s3_prefix: str = "fleet"
    s3_region: str = "us-east-1"
    s3_endpoint_env: EnvName | None = None
    s3_access_key_env: EnvName | None = None
    s3_secret_key_env: EnvName | None = None
    s3_allow_http: bool = False  # only for an endpoint on a private network


class StorageSection(Section):
    data_dir: str = ".fleet"
    database_url: str | None = None
    redis_url: str | None = None
    blobs: BlobSection = msgspec.field(default_factory=BlobSection)
    max_attachment_mb: Annotated[int, msgspec.Meta(ge=1, le=10_240)] = 50
    max_artifact_mb: Annotated[int, msgspec.Meta(ge=1, le=10_240)] = 100
    max_artifacts_per_run: Annotated[int, msgspec.Meta(ge=0, le=1_000)] = 20
    max_attachments_per_turn: Annotated[int, msgspec.Meta(ge=0, le=20)] = 10


class WorkerSection(Section):
    concurrency: Annotated[int, msgspec.Meta(ge=1, le=256)] = 4
    lease_seconds: Annotated[float, msgspec.Meta(ge=2)] = 3
    drain_seconds: Annotated[float, msgspec.Meta(ge=0)] = 30
    queue_name: str = "fleet:queue"


class LimitsSection(Section):
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 1_048_576
    max_text_chars: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 100_000


class GatewaySection(Section):
    limits: LimitsSection = msgspec.field(default_factory=LimitsSection)
    # An SSE connection ends after this long (the client resumes with Last-Event-ID), so proxies
    # and rolling deploys never wait on a stream forever.
    stream_max_seconds: Annotated[float, msgspec.Meta(ge=10, le=86_400)] = 900
    # On SIGTERM, open connections (streams included) get this long before the gateway's
    # processes are killed; clients resume on another gateway.
    shutdown_grace_seconds: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 5


class ObservabilitySection(Section):
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "console"] = "json"


class Profile(Section):
    llm: LLMSection
    runtime: RuntimeSection = msgspec.field(default_factory=RuntimeSection)
    rlm: RLMSection = msgspec.field(default_factory=RLMSection)
    sandbox: SandboxSection = msgspec.field(default_factory=SandboxSection)
    storage: StorageSection = msgspec.field(default_factory=StorageSection)
    worker: WorkerSection = msgspec.field(default_factory=WorkerSection)
    gateway: GatewaySection = msgspec.field(default_factory=GatewaySection)
    observability: ObservabilitySection = msgspec.field(default_factory=ObservabilitySection)


class FileHeader(Section):
    default_profile: str


class ConfigFile(Section):
    """The file's shape. Profiles stay raw here and are validated one at a time, by name."""

    config: FileHeader
    profiles: dict[str, dict[str, Any]]


class Secret:
    """A secret value read from the environment; it never prints itself."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


class ResolvedLM(msgspec.Struct, frozen=True, kw_only=True):
    """An LM with its env references resolved. `name` is what clients see as the model."""

    name: str
    scripted: bool
    script_path: Path | None
    api_key: Secret | None
    base_url: str | None
    num_retries: int
    temperature: float | None
    max_tokens: int | None
    request_timeout: float = 120

    def __repr__(self) -> str:
        # The base URL may carry credentials (user:password@): never in a log line.
        base_url = None if self.base_url is None else redact_url(self.base_url)
        return (
            f"ResolvedLM(name={self.name!r}, scripted={self.scripted}, base_url={base_url!r}, "
            f"api_key={self.api_key!r}, num_retries={self.num_retries})"
        )


class ResolvedBlobs(msgspec.Struct, frozen=True, kw_only=True):
    """The blob store with its env references resolved (secrets stay wrapped)."""

    backend: Literal["local", "s3"]
    local_dir: Path | None = None  # None: <data_dir>/blobs
    s3_bucket: str | None = None
    s3_prefix: str = ""
    s3_region: str = ""
    s3_endpoint: str | None = None
    s3_access_key: Secret | None = None
    s3_secret_key: Secret | None = None
    s3_allow_http: bool = False


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a process needs: the selected profile plus the resolved environment."""

    profile_name: str
    config_path: Path
    config_revision: str
    profile: Profile
    root_lm: ResolvedLM
    sub_lm: ResolvedLM
    database_url: str
    redis_url: str
    data_dir: Path
    api_token: Secret | None
    blobs: ResolvedBlobs
    skills_dir: Path  # the built-in skill cards, seeded into the DB by `fleet db upgrade`

    @property
    def workspaces_dir(self) -> Path:
        return self.data_dir / "workspaces"

    @property
    def blobs_dir(self) -> Path:
        """The local blob store's folder (backend = "local")."""
        return self.blobs.local_dir or self.data_dir / "blobs"

    def __repr__(self) -> str:
        # URLs may carry passwords; never let a stray repr put them in a log.
        return (
            f"Settings(profile={self.profile_name!r}, database={redact_url(self.database_url)!r}, "
            f"redis={redact_url(self.redis_url)!r})"
        )


URL_USERINFO = re.compile(r"://([^/\s]*)@")  # up to the last @ before the path: passwords may hold @


def redact_url(url: str) -> str:
    """The URL with its password (or a bare token as its user-info) replaced by ***."""

    def masked(match: re.Match[str]) -> str:
        user, colon, _secret = match.group(1).partition(":")
        return f"://{user}:***@" if colon else "://***@"

    return URL_USERINFO.sub(masked, url)


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Load, validate and resolve the config; raise ConfigError with one line on any problem."""
    env = os.environ if environ is None else environ
    path = Path(env.get("FLEET_CONFIG") or DEFAULT_CONFIG_PATH)
    raw = read_config_file(path)
    profile_name = env.get("FLEET_PROFILE") or raw.config.default_profile
    if profile_name not in raw.profiles:
        known = ", ".join(quote_key(name) for name in sorted(raw.profiles)) or "none"
        raise ConfigError(f"{path}: profile {profile_name!r} is not defined (known: {known})")
    profiles = {name: convert_profile(path, name, table) for name, table in raw.profiles.items()}
    profile = profiles[profile_name]
    base = path.parent
    key = f"profiles.{quote_key(profile_name)}.llm"
    root_lm = resolve_lm(profile.llm.root, f"{key}.root", env, base)
    sub_lm = resolve_lm(profile.llm.sub or profile.llm.root, f"{key}.sub", env, base)
    data_dir = Path(profile.storage.data_dir)
    database_url = (
        env.get("FLEET_DATABASE_URL")
        or profile.storage.database_url
        or f"sqlite+aiosqlite:///{(data_dir / 'fleet.db').resolve()}"
    )
    redis_url = env.get("FLEET_REDIS_URL") or profile.storage.redis_url
    if not redis_url:
        raise ConfigError(
            "FLEET_REDIS_URL is not set and storage.redis_url is empty "
            "(`fleet up` starts a private Redis; `fleet gateway`/`fleet worker` need one)"
        )
    token = env.get("FLEET_API_TOKEN")
    key_prefix = f"profiles.{quote_key(profile_name)}"
    return Settings(
        profile_name=profile_name,
        config_path=path,
        config_revision=file_revision(path),
        profile=profile,
        root_lm=root_lm,
        sub_lm=sub_lm,
        database_url=database_url,
        redis_url=redis_url,
        data_dir=data_dir,
        api_token=Secret(token) if token else None,
        blobs=resolve_blobs(profile.storage.blobs, f"{key_prefix}.storage.blobs", env),
        skills_dir=Path(env.get("FLEET_SKILLS_DIR") or base / "skills"),
    )


def resolve_blobs(section: BlobSection, key: str, env: Mapping[str, str]) -> ResolvedBlobs:
    local_dir = Path(section.local_dir) if section.local_dir else None
    if section.backend == "local":
        return ResolvedBlobs(backend="local", local_dir=local_dir)
    if not section.s3_bucket:
        raise ConfigError(f"{key}.s3_bucket is required when backend = 's3'")
    endpoint = access = secret = None
    if section.s3_endpoint_env:
        endpoint = require_env(env, section.s3_endpoint_env, f"{key}.s3_endpoint_env")
    if section.s3_access_key_env:
        access = Secret(require_env(env, section.s3_access_key_env, f"{key}.s3_access_key_env"))
    if section.s3_secret_key_env:
        secret = Secret(require_env(env, section.s3_secret_key_env, f"{key}.s3_secret_key_env"))
    return ResolvedBlobs(
        backend="s3",
        local_dir=local_dir,
        s3_bucket=section.s3_bucket,
        s3_prefix=section.s3_prefix,
        s3_region=section.s3_region,
        s3_endpoint=endpoint,
        s3_access_key=access,
        s3_secret_key=secret,
        s3_allow_http=section.s3_allow_http,
    )


def read_config_file(path: Path) -> ConfigFile:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found (set FLEET_CONFIG)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    try:
        return msgspec.convert(data, ConfigFile)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {describe_validation_error(exc, '')}") from None


def convert_profile(path: Path, name: str, table: dict[str, Any]) -> Profile:
    """Validate every profile, so a typo in one you are not using still fails at startup."""
    try:
        return msgspec.convert(table, Profile)
    except msgspec.ValidationError as exc:
        prefix = f"profiles.{quote_key(name)}"
        raise ConfigError(f"{path}: {describe_validation_error(exc, prefix)}") from None


UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<field>.*)`$", re.DOTALL)


def describe_validation_error(exc: msgspec.ValidationError, prefix: str) -> str:
    """msgspec's `<problem> - at `$.a.b`` as `<dotted.key>: <problem>`."""
    message = str(exc)
    text, sep, where = message.rpartition(" - at `")
    if not sep:
        text, where = message, "$`"
    parts = [prefix] if prefix else []
    inner = where.rstrip("`").removeprefix("$").lstrip(".")
    if inner:
        parts.append(inner)
    unknown = UNKNOWN_FIELD.match(text)
    if unknown:
        parts.append(quote_key(unknown["field"]))
        return f"{'.'.join(parts)}: unknown key"
    return f"{'.'.join(parts)}: {text}" if parts else text


def quote_key(key: str) -> str:
    """A TOML key as the user would write it: bare when it can be, quoted otherwise."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def resolve_lm(section: LMSection, key: str, env: Mapping[str, str], base: Path) -> ResolvedLM:
    if (section.model is None) == (section.model_env is None):
        raise ConfigError(f"{key}: set exactly one of `model` or `model_env`")
    name = section.model or require_env(env, section.model_env, f"{key}.model_env")
    scripted = name.startswith("scripted/")
    script_path: Path | None = None
    if scripted:
        override = env.get("FLEET_SCRIPTED_LM")
        if override:
            script_path = Path(override).resolve()
        elif section.script:
            script_path = (base / section.script).resolve()
        else:
            raise ConfigError(f"{key}.script is required for the scripted LM {name!r}")
        if not script_path.is_file():
            raise ConfigError(f"{key}: scripted LM file {script_path} does not exist")
    api_key = None
    if section.api_key_env:
        api_key = Secret(require_env(env, section.api_key_env, f"{key}.api_key_env"))
    base_url = None
    if section.base_url_env:  # as strict as every referenced variable: a typo stops startup
        base_url = require_env(env, section.base_url_env, f"{key}.base_url_env")
        if not base_url.startswith(("http://", "https://")):
            # The value is not echoed: a base URL may carry credentials.
            raise ConfigError(f"{key}.base_url_env: {section.base_url_env} is not an http(s) URL")
    return ResolvedLM(
        name=name,
        scripted=scripted,
        script_path=script_path,
        api_key=api_key,
        base_url=base_url,
        num_retries=section.num_retries,
        temperature=section.temperature,
        max_tokens=section.max_tokens,
        request_timeout=section.request_timeout_seconds,
    )


def require_env(env: Mapping[str, str], name: str | None, key: str) -> str:
    assert name is not None
    value = env.get(name)
    if not value:
        raise ConfigError(f"environment variable {name} is not set (referenced by {key})")
    return value


def file_revision(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def config_summary(settings: Settings) -> dict[str, Any]:
    """A loggable view of the settings: names and shapes only, never secret values."""
    return {
        "profile": settings.profile_name,
        "config": str(settings.config_path),
        "root_lm": settings.root_lm.name,
        "sub_lm": settings.sub_lm.name,
        "sandbox": settings.profile.sandbox.provider,
        "database": settings.database_url.split("://", 1)[0],
        "auth": settings.api_token is not None,
    }
