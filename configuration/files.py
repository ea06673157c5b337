"""The two files settings come from: the production file and the dev stack file's worker section.

The production file, named by DURABLE_COMFY_SETTINGS_FILE: one YAML file for the worker, the CLI,
the library and the gateway's client. Its sections:

    worker   task queue, default pool, concurrency, orphan sweep, metrics port, log level,
             heartbeat throttle, Worker Versioning          (WorkerSettings; task_queue: clients)
    pools    {name: PoolConfig}                             (WorkerSettings.pools)
    tenants  {tenant: TenantConfig}       (WorkerSettings.tenants; GatewaySettings.tenants)
    storage  bucket, endpoint_url, region, allowed_input_prefixes (S3Settings)
    codec    keys_file                                      (CodecSettings)
    client   query_timeout_s                                (ClientSettings)

Each settings class (configuration.settings) reads the keys its `file_keys` maps to its fields,
below its variables and above its defaults (configuration.sources). The whole file is checked
whenever it is read: an unknown key, a bad value or a credential is a `ConfigFileError` naming the
file and the key's path (`pools.gpu.endpoint_id`), and never quoting a value. Credentials never
live in this file: it names the variable holding a key (`api_key_env`) or a key file
(`codec.keys_file`). Relative paths in it (`codec.keys_file`, a pool's `node_registry`) are
relative to the file.

The dev stack file, named by DURABLE_COMFY_CONFIG (temporal-dev.yaml): the worker reads only its
`worker:` section (`WorkerSection`); the rest describes the local stack (devstack.config). Never
the same variable for both: the two have different shapes and different readers, and one
variable for both would let a production file be read as a stack file, or the other way round.

Nothing here knows a settings class: the sources read the files through these functions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from configuration import values
from configuration.errors import FILE_VAR, ConfigFileError
from configuration.pools import PoolConfig
from configuration.tenants import TenantConfig
from workflows.shared import DEFAULT_TASK_QUEUE

CONFIG_VAR = "DURABLE_COMFY_CONFIG"
# Top-level keys only a dev stack file (temporal-dev.yaml) has: such a file here is a mix-up.
_STACK_ONLY = ("state_dir", "temporal", "s3", "comfyui_sim", "runpod_sim")


class _Section(BaseModel):
    # extra="forbid": a typo is an error, not a setting silently left at its default.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


class WorkerFileSection(_Section):
    """WorkerSettings' fields, under the same names; unset: the variable or default decides."""

    task_queue: str | None = None
    default_pool: str | None = None
    max_concurrent_activities: values.Concurrency | None = None
    max_cached_workflows: values.Concurrency | None = None
    orphan_sweep_interval_s: values.SweepInterval | None = None
    metrics_port: values.Port | None = None
    metrics_host: values.MetricsHost | None = None
    log_level: str | None = None
    heartbeat_throttle_s: values.HeartbeatThrottle | None = None
    heartbeat_budget_per_s: values.HeartbeatBudgetRate | None = None
    budget_day_s: values.BudgetDayLength | None = None
    versioning: bool | None = None
    deployment_name: values.DeploymentName | None = None
    build_id: values.BuildId | None = None
    set_current: values.SetCurrent | None = None


class StorageFileSection(_Section):
    """S3Settings without its key pair (that stays in the environment or botocore's chain)."""

    bucket: values.BucketName | None = None
    endpoint_url: values.EndpointUrl | None = None
    region: str | None = None
    allowed_input_prefixes: values.AllowedInputPrefixes | None = None


class CodecFileSection(_Section):
    """Where the key ring's file is; the keys themselves never appear here."""

    keys_file: Path | None = None


class ClientFileSection(_Section):
    query_timeout_s: float | None = Field(None, gt=0)


class ConfigFile(_Section):
    worker: WorkerFileSection = Field(default_factory=WorkerFileSection)
    # None: no `pools:` key (DURABLE_COMFY_POOLS or the default decides).
    pools: dict[str, PoolConfig] | None = None
    # None: no `groups:` key (DURABLE_COMFY_GROUPS or the default decides).
    groups: dict[str, list[str]] | None = None
    # None: no `tenants:` key (DURABLE_COMFY_TENANTS or the default decides).
    tenants: dict[str, TenantConfig] | None = None
    storage: StorageFileSection = Field(default_factory=StorageFileSection)
    codec: CodecFileSection = Field(default_factory=CodecFileSection)
    client: ClientFileSection = Field(default_factory=ClientFileSection)

    def value(self, key: str) -> Any:
        """The value at a dotted key (`worker.task_queue`), None when the file does not set it."""
        found: Any = self
        for part in key.split("."):
            found = getattr(found, part)
        return found


_SECTIONS: dict[str, type[BaseModel]] = {
    "worker": WorkerFileSection,
    "storage": StorageFileSection,
    "codec": CodecFileSection,
    "client": ClientFileSection,
}


# --- credentials never in the file ------------------------------------------------------------

# A key named like a credential. `*_env` and `*_file` name where one lives, which is the point.
_SECRET_WORDS = ("secret", "password", "passwd", "token", "credential", "private_key")
_SECRET_NAMES = frozenset(
    {"key", "keys", "api_key", "apikey", "access_key", "access_key_id", "aws_access_key_id"}
)
# A value that looks like a credential, whatever its key.
_SECRET_VALUES = (
    (re.compile(r"^rpa_[A-Za-z0-9]{16,}$"), "a RunPod API key"),
    (re.compile(r"^(AKIA|ASIA)[A-Z0-9]{16}$"), "an AWS access key id"),
    (re.compile(r"^[A-Za-z0-9._-]{1,64}:[A-Za-z0-9+/]{43}=$"), "a codec key entry"),
    (re.compile(r"^[a-z][a-z0-9+.-]*://[^/@\s]*:[^/@\s]*@"), "a URL carrying credentials"),
)
_WHERE_SECRETS_GO = {
    "storage": "S3 keys go in AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or botocore's own "
    "chain (AWS_PROFILE, a shared credentials file, an instance role)",
    "pools": "a RunPod API key goes in the variable the pool's api_key_env names (default "
    "RUNPOD_API_KEY)",
    "codec": "codec keys go in DURABLE_COMFY_CODEC_KEYS, or a file the operator mounts, named "
    "by codec.keys_file or DURABLE_COMFY_CODEC_KEYS_FILE",
}


def _secret_in(data: Any, path: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """(key path, what it looks like) of the first credential in the raw file, else None."""
    if isinstance(data, Mapping):
        for key, value in data.items():
            here = (*path, str(key))
            name = str(key).lower().replace("-", "_")
            if not name.endswith(("_env", "_file")) and (
                name in _SECRET_NAMES or any(word in name for word in _SECRET_WORDS)
            ):
                return ".".join(here), "a credential"
            if found := _secret_in(value, here):
                return found
    elif isinstance(data, list):
        for position, item in enumerate(data):
            if found := _secret_in(item, (*path, str(position))):
                return found
    elif isinstance(data, str):
        for pattern, what in _SECRET_VALUES:
            if pattern.match(data.strip()):
                return ".".join(path), what
    return None


# --- reading it -------------------------------------------------------------------------------


def load_config_file(path: Path) -> ConfigFile:
    """Read and check the whole file; `ConfigFileError` for anything wrong in it."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigFileError(path, f"cannot read it ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # Only the position: YAML's own message quotes the line, which may hold anything.
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigFileError(path, f"not valid YAML{where}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigFileError(path, f"expected a mapping of sections ({', '.join(_top_keys())})")
    if stack_keys := [key for key in _STACK_ONLY if key in data]:
        raise ConfigFileError(
            path,
            f"{', '.join(stack_keys)}: this looks like a dev stack file (temporal-dev.yaml); "
            "name that with DURABLE_COMFY_CONFIG. A production file has the sections "
            f"{', '.join(_top_keys())}",
        )
    if found := _secret_in(data):
        key, what = found
        where = _WHERE_SECRETS_GO.get(
            key.split(".")[0], "credentials go in the environment or a file the operator mounts"
        )
        raise ConfigFileError(
            path, f"{key}: {what} does not belong in this file (it is not secret); {where}"
        )
    try:
        config = ConfigFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigFileError(path, _problems(exc)) from None
    return _relative_to(config, path.resolve().parent)


def _relative_to(config: ConfigFile, base: Path) -> ConfigFile:
    """Relative paths in the file are relative to it, not to whoever reads it."""

    def resolved(value: Path) -> Path:
        return value if value.is_absolute() else base / value

    codec = config.codec
    if codec.keys_file is not None:
        codec = codec.model_copy(update={"keys_file": resolved(codec.keys_file)})
    pools = config.pools
    if pools is not None:
        pools = {
            name: pool.model_copy(update={"node_registry": resolved(pool.node_registry)})
            if isinstance(pool.node_registry, Path)
            else pool
            for name, pool in pools.items()
        }
    return config.model_copy(update={"codec": codec, "pools": pools})


def _top_keys() -> list[str]:
    return list(ConfigFile.model_fields)


def _allowed(loc: tuple[str | int, ...]) -> list[str]:
    """The keys allowed beside an unknown one at `loc`."""
    model: type[BaseModel] = ConfigFile
    if len(loc) == 2 and str(loc[0]) in _SECTIONS:
        model = _SECTIONS[str(loc[0])]
    elif len(loc) == 3 and loc[0] == "pools":
        model = PoolConfig
    return list(model.model_fields)


def _problems(exc: ValidationError) -> str:
    """Each problem at its key path, with what to do; never the value."""

    def one(error: Any) -> str:
        loc = tuple(error["loc"])
        where = ".".join(str(part) for part in loc) or "(top level)"
        if error["type"] == "extra_forbidden":
            return f"{where}: unknown key (allowed here: {', '.join(_allowed(loc))})"
        message = str(error["msg"]).removeprefix("Value error, ")
        return f"{where}: {message}"

    return "; ".join(one(error) for error in exc.errors())


def file_named(environ: Mapping[str, str]) -> ConfigFile | None:
    """The file DURABLE_COMFY_SETTINGS_FILE names in `environ`, checked; None when it names
    none."""
    path = environ.get(FILE_VAR)
    return load_config_file(Path(path)) if path else None


# --- the dev stack file's worker section ----------------------------------------------------


class WorkerSection(BaseModel):
    """The `worker:` section of a stack file (temporal-dev.yaml): what this worker serves."""

    model_config = ConfigDict(extra="forbid")

    task_queue: str = DEFAULT_TASK_QUEUE
    default_pool: str = "comfyui"
    pools: dict[str, PoolConfig] = Field(default_factory=dict)
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    # Worker Versioning (see WorkerSettings). None: not in the file (the variable or the default
    # decides); a dumped stack file keeps them None.
    versioning: bool | None = None
    deployment_name: values.DeploymentName | None = None
    build_id: values.BuildId | None = None
    set_current: values.SetCurrent | None = None


def read_worker_section(path: Path) -> WorkerSection:
    """Only the worker's own section: the rest of the file describes the local stack."""
    data: Any = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    if "pools" in data or "storage" in data:
        # A production file here would have its pools ignored.
        raise ValueError(
            f"{path}: top-level pools/storage: this looks like a production configuration file; "
            "name it with DURABLE_COMFY_SETTINGS_FILE (DURABLE_COMFY_CONFIG names a dev stack file)"
        )
    return WorkerSection.model_validate(data.get("worker") or {})
