"""A worker process for the local stack, started detached like the other services.

`make demo` uses it so the demo's job has a worker; `durable-comfy dev down` stops it with the
rest (its PID file sits beside theirs).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel

from devstack.config import CONFIG_ENV, StackConfig
from devstack.errors import ServiceStartError
from devstack.files import write_atomic
from devstack.processes import is_alive, log_tail, read_pid_file, spawn_detached, terminate
from devstack.services import StackPaths

READY_MARK = "worker_started"
START_DEADLINE_S = 60.0
WORKER_PY = Path(__file__).resolve().parent.parent / "worker.py"


class DetachedWorker(BaseModel):
    pid: int
    log_file: Path
    started: bool
    # A worker of ours was running with other settings and was replaced.
    restarted: bool = False


class WorkerProcessState(BaseModel):
    """The stack's detached worker (the one `dev down` stops), as `dev status` reports it."""

    pid: int
    alive: bool
    # The stack file's worker.task_queue: what the worker is started with (stack.worker_env()
    # names the stack file and no queue of its own).
    task_queue: str
    log_file: Path


def _paths(config: StackConfig, base_dir: Path) -> tuple[Path, Path]:
    paths = StackPaths.of(config, base_dir)
    return paths.pids / "worker.pid", paths.logs / "worker.log"


def _settings_file(pid_file: Path) -> Path:
    return pid_file.with_suffix(".settings")


def settings_fingerprint(env: Mapping[str, str]) -> str:
    """A digest of what the worker reads once at start: the environment it is given and the
    stack file that environment names (its `worker:` section). No secret is stored, only this."""
    digest = hashlib.sha256(json.dumps(sorted(env.items())).encode())
    config_file = env.get(CONFIG_ENV)
    if config_file:
        try:
            digest.update(Path(config_file).read_bytes())
        except OSError:
            pass  # the worker itself says what is wrong with it
    return digest.hexdigest()


async def ensure_worker(
    config: StackConfig, base_dir: Path, env: Mapping[str, str]
) -> DetachedWorker:
    """Start `python worker.py` unless one of ours runs with these settings (one started with
    other settings, e.g. before the stack file changed, is stopped first); wait until it polls
    its task queue."""
    pid_file, log_file = _paths(config, base_dir)
    fingerprint = settings_fingerprint(env)
    record = read_pid_file(pid_file)
    restarted = False
    if record is not None and is_alive(record):
        try:
            running_with = _settings_file(pid_file).read_text().strip()
        except OSError:
            running_with = None
        if running_with == fingerprint:
            return DetachedWorker(pid=record.pid, log_file=log_file, started=False)
        await stop_worker(config, base_dir)
        restarted = True
    offset = log_file.stat().st_size if log_file.exists() else 0
    record = spawn_detached(
        [sys.executable, str(WORKER_PY)], log_file, base_dir, pid_file, env=dict(env)
    )
    write_atomic(_settings_file(pid_file), fingerprint + "\n", mode=0o600)
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        if not is_alive(record):
            raise ServiceStartError(
                "worker", "it exited at start", str(log_file), log_tail(log_file)
            )
        with log_file.open("rb") as f:
            f.seek(offset)
            ready = _ready_line(f.read())
        if ready is not None:
            if ready.get("current") is False:
                # Its version is not the deployment's current one: new jobs would wait for
                # another version's workers (docs/upgrading.md). Said now, not as a stuck job.
                await stop_worker(config, base_dir)
                raise ServiceStartError(
                    "worker",
                    "its version is not the current one of its Worker Deployment, so no new "
                    "job would reach it (see worker_version_not_current in its log)",
                    str(log_file),
                    log_tail(log_file),
                )
            return DetachedWorker(
                pid=record.pid, log_file=log_file, started=True, restarted=restarted
            )
        await asyncio.sleep(0.2)
    raise ServiceStartError(
        "worker", f"not ready after {START_DEADLINE_S:.0f} s", str(log_file), log_tail(log_file)
    )


def _ready_line(log: bytes) -> dict[str, object] | None:
    """The worker's `worker_started` log record (JSON), once it is written."""
    for line in log.splitlines():
        if READY_MARK.encode() in line:
            try:
                record = json.loads(line)
            except ValueError:
                return {}  # not JSON (a console renderer): started, nothing more to read
            return record if isinstance(record, dict) else {}
    return None


def worker_state(config: StackConfig, base_dir: Path) -> WorkerProcessState | None:
    """Our worker by its PID file, alive or not; None when none was started (or it was
    stopped by `dev down`, which removes the file)."""
    pid_file, log_file = _paths(config, base_dir)
    record = read_pid_file(pid_file)
    if record is None:
        return None
    return WorkerProcessState(
        pid=record.pid,
        alive=is_alive(record),
        task_queue=config.worker.task_queue,
        log_file=log_file,
    )


async def stop_worker(config: StackConfig, base_dir: Path) -> int | None:
    """Stop our worker if it runs; its SIGTERM handler hands running prompts over cleanly."""
    pid_file, _log_file = _paths(config, base_dir)
    record = read_pid_file(pid_file)
    if record is None:
        return None
    if is_alive(record):
        await terminate(record)
    pid_file.unlink(missing_ok=True)
    _settings_file(pid_file).unlink(missing_ok=True)
    return record.pid
