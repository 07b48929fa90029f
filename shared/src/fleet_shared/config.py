"""The typed configuration tree, loaded once per process from `config/fleet.toml`."""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec

from fleet_shared.auth_settings import auth_from_env, check_auth
from fleet_shared.config_file import (
    HOST_NAME_PATTERN,
    AuthSection,
    BlobSection,
    ConfigFile,
    DaytonaSection,
    EnvName,
    FileHeader,
    GatewaySection,
    LimitsSection,
    LLMSection,
    LMSection,
    LocalSandboxSection,
    ObservabilitySection,
    Profile,
    RLMSection,
    RuntimeSection,
    SandboxPythonSection,
    SandboxSection,
    Section,
    StorageSection,
    WorkerSection,
)
from fleet_shared.errors import ConfigError
from fleet_shared.redaction import has_credentials, redact_url

# The file's schema lives in config_file, URL redaction in redaction; both are re-exported here,
# where callers import them from.
__all__ = [
    "AuthSection",
    "BlobSection",
    "ConfigFile",
    "DaytonaSection",
    "EnvName",
    "FileHeader",
    "GatewaySection",
    "LLMSection",
    "LMSection",
    "LimitsSection",
    "LocalSandboxSection",
    "ObservabilitySection",
    "Profile",
    "RLMSection",
    "RuntimeSection",
    "SandboxPythonSection",
    "SandboxSection",
    "Section",
    "StorageSection",
    "WorkerSection",
    "has_credentials",
    "redact_url",
]

DEFAULT_CONFIG_PATH = Path("config/fleet.toml")
ALLOWED_HOSTS_ENV = "FLEET_ALLOWED_HOSTS"
BLOB_URL_ENV = "FLEET_BLOB_URL"


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
    price: tuple[float, float] | None = None  # the config's USD per million (input, output) tokens

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
    # Named by FLEET_BLOB_URL: the S3 client's own AWS_* variables give what the URL leaves out.
    from_url: bool = False


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
    tokens_file: Path | None = None  # gateway.auth.mode = "tokens"
    blobs: ResolvedBlobs
    skills_dir: Path  # the built-in skill cards, seeded into the DB by `fleet db upgrade`
    # Host names the gateway answers to beyond loopback and its bind address: the profile's
    # gateway.allowed_hosts, then FLEET_ALLOWED_HOSTS (comma-separated; a chart sets it).
    allowed_hosts: tuple[str, ...] = ()
    # FLEET_WEBHOOK_SECRET (`whsec_` + base64, Standard Webhooks): signs every delivery. Without
    # it a Turn or session that names a webhook is refused, and this process delivers none.
    webhook_secret: Secret | None = None

    @property
    def auth_required(self) -> bool:
        """Whether a caller must present a credential (false only for `token` with none set)."""
        return self.profile.gateway.auth.mode != "token" or self.api_token is not None

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


# Connection URLs the file may not hold with a password: each has an env variable for that.
CREDENTIAL_ENV = {"database_url": "FLEET_DATABASE_URL", "redis_url": "FLEET_REDIS_URL"}


def load_settings(environ: Mapping[str, str] | None = None, *, lm_credentials: bool = True) -> Settings:
    """Load, validate and resolve the config; raise ConfigError with one line on any problem.

    `lm_credentials=False` is for processes that never call an LM (the gateway, `fleet db`): the
    LM's key and base URL are neither required nor read, so those processes need only the model's
    name and an operator gives the provider key to the workers alone."""
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
    secrets = {name for each in profiles.values() for name in secret_variables(each)}
    root_lm = resolve_lm(profile.llm.root, f"{key}.root", env, base, lm_credentials, secrets=secrets)
    sub_lm = resolve_lm(
        profile.llm.sub or profile.llm.root, f"{key}.sub", env, base, lm_credentials, secrets=secrets
    )
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
    token = env.get(profile.gateway.auth.token_env)
    key_prefix = f"profiles.{quote_key(profile_name)}"
    auth = auth_from_env(profile.gateway.auth, env)
    profile = msgspec.structs.replace(profile, gateway=msgspec.structs.replace(profile.gateway, auth=auth))
    tokens_file = check_auth(auth, f"{key_prefix}.gateway.auth", env, base)
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
        tokens_file=tokens_file,
        blobs=blobs_from_url(env[BLOB_URL_ENV])
        if env.get(BLOB_URL_ENV)
        else resolve_blobs(profile.storage.blobs, f"{key_prefix}.storage.blobs", env),
        skills_dir=Path(env.get("FLEET_SKILLS_DIR") or base / "skills"),
        allowed_hosts=(*profile.gateway.allowed_hosts, *allowed_hosts_from(env)),
        webhook_secret=webhook_secret_from(env, profile.webhooks.allowed_networks, key_prefix),
    )


WEBHOOK_SECRET_ENV = "FLEET_WEBHOOK_SECRET"


def webhook_secret_from(env: Mapping[str, str], networks: list[str], key_prefix: str) -> Secret | None:
    """The signing secret, checked (its value is never echoed), and the allowed networks parsed."""
    for entry in networks:
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise ConfigError(f"{key_prefix}.webhooks.allowed_networks: {entry!r} is not a network") from None
    value = env.get(WEBHOOK_SECRET_ENV)
    if not value:
        return None
    encoded = value.removeprefix("whsec_")
    try:
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) < 24:
        raise ConfigError(f"{WEBHOOK_SECRET_ENV} must be whsec_ and the base64 of 24 or more random bytes")
    return Secret(value)


def allowed_hosts_from(env: Mapping[str, str]) -> tuple[str, ...]:
    names = tuple(name.strip() for name in env.get(ALLOWED_HOSTS_ENV, "").split(",") if name.strip())
    for name in names:
        if len(name) > 253 or not re.match(HOST_NAME_PATTERN, name):
            raise ConfigError(f"{ALLOWED_HOSTS_ENV}: {name[:60]!r} is not a host name")
    return names


def blobs_from_url(url: str) -> ResolvedBlobs:
    """The store FLEET_BLOB_URL names: `s3://bucket[/prefix]` (endpoint, region and credentials
    from the AWS_* variables the S3 client reads itself) or `file:///folder`."""
    parts = urlsplit(url)
    if parts.scheme == "s3" and parts.netloc and not (parts.query or parts.fragment or "@" in parts.netloc):
        return ResolvedBlobs(
            backend="s3", s3_bucket=parts.netloc, s3_prefix=parts.path.strip("/"), s3_region="", from_url=True
        )
    if parts.scheme == "file" and parts.path.startswith("/") and not parts.netloc:
        return ResolvedBlobs(backend="local", local_dir=Path(parts.path), from_url=True)
    # The value is not echoed: a URL in the environment may carry a secret.
    raise ConfigError(f"{BLOB_URL_ENV}: not s3://<bucket>[/<prefix>] or file:///<folder>")


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
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found (set FLEET_CONFIG)") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    return parse_config_text(text, path)


def parse_config_text(text: str, path: Path) -> ConfigFile:
    """The file's shape from its text (`path` only names it in errors)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    try:
        return msgspec.convert(data, ConfigFile)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {describe_validation_error(exc, '')}") from None


def convert_profile(path: Path, name: str, table: dict[str, Any]) -> Profile:
    """Validate every profile, so a typo in one you are not using still fails at startup."""
    prefix = f"profiles.{quote_key(name)}"
    try:
        profile = msgspec.convert(table, Profile)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {describe_validation_error(exc, prefix)}") from None
    for key, variable in CREDENTIAL_ENV.items():
        url = getattr(profile.storage, key)
        if url and has_credentials(url):
            # The file is read by people and tools that should never see a password.
            raise ConfigError(
                f"{path}: {prefix}.storage.{key}: a URL with credentials is accepted only from an "
                f"environment variable ({variable}), never from the config file"
            )
    if profile.sandbox.provider == "daytona" and profile.sandbox.daytona is None:
        raise ConfigError(
            f"{path}: {prefix}.sandbox.provider is 'daytona' but the profile has no "
            "[sandbox.daytona] table (see docs/daytona.md)"
        )
    return profile


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


# Variables that hold secrets whatever the file says, and names that say a variable holds one.
ALWAYS_SECRET = frozenset({"FLEET_API_TOKEN", "FLEET_DATABASE_URL", "FLEET_REDIS_URL"})
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|COOKIE|_URL|_URI|_DSN")
# A model name as clients see it (the stream's `start`, the Run row, logs): provider/model.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/\S+")
MAX_MODEL_CHARS = 200


def secret_variables(section: msgspec.Struct) -> set[str]:
    """Every variable a profile reads as a secret or an address (each `*_env` key but the model's),
    and those fleet always reads as one."""
    found = set(ALWAYS_SECRET)
    for name in section.__struct_fields__:
        value = getattr(section, name)
        if isinstance(value, msgspec.Struct):
            found |= secret_variables(value)
        elif name.endswith("_env") and name != "model_env" and isinstance(value, str):
            found.add(value)
    return found


def resolve_lm(
    section: LMSection,
    key: str,
    env: Mapping[str, str],
    base: Path,
    credentials: bool = True,
    *,
    secrets: frozenset[str] | set[str] = ALWAYS_SECRET,
) -> ResolvedLM:
    if (section.model is None) == (section.model_env is None):
        raise ConfigError(f"{key}: set exactly one of `model` or `model_env`")
    if section.model_env is not None and (
        section.model_env in secrets or SECRET_NAME.search(section.model_env)
    ):
        # Its value would be shown as the model: in every stream, Run row and start-up line.
        raise ConfigError(f"{key}.model_env: {section.model_env} holds a secret, never a model name")
    priced = (section.input_usd_per_million_tokens, section.output_usd_per_million_tokens)
    if (priced[0] is None) != (priced[1] is None):
        raise ConfigError(
            f"{key}: set both input_usd_per_million_tokens and output_usd_per_million_tokens, or neither"
        )
    name = section.model or require_env(env, section.model_env, f"{key}.model_env")
    if len(name) > MAX_MODEL_CHARS or not MODEL_NAME.fullmatch(name):
        where = f"{key}.model" if section.model else f"{key}.model_env ({section.model_env})"
        # The value is not echoed: it came from a variable that may hold anything.
        raise ConfigError(
            f"{where}: not a model name (provider/model, at most {MAX_MODEL_CHARS} characters, no spaces)"
        )
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
    if section.api_key_env and credentials:
        api_key = Secret(require_env(env, section.api_key_env, f"{key}.api_key_env"))
    base_url = None
    if section.base_url_env and credentials:  # as strict as every referenced variable: a typo stops startup
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
        price=None if scripted or priced[0] is None or priced[1] is None else (priced[0], priced[1]),
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
        "auth": settings.profile.gateway.auth.mode if settings.auth_required else "none",
    }
