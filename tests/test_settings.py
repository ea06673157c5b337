"""One way to configure: every documented variable reaches its field, in the documented order.

Fast, no server: every settings class of configuration.settings (the worker's, the client's, the
CLI's, the gateway's), read from a given mapping or from a scrubbed process environment; and the
shape that keeps it one way: one module of settings classes, one source order (the import cycle
the configuration once had is test_layers' to refuse).
"""

from __future__ import annotations

import ast
import base64
import inspect
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast, get_args

import pytest
import yaml
from pydantic import BaseModel, SecretStr, ValidationError
from pydantic_settings import SettingsError
from temporalio.client import Client
from typer.testing import CliRunner

import configuration.settings
import worker
from activities.storage import ArtifactStore
from configuration.errors import CodecSettingsError, ConfigFileError
from configuration.files import load_config_file
from configuration.pools import PoolConfig
from configuration.processes import CliConfig
from configuration.settings import (
    ClientSettings,
    CliSettings,
    CodecSettings,
    GatewaySettings,
    S3Settings,
    TemporalSettings,
    UrlFetchSettings,
    WebhookSettings,
    WorkerSettings,
    runpod_api_keys,
)
from configuration.sources import Settings, variable_names
from configuration.values import SetCurrent
from devstack.config import StackFileSettings
from starter.cli import build_app
from starter.cli.common import ExitCode, job_client
from starter.cli.ui import workflow_url
from starter.client import JobClient
from starter.codec import codec_from_environ, new_entry
from workflows.errors import StorageConfigError

ROOT = Path(__file__).resolve().parent.parent
SECRET = "s3cr3t-value-never-shown"
CODEC_ENTRY = new_entry("k1")
# Every settings class the worker, the client, the CLI and the gateway read.
ALL_SETTINGS: list[type[Settings]] = [
    cls
    for cls in vars(configuration.settings).values()
    if isinstance(cls, type)
    and issubclass(cls, Settings)
    and cls.__module__ == configuration.settings.__name__
]
# Not a class's field: the variable each runpod pool's `api_key_env` names, by default this one.
RUNPOD_KEY_VARIABLE = "RUNPOD_API_KEY"
VARIABLE = re.compile(r"DURABLE_COMFY_[A-Z0-9_]*[A-Z0-9](?![A-Za-z0-9_{*])")


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The process environment without any variable these settings (or botocore) read."""
    for name in list(os.environ):
        if name.startswith(("DURABLE_COMFY_", "TEMPORAL_", "AWS_")):
            monkeypatch.delenv(name)
    yield monkeypatch


def stack_file(tmp_path: Path, worker_section: dict[str, Any]) -> Path:
    path = tmp_path / "stack.yaml"
    path.write_text(json.dumps({"state_dir": ".x", "worker": worker_section}))  # JSON is YAML
    return path


# --- every variable reaches its field --------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value", "field", "expected"),
    [
        ("DURABLE_COMFY_TASK_QUEUE", "q1", "task_queue", "q1"),
        ("DURABLE_COMFY_DEFAULT_POOL", "gpu", "default_pool", "gpu"),
        ("DURABLE_COMFY_ORPHAN_SWEEP_S", "2.5", "orphan_sweep_interval_s", 2.5),
        ("DURABLE_COMFY_METRICS_PORT", "9464", "metrics_port", 9464),
        ("DURABLE_COMFY_METRICS_HOST", "0.0.0.0", "metrics_host", "0.0.0.0"),
        ("DURABLE_COMFY_LOG_LEVEL", "DEBUG", "log_level", "DEBUG"),
        ("DURABLE_COMFY_CONFIG", "nowhere.yaml", "config_file", None),  # checked below
    ],
)
def test_each_worker_variable_reaches_its_field(
    variable: str, value: str, field: str, expected: object, tmp_path: Path
) -> None:
    if variable == "DURABLE_COMFY_CONFIG":
        value = str(stack_file(tmp_path, {}))
        expected = Path(value)
    settings = WorkerSettings.from_env({variable: value})
    assert getattr(settings, field) == expected


def test_pools_come_as_json() -> None:
    runpod = {
        "kind": "runpod",
        "url": "https://api.runpod.ai/v2",
        "endpoint_id": "abc123",
        "api_key_env": "RUNPOD_API_KEY",
        "claims": True,
    }
    pools = {"gpu": {"kind": "comfyui", "url": "http://gpu:8188"}, "rp": runpod}
    settings = WorkerSettings.from_env({"DURABLE_COMFY_POOLS": json.dumps(pools)})
    assert {name: pool.model_dump(exclude_none=True) for name, pool in settings.pools.items()} == (
        pools
    )


def test_each_s3_variable_reaches_its_field() -> None:
    settings = S3Settings.from_env(
        {
            "DURABLE_COMFY_BUCKET": "artifacts",
            "DURABLE_COMFY_S3_ENDPOINT": "http://127.0.0.1:9000/",
            "AWS_ACCESS_KEY_ID": "AKID",
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_REGION": "eu-west-1",
            "AWS_DEFAULT_REGION": "ap-south-1",  # AWS_REGION wins
        }
    )
    assert (settings.bucket, settings.endpoint_url, settings.region) == (
        "artifacts",
        "http://127.0.0.1:9000",
        "eu-west-1",
    )
    assert settings.access_key_id and settings.access_key_id.get_secret_value() == "AKID"
    assert settings.secret_access_key and settings.secret_access_key.get_secret_value() == SECRET
    fallback = S3Settings.from_env({"DURABLE_COMFY_BUCKET": "b-1", "AWS_DEFAULT_REGION": "eu-2"})
    assert fallback.region == "eu-2"
    bare = S3Settings.from_env({"DURABLE_COMFY_BUCKET": "b-1"})
    assert (bare.region, bare.endpoint_url, bare.access_key_id) == ("us-east-1", None, None)


def test_cli_and_temporal_variables_reach_their_fields(environ: pytest.MonkeyPatch) -> None:
    config = CliConfig.load()
    assert (config.settings.task_queue, config.settings.query_timeout_s) == ("durable-comfy", 10)
    assert config.settings.log_level == "WARNING"
    assert (config.temporal.address, config.temporal.namespace) == (None, None)
    assert workflow_url(config.temporal, "a/b") == (
        "http://127.0.0.1:8233/namespaces/default/workflows/a%2Fb"
    )

    for name, value in {
        "DURABLE_COMFY_TASK_QUEUE": "q2",
        "DURABLE_COMFY_QUERY_TIMEOUT_S": "2.5",
        "DURABLE_COMFY_LOG_LEVEL": "INFO",
        "TEMPORAL_ADDRESS": "temporal.example:7233",
        "TEMPORAL_NAMESPACE": "prod ns",
        "TEMPORAL_UI_URL": "https://ui.example/",
    }.items():
        environ.setenv(name, value)
    config = CliConfig.load()
    assert (config.settings.task_queue, config.settings.query_timeout_s) == ("q2", 2.5)
    assert config.settings.log_level == "INFO"
    assert (config.temporal.address, config.temporal.namespace) == (
        "temporal.example:7233",
        "prod ns",
    )
    assert (
        workflow_url(config.temporal, "j") == "https://ui.example/namespaces/prod%20ns/workflows/j"
    )


def test_the_stack_file_variable_reaches_the_demo(environ: pytest.MonkeyPatch) -> None:
    assert StackFileSettings().config_file == Path("temporal-dev.yaml")
    environ.setenv("DURABLE_COMFY_CONFIG", "other.yaml")
    assert StackFileSettings().config_file == Path("other.yaml")


def test_empty_variables_count_as_unset(environ: pytest.MonkeyPatch) -> None:
    settings = WorkerSettings.from_env({"DURABLE_COMFY_TASK_QUEUE": "", "DURABLE_COMFY_POOLS": ""})
    assert (settings.task_queue, settings.pools) == ("durable-comfy", {})
    for name in ("DURABLE_COMFY_QUERY_TIMEOUT_S", "TEMPORAL_ADDRESS", "TEMPORAL_UI_URL"):
        environ.setenv(name, "")
    config = CliConfig.load()
    assert (config.settings.query_timeout_s, config.temporal.address) == (10, None)
    assert config.temporal.ui_url == "http://127.0.0.1:8233"


def test_only_the_named_variables_are_read(environ: pytest.MonkeyPatch) -> None:
    # Not the field names, in any case: `bucket`, `task_queue` or `address` are someone else's.
    for name in ("bucket", "task_queue", "TASK_QUEUE", "address", "ui_url", "query_timeout_s"):
        environ.setenv(name, "not-ours")
    assert WorkerSettings().task_queue == "durable-comfy"
    assert S3Settings.from_env_if_configured() is None
    config = CliConfig.load()
    assert (config.temporal.address, config.settings.task_queue) == (None, "durable-comfy")


def variables_read() -> set[str]:
    """Every variable a settings class reads (the names its fields' aliases give)."""
    return {
        name
        for cls in ALL_SETTINGS
        for f in cls.model_fields.values()
        for name in variable_names(f)
    }


def variables_documented() -> set[str]:
    """Every DURABLE_COMFY_ variable docs/configuration.md names in full, in backticks."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    return set(re.findall(r"`(DURABLE_COMFY_[A-Z0-9_]*[A-Z0-9])`", text))


def test_every_documented_variable_is_read_and_every_one_read_is_documented() -> None:
    read, documented = variables_read(), variables_documented()
    assert len(ALL_SETTINGS) >= 13 and read >= {"DURABLE_COMFY_POOLS", "TEMPORAL_UI_URL"}
    ours = {name for name in read if name.startswith("DURABLE_COMFY_")}
    assert sorted(ours - documented) == [], "read, and not in docs/configuration.md"
    assert sorted(documented - ours) == [], "in docs/configuration.md, and read by no class"
    # Temporal's, AWS's and RunPod's own names are documented too (not all of theirs are read).
    text = (ROOT / "docs" / "configuration.md").read_text()
    others = (read - ours) | {RUNPOD_KEY_VARIABLE}
    assert sorted(name for name in others if f"`{name}`" not in text) == []


def test_no_product_string_names_a_variable_nobody_reads() -> None:
    """A message, a docstring or a comment naming DURABLE_COMFY_SOMETHING that no settings class
    reads is a variable someone would set for nothing (the handler's image is apart: its
    variables are endpoint/settings.py's, documented in endpoint/README.md)."""
    read = variables_read()
    unknown = sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for path in product_files()
        for name in VARIABLE.findall(path.read_text())
        if name not in read
    )
    assert unknown == []


@pytest.fixture
def sample_files(tmp_path: Path) -> Path:
    """The files the file-naming variables' samples name."""
    stack_file(tmp_path, {"task_queue": "from-stack"})
    production_file(tmp_path, {"client": {"query_timeout_s": 3}})
    (tmp_path / "webhook-secrets").write_text(f"acme:{WEBHOOK_SECRET}\n")
    (tmp_path / "codec-keys").write_text(CODEC_ENTRY + "\n")
    (tmp_path / "api-keys").write_text("acme:sha256:" + "a" * 64 + "\n")
    return tmp_path


WEBHOOK_SECRET = "whsec_" + base64.b64encode(b"sixteen-byte-key" * 2).decode()
LIVE_KEY = "k" * 16
# Each variable a settings class reads: (a value, what its field holds then, the variables a
# class needs besides it). `{tmp}` is `sample_files`' folder.
SAMPLES: dict[str, tuple[str, Any, dict[str, str]]] = {
    "DURABLE_COMFY_CONFIG": ("{tmp}/stack.yaml", "{tmp}/stack.yaml", {}),
    "DURABLE_COMFY_SETTINGS_FILE": ("{tmp}/production.yaml", "{tmp}/production.yaml", {}),
    "DURABLE_COMFY_POOLS": (
        '{"gpu": {"url": "http://gpu:8188"}}',
        {"gpu": {"kind": "comfyui", "url": "http://gpu:8188"}},
        {},
    ),
    "DURABLE_COMFY_GROUPS": (
        '{"gpus": ["gpu"]}',
        {"gpus": ["gpu"]},
        {"DURABLE_COMFY_POOLS": '{"gpu": {"url": "http://gpu:8188"}}'},
    ),
    "DURABLE_COMFY_TENANTS": (
        '{"acme": {"weight": 2, "max_priority": 2, "gpu_seconds_per_day": 30, '
        '"over_budget": "refuse"}}',
        {
            "acme": {
                "weight": 2.0,
                "max_priority": 2,
                "gpu_seconds_per_day": 30.0,
                "over_budget": "refuse",
            }
        },
        {},
    ),
    "DURABLE_COMFY_TASK_QUEUE": ("q1", "q1", {}),
    "DURABLE_COMFY_DEFAULT_POOL": ("gpu", "gpu", {}),
    "DURABLE_COMFY_MAX_CONCURRENT_ACTIVITIES": ("7", 7, {}),
    "DURABLE_COMFY_MAX_CACHED_WORKFLOWS": ("250", 250, {}),
    "DURABLE_COMFY_ORPHAN_SWEEP_S": ("2.5", 2.5, {}),
    "DURABLE_COMFY_METRICS_PORT": ("9464", 9464, {}),
    "DURABLE_COMFY_METRICS_HOST": ("0.0.0.0", "0.0.0.0", {}),
    "DURABLE_COMFY_LOG_LEVEL": ("DEBUG", "DEBUG", {}),
    "DURABLE_COMFY_HEARTBEAT_THROTTLE_S": ("1.5", 1.5, {}),
    "DURABLE_COMFY_HEARTBEAT_BUDGET": ("100", 100.0, {}),
    "DURABLE_COMFY_BUDGET_DAY_S": ("20", 20.0, {}),
    "DURABLE_COMFY_LIVE_PROGRESS_PORT": (
        "7441",
        7441,
        {"DURABLE_COMFY_LIVE_PROGRESS_KEY": LIVE_KEY},
    ),
    "DURABLE_COMFY_LIVE_PROGRESS_HOST": ("10.0.0.5", "10.0.0.5", {}),
    "DURABLE_COMFY_LIVE_PROGRESS_URL": (
        "ws://10.0.0.5:7441/v1/live",
        "ws://10.0.0.5:7441/v1/live",
        {},
    ),
    "DURABLE_COMFY_LIVE_PROGRESS_KEY": (LIVE_KEY, LIVE_KEY, {}),
    "DURABLE_COMFY_VERSIONING": ("false", False, {}),
    "DURABLE_COMFY_DEPLOYMENT_NAME": ("dep", "dep", {}),
    "DURABLE_COMFY_BUILD_ID": ("b1", "b1", {}),
    "DURABLE_COMFY_SET_CURRENT": ("never", "never", {}),
    "DURABLE_COMFY_BUCKET": ("b-2", "b-2", {}),
    "DURABLE_COMFY_S3_ENDPOINT": ("http://127.0.0.1:9000/", "http://127.0.0.1:9000", {}),
    "DURABLE_COMFY_ALLOWED_INPUT_PREFIXES": (
        "s3://assets/masks/, s3://b2",
        ["s3://assets/masks/", "s3://b2/"],
        {},
    ),
    "AWS_ACCESS_KEY_ID": ("AKID", "AKID", {"AWS_SECRET_ACCESS_KEY": SECRET}),
    "AWS_SECRET_ACCESS_KEY": (SECRET, SECRET, {"AWS_ACCESS_KEY_ID": "AKID"}),
    "AWS_REGION": ("eu-west-1", "eu-west-1", {}),
    "AWS_DEFAULT_REGION": ("eu-2", "eu-2", {}),
    "DURABLE_COMFY_WEBHOOK_SECRETS": (f"acme:{WEBHOOK_SECRET}", {"acme": WEBHOOK_SECRET}, {}),
    "DURABLE_COMFY_WEBHOOK_SECRETS_FILE": ("{tmp}/webhook-secrets", "{tmp}/webhook-secrets", {}),
    "DURABLE_COMFY_WEBHOOK_ALLOW_HOSTS": ("LocalHost, 127.0.0.1", ["localhost", "127.0.0.1"], {}),
    "DURABLE_COMFY_URL_INPUT_MAX_BYTES": ("1024", 1024, {}),
    "DURABLE_COMFY_URL_INPUT_CONTENT_TYPES": ("image/png, Video/*", ["image/png", "video/*"], {}),
    "DURABLE_COMFY_URL_INPUT_PORTS": ("443, 8443", [443, 8443], {}),
    "DURABLE_COMFY_URL_INPUT_REDIRECTS": ("2", 2, {}),
    "DURABLE_COMFY_URL_INPUT_TIMEOUT_S": ("5", 5.0, {}),
    "DURABLE_COMFY_QUERY_TIMEOUT_S": ("2.5", 2.5, {}),
    "TEMPORAL_ADDRESS": ("temporal.example:7233", "temporal.example:7233", {}),
    "TEMPORAL_NAMESPACE": ("prod", "prod", {}),
    "TEMPORAL_UI_URL": ("https://ui.example", "https://ui.example", {}),
    "DURABLE_COMFY_CODEC_KEYS": (CODEC_ENTRY, CODEC_ENTRY, {}),
    "DURABLE_COMFY_CODEC_KEYS_FILE": ("{tmp}/codec-keys", "{tmp}/codec-keys", {}),
    "DURABLE_COMFY_CODEC_AUTH_TOKEN": ("token-1", "token-1", {}),
    "DURABLE_COMFY_API_KEYS": ("acme:key-1", "acme:key-1", {}),
    "DURABLE_COMFY_API_KEYS_FILE": ("{tmp}/api-keys", "{tmp}/api-keys", {}),
    "DURABLE_COMFY_TENANT_RPS": ("5", 5.0, {}),
    "DURABLE_COMFY_TENANT_BURST": ("6", 6, {}),
    "DURABLE_COMFY_TENANT_MAX_JOBS": ("7", 7, {}),
    "DURABLE_COMFY_GATEWAY_MAX_REQUESTS": ("8", 8, {}),
    "DURABLE_COMFY_GATEWAY_MAX_STREAMS": ("9", 9, {}),
    "DURABLE_COMFY_GATEWAY_MAX_BODY_BYTES": ("2048", 2048, {}),
    "DURABLE_COMFY_GATEWAY_HEARTBEAT_S": ("3", 3.0, {}),
    "DURABLE_COMFY_GATEWAY_CLIENT_SEEN_S": ("4", 4.0, {}),
    "DURABLE_COMFY_GATEWAY_FOLLOWER_GRACE_S": ("0", 0.0, {}),
    "DURABLE_COMFY_GATEWAY_POLL_S": ("0.3", 0.3, {}),
    "DURABLE_COMFY_GATEWAY_SUBSCRIBER_QUEUE": ("50", 50, {}),
    "DURABLE_COMFY_GATEWAY_BASE_PATH": ("/comfy", "/comfy", {}),
    "DURABLE_COMFY_GATEWAY_WS_AUTH_TIMEOUT_S": ("6", 6.0, {}),
    "DURABLE_COMFY_GATEWAY_READY_TIMEOUT_S": ("1.5", 1.5, {}),
    "DURABLE_COMFY_GATEWAY_UPLOAD_MAX_BYTES": ("1048576", 1048576, {}),
    "DURABLE_COMFY_GATEWAY_UPLOAD_TTL_S": ("60", 60, {}),
}
# What a class needs whatever the variable: the S3 settings have no store without a bucket.
CLASS_NEEDS: dict[type[Settings], dict[str, str]] = {S3Settings: {"DURABLE_COMFY_BUCKET": "b-1"}}


def plain(value: Any) -> Any:
    """A field's value as a sample's expectation writes it (secrets shown, lists as lists)."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_none=True)
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return [plain(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    return value


def readers(variable: str) -> list[tuple[type[Settings], str]]:
    """Each (class, field) that reads `variable`."""
    return [
        (cls, name)
        for cls in ALL_SETTINGS
        for name, f in cls.model_fields.items()
        if variable in variable_names(f)
    ]


def test_every_variable_read_has_a_sample() -> None:
    assert sorted(variables_read() ^ set(SAMPLES)) == []


@pytest.mark.parametrize("variable", sorted(SAMPLES))
def test_each_variable_reaches_its_field_in_every_class_that_reads_it(
    variable: str, sample_files: Path
) -> None:
    value, expected, needs = SAMPLES[variable]
    value = value.replace("{tmp}", str(sample_files))
    if isinstance(expected, str):
        expected = expected.replace("{tmp}", str(sample_files))
    assert readers(variable)
    for cls, field in readers(variable):
        settings = cls.from_env({**CLASS_NEEDS.get(cls, {}), **needs, variable: value})
        assert plain(getattr(settings, field)) == expected, f"{cls.__name__}.{field}"


def outcome(cls: type[Settings], environ: Mapping[str, str]) -> str:
    """What a class makes of an environment: its values, or its error."""
    try:
        settings = cls.from_env(environ)
    except (ValidationError, StorageConfigError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return repr({name: plain(getattr(settings, name)) for name in cls.model_fields})


@pytest.mark.parametrize("cls", ALL_SETTINGS, ids=lambda cls: cls.__name__)
def test_an_empty_variable_counts_as_unset_in_every_class(cls: type[Settings]) -> None:
    needs = CLASS_NEEDS.get(cls, {})
    for variable in {name for f in cls.model_fields.values() for name in variable_names(f)}:
        unset = {name: value for name, value in needs.items() if name != variable}
        assert outcome(cls, {**unset, variable: ""}) == outcome(cls, unset), variable


def test_a_list_variable_is_comma_separated_text_never_json() -> None:
    """A variable's value stays text for its field's own parser: `["a", "b"]` is two odd items,
    not a JSON list (as a stock pydantic-settings source would decode it)."""
    variable = "DURABLE_COMFY_WEBHOOK_ALLOW_HOSTS"
    assert len(readers(variable)) == 2, "the worker's and the gateway's"
    for cls, field in readers(variable):
        assert getattr(cls.from_env({variable: '["Evil", "b"]'}), field) == ('["evil"', '"b"]')
    with pytest.raises(ValidationError, match="DURABLE_COMFY_URL_INPUT_PORTS"):
        UrlFetchSettings.from_env({"DURABLE_COMFY_URL_INPUT_PORTS": "[443]"})


# --- precedence ------------------------------------------------------------------------------


def test_pools_from_the_variable_replace_the_files(tmp_path: Path) -> None:
    config = stack_file(
        tmp_path,
        {
            "task_queue": "from-file",
            "default_pool": "local",
            "pools": {"local": {"kind": "comfyui", "url": "http://127.0.0.1:8188"}},
        },
    )
    from_file = WorkerSettings.from_env({"DURABLE_COMFY_CONFIG": str(config)})
    assert (from_file.task_queue, from_file.default_pool) == ("from-file", "local")
    assert list(from_file.pools) == ["local"]

    env = {
        "DURABLE_COMFY_CONFIG": str(config),
        "DURABLE_COMFY_POOLS": json.dumps({"gpu": {"url": "http://gpu:8188"}}),
        "DURABLE_COMFY_TASK_QUEUE": "from-env",
    }
    settings = WorkerSettings.from_env(env)
    # Replaced, not merged; the file still gives what no variable does.
    assert list(settings.pools) == ["gpu"]
    assert (settings.task_queue, settings.default_pool) == ("from-env", "local")


def test_values_from_code_win_over_the_variables(tmp_path: Path) -> None:
    env = {
        "DURABLE_COMFY_METRICS_PORT": "9000",
        "DURABLE_COMFY_POOLS": json.dumps({"gpu": {"url": "http://gpu:8188"}}),
        "DURABLE_COMFY_CONFIG": str(stack_file(tmp_path, {"task_queue": "from-file"})),
    }
    settings = WorkerSettings.from_env(env, metrics_port=9464, pools={})
    assert (settings.metrics_port, settings.pools, settings.task_queue) == (9464, {}, "from-file")


def test_the_worker_builds_its_settings_once_with_the_option_winning(
    environ: pytest.MonkeyPatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    environ.setenv("DURABLE_COMFY_METRICS_PORT", "9000")
    environ.setenv("DURABLE_COMFY_BUCKET", "artifacts")
    environ.setenv("TEMPORAL_NAMESPACE", "ns")
    seen: dict[str, Any] = {}

    async def fake_run_worker(
        settings: WorkerSettings,
        s3: S3Settings,
        *,
        temporal: TemporalSettings,
        runpod_keys: Mapping[str, SecretStr],
        webhooks: WebhookSettings,
    ) -> None:
        seen.update(settings=settings, s3=s3, temporal=temporal, runpod_keys=runpod_keys)

    monkeypatch.setattr(worker, "run_worker", fake_run_worker)
    monkeypatch.setattr(worker, "exit_without_finalizing", lambda code: None)
    monkeypatch.setattr(worker, "configure_logging", lambda level: seen.update(level=level))
    worker.cli_command(metrics_port=9464)
    assert seen["settings"].metrics_port == 9464
    assert (seen["s3"].bucket, seen["temporal"].namespace, seen["level"]) == (
        "artifacts",
        "ns",
        "INFO",
    )
    assert seen["runpod_keys"] == {}, "no runpod pool, no key to read"


# --- bad values name their variable ------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("DURABLE_COMFY_ORPHAN_SWEEP_S", "-1", "greater than or equal to 0"),
        ("DURABLE_COMFY_ORPHAN_SWEEP_S", "soon", "valid number"),
        ("DURABLE_COMFY_METRICS_PORT", "70000", "less than or equal to 65535"),
        # The SDK binds "ip:port": a host name would fail only once the runtime starts.
        ("DURABLE_COMFY_METRICS_HOST", "metrics.example", "should match pattern"),
        ("DURABLE_COMFY_POOLS", "{gpu: url}", "not JSON"),
        ("DURABLE_COMFY_POOLS", '{"gpu": {"kind": "tpu"}}', "'comfyui' or 'runpod'"),
        ("DURABLE_COMFY_POOLS", '{"gpu": {"uri": "http://x"}}', "Extra inputs"),
    ],
)
def test_a_bad_worker_value_is_a_pydantic_error_naming_the_variable(
    variable: str, value: str, message: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        WorkerSettings.from_env({variable: value})
    [error] = caught.value.errors()
    assert error["loc"][0] == variable
    assert message in str(caught.value)


def test_a_config_file_that_cannot_be_read_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"DURABLE_COMFY_CONFIG=.*missing\.yaml"):
        WorkerSettings.from_env({"DURABLE_COMFY_CONFIG": str(tmp_path / "missing.yaml")})
    bad = stack_file(tmp_path, {"pools": {"x": {"kind": "tpu"}}})
    with pytest.raises(SettingsError, match=r"(?s)DURABLE_COMFY_CONFIG=.*pools\.x\.kind"):
        WorkerSettings.from_env({"DURABLE_COMFY_CONFIG": str(bad)})


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({}, "DURABLE_COMFY_BUCKET is not set"),
        ({"DURABLE_COMFY_BUCKET": "Not_A_Bucket"}, "DURABLE_COMFY_BUCKET: not a valid"),
        (
            {"DURABLE_COMFY_BUCKET": "b-1", "DURABLE_COMFY_S3_ENDPOINT": "ftp://x"},
            "DURABLE_COMFY_S3_ENDPOINT: endpoint must be an http(s) URL",
        ),
        (
            {"DURABLE_COMFY_BUCKET": "b-1", "AWS_ACCESS_KEY_ID": "AKID"},
            "AWS_SECRET_ACCESS_KEY is not set",
        ),
        (
            {"DURABLE_COMFY_BUCKET": "b-1", "AWS_SECRET_ACCESS_KEY": SECRET},
            "AWS_ACCESS_KEY_ID is not set",
        ),
    ],
)
def test_a_bad_s3_value_names_the_variable_and_never_a_secret(
    env: dict[str, str], named: str
) -> None:
    with pytest.raises(StorageConfigError) as caught:
        S3Settings.from_env(env)
    assert named in str(caught.value)
    assert SECRET not in str(caught.value)


def test_a_bad_cli_value_is_named_and_exits_2(environ: pytest.MonkeyPatch) -> None:
    environ.setenv("DURABLE_COMFY_QUERY_TIMEOUT_S", "ten")
    with pytest.raises(ValidationError) as caught:
        CliSettings()
    assert caught.value.errors()[0]["loc"] == ("DURABLE_COMFY_QUERY_TIMEOUT_S",)

    result = CliRunner().invoke(build_app(), ["status", "some-job"])
    assert (result.exit_code, result.stdout) == (ExitCode.BAD_INPUT, "")
    assert result.stderr.startswith("error: invalid settings: DURABLE_COMFY_QUERY_TIMEOUT_S: ")
    assert "hint: fix the environment variable" in result.stderr

    environ.setenv("DURABLE_COMFY_QUERY_TIMEOUT_S", "0")
    result = CliRunner().invoke(build_app(), ["status", "some-job"])
    assert result.exit_code == ExitCode.BAD_INPUT
    assert "DURABLE_COMFY_QUERY_TIMEOUT_S: Input should be greater than 0" in result.stderr


def test_a_bad_s3_value_only_stops_a_command_that_uses_the_bucket(
    environ: pytest.MonkeyPatch,
) -> None:
    environ.setenv("DURABLE_COMFY_BUCKET", "b-1")
    environ.setenv("AWS_ACCESS_KEY_ID", "AKID")  # half a key pair
    config = CliConfig.load()  # the job commands start...
    with pytest.raises(StorageConfigError, match="AWS_SECRET_ACCESS_KEY is not set"):
        config.artifact_store_settings()  # ...and only a store needs the S3 settings


def test_the_worker_reports_bad_settings_without_their_secrets(
    environ: pytest.MonkeyPatch,
) -> None:
    environ.setenv("DURABLE_COMFY_BUCKET", "b-1")
    environ.setenv("DURABLE_COMFY_S3_ENDPOINT", f"http://user:{SECRET}@127.0.0.1:9000")
    with pytest.raises(SystemExit) as caught:
        worker.cli_command()
    message = str(caught.value.code)
    assert message.startswith("worker: invalid settings: ")
    assert "DURABLE_COMFY_S3_ENDPOINT" in message and SECRET not in message


def test_the_worker_declares_its_options_once(capsys: pytest.CaptureFixture[str]) -> None:
    """`python worker.py` and `durable-comfy worker` are one typer command: its options are
    WorkerSettings fields (so a flag wins over the variable of the same setting), and
    `--set-current` offers exactly SetCurrent's values."""
    options = list(inspect.signature(worker.cli_command).parameters)
    assert options == ["metrics_port", "build_id", "set_current"]
    assert set(options) <= set(WorkerSettings.model_fields)
    assert [option.value for option in worker.SetCurrentOption] == list(get_args(SetCurrent))
    with pytest.raises(SystemExit) as helped:
        worker.main(["--help"])
    assert helped.value.code == 0
    shown = capsys.readouterr().out
    assert re.findall(r"--[a-z-]+", shown) == [
        "--metrics-port",
        "--build-id",
        "--set-current",
        "--help",
    ]
    with pytest.raises(SystemExit) as refused:
        worker.main(["--set-current", "sometimes"])
    assert refused.value.code == 2


# --- secrets ---------------------------------------------------------------------------------


def test_secrets_stay_out_of_repr_str_and_dumps(environ: pytest.MonkeyPatch) -> None:
    settings = S3Settings.from_env(
        {
            "DURABLE_COMFY_BUCKET": "b-1",
            "AWS_ACCESS_KEY_ID": "AKID-SECRET-TOO",
            "AWS_SECRET_ACCESS_KEY": SECRET,
        }
    )
    shown = [repr(settings), str(settings), settings.model_dump_json()]
    shown.append(json.dumps(settings.model_dump(mode="json")))
    for text in shown:
        assert SECRET not in text and "AKID-SECRET-TOO" not in text
    with pytest.raises(ValidationError) as caught:
        S3Settings(bucket="b-1", endpoint_url=f"https://u:{SECRET}@example.com")
    assert SECRET not in str(caught.value)


# --- botocore's default chain reaches the CLI --------------------------------------------------


@pytest.fixture
def shared_credentials(environ: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No AWS_* keys; a shared credentials file, as `aws configure` writes one."""
    credentials = tmp_path / "credentials"
    credentials.write_text(
        f"[default]\naws_access_key_id = AKIDFROMFILE\naws_secret_access_key = {SECRET}\n"
    )
    environ.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    environ.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    environ.setenv("DURABLE_COMFY_BUCKET", "b-1")
    environ.setenv("DURABLE_COMFY_S3_ENDPOINT", "http://127.0.0.1:9")
    return environ


class _FakeTemporal:
    namespace = "default"


async def _open_cli_store(
    monkeypatch: pytest.MonkeyPatch, config: CliConfig
) -> tuple[str, str, bool]:
    """Through the CLI's own `job_client`: the store's credentials, as botocore resolved them."""

    async def connect(cls: type[JobClient], *args: Any, **kwargs: Any) -> JobClient:
        client = JobClient(cast(Client, _FakeTemporal()), task_queue=kwargs["task_queue"])
        await client._open_store(kwargs["s3"])  # as the real connect does with the CLI's S3
        return client

    monkeypatch.setattr(JobClient, "connect", classmethod(connect))
    async with job_client(config, with_store=True) as client:
        assert isinstance(client.store, ArtifactStore)
        explicit = client.store.settings.access_key_id is not None
        credentials = client.store.client._request_signer._credentials
        frozen = await credentials.get_frozen_credentials()
        return credentials.method, frozen.access_key, explicit


async def test_without_keys_the_cli_store_takes_botocores_default_chain(
    shared_credentials: pytest.MonkeyPatch,
) -> None:
    config = CliConfig.load()
    s3 = config.artifact_store_settings()
    assert s3 is not None and s3.access_key_id is None and s3.secret_access_key is None
    method, key_id, explicit = await _open_cli_store(shared_credentials, config)
    assert (method, key_id, explicit) == ("shared-credentials-file", "AKIDFROMFILE", False)


async def test_with_keys_the_cli_store_uses_them(shared_credentials: pytest.MonkeyPatch) -> None:
    shared_credentials.setenv("AWS_ACCESS_KEY_ID", "AKIDFROMENV")
    shared_credentials.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    method, key_id, explicit = await _open_cli_store(shared_credentials, CliConfig.load())
    assert (method, key_id, explicit) == ("explicit", "AKIDFROMENV", True)


async def test_without_a_bucket_the_cli_opens_no_store(environ: pytest.MonkeyPatch) -> None:
    config = CliConfig.load()
    assert config.artifact_store_settings() is None

    async def connect(cls: type[JobClient], *args: Any, **kwargs: Any) -> JobClient:
        return JobClient(cast(Client, _FakeTemporal()))

    environ.setattr(JobClient, "connect", classmethod(connect))
    async with job_client(config, with_store=True) as client:
        assert client.store is None


# --- one reader ------------------------------------------------------------------------------


PRODUCT = ("workflows", "protocol", "configuration", "activities", "starter", "gateway")


def product_files() -> list[Path]:
    """The orchestrator's code: what the worker, the client and the gateway run."""
    files = [ROOT / "worker.py"]
    for layer in PRODUCT:
        files += sorted((ROOT / layer).rglob("*.py"))
    return files


def test_no_product_module_reads_the_environment_but_the_settings() -> None:
    """Only configuration.sources reads the process's environment (for every settings class,
    and for `runpod_api_keys`); everything else is handed the settings."""
    found = set()
    for path in product_files():
        for node in ast.walk(ast.parse(path.read_text())):
            reads = (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")) or (
                isinstance(node, ast.ImportFrom)
                and node.module == "os"
                and any(alias.name in ("environ", "getenv") for alias in node.names)
            )
            if reads:
                found.add(path.relative_to(ROOT).as_posix())
    assert sorted(found) == ["configuration/sources.py"]


# --- one module, one source order -------------------------------------------------------------


def class_bases(path: Path) -> list[tuple[str, list[str]]]:
    """(class name, the names of its bases) of each class a file defines."""
    return [
        (node.name, [ast.unparse(base).rsplit(".", 1)[-1] for base in node.bases])
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    ]


def test_every_settings_class_is_defined_in_one_module() -> None:
    """A class built on a settings class anywhere in the product but configuration.settings
    would be a second place to look for a variable (`Settings` itself is the source order's)."""
    settings_names = {cls.__name__ for cls in ALL_SETTINGS} | {"Settings", "BaseSettings"}
    elsewhere = sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for path in product_files()
        if path != ROOT / "configuration" / "settings.py"
        for name, bases in class_bases(path)
        if set(bases) & settings_names and not (name == "Settings" and path.name == "sources.py")
    )
    assert elsewhere == []
    assert {cls.__name__ for cls in ALL_SETTINGS} >= {
        "WorkerSettings",
        "S3Settings",
        "WebhookSettings",
        "UrlFetchSettings",
        "ClientSettings",
        "CliSettings",
        "TemporalSettings",
        "CodecSettings",
        "CodecServerSettings",
        "GatewaySettings",
    }


def test_the_source_order_is_written_once() -> None:
    """One `settings_customise_sources` in all the code that reads settings (tooling's included):
    every class takes the same order and the same rule for an empty variable."""
    files = product_files()
    for tooling in ("devstack", "bench"):
        files += sorted((ROOT / tooling).rglob("*.py"))
    defined = sorted(
        path.relative_to(ROOT).as_posix()
        for path in files
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "settings_customise_sources"
    )
    assert defined == ["configuration/sources.py"]
    assert all(issubclass(cls, Settings) for cls in ALL_SETTINGS)
    assert issubclass(StackFileSettings, Settings), "the dev stack's class takes the same order"


def test_the_configuration_imports_no_worker_client_or_gateway_code() -> None:
    """What reads settings imports the configuration, never the other way round; and reading
    them costs no S3 client (the CLI imports aioboto3 only for a command that stores)."""
    probe = (
        "import sys, configuration.settings, configuration.processes; "
        "print(sorted({m.split('.')[0] for m in sys.modules}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    loaded = set(ast.literal_eval(done.stdout))
    assert "configuration" in loaded
    assert loaded & {"activities", "starter", "gateway", "worker", "aioboto3", "botocore"} == set()


# --- runpod pools ----------------------------------------------------------------------------

RUNPOD_KEY = "rpa_NEVERSHOWN0123456789"


def test_a_runpod_pool_needs_only_its_endpoint_id() -> None:
    pools = {"rp": {"kind": "runpod", "endpoint_id": "abc123"}}
    pool = WorkerSettings.from_env({"DURABLE_COMFY_POOLS": json.dumps(pools)}).pools["rp"]
    assert (pool.url, pool.endpoint_id, pool.api_key_env, pool.claims) == (
        "https://api.runpod.ai/v2",
        "abc123",
        "RUNPOD_API_KEY",
        True,
    )
    assert (pool.usd_per_second, pool.execution_timeout_s) == (None, None)
    stock = PoolConfig(
        kind="runpod",
        url="http://127.0.0.1:8300/v2/",
        endpoint_id="stock-comfy",
        api_key_env="RUNPOD_KEY_TEAM_B",
        claims=False,
        usd_per_second=0.00044,
        execution_timeout_s=600,
    )
    assert (stock.url, stock.claims, stock.usd_per_second, stock.execution_timeout_s) == (
        "http://127.0.0.1:8300/v2",
        False,
        0.00044,
        600,
    )


def test_a_runpod_pool_from_the_stack_file(tmp_path: Path) -> None:
    config = stack_file(
        tmp_path, {"pools": {"rp": {"kind": "runpod", "endpoint_id": "ep1", "claims": False}}}
    )
    pool = WorkerSettings.from_env({"DURABLE_COMFY_CONFIG": str(config)}).pools["rp"]
    assert (pool.kind, pool.endpoint_id, pool.claims) == ("runpod", "ep1", False)


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        ({"kind": "runpod"}, "a runpod pool needs endpoint_id"),
        ({"kind": "runpod", "endpoint_id": "../other"}, "not a RunPod endpoint id"),
        ({"kind": "runpod", "endpoint_id": "e", "url": "ftp://x"}, "must be an http(s) URL"),
        ({"kind": "runpod", "endpoint_id": "e", "usd_per_second": -1}, "greater than or equal"),
        ({"kind": "runpod", "endpoint_id": "e", "execution_timeout_s": 2}, "greater than or equal"),
        (
            {"kind": "runpod", "endpoint_id": "e", "execution_timeout_s": 8 * 24 * 3600},
            "less than or equal",
        ),
        ({"kind": "runpod", "endpoint_id": "e", "api_key_env": "my key"}, "NAME of the"),
        ({"url": "http://gpu:8188", "endpoint_id": "e"}, "endpoint_id: only for pools of kind"),
        ({"url": "http://gpu:8188", "claims": False}, "claims: only for pools of kind 'runpod'"),
        ({"url": "http://gpu:8188", "claim_lease_s": 30}, "claim_lease_s: only for pools of"),
        ({"kind": "runpod", "endpoint_id": "e", "claim_lease_s": 1}, "greater than or equal"),
    ],
)
def test_a_bad_runpod_pool_is_named(pool: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        WorkerSettings.from_env({"DURABLE_COMFY_POOLS": json.dumps({"rp": pool})})
    assert caught.value.errors()[0]["loc"][:2] == ("DURABLE_COMFY_POOLS", "rp")
    assert message in str(caught.value)


@pytest.mark.parametrize(
    "pool",
    [
        {"kind": "runpod", "endpoint_id": "e", "api_key_env": RUNPOD_KEY},
        {"kind": "runpod", "endpoint_id": "e", "api_key_env": f"{RUNPOD_KEY}-x"},
        {"kind": "runpod", "endpoint_id": "e", "url": f"https://u:{RUNPOD_KEY}@api.runpod.ai/v2"},
        # Another error in the same pool must not print the key either.
        {"kind": "runpod", "api_key_env": RUNPOD_KEY},
    ],
)
def test_a_key_pasted_into_a_pool_is_refused_without_being_shown(pool: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as caught:
        WorkerSettings.from_env({"DURABLE_COMFY_POOLS": json.dumps({"rp": pool})})
    assert RUNPOD_KEY not in str(caught.value)
    assert "api_key_env" in str(caught.value) or "credentials" in str(caught.value)


def test_the_runpod_keys_are_read_once_from_the_variables_the_pools_name() -> None:
    pools = {
        "local": PoolConfig(url="http://127.0.0.1:8188"),
        "rp": PoolConfig(kind="runpod", endpoint_id="e1"),
        "team": PoolConfig(kind="runpod", endpoint_id="e2", api_key_env="RUNPOD_KEY_TEAM"),
    }
    keys = runpod_api_keys(pools, {"RUNPOD_API_KEY": RUNPOD_KEY, "RUNPOD_KEY_TEAM": "k2"})
    assert sorted(keys) == ["rp", "team"]
    assert keys["rp"].get_secret_value() == RUNPOD_KEY and keys["team"].get_secret_value() == "k2"
    assert RUNPOD_KEY not in repr(keys) and RUNPOD_KEY not in str(keys)

    with pytest.raises(SettingsError) as caught:
        runpod_api_keys(pools, {"RUNPOD_API_KEY": RUNPOD_KEY, "RUNPOD_KEY_TEAM": "  "})
    assert "pool 'team': RUNPOD_KEY_TEAM is not set" in str(caught.value)
    assert "'rp'" not in str(caught.value) and RUNPOD_KEY not in str(caught.value)
    assert runpod_api_keys({"local": pools["local"]}, {}) == {}, "no runpod pool, no key needed"


def test_how_many_prompts_a_worker_follows_at_once_is_a_setting() -> None:
    variable = "DURABLE_COMFY_MAX_CONCURRENT_ACTIVITIES"
    assert WorkerSettings.from_env({}).max_concurrent_activities == 1000
    assert WorkerSettings.from_env({variable: "250"}).max_concurrent_activities == 250
    with pytest.raises(ValidationError, match=variable):
        WorkerSettings.from_env({variable: "0"})


# --- the production configuration file ---------------------------------------------------------

FILE_VAR = "DURABLE_COMFY_SETTINGS_FILE"


def production_file(tmp_path: Path, data: dict[str, Any], name: str = "production.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("section", "key", "in_file", "variable", "in_variable", "field", "default"),
    [
        ("worker", "task_queue", "file-q", "DURABLE_COMFY_TASK_QUEUE", "var-q", None, None),
        ("worker", "default_pool", "gpu", "DURABLE_COMFY_DEFAULT_POOL", "cpu", None, None),
        ("worker", "orphan_sweep_interval_s", 5.0, "DURABLE_COMFY_ORPHAN_SWEEP_S", "7", None, None),
        ("worker", "metrics_port", 9100, "DURABLE_COMFY_METRICS_PORT", "9200", None, None),
        ("worker", "metrics_host", "0.0.0.0", "DURABLE_COMFY_METRICS_HOST", "::1", None, None),
        ("worker", "log_level", "DEBUG", "DURABLE_COMFY_LOG_LEVEL", "ERROR", None, None),
        (
            "worker",
            "max_concurrent_activities",
            7,
            "DURABLE_COMFY_MAX_CONCURRENT_ACTIVITIES",
            "9",
            None,
            None,
        ),
        (
            "worker",
            "max_cached_workflows",
            200,
            "DURABLE_COMFY_MAX_CACHED_WORKFLOWS",
            "300",
            None,
            None,
        ),
        (
            "worker",
            "heartbeat_throttle_s",
            1.5,
            "DURABLE_COMFY_HEARTBEAT_THROTTLE_S",
            "2",
            None,
            None,
        ),
        ("worker", "versioning", False, "DURABLE_COMFY_VERSIONING", "true", None, None),
        (
            "worker",
            "deployment_name",
            "file-dep",
            "DURABLE_COMFY_DEPLOYMENT_NAME",
            "var-dep",
            None,
            None,
        ),
        ("worker", "set_current", "never", "DURABLE_COMFY_SET_CURRENT", "always", None, None),
    ],
)
def test_a_worker_setting_comes_from_code_then_variable_then_file_then_default(
    tmp_path: Path,
    section: str,
    key: str,
    in_file: Any,
    variable: str,
    in_variable: str,
    field: str | None,
    default: Any,
) -> None:
    field = field or key
    default = WorkerSettings.model_fields[field].default
    path = production_file(tmp_path, {section: {key: in_file}})
    file_only = {FILE_VAR: str(path)}
    both = {**file_only, variable: in_variable}
    assert getattr(WorkerSettings.from_env({}), field) == default
    assert getattr(WorkerSettings.from_env(file_only), field) == in_file
    from_variable = getattr(WorkerSettings.from_env(both), field)
    assert from_variable == WorkerSettings.from_env({variable: in_variable}).model_dump()[field]
    assert from_variable != in_file
    # Code (a worker option) wins over both; checked with the variable's value for the type.
    code_value = WorkerSettings.from_env({variable: in_variable}).model_dump()[field]
    assert getattr(WorkerSettings.from_env(file_only, **{field: code_value}), field) == code_value


@pytest.mark.parametrize(
    ("key", "in_file", "variable", "in_variable", "expected_variable"),
    [
        ("bucket", "file-bucket", "DURABLE_COMFY_BUCKET", "var-bucket", "var-bucket"),
        ("region", "eu-north-1", "AWS_REGION", "ap-south-1", "ap-south-1"),
        ("region", "eu-north-1", "AWS_DEFAULT_REGION", "ap-south-1", "ap-south-1"),
        (
            "endpoint_url",
            "https://s3.file.example",
            "DURABLE_COMFY_S3_ENDPOINT",
            "https://s3.var.example/",
            "https://s3.var.example",
        ),
    ],
)
def test_a_storage_setting_comes_from_code_then_variable_then_file_then_default(
    tmp_path: Path, key: str, in_file: str, variable: str, in_variable: str, expected_variable: str
) -> None:
    storage = {"bucket": "file-bucket", key: in_file}
    path = production_file(tmp_path, {"storage": storage})
    file_only = {FILE_VAR: str(path)}
    default = S3Settings.from_env({"DURABLE_COMFY_BUCKET": "b-1"})
    assert getattr(S3Settings.from_env(file_only), key) == in_file
    assert getattr(S3Settings.from_env({**file_only, variable: in_variable}), key) == (
        expected_variable
    )
    code = "code-bucket" if key == "bucket" else getattr(default, key) or "https://s3.code"
    both = {**file_only, variable: in_variable}
    assert getattr(S3Settings.from_env(both, **{key: code}), key) == code
    if key != "bucket":  # the bucket has no default: without it there is no store
        assert getattr(S3Settings.from_env({**file_only, "DURABLE_COMFY_BUCKET": "b-1"}), key) in (
            in_file,
        )
        assert getattr(default, key) == S3Settings.model_fields[key].default


def test_the_clients_settings_come_from_code_then_variable_then_file_then_default(
    environ: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = production_file(
        tmp_path,
        {
            "worker": {"task_queue": "file-q", "log_level": "DEBUG"},
            "client": {"query_timeout_s": 3},
            "storage": {"bucket": "file-bucket"},
        },
    )
    assert (ClientSettings().task_queue, ClientSettings().query_timeout_s) == ("durable-comfy", 10)
    assert S3Settings.from_env_if_configured() is None
    environ.setenv(FILE_VAR, str(path))
    config = CliConfig.load()
    assert (config.settings.task_queue, config.settings.query_timeout_s) == ("file-q", 3)
    # The worker's log level is the worker's: the CLI keeps its own quiet default.
    assert config.settings.log_level == "WARNING"
    store = config.artifact_store_settings()
    assert store is not None and store.bucket == "file-bucket"
    environ.setenv("DURABLE_COMFY_TASK_QUEUE", "var-q")
    environ.setenv("DURABLE_COMFY_QUERY_TIMEOUT_S", "4")
    assert (ClientSettings().task_queue, ClientSettings().query_timeout_s) == ("var-q", 4)
    code = ClientSettings(task_queue="code-q")
    assert code.task_queue == "code-q"


def test_the_codec_key_file_comes_from_the_variables_then_the_file(
    environ: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "keys").write_text(CODEC_ENTRY + "\n")
    path = production_file(tmp_path, {"codec": {"keys_file": "keys"}})  # relative to the file
    assert CodecSettings().key_ring() is None
    environ.setenv(FILE_VAR, str(path))
    ring = CodecSettings().key_ring()
    assert ring is not None and ring.active_id == "k1"
    assert CodecSettings().keys_file == tmp_path / "keys"
    mapping = {FILE_VAR: str(path)}
    from_mapping = codec_from_environ(mapping)
    assert from_mapping is not None and from_mapping.active_id == "k1"
    # Either variable replaces the file's key file: the ring is one setting, no "not both".
    other = new_entry("k2")
    environ.setenv("DURABLE_COMFY_CODEC_KEYS", other)
    ring = CodecSettings().key_ring()
    assert ring is not None and ring.active_id == "k2"
    codec = codec_from_environ({**mapping, "DURABLE_COMFY_CODEC_KEYS": other})
    assert codec is not None and codec.active_id == "k2"
    # A key file the production file names but that is missing stops the client at start-up.
    environ.delenv("DURABLE_COMFY_CODEC_KEYS")
    (tmp_path / "keys").unlink()
    with pytest.raises(ValidationError, match="cannot read"):
        TemporalSettings()


def test_the_variables_pools_replace_the_production_files(tmp_path: Path) -> None:
    path = production_file(
        tmp_path,
        {
            "worker": {"default_pool": "local"},
            "pools": {"local": {"kind": "comfyui", "url": "http://127.0.0.1:8188"}},
        },
    )
    assert list(WorkerSettings.from_env({FILE_VAR: str(path)}).pools) == ["local"]
    env = {FILE_VAR: str(path), "DURABLE_COMFY_POOLS": json.dumps({"gpu": {"url": "http://g"}})}
    settings = WorkerSettings.from_env(env)
    assert list(settings.pools) == ["gpu"]  # replaced, not merged
    assert settings.default_pool == "local"  # the file still gives what no variable does


def test_the_gateway_reads_the_tenants_of_the_production_file_below_the_variable(
    tmp_path: Path,
) -> None:
    """The gateway refuses a too-urgent priority with the workers' tenants: from the same file
    they read (`tenants:`), unless the variable says otherwise."""
    path = production_file(tmp_path, {"tenants": {"free-tier": {"max_priority": 4}}})
    from_file = GatewaySettings.from_env({FILE_VAR: str(path)})
    assert from_file.tenants["free-tier"].max_priority == 4
    variable = {"acme": {"max_priority": 2}}
    env = {FILE_VAR: str(path), "DURABLE_COMFY_TENANTS": json.dumps(variable)}
    assert list(GatewaySettings.from_env(env).tenants) == ["acme"]  # replaced, not merged
    assert GatewaySettings.from_env({}).tenants == {}


def test_the_example_production_file_loads() -> None:
    example = ROOT / "examples" / "production.yaml"
    config = load_config_file(example)
    assert set(config.model_fields_set) == {
        "worker",
        "pools",
        "tenants",
        "storage",
        "codec",
        "client",
    }
    assert config.pools is not None
    assert {name: pool.kind for name, pool in config.pools.items()} == {
        "gpu": "runpod",
        "stock": "runpod",
        "local": "comfyui",
    }
    gpu = config.pools["gpu"]
    assert (gpu.endpoint_id, gpu.api_key_env, gpu.idle_timeout_s, gpu.claims) == (
        "abc123xyz",
        "RUNPOD_API_KEY",
        5,
        True,
    )
    assert config.pools["stock"].node_registry == example.parent / "nodes/stock-object-info.json"
    assert (gpu.max_running, gpu.max_pending) == (20, 4000)
    settings = WorkerSettings.from_env({FILE_VAR: str(example)})
    assert settings.tenants["acme"].weight == 2 and settings.tenants["free-tier"].max_priority == 3
    assert (settings.default_pool, settings.set_current, settings.metrics_port) == (
        "gpu",
        "never",
        9464,
    )
    s3 = S3Settings.from_env({FILE_VAR: str(example)})
    assert (s3.bucket, s3.region) == ("durable-comfy-artifacts", "eu-west-1")


def test_the_worker_starts_from_the_production_file_and_the_environments_secrets(
    environ: pytest.MonkeyPatch, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = production_file(
        tmp_path,
        {
            "worker": {"default_pool": "gpu", "metrics_port": 9100, "log_level": "DEBUG"},
            "pools": {
                "gpu": {"kind": "runpod", "endpoint_id": "abc123", "idle_timeout_s": 5},
                "team-b": {"kind": "runpod", "endpoint_id": "def456", "api_key_env": "RP_B"},
                "local": {"kind": "comfyui", "url": "http://127.0.0.1:8188"},
            },
            "storage": {"bucket": "prod-artifacts", "region": "eu-west-1"},
        },
    )
    environ.setenv(FILE_VAR, str(path))
    environ.setenv("RUNPOD_API_KEY", RUNPOD_KEY)
    environ.setenv("RP_B", RUNPOD_KEY + "b")
    environ.setenv("AWS_ACCESS_KEY_ID", "AKID")
    environ.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    seen: dict[str, Any] = {}

    async def fake_run_worker(
        settings: WorkerSettings,
        s3: S3Settings,
        *,
        temporal: TemporalSettings,
        runpod_keys: Mapping[str, SecretStr],
        webhooks: WebhookSettings,
    ) -> None:
        seen.update(settings=settings, s3=s3, runpod_keys=runpod_keys)

    monkeypatch.setattr(worker, "run_worker", fake_run_worker)
    monkeypatch.setattr(worker, "exit_without_finalizing", lambda code: None)
    monkeypatch.setattr(worker, "configure_logging", lambda level: seen.update(level=level))
    worker.cli_command(metrics_port=9464)
    settings = seen["settings"]
    assert (sorted(settings.pools), settings.default_pool) == (["gpu", "local", "team-b"], "gpu")
    assert (settings.metrics_port, seen["level"]) == (9464, "DEBUG")  # the option wins
    assert {name: key.get_secret_value() for name, key in seen["runpod_keys"].items()} == {
        "gpu": RUNPOD_KEY,
        "team-b": RUNPOD_KEY + "b",
    }
    s3 = seen["s3"]
    assert (s3.bucket, s3.region) == ("prod-artifacts", "eu-west-1")
    assert s3.secret_access_key.get_secret_value() == SECRET


@pytest.mark.parametrize(
    ("data", "key_path"),
    [
        ({"worker": {"metrcs_port": 9100}}, "worker.metrcs_port"),
        ({"pools": {"gpu": {"kind": "runpod", "endpont_id": "abc"}}}, "pools.gpu.endpont_id"),
        ({"storge": {"bucket": "b-1"}}, "storge"),
        ({"codec": {"key_file": "keys"}}, "codec.key_file"),
    ],
)
def test_an_unknown_key_is_refused_with_its_path(
    tmp_path: Path, data: dict[str, Any], key_path: str
) -> None:
    path = production_file(tmp_path, data)
    with pytest.raises(ConfigFileError) as caught:
        load_config_file(path)
    message = str(caught.value)
    assert f"{key_path}: unknown key (allowed here:" in message
    assert str(path) in message
    with pytest.raises(ValidationError) as through_settings:
        WorkerSettings.from_env({FILE_VAR: str(path)})
    [error] = through_settings.value.errors()
    assert error["loc"] == (FILE_VAR,) and key_path in error["msg"]


@pytest.mark.parametrize(
    ("data", "key_path", "where"),
    [
        ({"storage": {"aws_secret_access_key": SECRET}}, "storage.aws_secret_access_key", "AWS_"),
        ({"storage": {"secret_access_key": SECRET}}, "storage.secret_access_key", "AWS_"),
        ({"storage": {"access_key_id": "AKIAABCDEFGHIJKLMNOP"}}, "storage.access_key_id", "AWS_"),
        ({"storage": {"region": "AKIAABCDEFGHIJKLMNOP"}}, "storage.region", "AWS_"),
        (
            {"pools": {"gpu": {"kind": "runpod", "endpoint_id": "a", "api_key": RUNPOD_KEY}}},
            "pools.gpu.api_key",
            "api_key_env",
        ),
        (
            {"pools": {"gpu": {"kind": "runpod", "endpoint_id": "a", "api_key_env": RUNPOD_KEY}}},
            "pools.gpu.api_key_env",
            "api_key_env",
        ),
        ({"codec": {"keys": CODEC_ENTRY}}, "codec.keys", "DURABLE_COMFY_CODEC_KEYS"),
        ({"codec": {"keys_file": CODEC_ENTRY}}, "codec.keys_file", "DURABLE_COMFY_CODEC_KEYS"),
        ({"storage": {"endpoint_url": f"https://u:{SECRET}@s3"}}, "storage.endpoint_url", "AWS_"),
    ],
)
def test_a_secret_in_the_file_is_refused_saying_where_secrets_go(
    tmp_path: Path, data: dict[str, Any], key_path: str, where: str
) -> None:
    path = production_file(tmp_path, data)
    with pytest.raises(ConfigFileError) as caught:
        load_config_file(path)
    message = str(caught.value)
    assert f"{key_path}: " in message and "does not belong in this file" in message
    assert where in message
    for secret in (SECRET, RUNPOD_KEY, CODEC_ENTRY, "AKIAABCDEFGHIJKLMNOP"):
        assert secret not in message
    with pytest.raises(StorageConfigError) as through_settings:
        S3Settings.from_env({FILE_VAR: str(path), "DURABLE_COMFY_BUCKET": "b-1"})
    assert key_path in str(through_settings.value) and SECRET not in str(through_settings.value)


@pytest.mark.parametrize(
    ("data", "key_path", "what"),
    [
        (
            {"pools": {"gpu": {"kind": "runpod", "endpoint_id": "a b"}}},
            "pools.gpu.endpoint_id",
            "not a RunPod endpoint id",
        ),
        ({"pools": {"gpu": {"kind": "runpod"}}}, "pools.gpu", "needs endpoint_id"),
        ({"worker": {"metrics_port": 70000}}, "worker.metrics_port", "less than or equal"),
        ({"worker": {"set_current": "sometimes"}}, "worker.set_current", "'first'"),
        ({"storage": {"bucket": "Not_A_Bucket"}}, "storage.bucket", "not a valid S3 bucket"),
        ({"client": {"query_timeout_s": 0}}, "client.query_timeout_s", "greater than 0"),
        ({"pools": "gpu"}, "pools", "valid dictionary"),
    ],
)
def test_a_bad_value_names_the_file_and_the_key(
    tmp_path: Path, data: dict[str, Any], key_path: str, what: str
) -> None:
    path = production_file(tmp_path, data)
    with pytest.raises(ConfigFileError) as caught:
        load_config_file(path)
    assert caught.value.path == path
    assert f"{path} ({FILE_VAR}): " in str(caught.value)
    assert f"{key_path}: " in caught.value.problem and what in caught.value.problem
    # Every reader says the same: the worker, storage, the client and the codec.
    with pytest.raises(ValidationError, match=key_path):
        WorkerSettings.from_env({FILE_VAR: str(path)})
    with pytest.raises(StorageConfigError, match=key_path):
        S3Settings.from_env({FILE_VAR: str(path), "DURABLE_COMFY_BUCKET": "b-1"})
    with pytest.raises(CodecSettingsError, match=key_path):
        codec_from_environ({FILE_VAR: str(path)})


def test_unreadable_files_and_mixed_up_files_are_named(tmp_path: Path) -> None:
    missing = tmp_path / "absent.yaml"
    with pytest.raises(ConfigFileError, match=r"absent\.yaml .*cannot read it"):
        load_config_file(missing)
    broken = tmp_path / "broken.yaml"
    broken.write_text(f"storage: {{bucket: [{SECRET}\n")
    with pytest.raises(ConfigFileError, match="not valid YAML at line") as caught:
        load_config_file(broken)
    assert SECRET not in str(caught.value)
    # The dev stack's file is not a production file, and the other way round.
    with pytest.raises(ConfigFileError, match="DURABLE_COMFY_CONFIG"):
        load_config_file(ROOT / "temporal-dev.yaml")
    example = str(ROOT / "examples" / "production.yaml")
    with pytest.raises(SettingsError, match="DURABLE_COMFY_SETTINGS_FILE"):
        WorkerSettings.from_env({"DURABLE_COMFY_CONFIG": example})
    both = {"DURABLE_COMFY_CONFIG": str(stack_file(tmp_path, {})), FILE_VAR: example}
    with pytest.raises(ValidationError, match="both set"):
        WorkerSettings.from_env(both)
