"""Settings of the RunPod serverless simulator (durable-comfy's stand-in for RunPod's control
plane; not RunPod). The CLI flags map one to one onto these fields."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SIM_VERSION = "sim-0.1 (durable-comfy RunPod serverless simulator)"
PROJECT_ROOT = Path(__file__).resolve().parents[2]

# What happens to the job of a worker that dies mid-job. RunPod does not document it: expect
# TIMED_OUT, a re-delivery to another worker (reported for OOM-killed workers), or IN_PROGRESS until
# the execution timeout.
DeathOutcome = Literal["timed_out", "redeliver", "stuck"]
# Whether each worker gets a watchdog beside its handler (worker_watchdog.py). auto: when the
# worker runs our handler (endpoint/handler.py), as endpoint/start.sh starts one on the image.
WatchdogMode = Literal["auto", "on", "off"]
OUR_HANDLER = "endpoint/handler.py"
OUR_WATCHDOG = "endpoint/watchdog.py"
MB = 1024 * 1024


class RateLimits(BaseModel):
    """Requests per window (RunPod: per 10 s) before answering 429."""

    model_config = ConfigDict(extra="forbid")

    window_s: float = Field(default=10.0, gt=0)
    run: int = Field(default=1000, ge=1)  # /run and /runsync
    status: int = Field(default=2000, ge=1)  # /status and /stream
    cancel: int = Field(default=100, ge=1)


class SimSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    # A real port: the workers are told this address (no ephemeral port 0).
    port: int = Field(default=8000, ge=1, le=65535)
    api_key: str = Field(default="sim-api-key", min_length=1)
    endpoint_id: str = Field(default="sim-endpoint", pattern=r"^[A-Za-z0-9_-]+$")

    # The worker: one process per worker, started in `worker_cwd` with RunPod's variables set.
    worker_command: tuple[str, ...] = (".venv-endpoint/bin/python", "endpoint/handler.py")
    worker_cwd: Path = PROJECT_ROOT
    worker_env: dict[str, str] = Field(default_factory=dict)
    # "module:attr" of a callable returning a WorkerEnvFactory (see env_factories.py).
    worker_env_factory: str | None = None
    comfy_sim_per_worker: bool = False
    comfy_sim_args: tuple[str, ...] = ()
    # Worker logs and per-worker files; a fresh temporary directory when not given.
    work_dir: Path | None = None
    # The watchdog beside each worker's handler: started with `--pid <handler pid>` and the
    # handler's environment, in a session of its own. The command defaults to the handler's
    # interpreter running endpoint/watchdog.py.
    watchdog: WatchdogMode = "auto"
    watchdog_command: tuple[str, ...] | None = None
    # Each worker's BUCKET_ENDPOINT_URL (http only) goes through a TCP proxy of the simulator's
    # own, which the `partition` fault shuts: that worker alone loses S3.
    s3_proxy: bool = True

    # Every duration the platform measures (TTL, execution timeout, retention, idle timeout, cold
    # start, runsync's wait, delayTime/executionTime, billing) runs on the simulator clock, which
    # runs `clock_speed` times faster than real time. Network long-polls and rate-limit windows are
    # about real traffic and stay in real seconds.
    clock_speed: float = Field(default=1.0, gt=0)

    max_workers: int = Field(default=3, ge=0)  # RunPod's default for a new endpoint
    # RunPod's "active" workers: kept running (and billed) without jobs, never idle-stopped,
    # replaced when they die.
    min_workers: int = Field(default=0, ge=0)
    idle_timeout_s: float = Field(default=5.0, ge=0)
    cold_start_s: float = Field(default=0.0, ge=0)
    # Real seconds between SIGTERM (the SDK finishes its in-flight job) and SIGKILL.
    stop_grace_s: float = Field(default=5.0, ge=0)
    # RUNPOD_PING_INTERVAL; the SDK sleeps int(ms) // 1000 seconds, so below 1000 it would spin.
    ping_interval_ms: int = Field(default=10_000, ge=1000)
    runpod_log_level: str = "INFO"
    worker_death: DeathOutcome = "timed_out"
    execution_timeout_status: Literal["TIMED_OUT", "FAILED"] = "TIMED_OUT"

    # Real seconds a job-take / job-stop / stream request is held open when there is nothing yet.
    take_poll_s: float = Field(default=2.0, ge=0)
    stop_poll_s: float = Field(default=5.0, ge=0)
    stream_poll_s: float = Field(default=1.0, ge=0)

    default_execution_timeout_ms: int = Field(default=600_000, ge=5_000)
    default_ttl_ms: int = Field(default=24 * 3600 * 1000, ge=10_000)
    run_retention_s: float = Field(default=30 * 60, ge=0)
    runsync_retention_s: float = Field(default=60, ge=0)
    runsync_default_wait_ms: int = Field(default=90_000, ge=1000, le=300_000)

    max_run_body_mb: float = Field(default=10, gt=0)
    max_runsync_body_mb: float = Field(default=20, gt=0)
    max_stream_chunk_mb: float = Field(default=1, gt=0)
    # A job-done body above this is refused (400) and the job is COMPLETED without output, as
    # users report for worker-comfyui's big base64 results.
    max_result_mb: float = Field(default=20, gt=0)

    rate_limits: RateLimits = Field(default_factory=RateLimits)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @model_validator(mode="after")
    def _workers_range(self) -> SimSettings:
        if self.min_workers > self.max_workers:
            raise ValueError("min_workers cannot exceed max_workers")
        return self

    def limit_bytes(self, megabytes: float) -> int:
        return round(megabytes * MB)

    def runs_our_handler(self) -> bool:
        return any(Path(arg).as_posix().endswith(OUR_HANDLER) for arg in self.worker_command)

    def watchdog_argv(self) -> tuple[str, ...] | None:
        """The watchdog's command (without `--pid`), or None when workers get none. In auto
        mode a missing endpoint/watchdog.py means none (a checkout from before it existed);
        with `on`, a missing script is the watchdog's own failure to start, in its log."""
        if self.watchdog == "off":
            return None
        if self.watchdog == "auto" and not self.runs_our_handler():
            return None
        if self.watchdog_command:
            return self.watchdog_command
        if self.watchdog == "auto" and not (self.worker_cwd / OUR_WATCHDOG).is_file():
            return None
        return (self.worker_command[0], OUR_WATCHDOG)
