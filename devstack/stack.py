"""Start, stop and inspect the local stack: Temporal dev server, SeaweedFS S3, the ComfyUI
simulator and the RunPod simulator.

Services run detached (own session, logs in STATE/logs, PIDs in STATE/pids), so they outlive the
process that started them; `down` stops exactly the recorded PIDs and keeps the data.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import structlog
import yaml
from pydantic import SecretStr

from devstack.codec_server import keys_file, start_codec_server, stop_codec_server
from devstack.config import StackConfig
from devstack.errors import ServiceStopError, StackError
from devstack.files import write_atomic
from devstack.models import RunningStack, ServiceState, StackStatus
from devstack.processes import (
    PidRecord,
    check_port_free,
    is_alive,
    read_pid_file,
    spawn_detached,
    terminate,
)
from devstack.seaweed import (
    S3Credentials,
    load_credentials,
    load_or_create_credentials,
    seaweed_spec,
)
from devstack.services import (
    NODES_BUCKET_VAR,
    SERVICE_NAMES,
    ServiceName,
    ServiceSpec,
    StackPaths,
    comfy_sim_spec,
    load_or_create_runpod_key,
    probe_once,
    runpod_sim_spec,
    wait_ready,
)
from devstack.temporal_server import PROFILE_NAME, temporal_spec, write_temporal_toml

__all__ = [
    "RunningStack",
    "ServiceState",
    "StackStatus",
    "stack_ports",
    "stack_status",
    "start_service",
    "start_stack",
    "stop_service",
    "stop_stack",
]

log = structlog.get_logger(__name__)


def _bucket_env(config: StackConfig, creds: S3Credentials) -> dict[str, str]:
    """The stack's bucket, in the names our RunPod handler reads (worker-comfyui's), and the
    bucket it publishes its node registry to (the orchestrator's, the same one here)."""
    return {
        "BUCKET_ENDPOINT_URL": config.s3.endpoint_url,
        "BUCKET_ACCESS_KEY_ID": creds.access_key_id,
        "BUCKET_SECRET_ACCESS_KEY": creds.secret_access_key.get_secret_value(),
        "BUCKET_REGION": config.s3.region,
        NODES_BUCKET_VAR: config.s3.bucket,
    }


def _specs(
    config: StackConfig,
    base_dir: Path,
    creds: S3Credentials | None,
    runpod_key: SecretStr | None = None,
) -> dict[ServiceName, ServiceSpec]:
    """Every service; `creds` and `runpod_key` are needed only to start them."""
    paths = StackPaths.of(config, base_dir)
    bucket_env = _bucket_env(config, creds) if creds is not None else None
    return {
        "s3": seaweed_spec(config, base_dir, paths, creds),
        "comfyui_sim": comfy_sim_spec(config, base_dir, paths),
        "runpod_sim": runpod_sim_spec(config, base_dir, paths, bucket_env, runpod_key),
        "temporal": temporal_spec(config, base_dir, paths),
    }


def stack_ports(config: StackConfig) -> dict[ServiceName, tuple[tuple[str, int], ...]]:
    """(config key, port) for every port each service binds: what `up` checks before starting."""
    specs = _specs(config, Path(config.state_dir), None)
    return {name: specs[name].ports for name in SERVICE_NAMES}


def _running_record(spec: ServiceSpec) -> PidRecord | None:
    """The recorded process if it is still alive; a stale PID file is removed."""
    record = read_pid_file(spec.pid_file)
    if record is None:
        spec.pid_file.unlink(missing_ok=True)
        return None
    if is_alive(record):
        return record
    spec.pid_file.unlink(missing_ok=True)
    return None


def _check_ports(specs: list[ServiceSpec]) -> None:
    seen: dict[int, str] = {}
    for spec in specs:
        for key, port in spec.ports:
            if port in seen:
                raise StackError(
                    f"port {port} is configured twice ({seen[port]} and {key})",
                    hint="give every service its own port",
                )
            seen[port] = key
    for spec in specs:
        hosts = (spec.host, "0.0.0.0") if spec.check_wildcard else (spec.host,)
        for key, port in spec.ports:
            for host in hosts:
                check_port_free(host, port, spec.name, key)


async def _ensure(
    specs: dict[ServiceName, ServiceSpec], names: tuple[ServiceName, ...]
) -> dict[ServiceName, ServiceState]:
    """Start whichever of `names` is not running and wait until all answer their probes.

    All-or-nothing: if any fails, the ones this call started are stopped again.
    """
    running = {name: _running_record(specs[name]) for name in names}
    # Build every command first: a missing binary must fail before anything is spawned.
    argvs = {name: specs[name].build_argv() for name in names}
    for name, record in running.items():
        # Ports or flags changed in the config since `up`: "already running" would be a lie.
        if record is not None and record.argv[1:] != list(argvs[name][1:]):
            raise StackError(
                f"{name} is already running (pid {record.pid}) with other settings",
                hint="run `durable-comfy dev down`, then `up` again",
            )
    to_start = [specs[name] for name in names if running[name] is None]
    _check_ports(to_start)  # before anything starts, so a clash leaves nothing half-up
    for spec in to_start:
        if spec.prepare is not None:
            spec.prepare()
    started: dict[ServiceName, PidRecord] = {}
    records: dict[ServiceName, PidRecord] = {}
    try:
        for name in names:
            spec = specs[name]
            record = running[name]
            if record is None:
                record = spawn_detached(
                    argvs[name], spec.log_file, spec.cwd, spec.pid_file, spec.env, spec.unset_env
                )
                started[name] = record
                log.info("service starting", service=name, pid=record.pid)
            records[name] = record
        results = await asyncio.gather(
            *(wait_ready(specs[name], records[name]) for name in names), return_exceptions=True
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise failures[0]
    except BaseException:
        await asyncio.gather(
            *(_stop(specs[name], rec, signal.SIGTERM) for name, rec in started.items())
        )
        raise

    states: dict[ServiceName, ServiceState] = {}
    for name, ready_s in zip(names, results, strict=True):
        assert isinstance(ready_s, float)
        spec = specs[name]
        states[name] = ServiceState(
            name=name,
            state="running",
            action="started" if name in started else "already running",
            pid=records[name].pid,
            url=spec.url,
            note=spec.note,
            log_file=spec.log_file,
            ready_s=round(ready_s, 3) if name in started else None,
        )
        log.info("service ready", service=name, action=states[name].action, ready_s=ready_s)
    return states


def _stat_fields(pid_dir: Path) -> list[str] | None:
    try:
        raw = (pid_dir / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; fields resume after the last ")".
    return raw[raw.rindex(")") + 2 :].split()


def _child_groups(record: PidRecord) -> list[int]:
    """The process groups led by the service's children outside its own group (from /proc;
    none off Linux): a signal to the service's group does not reach them."""
    groups: list[int] = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        fields = _stat_fields(pid_dir)
        if fields is None:
            continue
        pid, ppid, pgrp = int(pid_dir.name), int(fields[1]), int(fields[2])
        if ppid == record.pid and pgrp == pid and pgrp != record.pgid:
            groups.append(pgrp)
    return groups


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of the group."""
    members: list[int] = []
    for pid_dir in Path("/proc").iterdir():
        if pid_dir.name.isdigit():
            fields = _stat_fields(pid_dir)
            if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(pid_dir.name))
    return members


async def _wait_groups_gone(groups: list[int], within_s: float) -> list[int]:
    """The groups that still have live members after `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        left = [pgid for pgid in groups if _group_members(pgid)]
        if not left or time.monotonic() >= deadline:
            return left
        await asyncio.sleep(0.05)


async def _stop(spec: ServiceSpec, record: PidRecord, sig: signal.Signals) -> str | None:
    """Stop the service; for one with child groups, what became of them (None: it had none)."""
    children = _child_groups(record) if spec.reap_child_groups else []
    await terminate(record, sig, grace_s=spec.stop_grace_s)
    spec.pid_file.unlink(missing_ok=True)
    if spec.cleanup is not None:
        spec.cleanup()
    if not children:
        return None
    # The service stops them itself on SIGTERM (a group's last members may take a moment to
    # go); whatever outlives that (after a SIGKILL of the service, say) is killed here by group,
    # never by name.
    leftovers = await _wait_groups_gone(children, within_s=5.0)
    for pgid in leftovers:
        log.warning("child group outlived its service, killing", service=spec.name, pgid=pgid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    if await _wait_groups_gone(leftovers, within_s=5.0):
        raise ServiceStopError(f"{spec.name}: child process groups survived SIGKILL")
    detail = f"{len(children)} child process group(s) stopped with it"
    if leftovers:
        detail += f", {len(leftovers)} of them killed after it was gone"
    return detail


def _write_client_files(
    config: StackConfig,
    base_dir: Path,
    creds: S3Credentials,
    runpod_key: SecretStr,
    config_file: Path | None,
) -> RunningStack:
    paths = StackPaths.of(config, base_dir)
    if config_file is None:
        # Called as a library: the worker still needs a config file, so write the effective one.
        effective = config.model_copy(update={"state_dir": str(paths.state_dir)})
        write_atomic(
            paths.effective_config,
            yaml.safe_dump(effective.model_dump(mode="json"), sort_keys=False),
        )
        config_file = paths.effective_config
    codec = config.codec if config.codec.enabled else None
    write_temporal_toml(paths.temporal_toml, config.temporal, codec.url if codec else None)
    stack = RunningStack(
        temporal_address=config.temporal.address,
        namespace=config.temporal.namespace,
        temporal_ui=config.temporal.ui_url,
        s3_endpoint=config.s3.endpoint_url,
        bucket=config.s3.bucket,
        region=config.s3.region,
        access_key_id=creds.access_key_id,
        secret_access_key=creds.secret_access_key,
        comfyui_url=config.comfyui_sim.url,
        runpod_url=config.runpod_sim.api_url,
        runpod_endpoint_id=config.runpod_sim.endpoint_id,
        runpod_api_key=runpod_key,
        state_dir=paths.state_dir,
        env_file=paths.env_file,
        temporal_config_file=paths.temporal_toml,
        temporal_profile=PROFILE_NAME,
        config_file=config_file.resolve(),
        codec_keys_file=keys_file(config, base_dir) if codec else None,
        codec_endpoint=codec.url if codec else None,
    )
    write_atomic(paths.env_file, stack.env_file_text(), mode=0o600)
    return stack


async def start_stack(
    config: StackConfig, base_dir: Path, config_file: Path | None = None
) -> RunningStack:
    """Start what is not running, wait until every service answers, write env + client profile.

    `config_file` is what DURABLE_COMFY_CONFIG points at; without it the effective config is
    written to the state dir.
    """
    paths = StackPaths.of(config, base_dir)
    paths.state_dir.mkdir(parents=True, exist_ok=True)
    creds = load_or_create_credentials(paths.s3_credentials)
    runpod_key = load_or_create_runpod_key(paths.runpod_api_key)
    states = await _ensure(_specs(config, base_dir, creds, runpod_key), SERVICE_NAMES)
    if config.codec.enabled:
        pid, action = await start_codec_server(config, base_dir)
        log.info("codec server ready", pid=pid, action=action, url=config.codec.url)
    stack = _write_client_files(config, base_dir, creds, runpod_key, config_file)
    return stack.model_copy(update={"services": states})


async def stop_stack(config: StackConfig, base_dir: Path) -> dict[ServiceName, ServiceState]:
    """SIGTERM (then SIGKILL) exactly the recorded PIDs; data, credentials and logs stay."""
    await stop_codec_server(config, base_dir)
    states = await asyncio.gather(
        *(stop_service(config, base_dir, name) for name in reversed(SERVICE_NAMES))
    )
    return {state.name: state for state in states}


async def start_service(config: StackConfig, base_dir: Path, name: ServiceName) -> ServiceState:
    """Start one service (if not running) and wait for it; for restarts in chaos tests."""
    paths = StackPaths.of(config, base_dir)
    paths.state_dir.mkdir(parents=True, exist_ok=True)
    creds = load_or_create_credentials(paths.s3_credentials)
    runpod_key = load_or_create_runpod_key(paths.runpod_api_key)
    states = await _ensure(_specs(config, base_dir, creds, runpod_key), (name,))
    return states[name]


async def stop_service(
    config: StackConfig,
    base_dir: Path,
    name: ServiceName,
    sig: signal.Signals = signal.SIGTERM,
) -> ServiceState:
    """Send `sig` to the service's process group, SIGKILL after its grace period if need be."""
    spec = _specs(config, base_dir, None)[name]
    record = _running_record(spec)
    detail = None
    if record is not None:
        detail = await _stop(spec, record, sig)
        log.info("service stopped", service=name, pid=record.pid, signal=sig.name)
    return ServiceState(
        name=name,
        state="stopped",
        action="stopped" if record is not None else "was not running",
        pid=record.pid if record is not None else None,
        url=spec.url,
        note=spec.note,
        log_file=spec.log_file,
        detail=detail,
    )


async def stack_status(config: StackConfig, base_dir: Path) -> StackStatus:
    paths = StackPaths.of(config, base_dir)
    specs = _specs(config, base_dir, load_credentials(paths.s3_credentials))

    async def one(name: ServiceName) -> ServiceState:
        spec = specs[name]
        record = _running_record(spec)
        if record is None:
            return ServiceState(
                name=name, state="stopped", url=spec.url, note=spec.note, log_file=spec.log_file
            )
        problem = await probe_once(spec, timeout_s=3.0)
        return ServiceState(
            name=name,
            state="running" if problem is None else "unhealthy",
            pid=record.pid,
            url=spec.url,
            note=spec.note,
            log_file=spec.log_file,
            detail=problem,
        )

    states = await asyncio.gather(*(one(name) for name in SERVICE_NAMES))
    return StackStatus(
        state_dir=paths.state_dir,
        env_file=paths.env_file,
        services={state.name: state for state in states},
    )
