"""One way to configure: every documented variable reaches its field, in the documented order.

Fast, no server: the worker's, S3's, Temporal's and the CLI's settings classes, read from a given
mapping or from a scrubbed process environment.
"""

from __future__ import annotations

import ast
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import pytest
from pydantic import SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsError
from temporalio.client import Client
from typer.testing import CliRunner

import worker
from activities.settings import (
    PoolConfig,
    S3Settings,
    WorkerSettings,
    runpod_api_keys,
    variable_names,
)
from activities.storage import ArtifactStore, StorageConfigError
from devstack.config import StackFileSettings
from starter.cli import build_app
from starter.cli.common import ExitCode, job_client
from starter.cli.settings import CliConfig, CliSettings
from starter.cli.ui import workflow_url
from starter.client import JobClient
from starter.connection import TemporalSettings

ROOT = Path(__file__).resolve().parent.parent
SECRET = "s3cr3t-value-never-shown"
ALL_SETTINGS: list[type[BaseSettings]] = [
    WorkerSettings,
    S3Settings,
    TemporalSettings,
    CliSettings,
    StackFileSettings,
]


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


def test_every_variable_read_is_documented() -> None:
    configuration = (ROOT / "docs" / "configuration.md").read_text()
    read = {
        name
        for cls in ALL_SETTINGS
        for f in cls.model_fields.values()
        for name in variable_names(f)
    }
    assert read >= {"DURABLE_COMFY_POOLS", "AWS_SECRET_ACCESS_KEY", "TEMPORAL_UI_URL"}
    assert sorted(name for name in read if f"`{name}`" not in configuration) == []


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
    ) -> None:
        seen.update(settings=settings, s3=s3, temporal=temporal, runpod_keys=runpod_keys)

    monkeypatch.setattr(worker, "run_worker", fake_run_worker)
    monkeypatch.setattr(worker, "exit_without_finalizing", lambda code: None)
    monkeypatch.setattr(worker, "configure_logging", lambda level: seen.update(level=level))
    worker.main(["--metrics-port", "9464"])
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
        worker.main([])
    message = str(caught.value.code)
    assert message.startswith("worker: invalid settings: ")
    assert "DURABLE_COMFY_S3_ENDPOINT" in message and SECRET not in message


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


def test_no_product_module_reads_the_environment_but_the_settings() -> None:
    """workflows/, activities/, starter/ and worker.py: only the settings classes read it."""
    allowed = {
        "activities/settings.py",
        # Its fallback when called without a level; the worker and the CLI always pass one.
        "activities/log_setup.py",
    }
    files = [ROOT / "worker.py"]
    for layer in ("workflows", "activities", "starter"):
        files += sorted((ROOT / layer).rglob("*.py"))
    readers = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            reads = (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")) or (
                isinstance(node, ast.ImportFrom)
                and node.module == "os"
                and any(alias.name in ("environ", "getenv") for alias in node.names)
            )
            if reads:
                readers.add(path.relative_to(ROOT).as_posix())
    assert sorted(readers - allowed) == []


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
    assert WorkerSettings.from_env({}).max_concurrent_activities == 100
    assert WorkerSettings.from_env({variable: "1000"}).max_concurrent_activities == 1000
    with pytest.raises(ValidationError, match=variable):
        WorkerSettings.from_env({variable: "0"})
