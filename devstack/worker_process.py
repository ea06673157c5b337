"""A worker process for the local stack, started detached like the other services.

`make demo` uses it so the demo's job has a worker; `durable-comfy dev down` stops it with the
rest (its PID file sits beside theirs).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel

from devstack.config import StackConfig
from devstack.errors import ServiceStartError
from devstack.processes import is_alive, log_tail, read_pid_file, spawn_detached, terminate
from devstack.services import StackPaths

READY_MARK = "worker_started"
START_DEADLINE_S = 60.0
WORKER_PY = Path(__file__).resolve().parent.parent / "worker.py"


class DetachedWorker(BaseModel):
    pid: int
    log_file: Path
    started: bool


def _paths(config: StackConfig, base_dir: Path) -> tuple[Path, Path]:
    paths = StackPaths.of(config, base_dir)
    return paths.pids / "worker.pid", paths.logs / "worker.log"


async def ensure_worker(
    config: StackConfig, base_dir: Path, env: Mapping[str, str]
) -> DetachedWorker:
    """Start `python worker.py` unless one of ours runs; wait until it polls its task queue."""
    pid_file, log_file = _paths(config, base_dir)
    record = read_pid_file(pid_file)
    if record is not None and is_alive(record):
        return DetachedWorker(pid=record.pid, log_file=log_file, started=False)
    offset = log_file.stat().st_size if log_file.exists() else 0
    record = spawn_detached(
        [sys.executable, str(WORKER_PY)], log_file, base_dir, pid_file, env=dict(env)
    )
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        if not is_alive(record):
            raise ServiceStartError(
                "worker", "it exited at start", str(log_file), log_tail(log_file)
            )
        with log_file.open("rb") as f:
            f.seek(offset)
            if READY_MARK.encode() in f.read():
                return DetachedWorker(pid=record.pid, log_file=log_file, started=True)
        await asyncio.sleep(0.2)
    raise ServiceStartError(
        "worker", f"not ready after {START_DEADLINE_S:.0f} s", str(log_file), log_tail(log_file)
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
    return record.pid
