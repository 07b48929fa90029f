"""The config file's schema: one msgspec Struct per TOML table (docs/configuration.md).

Unknown keys are errors and values are immutable. `fleet_shared.config` loads a file into these
and resolves it (env references, paths) into `Settings`; import them from there.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

# What the settings API (PATCH /api/settings) may change is declared here, beside each key, in
# its type's metadata (fleet_shared.settings_policy reads it): FILE_ONLY marks a key that chooses
# a host path, an executable, an identity, an exposure (where a credential is sent included) or
# what is deleted. Only whoever edits the file on disk may change it; a request never can. Every
# `*_env` key (it names a variable) is file-only too, whatever its type says.
FILE_ONLY = {"file_only": True}
ENV_NAME_PATTERN = r"^[A-Z_][A-Z0-9_]*$"

EnvName = Annotated[str, msgspec.Meta(pattern=ENV_NAME_PATTERN)]
HostPath = Annotated[str, msgspec.Meta(extra=FILE_ONLY)]
# An address to bind: never empty or blank (that would bind every interface). \Z, not $: a
# trailing newline must not pass either.
BIND_HOST_PATTERN = r"^\S+\Z"
BindHost = Annotated[str, msgspec.Meta(min_length=1, pattern=BIND_HOST_PATTERN, extra=FILE_ONLY)]
# A host name the gateway answers to, without a port (the Host check drops the port): a name (a
# leading dot matches every subdomain), an IPv4 or IPv6 address (bracketed or not), or "*" any name.
HOST_NAME_PATTERN = (
    r"^(\*"
    r"|\.?[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?"  # a name
    r"|\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f]*:[0-9A-Fa-f]*:[0-9A-Fa-f:.]*"  # an IPv6 address
    r")\Z"
)
HostName = Annotated[str, msgspec.Meta(min_length=1, max_length=253, pattern=HOST_NAME_PATTERN)]
Origin = Annotated[str, msgspec.Meta(min_length=1, max_length=300, pattern=r"^https?://[^\s/]+\Z")]


class Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base for every config table: unknown keys are errors, values are immutable."""


class RuntimeSection(Section):
    heartbeat_seconds: Annotated[float, msgspec.Meta(ge=1, le=300)] = 10
    turn_timeout_seconds: Annotated[float, msgspec.Meta(gt=0)] = 600
    # A cell waiting for approval (`approval: always | on_risk`) is denied past this; the wait
    # counts against the Turn's deadline, never the cell's timeout.
    approval_timeout_seconds: Annotated[float, msgspec.Meta(ge=1, le=86_400)] = 300


class LMSection(Section):
    """One LM. `model` names it directly; `model_env` names the env var that holds the name.

    `script` (scripted LMs only) is a JSONL file, relative to the config file's folder.
    """

    # The model picks the provider, and so where the key goes: file-only, as the key's and the
    # base URL's variables are.
    model: Annotated[str, msgspec.Meta(extra=FILE_ONLY)] | None = None
    model_env: EnvName | None = None
    script: HostPath | None = None
    api_key_env: EnvName | None = None
    base_url_env: EnvName | None = None
    num_retries: Annotated[int, msgspec.Meta(ge=0, le=10)] = 3
    # One HTTP request to the provider (a retry gets its own); the Turn settles at its deadline
    # regardless (docs/rlm.md, the provider path).
    request_timeout_seconds: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 120
    temperature: float | None = None
    max_tokens: int | None = None
    # USD per million tokens, in place of LiteLLM's price map (both, or neither): for a model the
    # map does not know, or a negotiated price. The scripted LM has no price.
    input_usd_per_million_tokens: Annotated[float, msgspec.Meta(ge=0, le=1e6)] | None = None
    output_usd_per_million_tokens: Annotated[float, msgspec.Meta(ge=0, le=1e6)] | None = None


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
    allow_unisolated: Annotated[bool, msgspec.Meta(extra=FILE_ONLY)] = False
    python: HostPath = "auto"
    cell_timeout_seconds: Annotated[float, msgspec.Meta(gt=0)] = 60
    # Bounded above too: a budget is a request's to change, and past these a worker could no longer
    # make a workspace's volume (mkfs refuses 2^32 inodes) or would hand a cell the whole host.
    memory_mb: Annotated[int, msgspec.Meta(ge=64, le=1_048_576)] = 1024
    max_processes: Annotated[int, msgspec.Meta(ge=1, le=65_536)] = 64
    max_file_mb: Annotated[int, msgspec.Meta(ge=1, le=1_048_576)] = 64
    tmp_mb: Annotated[int, msgspec.Meta(ge=1, le=65_536)] = 256
    workspace_mb: Annotated[int, msgspec.Meta(ge=1, le=1_048_576)] = 1024
    workspace_files: Annotated[int, msgspec.Meta(ge=10, le=10_000_000)] = 100_000
    # On a root worker, each workspace is a filesystem of its own of that size and file count,
    # so the kernel enforces the budget (sandbox/volumes.py); off, the budget is checked only.
    workspace_volumes: Annotated[bool, msgspec.Meta(extra=FILE_ONLY)] = True
    cpus: Annotated[float, msgspec.Meta(gt=0, le=256)] = 1.0
    uid_base: Annotated[int, msgspec.Meta(ge=1000, le=2**31 - 2**17, extra=FILE_ONLY)] = 200_000
    uid_count: Annotated[int, msgspec.Meta(ge=1, le=2**17, extra=FILE_ONLY)] = 65_536
    pool_size: Annotated[int, msgspec.Meta(ge=0, le=256)] = 4
    pool_idle_seconds: Annotated[float, msgspec.Meta(ge=1)] = 300


class DaytonaSection(Section):
    """One Daytona sandbox per session (see docs/daytona.md). Secrets are env var names only."""

    api_key_env: EnvName = "FLEET_DAYTONA_API_KEY"
    api_url_env: EnvName | None = None
    target: str | None = None
    # Which image runs cells and which sandboxes the sweep may delete: each could reach another
    # deployment's, so only the file on disk chooses them.
    snapshot: Annotated[str, msgspec.Meta(extra=FILE_ONLY)] = "fleet-repl"  # `fleet daytona snapshot`
    # Ignored: workspaces live in the blob store, synced into each sandbox's own disk. Kept so
    # that a file written for an older fleet still loads (the worker logs that it is unused).
    volume: Annotated[str | None, msgspec.Meta(extra=FILE_ONLY)] = None
    deployment: Annotated[str, msgspec.Meta(extra=FILE_ONLY)] = "fleet"  # the `fleet.deployment` label
    workspace_files: Annotated[int, msgspec.Meta(ge=10)] = 100_000  # entries a capture walks
    cell_timeout_seconds: Annotated[float, msgspec.Meta(gt=0)] = 120
    startup_timeout_seconds: Annotated[float, msgspec.Meta(gt=0)] = 60
    create_timeout_seconds: Annotated[float, msgspec.Meta(gt=0)] = 120
    auto_stop_minutes: Annotated[int, msgspec.Meta(ge=0)] = 15
    idle_minutes: Annotated[float, msgspec.Meta(gt=0)] = 30  # then the sweep deletes the sandbox


# `name==version` or `name[extra]==version`, nothing else: never an option (it starts with a
# letter or digit), a URL or a path, so the list can only name wheels from the index uv uses.
PINNED_REQUIREMENT = r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?==[A-Za-z0-9.+!_-]+\Z"
PinnedRequirement = Annotated[str, msgspec.Meta(pattern=PINNED_REQUIREMENT, max_length=200)]
ModuleName = Annotated[
    str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z", max_length=200)
]
# The data set cells get by default: numpy and pandas for tables, and regex, whose `timeout`
# bounds a pattern that backtracks without end over a large context (the stdlib's `re` has none).
DEFAULT_SANDBOX_PACKAGES = ("numpy==2.4.6", "pandas==3.1.1", "regex==2026.12.2")


class SandboxPythonSection(Section):
    """The packages cells can import, besides the standard library (docs/sandbox-python.md)."""

    # What the worker builds and every cell may run: only whoever edits the file chooses it.
    packages: Annotated[tuple[PinnedRequirement, ...], msgspec.Meta(max_length=100, extra=FILE_ONLY)] = (
        DEFAULT_SANDBOX_PACKAGES
    )
    # Imported by each REPL before its first cell (a warm REPL has them loaded when its Run comes).
    preload: Annotated[tuple[ModuleName, ...], msgspec.Meta(max_length=50)] = ()


class SandboxSection(Section):
    # Where cells run and workspaces go (this host, or a third party's sandboxes): an exposure.
    provider: Annotated[Literal["local", "daytona"], msgspec.Meta(extra=FILE_ONLY)] = "local"
    local: LocalSandboxSection = msgspec.field(default_factory=LocalSandboxSection)
    daytona: DaytonaSection | None = None
    python: SandboxPythonSection = msgspec.field(default_factory=SandboxPythonSection)


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
    data_dir: HostPath = ".fleet"
    database_url: HostPath | None = None
    redis_url: HostPath | None = None
    blobs: Annotated[BlobSection, msgspec.Meta(extra=FILE_ONLY)] = msgspec.field(default_factory=BlobSection)
    max_attachment_mb: Annotated[int, msgspec.Meta(ge=1, le=10_240)] = 50
    max_artifact_mb: Annotated[int, msgspec.Meta(ge=1, le=10_240)] = 100
    max_artifacts_per_run: Annotated[int, msgspec.Meta(ge=0, le=1_000)] = 20
    max_attachments_per_turn: Annotated[int, msgspec.Meta(ge=0, le=20)] = 10
    # What the blob store may hold, counted from the rows of what it holds (0: no quota): one
    # session's artifacts, and every artifact and attachment of the deployment.
    quota_session_mb: Annotated[int, msgspec.Meta(ge=0, extra=FILE_ONLY)] = 2_048
    quota_deployment_mb: Annotated[int, msgspec.Meta(ge=0, extra=FILE_ONLY)] = 20_480
    # A worker's local copy of workspace contents it fetched or stored (scratch: evicted least
    # recently used first past this bound; 0 keeps none). Unused with the local backend.
    workspace_cache_mb: Annotated[int, msgspec.Meta(ge=0, le=1_048_576)] = 2_048
    # The versions of a workspace that stay readable: the commit that records version N deletes
    # the rows of versions up to N minus this, and gc then removes what only they referred to.
    # Both keys decide what is deleted, so only the file on disk sets them.
    workspace_versions_kept: Annotated[int, msgspec.Meta(ge=1, le=1_000_000, extra=FILE_ONLY)] = 50
    # gc removes only unreferenced objects older than this: an upload whose commit is still under
    # way is younger (it must outlast the longest upload plus its Turn's settlement).
    gc_grace_seconds: Annotated[float, msgspec.Meta(ge=60, le=30 * 86_400, extra=FILE_ONLY)] = 3_600
    # How often each worker offers to run gc (one at a time across the deployment; 0: never).
    gc_interval_seconds: Annotated[float, msgspec.Meta(ge=0, le=7 * 86_400)] = 3_600
    # A session neither changed nor given a Turn for this many days is deleted by the gc, like a
    # DELETE (0: never). It decides what is deleted, so only the file on disk sets it.
    session_ttl_days: Annotated[int, msgspec.Meta(ge=0, le=36_500, extra=FILE_ONLY)] = 0


class WebhooksSection(Section):
    """Where a settled Run is posted (fleet_shared.webhook_targets, fleet_shared.webhook_delivery);
    the signing secret is FLEET_WEBHOOK_SECRET, never the file. Which targets are allowed is a
    security boundary (SSRF): only the file on disk sets it."""

    # http:// targets too (https only otherwise).
    allow_http: Annotated[bool, msgspec.Meta(extra=FILE_ONLY)] = False
    # Networks (CIDR, or one address) a target may resolve to although they are not public:
    # private, loopback, link-local and reserved addresses are refused otherwise.
    allowed_networks: Annotated[list[str], msgspec.Meta(max_length=100, extra=FILE_ONLY)] = []
    # A failed delivery is tried again after this, doubling up to an hour, until give_up_seconds
    # after the Run ended.
    first_retry_seconds: Annotated[float, msgspec.Meta(ge=0.05, le=3_600)] = 5
    give_up_seconds: Annotated[float, msgspec.Meta(ge=1, le=7 * 86_400)] = 86_400
    timeout_seconds: Annotated[float, msgspec.Meta(ge=1, le=60)] = 10  # one attempt, all of it
    # How often each gateway and worker looks for deliveries that are due.
    poll_seconds: Annotated[float, msgspec.Meta(ge=0.05, le=60)] = 1


class WorkerSection(Section):
    concurrency: Annotated[int, msgspec.Meta(ge=1, le=256)] = 4
    lease_seconds: Annotated[float, msgspec.Meta(ge=2)] = 3
    drain_seconds: Annotated[float, msgspec.Meta(ge=0)] = 30
    queue_name: Annotated[str, msgspec.Meta(extra=FILE_ONLY)] = "fleet:queue"  # another's: its workers
    # How often a worker with a free slot asks Redis for a job: a queued Turn waits up to this
    # long. Each poll is a Redis read (and a check of each job other workers run), paid by every
    # worker with a free slot all the time, so a shorter delay costs Redis and CPU in proportion
    # to the fleet (ADR 0034).
    poll_delay_seconds: Annotated[float, msgspec.Meta(ge=0.005, le=5)] = 0.02
    # The worker's GET /metrics and GET /health (its liveness); port 0 serves neither.
    metrics_host: BindHost = "127.0.0.1"
    metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 9100


class LimitsSection(Section):
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 1_048_576
    max_text_chars: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 100_000
    # All request headers together; past it the answer is 431 in the envelope (Granian's own
    # buffer takes far more).
    max_header_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1_048_576)] = 16_384
    # An upload whose client sends nothing for this long is answered 408, its connection closed
    # and its temporary file removed.
    upload_idle_seconds: Annotated[float, msgspec.Meta(ge=1, le=3600)] = 30
    # Uploads one client (the socket peer's address) may have in progress in one gateway process;
    # the next gets 429 until one has been received. Behind a proxy every client is the proxy.
    max_concurrent_uploads_per_client: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 4
    # Follow-ups (`multitask: enqueue`) one session may have waiting behind its active Turn; one
    # more is 409 `queue_full`.
    max_waiting_turns: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 32


# Signature algorithms a JWT may use: asymmetric only, so a verifier never holds a signing
# secret, and `none` or an HMAC "signed" with the public key can never verify.
JwtAlgorithm = Literal[
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"
]


class JwtSection(Section):
    """`mode = "jwt"`: bearer JWTs from an OIDC provider, checked against its published keys."""

    jwks_url: str = ""  # https, or http to a loopback address
    issuer: str = ""
    audience: str = ""
    algorithms: Annotated[tuple[JwtAlgorithm, ...], msgspec.Meta(min_length=1)] = ("RS256", "ES256")
    tenant_claim: Annotated[str, msgspec.Meta(min_length=1, max_length=100)] = "tid"
    leeway_seconds: Annotated[int, msgspec.Meta(ge=0, le=300)] = 30  # the clock skew allowed
    # The key set is kept this long; a token with an unknown `kid` refetches it, at most once
    # per `jwks_min_refresh_seconds` (so random kids cannot make the gateway hammer the provider).
    jwks_cache_seconds: Annotated[int, msgspec.Meta(ge=10, le=86_400)] = 300
    jwks_min_refresh_seconds: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 30


class AuthSection(Section):
    """Who may call `/api/*` (docs/security.md, tenancy). `token`: one bearer token from the
    named variable, or none when it is unset; `tokens`: a file of token hashes, each bound to a
    tenant, a user and scopes; `jwt`: OIDC bearer JWTs. Tokens themselves never live in a file."""

    mode: Literal["token", "tokens", "jwt"] = "token"
    token_env: EnvName = "FLEET_API_TOKEN"
    # `mode = "tokens"`: relative to the config file's folder; FLEET_AUTH_TOKENS_FILE overrides.
    tokens_file: str = ""
    jwt: JwtSection = msgspec.field(default_factory=JwtSection)


class CorsSection(Section):
    """Web origins whose pages may call the API (CORS). Empty: none; a request that carries any
    other origin is refused for every method that can change something."""

    allowed_origins: Annotated[tuple[Origin, ...], msgspec.Meta(max_length=100, extra=FILE_ONLY)] = ()


class GatewaySection(Section):
    limits: LimitsSection = msgspec.field(default_factory=LimitsSection)
    auth: Annotated[AuthSection, msgspec.Meta(extra=FILE_ONLY)] = msgspec.field(default_factory=AuthSection)
    # Host names the gateway answers to besides localhost, 127.0.0.1, ::1 and its bind address
    # (FLEET_ALLOWED_HOSTS adds more): any other Host header is refused before routing, so a web
    # page that rebinds its own name to this address reaches nothing.
    allowed_hosts: Annotated[tuple[HostName, ...], msgspec.Meta(max_length=100, extra=FILE_ONLY)] = ()
    cors: Annotated[CorsSection, msgspec.Meta(extra=FILE_ONLY)] = msgspec.field(default_factory=CorsSection)
    # An SSE connection ends after this long (the client resumes with Last-Event-ID), so proxies
    # and rolling deploys never wait on a stream forever.
    stream_max_seconds: Annotated[float, msgspec.Meta(ge=10, le=86_400)] = 900
    # On SIGTERM, open connections (streams included) get this long before the gateway's
    # processes are killed; clients resume on another gateway.
    shutdown_grace_seconds: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 5
    # Requests (SSE streams included) one gateway process serves at once; Granian's default
    # (its backlog, 1024) left the rest of 2,000 streams waiting. The open-files limit is raised
    # to match at start.
    max_concurrent_requests: Annotated[int, msgspec.Meta(ge=64, le=100_000)] = 10_000


class TracingSection(Section):
    # Spans carry ids, counts, models and timings. With this on they carry the request, each
    # cell's code and each sub-LM prompt too (redacted as logs are): for a backend you trust.
    capture_content: bool = False
    # A POST's `traceparent` header: false (the default), the Turn's trace is fleet's own, with a
    # link to the caller's span; true, it continues the caller's trace and sampling decision.
    # Turn it on only when the callers are your own services.
    trust_inbound_context: bool = False


class ObservabilitySection(Section):
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # auto: structlog's console renderer (colours, aligned keys) when stderr is a terminal, JSON
    # lines otherwise (a pod, a pipe, a file). json or console force one.
    log_format: Literal["auto", "json", "console"] = "auto"
    # The worker's fleet_tenant_* metrics: Turns and LM tokens with a `tenant` label. Off by
    # default, since each tenant adds series; turn it on when tenants are few and known.
    metrics_tenant_label: bool = False
    # Traces export only when the standard OTEL_* variables name an endpoint
    # (fleet_shared.tracing); this section says what the spans may carry.
    tracing: TracingSection = TracingSection()


class QuotaLimits(Section):
    """One tenant's limits; 0 means none."""

    # Turns queued or running at once; one more is 429 `quota_exceeded` at its POST.
    active_turns: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 0
    # New Turns per clock minute; one more is 429 until the minute ends (its key is not burned).
    turns_per_minute: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    # Bytes the blob store may hold for the tenant (its sessions' artifacts and workspace
    # versions, a fork's copies included, and its attachments); past it: 507, as storage.quota_*.
    storage_mb: Annotated[int, msgspec.Meta(ge=0, le=1 << 30)] = 0
    # LM tokens (prompt and completion, every model, child RLMs included) per UTC day. Once
    # reached, a new Turn is 429 `quota_exceeded` until midnight, and a running one stops at its
    # next LM call, failing `quota_exhausted`.
    lm_tokens_per_day: Annotated[int, msgspec.Meta(ge=0, le=1 << 50)] = 0


class QuotasSection(QuotaLimits):
    """Per-tenant limits (docs/security.md, tenancy): these for every tenant, `tenants.<name>`
    in place of them for one."""

    tenants: dict[str, QuotaLimits] = msgspec.field(default_factory=dict)

    def of(self, tenant: str) -> QuotaLimits:
        return self.tenants.get(tenant, self)


class Profile(Section):
    llm: LLMSection
    runtime: RuntimeSection = msgspec.field(default_factory=RuntimeSection)
    rlm: RLMSection = msgspec.field(default_factory=RLMSection)
    sandbox: SandboxSection = msgspec.field(default_factory=SandboxSection)
    storage: StorageSection = msgspec.field(default_factory=StorageSection)
    worker: WorkerSection = msgspec.field(default_factory=WorkerSection)
    gateway: GatewaySection = msgspec.field(default_factory=GatewaySection)
    observability: ObservabilitySection = msgspec.field(default_factory=ObservabilitySection)
    quotas: QuotasSection = msgspec.field(default_factory=QuotasSection)
    webhooks: WebhooksSection = msgspec.field(default_factory=WebhooksSection)


class FileHeader(Section):
    # Which profile runs decides every file-only key at once: file-only itself.
    default_profile: Annotated[str, msgspec.Meta(extra=FILE_ONLY)]


class ConfigFile(Section):
    """The file's shape. Profiles stay raw here and are validated one at a time, by name."""

    config: FileHeader
    profiles: dict[str, dict[str, Any]]
