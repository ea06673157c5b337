"""What a service of the stack is (command, ports, probe, files) and how to wait for it."""

from __future__ import annotations

import asyncio
import os
import secrets
import shlex
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal, get_args

from pydantic import SecretStr

from devstack.config import StackConfig
from devstack.errors import ServiceStartError, StackError
from devstack.files import write_atomic
from devstack.probes import Probe, ProbeFailed, http_get_ok
from devstack.processes import PidRecord, is_alive, log_tail

ServiceName = Literal["temporal", "s3", "comfyui_sim", "runpod_sim"]
# Start order matters: the Temporal dev server grabs a few random ports for its internal services,
# so it goes last, when every explicitly configured port is already bound by its owner.
SERVICE_NAMES: tuple[ServiceName, ...] = ("s3", "comfyui_sim", "runpod_sim", "temporal")
assert set(SERVICE_NAMES) == set(get_args(ServiceName))

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# The RunPod simulator's workers run our handler in the endpoint's own venv (`make install`
# builds it from endpoint/requirements.txt: the runpod SDK cannot share the app's venv).
ENDPOINT_PYTHON = PROJECT_ROOT / ".venv-endpoint" / "bin" / "python"
ENDPOINT_HANDLER = "endpoint/handler.py"
# Where the RunPod simulator reads its API key from (never from its command line, which any
# local user can read), and the name the stack's env file gives it for workers and clients.
RUNPOD_SIM_KEY_VAR = "RUNPOD_SIM_API_KEY"
RUNPOD_KEY_VAR = "RUNPOD_API_KEY"
# The bucket settings our handler reads (worker-comfyui's names), handed to every simulated
# worker by name (`--worker-env NAME`) with the values in the simulator's environment.
BUCKET_VARS = ("BUCKET_ENDPOINT_URL", "BUCKET_ACCESS_KEY_ID", "BUCKET_SECRET_ACCESS_KEY")
BUCKET_REGION_VAR = "BUCKET_REGION"
# The orchestrator's bucket, where our handler publishes its ComfyUI's node registry at start
# (activities/runpod/nodes.py reads it before a job reaches a paid worker).
NODES_BUCKET_VAR = "DURABLE_COMFY_BUCKET"
# Real seconds the simulator gives each worker between SIGTERM and SIGKILL when it stops one.
RUNPOD_WORKER_STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class StackPaths:
    state_dir: Path

    @classmethod
    def of(cls, config: StackConfig, base_dir: Path) -> StackPaths:
        state = Path(config.state_dir)
        if not state.is_absolute():
            state = base_dir / state
        return cls(state_dir=state.resolve())

    @property
    def logs(self) -> Path:
        return self.state_dir / "logs"

    @property
    def pids(self) -> Path:
        return self.state_dir / "pids"

    @property
    def env_file(self) -> Path:
        return self.state_dir / "env"

    @property
    def temporal_toml(self) -> Path:
        return self.state_dir / "temporal.toml"

    @property
    def s3_credentials(self) -> Path:
        return self.state_dir / "s3-credentials.json"

    @property
    def s3_identities(self) -> Path:
        return self.state_dir / "seaweedfs-identities.json"

    @property
    def run(self) -> Path:
        return self.state_dir / "run"

    @property
    def seaweed_config_dir(self) -> Path:
        return self.state_dir / "seaweedfs-config"

    @property
    def runpod_api_key(self) -> Path:
        return self.state_dir / "runpod-sim-api-key"

    @property
    def effective_config(self) -> Path:
        return self.state_dir / "temporal-dev.effective.yaml"

    def log_file(self, name: ServiceName) -> Path:
        return self.logs / f"{name}.log"

    def pid_file(self, name: ServiceName) -> Path:
        return self.pids / f"{name}.pid"


@dataclass(frozen=True)
class ServiceSpec:
    name: ServiceName
    host: str
    # (config key, port) for every port the service binds, checked before anything starts.
    ports: tuple[tuple[str, int], ...]
    # Built only when starting, so that `status` and `down` work without the binaries.
    build_argv: Callable[[], tuple[str, ...]]
    cwd: Path
    log_file: Path
    pid_file: Path
    probe: Probe
    url: str
    check_wildcard: bool = False
    # Runs right before spawning (never while the service is up): directories, config files.
    prepare: Callable[[], None] | None = None
    # Runs once the process is gone: whatever it leaves behind outside the state dir.
    cleanup: Callable[[], None] | None = None
    startup_timeout_s: float = 60.0
    stop_grace_s: float = 15.0
    env: dict[str, str] = field(default_factory=dict)
    unset_env: tuple[str, ...] = ()
    # Shown after the URL (`dev up`, `dev status`): what the URL alone does not say.
    note: str | None = None
    # The service starts children in sessions of their own (the RunPod simulator's workers),
    # which a signal to its process group misses: it stops them itself on SIGTERM, and whatever
    # outlives it is killed by group once it is gone.
    reap_child_groups: bool = False


def comfy_sim_argv(config: StackConfig, base_dir: Path) -> tuple[str, ...]:
    sim = config.comfyui_sim
    # Only when set: an unchanged config keeps the argv a running stack was started with.
    cost = () if sim.ms_per_megapixel is None else ("--ms-per-megapixel", str(sim.ms_per_megapixel))
    return (
        sys.executable,
        "-m",
        "devstack.comfy_sim",
        "--host",
        sim.host,
        "--port",
        str(sim.port),
        "--output-dir",
        str(config.path(base_dir, sim.output_dir).resolve()),
        "--input-dir",
        str(config.path(base_dir, sim.input_dir).resolve()),
        "--step-delay-ms",
        str(sim.step_delay_ms),
        *cost,
    )


def comfy_sim_spec(config: StackConfig, base_dir: Path, paths: StackPaths) -> ServiceSpec:
    sim = config.comfyui_sim
    # The project is not necessarily installed into the venv; the simulator must import it anyway.
    pythonpath = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p)
    return ServiceSpec(
        name="comfyui_sim",
        host=sim.host,
        ports=(("comfyui_sim.port", sim.port),),
        build_argv=partial(comfy_sim_argv, config, base_dir),
        cwd=paths.state_dir,
        log_file=paths.log_file("comfyui_sim"),
        pid_file=paths.pid_file("comfyui_sim"),
        probe=partial(http_get_ok, f"{sim.url}/system_stats"),
        url=sim.url,
        startup_timeout_s=30.0,
        stop_grace_s=5.0,
        env={"PYTHONPATH": pythonpath},
        prepare=partial(_make_dirs, config, base_dir, (sim.output_dir, sim.input_dir)),
    )


def load_or_create_runpod_key(path: Path) -> SecretStr:
    """The RunPod simulator's API key: made at the first `up`, kept 0600 in the state dir."""
    if path.exists():
        path.chmod(0o600)
        key = path.read_text().strip()
        if key:
            return SecretStr(key)
    key = f"sim-{secrets.token_hex(24)}"
    write_atomic(path, key + "\n", mode=0o600)
    return SecretStr(key)


def endpoint_venv_missing() -> str | None:
    """Why the RunPod simulator's workers could not start, or None."""
    if ENDPOINT_PYTHON.exists():
        return None
    return f"{ENDPOINT_PYTHON} is missing: `make install` builds the endpoint's venv"


def runpod_sim_argv(config: StackConfig, base_dir: Path) -> tuple[str, ...]:
    sim = config.runpod_sim
    # Names only: the values (the bucket's keys among them) are in the simulator's environment.
    names = (*BUCKET_VARS, BUCKET_REGION_VAR, NODES_BUCKET_VAR)
    worker_env = [f"--worker-env={name}" for name in names]
    return (
        sys.executable,
        "-m",
        "devstack.runpod_sim",
        "--host",
        sim.host,
        "--port",
        str(sim.port),
        "--endpoint-id",
        sim.endpoint_id,
        "--worker-command",
        shlex.join((str(ENDPOINT_PYTHON), ENDPOINT_HANDLER)),
        "--worker-cwd",
        str(PROJECT_ROOT),
        *worker_env,
        "--comfy-sim-per-worker",
        f"--comfy-sim-args=--step-delay-ms {sim.comfyui_step_delay_ms}",
        "--work-dir",
        str(config.path(base_dir, sim.work_dir).resolve()),
        "--idle-timeout",
        str(sim.idle_timeout_s),
        "--max-workers",
        str(sim.max_workers),
        "--stop-grace",
        str(RUNPOD_WORKER_STOP_GRACE_S),
    )


def runpod_sim_spec(
    config: StackConfig,
    base_dir: Path,
    paths: StackPaths,
    bucket_env: Mapping[str, str] | None,
    api_key: SecretStr | None,
) -> ServiceSpec:
    """`bucket_env` (BUCKET_*) and `api_key` are needed only to start it: `status` and `down`
    pass None."""
    sim = config.runpod_sim
    pythonpath = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": pythonpath, **(bucket_env or {})}
    if api_key is not None:
        env[RUNPOD_SIM_KEY_VAR] = api_key.get_secret_value()
    return ServiceSpec(
        name="runpod_sim",
        host=sim.host,
        # The per-worker ComfyUI simulators take free ports of the simulator's choosing (below
        # the kernel's ephemeral range), each only while its worker lives.
        ports=(("runpod_sim.port", sim.port),),
        build_argv=partial(runpod_sim_argv, config, base_dir),
        cwd=paths.state_dir,
        log_file=paths.log_file("runpod_sim"),
        pid_file=paths.pid_file("runpod_sim"),
        probe=partial(http_get_ok, f"{sim.base_url}/sim/health"),
        url=sim.api_url,
        note=f"endpoint {sim.endpoint_id}",
        startup_timeout_s=30.0,
        # On SIGTERM it stops every worker: up to 2 s for job-stop signals to go out, the
        # worker's grace, then its ComfyUI simulator's (5 s); SIGKILL would leave them running.
        stop_grace_s=30.0,
        env=env,
        # A real key in the caller's shell is none of the simulator's business.
        unset_env=(RUNPOD_KEY_VAR,),
        prepare=partial(_prepare_runpod_sim, config, base_dir, bucket_env, api_key),
        reap_child_groups=True,
    )


def _prepare_runpod_sim(
    config: StackConfig,
    base_dir: Path,
    bucket_env: Mapping[str, str] | None,
    api_key: SecretStr | None,
) -> None:
    if bucket_env is None or api_key is None:
        raise StackError("no S3 credentials or RunPod API key to start the RunPod simulator with")
    config.path(base_dir, config.runpod_sim.work_dir).mkdir(parents=True, exist_ok=True)


def _make_dirs(config: StackConfig, base_dir: Path, relative: tuple[str, ...]) -> None:
    for directory in relative:
        config.path(base_dir, directory).mkdir(parents=True, exist_ok=True)


async def probe_once(spec: ServiceSpec, timeout_s: float = 3.0) -> str | None:
    """None when healthy, else why not."""
    try:
        await asyncio.wait_for(spec.probe(), timeout=timeout_s)
    except TimeoutError:
        return f"probe timed out after {timeout_s:.1f}s"
    except ProbeFailed as exc:
        return str(exc)
    return None


async def wait_ready(spec: ServiceSpec, record: PidRecord) -> float:
    """Poll the probe until it passes; seconds taken. Fails fast if the process exits."""
    started = time.monotonic()
    deadline = started + spec.startup_timeout_s
    last_error = "no answer yet"
    while True:
        if not is_alive(record):
            raise ServiceStartError(
                spec.name,
                f"process {record.pid} exited (last probe: {last_error})",
                str(spec.log_file),
                log_tail(spec.log_file),
            )
        remaining = deadline - time.monotonic()
        error = await probe_once(spec, timeout_s=max(0.5, min(5.0, remaining)))
        if error is None:
            return time.monotonic() - started
        last_error = error
        if time.monotonic() >= deadline:
            raise ServiceStartError(
                spec.name,
                f"no healthy answer within {spec.startup_timeout_s:.0f}s"
                f" (last probe: {last_error})",
                str(spec.log_file),
                log_tail(spec.log_file),
            )
        await asyncio.sleep(0.1)
