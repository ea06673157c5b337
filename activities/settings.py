"""The worker's settings: which pools it serves and where artifacts go.

Both are `pydantic-settings` classes read from the environment once, at start-up (worker.py
builds them and passes them down; nothing else reads these variables):

    WorkerSettings  DURABLE_COMFY_CONFIG, DURABLE_COMFY_SETTINGS_FILE, DURABLE_COMFY_POOLS,
                    DURABLE_COMFY_TASK_QUEUE,
                    DURABLE_COMFY_DEFAULT_POOL, DURABLE_COMFY_ORPHAN_SWEEP_S,
                    DURABLE_COMFY_METRICS_PORT, DURABLE_COMFY_METRICS_HOST,
                    DURABLE_COMFY_LOG_LEVEL,
                    DURABLE_COMFY_HEARTBEAT_THROTTLE_S, DURABLE_COMFY_VERSIONING,
                    DURABLE_COMFY_DEPLOYMENT_NAME, DURABLE_COMFY_BUILD_ID,
                    DURABLE_COMFY_SET_CURRENT
    S3Settings      DURABLE_COMFY_BUCKET, DURABLE_COMFY_S3_ENDPOINT, AWS_ACCESS_KEY_ID,
                    AWS_SECRET_ACCESS_KEY, AWS_REGION (else AWS_DEFAULT_REGION),
                    DURABLE_COMFY_ALLOWED_INPUT_PREFIXES
    WebhookSettings DURABLE_COMFY_WEBHOOK_SECRETS, DURABLE_COMFY_WEBHOOK_SECRETS_FILE,
                    DURABLE_COMFY_WEBHOOK_ALLOW_HOSTS

and `runpod_api_keys` reads each runpod pool's API key, at start-up too, from the variable the
pool's `api_key_env` names (default RUNPOD_API_KEY).

Precedence, highest first: values passed in code (`worker --metrics-port`, `--build-id`, ...),
the variables, a file, the defaults. The file is either the production file
DURABLE_COMFY_SETTINGS_FILE names (activities.config_file: worker, pools and storage settings,
never a credential) or, on the dev stack, the `worker:` section of the stack file
DURABLE_COMFY_CONFIG names (temporal-dev.yaml); never both.
A field takes its value from one place only: DURABLE_COMFY_POOLS replaces the file's pools, it is
not merged with them. An empty variable counts as unset. A bad value is a pydantic
`ValidationError` whose location is the variable's name.

Credentials come only from the environment (or botocore's own chain when no keys are set) and are
`SecretStr`s: never in a repr, a request, a result or a log line.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from activities.runpod.models import (
    ENDPOINT_ID_PATTERN,
    MAX_POLICY_S,
    MIN_EXECUTION_TIMEOUT_S,
)
from activities.storage_errors import StorageConfigError
from workflows.shared import DEFAULT_TASK_QUEUE
from workflows.tenancy import normalised_allowed_prefix

CONFIG_VAR = "DURABLE_COMFY_CONFIG"
SETTINGS_FILE_VAR = "DURABLE_COMFY_SETTINGS_FILE"  # activities.config_file.FILE_VAR
POOLS_VAR = "DURABLE_COMFY_POOLS"
BUCKET_VAR = "DURABLE_COMFY_BUCKET"
ALLOWED_INPUT_PREFIXES_VAR = "DURABLE_COMFY_ALLOWED_INPUT_PREFIXES"

_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_KEY_PAIR = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


RUNPOD_API_URL = "https://api.runpod.ai/v2"
RUNPOD_API_KEY_ENV = "RUNPOD_API_KEY"
_VARIABLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# What a hidden value becomes (see `PoolConfig._hide_secrets`).
_HIDDEN = "<hidden>"
_RUNPOD_ONLY = (
    "endpoint_id",
    "api_key_env",
    "claims",
    "usd_per_second",
    "execution_timeout_s",
    "idle_timeout_s",
    "claim_lease_s",
    "fence_after_s",
    "status_poll_s",
    "report_interval_s",
    "node_registry",
)


class PoolConfig(BaseModel):
    """A named backend the worker may run jobs on. Requests name pools, never URLs.

    `comfyui`: `url` is the ComfyUI server.
    `runpod`: a serverless endpoint. `endpoint_id` (required) on the API at `url` (default
    RunPod's); its key is read once at start-up from the variable `api_key_env` names (default
    RUNPOD_API_KEY, see `runpod_api_keys`), never from a config file. `claims`: the endpoint runs
    our handler, which claims each submission, so resubmitting after a lost `/run` answer is safe;
    false for stock worker-comfyui endpoints (a person decides instead). `usd_per_second`: the
    endpoint's price, for the job's cost estimate. `execution_timeout_s`: sent as RunPod's
    `executionTimeout` instead of the job's own. `idle_timeout_s`: the endpoint's idle timeout,
    what a worker keeps billing after its last job (RunPod's default 5 s when unset).
    `claim_lease_s`: how long our handler's claim holds without renewal (default 60): how long a
    crashed worker's submission waits before another delivery may take it over.
    `fence_after_s`: how long past a lapsed lease its holder is certainly fenced (default 30:
    its handler stops the prompt before the lease ends, and its worker's watchdog stops it and
    takes the worker down by then when the handler is frozen); nobody runs the submission again
    before (docs/architecture.md, *Fencing*). Sent to the handler with every submission.
    `status_poll_s`: how often the follow of one job reads its `/status` while RunPod runs it
    (default 0.8, start to start; twice that while it is queued), and `report_interval_s`: how
    often our handler sends the platform a progress update while the steps move (default 0.25,
    sent with every submission): together, a running job's step reaches clients at least once
    a second. Each follow reads `/status` itself, so a pool's calls are about
    `running / status_poll_s` a second, against RunPod's 200 a second per endpoint.
    `node_registry`: what a runpod pool checks each graph against before any RunPod job exists
    (a class that is not installed, a required input missing, a link to an output a node does
    not have: `InvalidGraph`, naming node and class, teardown SKIPPED), as a comfyui pool checks
    its server's `/object_info`. `published` (the default): the `/object_info` our handler's
    workers publish in the orchestrator's bucket (`s3://{DURABLE_COMFY_BUCKET}/_durable_comfy/
    endpoints/{endpoint_id}/object_info.json`): once per worker process, at start when the
    endpoint sets DURABLE_COMFY_BUCKET, else on its first job (every durable submission names
    where). A worker re-reads it after a minute, or at once when a graph names a class it lacks,
    so a new image's registry is picked up as soon as one of its workers has published it. Until
    one has (a new endpoint, or one whose workers never got a bucket), the check is skipped with
    a log line (`node_registry_unknown`) and the job goes on: ComfyUI's own validation on the
    worker refuses a bad graph there (`PromptRejected`), after RunPod has started, and billed,
    a job for it. A path: a JSON file holding a captured `/object_info` (`curl
    http://<comfyui>/object_info > nodes.json`, from the same image; absolute, or relative to
    the worker's working directory), what a stock worker-comfyui endpoint needs, since it
    publishes nothing; read at start-up and again after a minute. `off`: no check here.
    `allowed_node_classes` (any kind): when set, the only node classes a graph may use on this
    pool; the prepare activity refuses any other class (`InvalidGraph`, naming the node) before
    anything reaches the backend. Unset: any class the backend has.
    `loader_inputs` (any kind): `{class: [input, ...]}`, the inputs of the pool's custom nodes
    that name a file of ComfyUI's input, output or temp folder, beside ComfyUI's core loaders
    (`workflows.graph.CORE_FILE_INPUTS`) and the inputs its registry marks (an upload widget,
    `image_folder`, `remote`): each must name one of the job's own input files
    (workflows/graph.py `check_input_files`). `unclassified_inputs` (any kind): what to do with
    a graph whose file inputs cannot all be told because no node registry describes its
    classes (a runpod pool before its workers publish one, or `node_registry: off`): `allow`
    (unset: the default; the rules for every value still hold: no `[output]`/`[temp]`
    annotation, no name of another job's files) or `refuse` (`InvalidGraph`: no graph without a
    registry, nor a node whose class neither it, the core loaders nor `loader_inputs` name:
    for a pool shared by tenants).

    After validation a runpod pool has `url`, `api_key_env` and `claims` set; a comfyui pool has
    none of the runpod fields (so its dump is what it always was).
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["comfyui", "runpod"] = "comfyui"
    url: str | None = None
    endpoint_id: str | None = None
    api_key_env: str | None = None
    claims: bool | None = None
    usd_per_second: float | None = Field(None, ge=0)
    execution_timeout_s: float | None = Field(None, ge=MIN_EXECUTION_TIMEOUT_S, le=MAX_POLICY_S)
    idle_timeout_s: float | None = Field(None, ge=0)
    claim_lease_s: float | None = Field(None, ge=5, le=3600)
    fence_after_s: float | None = Field(None, ge=1, le=3600)
    status_poll_s: float | None = Field(None, ge=0.2, le=60)
    report_interval_s: float | None = Field(None, ge=0.05, le=60)
    # None means `published` (kept unset so a pool's dump is what it was given).
    node_registry: Literal["published", "off"] | Path | None = None
    allowed_node_classes: list[str] | None = None
    # None rather than empty: a pool's dump stays what it was given.
    loader_inputs: dict[str, list[str]] | None = None
    unclassified_inputs: Literal["allow", "refuse"] | None = None

    @field_validator("allowed_node_classes")
    @classmethod
    def _class_names(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not all(name.strip() for name in value):
            raise ValueError("node class names must be non-empty (e.g. [KSampler, SaveImage])")
        return value

    @field_validator("loader_inputs")
    @classmethod
    def _loader_inputs(cls, value: dict[str, list[str]] | None) -> dict[str, list[str]] | None:
        if value is None:
            return value
        for class_type, names in value.items():
            if not class_type.strip() or not names or not all(n.strip() for n in names):
                raise ValueError(
                    "loader_inputs is {class: [input, ...]}, each class and input named "
                    "(e.g. {VHS_LoadVideo: [video]})"
                )
        return value

    @model_validator(mode="before")
    @classmethod
    def _hide_secrets(cls, data: Any) -> Any:
        # A key pasted where its variable's name belongs, or a URL with credentials, would be
        # echoed by every later validation error (they print the pool's input): take them out
        # before anything else, and let the validators below say what is wrong.
        if not isinstance(data, dict):
            return data
        name, url = data.get("api_key_env"), data.get("url")
        if isinstance(name, str) and (name.startswith("rpa_") or not _VARIABLE_NAME.match(name)):
            data = {**data, "api_key_env": _HIDDEN}
        # (A comfyui pool's URL is left as it always was.)
        if data.get("kind") == "runpod" and isinstance(url, str) and _has_credentials(url):
            data = {**data, "url": _HIDDEN}
        return data

    @field_validator("api_key_env")
    @classmethod
    def _variable_name(cls, value: str | None) -> str | None:
        if value is not None and not _VARIABLE_NAME.match(value):
            raise ValueError(
                "must be the NAME of the environment variable that holds the API key "
                f"(e.g. {RUNPOD_API_KEY_ENV}), never the key itself"
            )
        return value

    @field_validator("endpoint_id")
    @classmethod
    def _endpoint_id(cls, value: str | None) -> str | None:
        if value is not None and not ENDPOINT_ID_PATTERN.match(value):
            raise ValueError("not a RunPod endpoint id (letters, digits, '-' and '_' only)")
        return value

    @model_validator(mode="after")
    def _fields_of_its_kind(self) -> Self:
        if self.kind != "runpod":
            misplaced = [name for name in _RUNPOD_ONLY if getattr(self, name) is not None]
            if misplaced:
                raise ValueError(f"{', '.join(misplaced)}: only for pools of kind 'runpod'")
            return self
        if not self.endpoint_id:
            raise ValueError(
                "a runpod pool needs endpoint_id (the id in the endpoint's URL, "
                "https://api.runpod.ai/v2/<endpoint_id>/run)"
            )
        self.url = _api_url(self.url or RUNPOD_API_URL)
        self.api_key_env = self.api_key_env or RUNPOD_API_KEY_ENV
        if self.claims is None:
            self.claims = True
        return self


def _has_credentials(url: str) -> bool:
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    return bool(parts.username or parts.password)


def _api_url(value: str) -> str:
    if value == _HIDDEN:
        raise ValueError("url must not carry credentials: the key comes from api_key_env")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must be an http(s) URL (RunPod's API base, e.g. {RUNPOD_API_URL})")
    return value.rstrip("/")


def runpod_api_keys(
    pools: Mapping[str, PoolConfig], environ: Mapping[str, str] | None = None
) -> dict[str, SecretStr]:
    """The API key of every runpod pool, read once at worker start-up from the variable its
    `api_key_env` names (default: the process's environment).

    A `SettingsError` names each pool whose variable is unset or empty, and the variable; never
    a value. Pools may share a variable (one account) or each name their own.
    """
    env = os.environ if environ is None else environ
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


DEFAULT_DEPLOYMENT_NAME = "durable-comfy"
PACKAGE = "durable-comfy"
# A version's canonical name is `deployment.build_id`, split at the first dot: a dot in the
# deployment's name would move part of it into the build ID.
DeploymentName = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[^.\s]+$")]
BuildId = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^\S+$")]
SetCurrent = Literal["first", "always", "never"]
# Constraints shared by the settings classes and the production file's model
# (activities.config_file), so a value is checked the same way wherever it comes from.
Port = Annotated[int, Field(ge=1, le=65535)]
# An IP address to bind (not a host name: the SDK's Prometheus server binds "ip:port").
MetricsHost = Annotated[str, Field(pattern=r"^(\d{1,3}(\.\d{1,3}){3}|\[?[0-9a-fA-F:]+\]?)$")]
# A gateway connects to it with the key: ws:// on a private network, wss:// across one.
LiveProgressUrl = Annotated[str, Field(pattern=r"^wss?://[^\s/?#]+(/[^\s?#]*)?$", max_length=500)]
# The live-progress key is a shared secret between workers and gateways.
MIN_LIVE_KEY_CHARS = 16
Concurrency = Annotated[int, Field(ge=1)]
SweepInterval = Annotated[float, Field(ge=0)]
HeartbeatThrottle = Annotated[float, Field(gt=0, le=60)]
HeartbeatBudgetRate = Annotated[float, Field(gt=0, le=100_000)]


def _bucket_name(value: str) -> str:
    if not _BUCKET_NAME.match(value) or ".." in value:
        raise ValueError("not a valid S3 bucket name")
    return value


def _endpoint_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("endpoint must be an http(s) URL")
    if parts.username or parts.password:
        # Credentials in a URL end up in logs and error messages.
        raise ValueError("endpoint must not carry credentials")
    return value.rstrip("/")


def _allowed_prefixes(value: Any) -> Any:
    """A variable's comma-separated entries, or the file's list, each a folder
    (`workflows.tenancy.normalised_allowed_prefix`)."""
    if isinstance(value, str):
        value = [entry.strip() for entry in value.split(",") if entry.strip()]
    if not isinstance(value, list | tuple):
        return value
    return tuple(
        normalised_allowed_prefix(entry) if isinstance(entry, str) else entry for entry in value
    )


BucketName = Annotated[str, AfterValidator(_bucket_name)]
EndpointUrl = Annotated[str, AfterValidator(_endpoint_url)]
# Folders any tenant's job may read `s3://` inputs from, beside its own area.
AllowedInputPrefixes = Annotated[tuple[str, ...], BeforeValidator(_allowed_prefixes)]


def package_build_id() -> str:
    """The installed durable-comfy package's version: the default build ID."""
    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        raise ValueError(
            f"the {PACKAGE} package is not installed, so it has no version to be the build ID: "
            "set DURABLE_COMFY_BUILD_ID (or `worker --build-id`)"
        ) from None


class WorkerSection(BaseModel):
    """The `worker:` section of a stack file (temporal-dev.yaml): what this worker serves."""

    model_config = ConfigDict(extra="forbid")

    task_queue: str = DEFAULT_TASK_QUEUE
    default_pool: str = "comfyui"
    pools: dict[str, PoolConfig] = Field(default_factory=dict)
    # Worker Versioning (see WorkerSettings). None: not in the file (the variable or the default
    # decides); a dumped stack file keeps them None.
    versioning: bool | None = None
    deployment_name: DeploymentName | None = None
    build_id: BuildId | None = None
    set_current: SetCurrent | None = None


def read_worker_section(path: Path) -> WorkerSection:
    """Only the worker's own section: the rest of the file describes the local stack."""
    data: Any = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    if "pools" in data or "storage" in data:
        # A production file (activities.config_file) here would have its pools ignored.
        raise ValueError(
            f"{path}: top-level pools/storage: this looks like a production configuration file; "
            "name it with DURABLE_COMFY_SETTINGS_FILE (DURABLE_COMFY_CONFIG names a dev stack file)"
        )
    return WorkerSection.model_validate(data.get("worker") or {})


# --- reading the environment ------------------------------------------------------------------

# The environment `EnvSettings.from_env` was given; None: the process's own.
_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("durable_comfy_environ", default=None)


def current_environ() -> Mapping[str, str]:
    """The environment settings are being read from: `from_env`'s mapping, else the process's
    (the one place besides the variables' own sources that reads it)."""
    environ = _ENVIRON.get()
    return os.environ if environ is None else environ


def variable_names(field: FieldInfo) -> list[str]:
    """The variables a field is read from, in order: its validation alias(es)."""
    alias = field.validation_alias
    if isinstance(alias, str):
        return [alias]
    if isinstance(alias, AliasChoices):
        return [choice for choice in alias.choices if isinstance(choice, str)]
    return []


def taken(state: Mapping[str, Any], name: str, field: FieldInfo) -> bool:
    """Whether a higher source already gave this field (under its name or a variable's)."""
    return name in state or any(var in state for var in variable_names(field))


class _Variables(PydanticBaseSettingsSource):
    """The variables a settings class names (its fields' aliases), and nothing else.

    Values stay strings for pydantic to parse, keyed by the variable's name, so an error names
    the variable. A field a higher source (code) already set is left alone: sources never merge.
    """

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        super().__init__(settings_cls)
        self._environ = environ

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        for name in variable_names(field):
            value = self._environ.get(name)
            if value:  # an empty variable counts as unset
                return value, name, False
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for name, field in self.settings_cls.model_fields.items():
            if taken(self.current_state, name, field):
                continue
            value, key, _ = self.get_field_value(field, name)
            if value is not None:
                values[key] = value
        return values


class EnvSettings(BaseSettings):
    """Settings read from the variables their fields' aliases name, and from code by field name.

    `Cls()` reads the process's environment; `Cls.from_env(mapping)` reads that mapping instead
    (the local stack's `worker_env()`, a test's dict).
    """

    model_config = SettingsConfigDict(
        extra="forbid",
        frozen=True,
        validate_by_name=True,
        validate_by_alias=True,
        case_sensitive=True,
    )
    # Field -> dotted key in the production file (activities.config_file); none: not read.
    file_keys: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **values: Any) -> Self:
        """Build from `environ` (default: the process's environment); `values` win over it."""
        token = _ENVIRON.set(environ)
        try:
            return cls(**values)
        finally:
            _ENVIRON.reset(token)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Imported here: activities.config_file builds its model from this module's types.
        from activities.config_file import ConfigFileSource

        file_keys = cls.file_keys
        return (
            init_settings,
            _Variables(settings_cls, current_environ()),
            ConfigFileSource(settings_cls, file_keys, exclusive=False),
        )


@contextmanager
def _reading(what: str) -> Iterator[None]:
    try:
        yield
    except (OSError, ValueError, yaml.YAMLError) as exc:  # ValidationError is a ValueError
        raise SettingsError(f"{what}: {exc}") from exc


class _StackFileWorkerSection(PydanticBaseSettingsSource):
    """The `worker:` section of the file DURABLE_COMFY_CONFIG names, below the variables."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # everything happens in __call__

    def __call__(self) -> dict[str, Any]:
        state = self.current_state
        path = state.get(CONFIG_VAR) or state.get("config_file")
        if not path:
            return {}
        with _reading(f"{CONFIG_VAR}={path}"):
            section = read_worker_section(Path(path))
        fields = self.settings_cls.model_fields
        return {
            name: getattr(section, name)
            for name in WorkerSection.model_fields
            if not taken(state, name, fields[name]) and getattr(section, name) is not None
        }


# --- the worker -------------------------------------------------------------------------------

# WorkerSettings' fields the production file's `worker:` section may set (same names).
_WORKER_FILE_FIELDS = (
    "task_queue",
    "default_pool",
    "max_concurrent_activities",
    "orphan_sweep_interval_s",
    "metrics_port",
    "metrics_host",
    "log_level",
    "heartbeat_throttle_s",
    "heartbeat_budget_per_s",
    "versioning",
    "deployment_name",
    "build_id",
    "set_current",
)


class WorkerSettings(EnvSettings):
    """What one worker process serves, and how."""

    # The config file holds no secret: a bad value is worth showing.
    config_file: Path | None = Field(None, validation_alias=CONFIG_VAR)
    # The production configuration file (activities.config_file); not with `config_file`.
    settings_file: Path | None = Field(None, validation_alias=SETTINGS_FILE_VAR)
    task_queue: str = Field(DEFAULT_TASK_QUEUE, validation_alias="DURABLE_COMFY_TASK_QUEUE")
    default_pool: str = Field("comfyui", validation_alias="DURABLE_COMFY_DEFAULT_POOL")
    # JSON `{name: {kind, url}}` from the variable; replaces the config file's pools.
    pools: dict[str, PoolConfig] = Field(default_factory=dict, validation_alias=POOLS_VAR)
    # Each running job holds one activity slot for its whole follow: this is how many prompts
    # one worker process follows at once. What a slot costs: about 0.1 MB of RSS per followed
    # job (`make bench` group 4, at 1,000 jobs), one open socket (a file descriptor) per
    # followed ComfyUI prompt, and its share of the heartbeat budget below. Not CPU: a worker
    # is one Python thread, which `make bench` saturates at about 8 short jobs a second on 2
    # cores. A job past the slots waits (`JobStatus.worker_wait`); more jobs: more workers.
    max_concurrent_activities: Concurrency = Field(
        1000, validation_alias="DURABLE_COMFY_MAX_CONCURRENT_ACTIVITIES"
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
    }

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

    @field_validator("pools", mode="before")
    @classmethod
    def _pools_json(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not JSON ({exc}); expected {{name: {{kind, url}}}}") from None
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        above = super().settings_customise_sources(
            settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
        )
        init, variables, production_file = above
        return (init, variables, _StackFileWorkerSection(settings_cls), production_file)


# --- artifact storage -------------------------------------------------------------------------


class S3Settings(EnvSettings):
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
        """As `EnvSettings.from_env`, with every problem one `StorageConfigError` naming the
        variable (and never its value)."""
        try:
            return super().from_env(environ, **values)
        except ValidationError as exc:
            raise StorageConfigError(f"invalid S3 settings: {problems(exc)}") from None

    @classmethod
    def from_env_if_configured(cls, environ: Mapping[str, str] | None = None) -> Self | None:
        """None without a bucket, in DURABLE_COMFY_BUCKET or the production file's
        `storage.bucket` (a client that stores nothing); else `from_env`."""
        from activities.config_file import ConfigFileError, file_named

        env = os.environ if environ is None else environ
        if not env.get(BUCKET_VAR):
            try:
                config = file_named(env)
            except ConfigFileError as exc:
                raise StorageConfigError(f"invalid S3 settings: {exc}") from None
            if config is None or config.storage.bucket is None:
                return None
        return cls.from_env(environ)


def problems(exc: ValidationError) -> str:
    """One line for a settings error: each problem with the variable (or field) it is about."""

    def one(error: Any) -> str:
        where = ".".join(str(part) for part in error["loc"])
        if error["type"] == "missing":
            return f"{where} is not set"
        message = str(error["msg"]).removeprefix("Value error, ")
        return f"{where}: {message}" if where else message

    return "; ".join(one(error) for error in exc.errors())


# --- webhooks ---------------------------------------------------------------------------------

WEBHOOK_SECRETS_VAR = "DURABLE_COMFY_WEBHOOK_SECRETS"
WEBHOOK_SECRETS_FILE_VAR = "DURABLE_COMFY_WEBHOOK_SECRETS_FILE"
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_WEBHOOK_SECRET_PREFIX = "whsec_"
# Standard Webhooks asks for 24 to 64 random bytes; fewer than 16 is not a secret.
_MIN_SECRET_BYTES = 16


def webhook_signing_key(secret: str) -> bytes:
    """The HMAC key of a `whsec_<base64>` secret (its base64 part, decoded)."""
    if not secret.startswith(_WEBHOOK_SECRET_PREFIX):
        raise ValueError("a webhook secret is whsec_ followed by base64")
    try:
        key = base64.b64decode(secret.removeprefix(_WEBHOOK_SECRET_PREFIX), validate=True)
    except binascii.Error:
        raise ValueError("a webhook secret's part after whsec_ is not base64") from None
    if len(key) < _MIN_SECRET_BYTES:
        raise ValueError(f"a webhook secret must hold at least {_MIN_SECRET_BYTES} bytes")
    return key


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


class WebhookSettings(EnvSettings):
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
    allow_hosts: tuple[str, ...] = Field((), validation_alias="DURABLE_COMFY_WEBHOOK_ALLOW_HOSTS")

    @field_validator("secrets", mode="before")
    @classmethod
    def _comma_separated_secrets(cls, value: Any) -> Any:
        if isinstance(value, str):
            return _tenant_secrets(value, ",", WEBHOOK_SECRETS_VAR)
        return value

    @field_validator("allow_hosts", mode="before")
    @classmethod
    def _comma_separated_hosts(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(h.strip().lower() for h in value.split(",") if h.strip())
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
