"""Every settings class the worker, the client library, the CLI and the gateway read.

    the worker   WorkerSettings  DURABLE_COMFY_CONFIG, _SETTINGS_FILE, _POOLS, _TASK_QUEUE,
                                 _DEFAULT_POOL, _MAX_CONCURRENT_ACTIVITIES, _ORPHAN_SWEEP_S,
                                 _METRICS_PORT, _METRICS_HOST, _LOG_LEVEL, _HEARTBEAT_THROTTLE_S,
                                 _HEARTBEAT_BUDGET, _LIVE_PROGRESS_{PORT,HOST,URL,KEY},
                                 _VERSIONING, _DEPLOYMENT_NAME, _BUILD_ID, _SET_CURRENT
                 S3Settings      DURABLE_COMFY_BUCKET, _S3_ENDPOINT, _ALLOWED_INPUT_PREFIXES,
                                 AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION (else
                                 AWS_DEFAULT_REGION); the client and the gateway too
                 WebhookSettings DURABLE_COMFY_WEBHOOK_SECRETS, _WEBHOOK_SECRETS_FILE,
                                 _WEBHOOK_ALLOW_HOSTS
                 UrlFetchSettings DURABLE_COMFY_URL_INPUT_{MAX_BYTES,CONTENT_TYPES,PORTS,
                                 REDIRECTS,TIMEOUT_S} (read at the first URL input)
                 runpod_api_keys each runpod pool's key, from the variable its `api_key_env`
                                 names (default RUNPOD_API_KEY)
    the client   ClientSettings  DURABLE_COMFY_TASK_QUEUE, _QUERY_TIMEOUT_S, _LIVE_PROGRESS_KEY
                 CliSettings     the client's, and DURABLE_COMFY_LOG_LEVEL (the CLI's)
                 TemporalSettings TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TEMPORAL_UI_URL (and a
                                 check of the codec's keys); TemporalTarget without either
                 CodecSettings   DURABLE_COMFY_CODEC_KEYS, _CODEC_KEYS_FILE
                 CodecServerSettings DURABLE_COMFY_LOG_LEVEL, _CODEC_AUTH_TOKEN (codec-server)
    the gateway  GatewaySettings DURABLE_COMFY_GATEWAY_*, DURABLE_COMFY_LOG_LEVEL,
                                 _WEBHOOK_ALLOW_HOSTS, the keys (AuthSettings: _API_KEYS,
                                 _API_KEYS_FILE) and the limits (LimitSettings: _TENANT_RPS,
                                 _TENANT_BURST, _TENANT_MAX_JOBS, _GATEWAY_MAX_REQUESTS,
                                 _GATEWAY_MAX_STREAMS)

Where each value comes from, and in which order, is configuration.sources (`Settings`); which of
them each process reads at its start, configuration.processes. docs/configuration.md lists every
variable. Credentials come only from the environment (or botocore's own chain when no S3 keys are
set) and are `SecretStr`s: never in a repr, a request, a result or a log line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Self

from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_settings import SettingsConfigDict, SettingsError

from configuration.codec_keys import KEYS_ENV, KEYS_FILE_ENV, TOKEN_ENV, KeyRing
from configuration.errors import FILE_VAR, CodecSettingsError, ConfigFileError
from configuration.files import CONFIG_VAR, file_named
from configuration.pools import RUNPOD_API_KEY_ENV, PoolConfig
from configuration.sources import Settings, current_environ, problems
from configuration.tenants import TenantConfig
from configuration.values import (
    DEFAULT_DEPLOYMENT_NAME,
    MIN_LIVE_KEY_CHARS,
    TENANT_PATTERN,
    AllowedInputPrefixes,
    BucketName,
    BudgetDayLength,
    BuildId,
    Concurrency,
    DeploymentName,
    EndpointUrl,
    HeartbeatBudgetRate,
    HeartbeatThrottle,
    LiveProgressUrl,
    LowerCaseItems,
    MetricsHost,
    Port,
    SetCurrent,
    SweepInterval,
    package_build_id,
    webhook_signing_key,
)
from workflows.budgets import DEFAULT_BUDGET_DAY_S
from workflows.errors import StorageConfigError
from workflows.shared import DEFAULT_TASK_QUEUE

SETTINGS_FILE_VAR = FILE_VAR
POOLS_VAR = "DURABLE_COMFY_POOLS"
GROUPS_VAR = "DURABLE_COMFY_GROUPS"
TENANTS_VAR = "DURABLE_COMFY_TENANTS"
BUCKET_VAR = "DURABLE_COMFY_BUCKET"
ALLOWED_INPUT_PREFIXES_VAR = "DURABLE_COMFY_ALLOWED_INPUT_PREFIXES"
API_KEYS_VAR = "DURABLE_COMFY_API_KEYS"
API_KEYS_FILE_VAR = "DURABLE_COMFY_API_KEYS_FILE"
_KEY_PAIR = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
DEFAULT_UI_URL = "http://127.0.0.1:8233"
MiB = 1024 * 1024
GiB = 1024 * MiB


# --- the worker -------------------------------------------------------------------------------

# WorkerSettings' fields the production file's `worker:` section may set (same names).
_WORKER_FILE_FIELDS = (
    "task_queue",
    "default_pool",
    "max_concurrent_activities",
    "max_cached_workflows",
    "orphan_sweep_interval_s",
    "metrics_port",
    "metrics_host",
    "log_level",
    "heartbeat_throttle_s",
    "heartbeat_budget_per_s",
    "budget_day_s",
    "versioning",
    "deployment_name",
    "build_id",
    "set_current",
)


# What DURABLE_COMFY_POOLS and DURABLE_COMFY_TENANTS hold, as their errors say it.
_JSON_SHAPES = {
    "pools": "{name: {kind, url}}",
    "groups": "{group: [pool, ...]}",
    "tenants": "{tenant: {weight, max_priority}}",
}


class WorkerSettings(Settings):
    """What one worker process serves, and how."""

    # The config file holds no secret: a bad value is worth showing.
    config_file: Path | None = Field(None, validation_alias=CONFIG_VAR)
    # The production configuration file (configuration.files); not with `config_file`.
    settings_file: Path | None = Field(None, validation_alias=SETTINGS_FILE_VAR)
    task_queue: str = Field(DEFAULT_TASK_QUEUE, validation_alias="DURABLE_COMFY_TASK_QUEUE")
    default_pool: str = Field("comfyui", validation_alias="DURABLE_COMFY_DEFAULT_POOL")
    # JSON `{name: {kind, url}}` from the variable; replaces the config file's pools.
    pools: dict[str, PoolConfig] = Field(default_factory=dict, validation_alias=POOLS_VAR)
    # JSON `{group: [pool, ...]}`: a request's `pool` may name a group, an ordered list of pools
    # tried in turn (docs/pools.md "Groups"); replaces the config file's groups.
    groups: dict[str, list[str]] = Field(default_factory=dict, validation_alias=GROUPS_VAR)
    # JSON `{tenant: {weight, max_priority, max_pending}}` (configuration/tenants.py): each
    # tenant's share of a bounded pool; a `default` entry is every unnamed tenant's.
    tenants: dict[str, TenantConfig] = Field(default_factory=dict, validation_alias=TENANTS_VAR)
    # How many prompts one worker follows at once: each running job holds a slot for its whole
    # follow, and a job past them waits (`JobStatus.worker_wait`). What a slot costs, measured:
    # docs/configuration.md, "Worker slots".
    max_concurrent_activities: Concurrency = Field(
        1000, validation_alias="DURABLE_COMFY_MAX_CONCURRENT_ACTIVITIES"
    )
    # How many workflows (jobs, and pools' dispatchers) one worker keeps in memory between
    # their workflow tasks; one evicted is replayed from its history at its next task. A job
    # waiting by itself in a bounded pool's queue has no task until its grant (one whose follow
    # waits in line holds an activity slot instead): docs/queue.md, "Memory".
    max_cached_workflows: Concurrency = Field(
        1000, validation_alias="DURABLE_COMFY_MAX_CACHED_WORKFLOWS"
    )
    # How often each worker looks for prompts whose job is over (0: never).
    orphan_sweep_interval_s: SweepInterval = Field(
        60.0, validation_alias="DURABLE_COMFY_ORPHAN_SWEEP_S"
    )
    # Serve Prometheus metrics (Temporal's and ours) on <metrics_host>:<port>/metrics.
    metrics_port: Port | None = Field(None, validation_alias="DURABLE_COMFY_METRICS_PORT")
    # Loopback by default: metrics name pools and task queues. In a container, 0.0.0.0 lets a
    # scraper outside it reach them (the worker image sets it; its port is not published).
    metrics_host: MetricsHost = Field("127.0.0.1", validation_alias="DURABLE_COMFY_METRICS_HOST")
    # Unknown names fall back to INFO (activities.log_setup).
    log_level: str = Field("INFO", validation_alias="DURABLE_COMFY_LOG_LEVEL")
    # The shortest time between two heartbeats of one followed prompt. Clients read a running
    # job's step from the follow activity's heartbeat; below the CLI's 0.5 s poll, so each poll
    # finds a newer step than the last. Each heartbeat is one call to the server (a billed
    # action on Temporal Cloud), so they are also paced by the budget below.
    heartbeat_throttle_s: HeartbeatThrottle = Field(
        0.4, validation_alias="DURABLE_COMFY_HEARTBEAT_THROTTLE_S"
    )
    # Heartbeats per second this worker sends in all, shared by the prompts it follows
    # (activities/heartbeat_budget.py): each prompt's interval is (prompts followed / budget),
    # between `heartbeat_throttle_s` and 1 s; past `budget` prompts each still heartbeats once
    # a second (a visible step every second wins over the budget; logged). A heartbeat is sent
    # only when it carries a new step, stage or output, or as a sign of life.
    heartbeat_budget_per_s: HeartbeatBudgetRate = Field(
        250.0, validation_alias="DURABLE_COMFY_HEARTBEAT_BUDGET"
    )
    # Live progress (activities/live_progress.py): serve a WebSocket on <host>:<port> that
    # pushes each followed prompt's steps, as they happen, to the gateways that subscribe; its
    # address (`url`, by default ws://<host>:<port>/v1/live) goes into every follow heartbeat,
    # and the gateways must hold the same `key`. Unset port: no push, clients poll.
    live_progress_port: Port | None = Field(
        None, validation_alias="DURABLE_COMFY_LIVE_PROGRESS_PORT"
    )
    live_progress_host: MetricsHost = Field(
        "127.0.0.1", validation_alias="DURABLE_COMFY_LIVE_PROGRESS_HOST"
    )
    live_progress_url: LiveProgressUrl | None = Field(
        None, validation_alias="DURABLE_COMFY_LIVE_PROGRESS_URL"
    )
    live_progress_key: SecretStr | None = Field(
        None, validation_alias="DURABLE_COMFY_LIVE_PROGRESS_KEY"
    )
    # The length of tenants' budget days (`gpu_seconds_per_day`, `usd_per_day`), counted from
    # the Unix epoch: 86,400 resets budgets at 00:00 UTC; a test sets a few seconds. Every
    # worker must say the same (the ledger keeps the latest it was told).
    budget_day_s: BudgetDayLength = Field(
        DEFAULT_BUDGET_DAY_S, validation_alias="DURABLE_COMFY_BUDGET_DAY_S"
    )
    # Worker Versioning (docs/upgrading.md): the worker polls as one version of a Worker
    # Deployment, `deployment_name` + `build_id`, and InferenceJob is pinned to the version it
    # started on. Off: an unversioned worker (a server without Worker Deployments).
    versioning: bool = Field(True, validation_alias="DURABLE_COMFY_VERSIONING")
    deployment_name: DeploymentName = Field(
        DEFAULT_DEPLOYMENT_NAME, validation_alias="DURABLE_COMFY_DEPLOYMENT_NAME"
    )
    # None: this package's version. It must change with every release whose workflow code
    # changed, or running jobs replay on code they did not start on.
    build_id: BuildId | None = Field(None, validation_alias="DURABLE_COMFY_BUILD_ID")
    # When the worker makes its version the deployment's current one (new jobs go to the current
    # version). `first`: only while the deployment has none (its very first version); `always`:
    # at every start (the dev stack); `never`: an operator runs `temporal worker deployment
    # set-current-version`.
    set_current: SetCurrent = Field("first", validation_alias="DURABLE_COMFY_SET_CURRENT")

    file_keys: ClassVar[Mapping[str, str]] = {
        **{name: f"worker.{name}" for name in _WORKER_FILE_FIELDS},
        "pools": "pools",
        "groups": "groups",
        "tenants": "tenants",
    }
    reads_stack_file: ClassVar[bool] = True

    @model_validator(mode="after")
    def _groups_of_pools(self) -> Self:
        for group, members in self.groups.items():
            if group in self.pools:
                raise ValueError(f"groups.{group}: a pool has that name; name the group otherwise")
            if not members:
                raise ValueError(f"groups.{group}: name at least one pool")
            if len(set(members)) != len(members):
                raise ValueError(f"groups.{group}: a pool is named twice")
            unknown = [m for m in members if m not in self.pools]
            if unknown:
                known = ", ".join(sorted(self.pools)) or "none"
                raise ValueError(
                    f"groups.{group}: {', '.join(unknown)} not among the pools ({known})"
                )
        return self

    @model_validator(mode="after")
    def _one_file(self) -> Self:
        if self.config_file is not None and self.settings_file is not None:
            raise ValueError(
                f"{CONFIG_VAR} (a dev stack file) and {SETTINGS_FILE_VAR} (a production file) "
                "are both set: a worker reads one file, unset the other"
            )
        return self

    @model_validator(mode="after")
    def _live_progress_complete(self) -> Self:
        if self.live_progress_port is None:
            return self
        key = self.live_progress_key
        if key is None or len(key.get_secret_value()) < MIN_LIVE_KEY_CHARS:
            raise ValueError(
                "DURABLE_COMFY_LIVE_PROGRESS_PORT is set: set DURABLE_COMFY_LIVE_PROGRESS_KEY "
                f"too (at least {MIN_LIVE_KEY_CHARS} characters, the same on the gateways), "
                "or unset the port"
            )
        if self.live_progress_url is None and self.live_progress_host in ("0.0.0.0", "::", "[::]"):
            raise ValueError(
                f"DURABLE_COMFY_LIVE_PROGRESS_HOST={self.live_progress_host} is no address a "
                "gateway can reach: set DURABLE_COMFY_LIVE_PROGRESS_URL to the worker's "
                "(ws://<address>:<port>/v1/live)"
            )
        return self

    @property
    def live_progress_address(self) -> str | None:
        """Where gateways reach this worker's live progress; None when it serves none."""
        if self.live_progress_port is None:
            return None
        if self.live_progress_url is not None:
            return self.live_progress_url
        host = self.live_progress_host
        host = f"[{host.strip('[]')}]" if ":" in host else host
        return f"ws://{host}:{self.live_progress_port}/v1/live"

    @model_validator(mode="after")
    def _build_id_from_the_package(self) -> Self:
        if self.versioning and self.build_id is None:
            # The model is frozen: this default is resolved once, here.
            object.__setattr__(self, "build_id", package_build_id())
        return self

    @field_validator("pools", "groups", "tenants", mode="before")
    @classmethod
    def _mapping_json(cls, value: Any, info: ValidationInfo) -> Any:
        return _json_mapping(value, info)


def _json_mapping(value: Any, info: ValidationInfo) -> Any:
    """A variable's value is JSON; the file's is a mapping already."""
    if isinstance(value, str):
        expected = _JSON_SHAPES[info.field_name or ""]
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON ({exc}); expected {expected}") from None
    return value


def runpod_api_keys(
    pools: Mapping[str, PoolConfig], environ: Mapping[str, str] | None = None
) -> dict[str, SecretStr]:
    """The API key of every runpod pool, read once at worker start-up from the variable its
    `api_key_env` names (default: the environment settings are read from).

    Not a settings class: the variables it reads are named by the pools. A key of only
    whitespace counts as unset (a key is never stripped by the settings classes).

    A `SettingsError` names each pool whose variable is unset or empty, and the variable; never
    a value. Pools may share a variable (one account) or each name their own.
    """
    env = current_environ() if environ is None else environ
    keys: dict[str, SecretStr] = {}
    missing: list[str] = []
    for name, pool in pools.items():
        if pool.kind != "runpod":
            continue
        variable = pool.api_key_env or RUNPOD_API_KEY_ENV
        value = env.get(variable, "").strip()
        if value:
            keys[name] = SecretStr(value)
        else:
            missing.append(f"pool {name!r}: {variable} is not set")
    if missing:
        raise SettingsError(
            "; ".join(missing) + " (set it to the RunPod API key, or point the pool's "
            "api_key_env at the variable that holds it)"
        )
    return keys


# --- artifact storage -------------------------------------------------------------------------


class S3Settings(Settings):
    """Where artifacts go. Credentials are SecretStr: never in repr, str, dumps or logs.

    Without credentials the S3 client gets none, and botocore's default chain applies (a shared
    credentials file or AWS_PROFILE, web identity, an instance role, ...).
    """

    # hide_input_in_errors: a ValidationError must not print a secret (or a URL carrying one).
    model_config = SettingsConfigDict(hide_input_in_errors=True)

    endpoint_url: EndpointUrl | None = Field(None, validation_alias="DURABLE_COMFY_S3_ENDPOINT")
    region: str = Field(
        "us-east-1", validation_alias=AliasChoices("AWS_REGION", "AWS_DEFAULT_REGION")
    )
    bucket: BucketName = Field(validation_alias=BUCKET_VAR)
    access_key_id: SecretStr | None = Field(None, validation_alias=_KEY_PAIR[0])
    secret_access_key: SecretStr | None = Field(None, validation_alias=_KEY_PAIR[1])
    # Beside its tenant's own area (workflows/tenancy.py), the folders a tenant's job may name
    # as `s3://` inputs: shared assets the operator puts there (`s3://assets/masks/`).
    allowed_input_prefixes: AllowedInputPrefixes = Field(
        (), validation_alias=ALLOWED_INPUT_PREFIXES_VAR
    )

    # The key pair is never read from the file (it refuses one).
    file_keys: ClassVar[Mapping[str, str]] = {
        "bucket": "storage.bucket",
        "endpoint_url": "storage.endpoint_url",
        "region": "storage.region",
        "allowed_input_prefixes": "storage.allowed_input_prefixes",
    }

    @model_validator(mode="after")
    def _both_keys_or_neither(self) -> Self:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            key_id, secret = _KEY_PAIR
            missing = key_id if self.access_key_id is None else secret
            raise ValueError(f"{missing} is not set (the other half of the key pair is)")
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **values: Any) -> Self:
        """As `Settings.from_env`, with every problem one `StorageConfigError` naming the
        variable (and never its value)."""
        try:
            return super().from_env(environ, **values)
        except ValidationError as exc:
            raise StorageConfigError(f"invalid S3 settings: {problems(exc)}") from None

    @classmethod
    def from_env_if_configured(cls, environ: Mapping[str, str] | None = None) -> Self | None:
        """None without a bucket, in DURABLE_COMFY_BUCKET or the production file's
        `storage.bucket` (a client that stores nothing); else `from_env`."""
        env = current_environ() if environ is None else environ
        if not env.get(BUCKET_VAR):
            try:
                config = file_named(env)
            except ConfigFileError as exc:
                raise StorageConfigError(f"invalid S3 settings: {exc}") from None
            if config is None or config.storage.bucket is None:
                return None
        return cls.from_env(environ)


# --- webhooks ---------------------------------------------------------------------------------

WEBHOOK_SECRETS_VAR = "DURABLE_COMFY_WEBHOOK_SECRETS"
WEBHOOK_SECRETS_FILE_VAR = "DURABLE_COMFY_WEBHOOK_SECRETS_FILE"
WEBHOOK_ALLOW_HOSTS_VAR = "DURABLE_COMFY_WEBHOOK_ALLOW_HOSTS"


def _tenant_secrets(text: str, separator: str, where: str) -> dict[str, SecretStr]:
    """`tenant:whsec_...` items; each problem names the item's place, never its value."""
    secrets: dict[str, SecretStr] = {}
    for number, item in enumerate(text.split(separator), start=1):
        item = item.strip()
        if not item or item.startswith("#"):
            continue
        tenant, colon, secret = item.partition(":")
        tenant = tenant.strip()
        if not colon or not TENANT_PATTERN.match(tenant):
            raise ValueError(f"{where} item {number}: expected tenant:whsec_<base64>")
        try:
            webhook_signing_key(secret.strip())
        except ValueError as exc:
            raise ValueError(f"{where} item {number} (tenant {tenant}): {exc}") from None
        if tenant in secrets:
            raise ValueError(f"{where} item {number}: tenant {tenant} has a secret already")
        secrets[tenant] = SecretStr(secret.strip())
    return secrets


class WebhookSettings(Settings):
    """The worker's webhook secrets (one per tenant, Standard Webhooks' `whsec_<base64>`) and
    the hosts a webhook may reach without the public-address rule, for development only."""

    # hide_input_in_errors: a ValidationError must not print a secret.
    model_config = SettingsConfigDict(hide_input_in_errors=True)

    secrets: dict[str, SecretStr] = Field(
        default_factory=dict, validation_alias=WEBHOOK_SECRETS_VAR
    )
    # One `tenant:whsec_...` per line, `#` comments; not with the variable.
    secrets_file: Path | None = Field(None, validation_alias=WEBHOOK_SECRETS_FILE_VAR)
    # Hosts (as the URL names them: `127.0.0.1`, `localhost`) a webhook may reach over http and
    # at a private address: a test's or a developer's receiver. Never in production.
    allow_hosts: Annotated[tuple[str, ...], LowerCaseItems] = Field(
        (), validation_alias=WEBHOOK_ALLOW_HOSTS_VAR
    )

    @field_validator("secrets", mode="before")
    @classmethod
    def _comma_separated_secrets(cls, value: Any) -> Any:
        if isinstance(value, str):
            return _tenant_secrets(value, ",", WEBHOOK_SECRETS_VAR)
        return value

    @model_validator(mode="after")
    def _secrets_from_the_file(self) -> Self:
        if self.secrets_file is None:
            return self
        if self.secrets:
            raise ValueError(
                f"{WEBHOOK_SECRETS_VAR} and {WEBHOOK_SECRETS_FILE_VAR} are both set: use one"
            )
        try:
            text = self.secrets_file.read_text()
        except OSError as exc:
            raise ValueError(f"{WEBHOOK_SECRETS_FILE_VAR}: {exc.strerror}") from None
        # The model is frozen: the file's secrets are read once, here.
        object.__setattr__(self, "secrets", _tenant_secrets(text, "\n", str(self.secrets_file)))
        return self

    def signing_key(self, tenant: str) -> bytes | None:
        secret = self.secrets.get(tenant)
        return webhook_signing_key(secret.get_secret_value()) if secret is not None else None


# --- URL inputs -------------------------------------------------------------------------------


class UrlFetchSettings(Settings):
    """Limits for URL inputs, read from the worker's environment."""

    # A cap of its own; the caller's limit (what its backend accepts) applies too.
    max_bytes: int = Field(
        100 * 1024 * 1024, gt=0, validation_alias="DURABLE_COMFY_URL_INPUT_MAX_BYTES"
    )
    # Comma-separated media types; `type/*` matches a whole family.
    content_types: Annotated[tuple[str, ...], LowerCaseItems] = Field(
        ("image/*", "video/*", "audio/*", "application/octet-stream"),
        validation_alias="DURABLE_COMFY_URL_INPUT_CONTENT_TYPES",
    )
    ports: Annotated[tuple[int, ...], LowerCaseItems] = Field(
        (443,), validation_alias="DURABLE_COMFY_URL_INPUT_PORTS"
    )
    max_redirects: int = Field(5, ge=0, le=20, validation_alias="DURABLE_COMFY_URL_INPUT_REDIRECTS")
    # The whole fetch, redirects included; prepare's own timeout is 2 minutes for all inputs.
    timeout_s: float = Field(60.0, gt=0, validation_alias="DURABLE_COMFY_URL_INPUT_TIMEOUT_S")

    @field_validator("content_types")
    @classmethod
    def _media_types(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for item in value:
            kind, sep, sub = item.partition("/")
            if not sep or not kind or not sub or kind == "*":
                raise ValueError(f"{item!r} is not a media type (e.g. image/png or image/*)")
        return value


# --- the client and the CLI -------------------------------------------------------------------


class ClientSettings(Settings):
    """The client's own variables. Empty counts as unset; read only under these names."""

    task_queue: str = Field(DEFAULT_TASK_QUEUE, validation_alias="DURABLE_COMFY_TASK_QUEUE")
    # The workers' default pool: a request that names no pool is checked against its queue's
    # room (`max_pending`) at submission. None: such a request is not checked here.
    default_pool: str | None = Field(None, validation_alias="DURABLE_COMFY_DEFAULT_POOL")
    # How long a status query waits for a worker to answer.
    query_timeout_s: float = Field(10.0, gt=0, validation_alias="DURABLE_COMFY_QUERY_TIMEOUT_S")
    # The workers' live-progress key: with it, `watch` also takes the steps the worker following
    # a job pushes (docs/configuration.md, "Live progress"); without it, it polls.
    live_progress_key: SecretStr | None = Field(
        None, validation_alias="DURABLE_COMFY_LIVE_PROGRESS_KEY"
    )

    # The queue the workers serve is the one the client starts jobs on. (A subclass's own
    # fields, such as the CLI's log level, are not read from the file.)
    file_keys: ClassVar[Mapping[str, str]] = {
        "task_queue": "worker.task_queue",
        "default_pool": "worker.default_pool",
        "query_timeout_s": "client.query_timeout_s",
    }


class CliSettings(ClientSettings):
    """The library's variables, and the CLI's own. Empty counts as unset."""

    # Quiet unless something is off; unknown names fall back to INFO (activities.log_setup).
    log_level: str = Field("WARNING", validation_alias="DURABLE_COMFY_LOG_LEVEL")


class TemporalTarget(Settings):
    """`TemporalSettings`' address and namespace without its check of the codec's keys, for
    when only those are wrong: the encryption check reports them."""

    address: str | None = Field(None, validation_alias="TEMPORAL_ADDRESS")
    namespace: str | None = Field(None, validation_alias="TEMPORAL_NAMESPACE")


class TemporalSettings(TemporalTarget):
    """TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE and TEMPORAL_UI_URL, read once at start-up.

    Unset (or empty), the address and namespace are None: the profile's, else the SDK's defaults.
    Fields are read only from their variables (case-sensitive) and set in code by those names.
    """

    ui_url: str = Field(DEFAULT_UI_URL, validation_alias="TEMPORAL_UI_URL")

    @model_validator(mode="after")
    def _codec_keys_usable(self) -> Self:
        """The payload codec's keys are read by `connect_temporal`; checked here as well so a
        bad one is a settings error at start-up. The error text never holds key material."""
        try:
            CodecSettings.from_environ().key_ring()
        except CodecSettingsError as exc:
            raise ValueError(str(exc)) from None
        return self

    def ui_namespace(self) -> str:
        """The namespace the UI's links name (Temporal's default unless TEMPORAL_NAMESPACE)."""
        return self.namespace or "default"


# --- payload encryption -----------------------------------------------------------------------


class CodecSettings(Settings):
    """DURABLE_COMFY_CODEC_KEYS or DURABLE_COMFY_CODEC_KEYS_FILE; neither: no encryption."""

    keys: SecretStr | None = Field(None, validation_alias=KEYS_ENV)
    keys_file: Path | None = Field(None, validation_alias=KEYS_FILE_ENV)

    # The production file may name the key file (never hold a key): one setting with the two
    # variables, so either of them replaces it rather than clashing with it.
    file_keys: ClassVar[Mapping[str, str]] = {"keys_file": "codec.keys_file"}
    file_keys_exclusive: ClassVar[bool] = True

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> CodecSettings:
        """From `environ` alone when given (as `connect_temporal` takes it), else the process's.

        A production file that cannot be used is a `CodecSettingsError` naming it."""
        try:
            return cls.from_env(environ)
        except ValidationError as exc:
            cause = exc.__cause__
            if environ is not None and isinstance(cause, ConfigFileError):
                # Said as the file's own error, as a caller handing its own environment has
                # always been told.
                raise CodecSettingsError(str(cause)) from None
            raise CodecSettingsError(
                "; ".join(
                    f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"
                    for error in exc.errors()
                )
            ) from None

    def key_ring(self) -> KeyRing | None:
        """The ring, or None when no key is configured; `CodecSettingsError` if unusable."""
        if self.keys is not None and self.keys_file is not None:
            raise CodecSettingsError(f"set {KEYS_ENV} or {KEYS_FILE_ENV}, not both")
        if self.keys is not None:
            return KeyRing.parse(self.keys.get_secret_value(), KEYS_ENV)
        if self.keys_file is None:
            return None
        try:
            text = self.keys_file.read_text()
        except OSError as exc:
            raise CodecSettingsError(
                f"{KEYS_FILE_ENV}: cannot read {self.keys_file}: {exc.strerror}"
            ) from None
        return KeyRing.parse(text, f"{KEYS_FILE_ENV} ({self.keys_file})")


class CodecServerSettings(Settings):
    """`durable-comfy codec-server`'s own variables: its log level and its bearer token."""

    log_level: str = Field("INFO", validation_alias="DURABLE_COMFY_LOG_LEVEL")
    auth_token: SecretStr | None = Field(None, validation_alias=TOKEN_ENV)

    @classmethod
    def load(cls, token_env: str | None = None) -> CodecServerSettings:
        """With `token_env`, the token is read from that variable instead of TOKEN_ENV."""
        if token_env is None:
            return cls()
        named = create_model(
            "CodecServerSettings",
            __base__=cls,
            auth_token=(SecretStr | None, Field(None, validation_alias=token_env)),
        )
        return named()


# --- the gateway ------------------------------------------------------------------------------


class AuthSettings(Settings):
    api_keys: SecretStr | None = Field(None, validation_alias=API_KEYS_VAR)
    api_keys_file: Path | None = Field(None, validation_alias=API_KEYS_FILE_VAR)


class LimitSettings(Settings):
    tenant_rps: float = Field(
        20.0, gt=0, allow_inf_nan=False, validation_alias="DURABLE_COMFY_TENANT_RPS"
    )
    tenant_burst: int = Field(40, ge=1, validation_alias="DURABLE_COMFY_TENANT_BURST")
    tenant_max_jobs: int = Field(2000, ge=1, validation_alias="DURABLE_COMFY_TENANT_MAX_JOBS")
    gateway_max_requests: int = Field(
        256, ge=1, validation_alias="DURABLE_COMFY_GATEWAY_MAX_REQUESTS"
    )
    gateway_max_streams: int = Field(
        10_000, ge=1, validation_alias="DURABLE_COMFY_GATEWAY_MAX_STREAMS"
    )


class GatewaySettings(AuthSettings, LimitSettings):
    """Every gateway variable. Empty counts as unset; read only under these names."""

    # A job request is at most Temporal's 2 MiB payload; JSON framing and a graph pasted with
    # indentation fit in twice that. Larger bodies are refused before they are read.
    max_body_bytes: int = Field(
        4 * MiB, ge=1024, validation_alias="DURABLE_COMFY_GATEWAY_MAX_BODY_BYTES"
    )
    # A comment line on an idle event stream, so proxies (nginx: 60 s) keep it open.
    heartbeat_s: float = Field(15.0, gt=0, validation_alias="DURABLE_COMFY_GATEWAY_HEARTBEAT_S")
    # A GET counts as client contact at most this often per job (each contact is a signal, a
    # history event); never less often than a quarter of the job's abandonment horizon.
    client_seen_interval_s: float = Field(
        5.0, gt=0, validation_alias="DURABLE_COMFY_GATEWAY_CLIENT_SEEN_S"
    )
    # How long a job's follower outlives its last subscriber: a client reconnecting within it
    # finds the follower still there. Past it an attached job hears from nobody, as it should.
    follower_grace_s: float = Field(
        10.0, ge=0, validation_alias="DURABLE_COMFY_GATEWAY_FOLLOWER_GRACE_S"
    )
    # How often a follower polls its job (JobClient.watch's poll interval).
    poll_interval_s: float = Field(0.5, gt=0, validation_alias="DURABLE_COMFY_GATEWAY_POLL_S")
    # Events a subscriber may have waiting; one that falls further behind is dropped (its stream
    # ends and it reconnects with Last-Event-ID), never the follower held up.
    subscriber_queue: int = Field(
        1000, ge=10, validation_alias="DURABLE_COMFY_GATEWAY_SUBSCRIBER_QUEUE"
    )
    # The path the gateway is served under behind a proxy (`/comfy`): the links it gives.
    base_path: str = Field(
        "", pattern=r"^(/[A-Za-z0-9._~-]+)*$", validation_alias="DURABLE_COMFY_GATEWAY_BASE_PATH"
    )
    # How long a WebSocket client that sent no Authorization header has to send its key.
    ws_auth_timeout_s: float = Field(
        10.0, gt=0, validation_alias="DURABLE_COMFY_GATEWAY_WS_AUTH_TIMEOUT_S"
    )
    # How long /readyz waits for Temporal's answer.
    ready_timeout_s: float = Field(
        2.0, gt=0, validation_alias="DURABLE_COMFY_GATEWAY_READY_TIMEOUT_S"
    )
    # The largest file `POST /v1/uploads` presigns a PUT for: ComfyUI's own upload limit
    # (--max-upload-size), which is also what a worker reads of one input. One PUT carries at
    # most 5 GiB (S3's limit without multipart).
    upload_max_bytes: int = Field(
        100 * MiB, ge=1, le=5 * GiB, validation_alias="DURABLE_COMFY_GATEWAY_UPLOAD_MAX_BYTES"
    )
    # How long an upload's presigned PUT works: long enough for a slow link to send the largest
    # file, short enough that a leaked URL soon stops working (it can only ever store that file).
    upload_ttl_s: int = Field(
        900, ge=1, le=7 * 24 * 3600, validation_alias="DURABLE_COMFY_GATEWAY_UPLOAD_TTL_S"
    )
    log_level: str = Field("INFO", validation_alias="DURABLE_COMFY_LOG_LEVEL")
    # The workers' tenants (the same variable): a job asking for a better priority than its
    # tenant's `max_priority` is refused here, 403, before it is started (the worker refuses it
    # too, as it must for a client that does not come through the gateway). Unset: the workers
    # alone check it.
    tenants: dict[str, TenantConfig] = Field(default_factory=dict, validation_alias=TENANTS_VAR)
    # The worker's development allow-list of webhook hosts (WebhookSettings.allow_hosts): the
    # gateway must refuse no URL the worker would take.
    webhook_allow_hosts: Annotated[tuple[str, ...], LowerCaseItems] = Field(
        (), validation_alias=WEBHOOK_ALLOW_HOSTS_VAR
    )
    # The production file's `tenants:` section too (DURABLE_COMFY_SETTINGS_FILE), as the
    # workers read it, below the variable: one place for a tenant's terms.
    file_keys: ClassVar[Mapping[str, str]] = {"tenants": "tenants"}

    @field_validator("tenants", mode="before")
    @classmethod
    def _tenants_json(cls, value: Any, info: ValidationInfo) -> Any:
        return _json_mapping(value, info)
