"""The watchdog beside a worker's handler, as endpoint/start.sh runs one on the real image.

`<command> --pid <handler pid>` with the handler's own environment (COMFY_URL, COMFY_PID, the
bucket through the worker's S3 proxy, DURABLE_COMFY_FENCE_FILE), in a session of its own: a
`freeze` of the handler's process group does not freeze it, and it can kill the handler. Its
log is `watchdog.log` beside the worker's `worker.log`. It lives as long as its worker: once
the worker's process is gone it is stopped (SIGTERM, SIGKILL to its group after the grace).

When the handler dies of a signal the simulator did not send while its watchdog runs, the
worker's container is taken to have been killed by its watchdog (`stop_reason` "watchdog"):
for the platform that is a container exiting mid-job, as a crash is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

import structlog

from .procs import ChildProcess

log = structlog.get_logger("runpod_sim.watchdog")

FENCE_FILE = "fence"
LOG_FILE = "watchdog.log"
# off: none for this worker; running; exited: by itself, while its worker lived on; stopped:
# with its worker.
WatchdogState = Literal["off", "starting", "running", "exited", "stopped"]


class WorkerWatchdog:
    def __init__(self, argv: Sequence[str], work_dir: Path) -> None:
        self.argv = list(argv)
        self.log_path = work_dir / LOG_FILE
        self.fence_file = work_dir / FENCE_FILE
        self.process: ChildProcess | None = None
        self.state: WatchdogState = "starting"
        self.exit_code: int | None = None
        self._waiter: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def started(self) -> bool:
        return self.process is not None

    @property
    def running(self) -> bool:
        return self.state == "running"

    def kill(self) -> None:
        """SIGKILL its group at once: the container died (the crash fault)."""
        if self.process is not None:
            if self.state == "running":
                self.state = "stopped"
            self.process.kill_group()

    async def start(
        self,
        handler_pid: int,
        env: Mapping[str, str],
        cwd: Path,
        on_exit: Callable[[int], None],
    ) -> None:
        argv = [*self.argv, "--pid", str(handler_pid)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            out.write(f"=== watchdog: {' '.join(argv)}\n".encode())
        # ChildProcess.spawn starts a new session: the watchdog leads a group of its own.
        self.process = await ChildProcess.spawn(argv, env=env, cwd=cwd, log_path=self.log_path)
        self.state = "running"
        self._waiter = asyncio.create_task(self._wait(on_exit), name=f"watchdog {handler_pid}")

    async def _wait(self, on_exit: Callable[[int], None]) -> None:
        assert self.process is not None
        code = await self.process.wait()
        self.exit_code = code
        if self.state == "running":
            self.state = "exited"
            on_exit(code)

    async def outlived(self, within_s: float) -> None:
        """Until it exits by itself (it follows its handler out, after any salvage of a prompt
        that had finished), for at most `within_s`: endpoint/start.sh waits for it the same way
        before the container exits."""
        if self._waiter is None or self.state != "running":
            return
        self.state = "stopped"  # with its worker: its exit now is no news
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self._waiter), within_s)

    async def stop(self, grace_s: float) -> None:
        """With its worker: SIGTERM, SIGKILL to its group after `grace_s`."""
        if self.process is None:
            self.state = "stopped" if self.state == "starting" else self.state
            return
        if self.state == "running":
            self.state = "stopped"
        await self.process.terminate(grace_s)
        if self._waiter is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._waiter, 5)
        if self.exit_code is None:
            self.exit_code = self.process.returncode
