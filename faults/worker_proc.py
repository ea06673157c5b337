"""`python worker.py` as a real subprocess that a test can SIGKILL, SIGTERM and start again.

An in-process worker cannot be `kill -9`ed: the point of these tests is that the process dies
without running a single line of cleanup (no graceful shutdown, no final heartbeat, no aborted
multipart upload), exactly as a disposable GPU worker does when its machine is reclaimed.
Each process is started in its own session (a Ctrl-C on pytest does not reach it half-way) and is
stopped by its own PID, never by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from devstack.worker_process import READY_MARK

ROOT = Path(__file__).resolve().parents[1]
WORKER_PY = ROOT / "worker.py"
# Variables a developer's shell may carry that would point a test worker at another stack.
_FOREIGN_ENV_PREFIXES = ("TEMPORAL_", "AWS_", "DURABLE_COMFY_")


class WorkerStartError(RuntimeError):
    pass


def clean_environ() -> dict[str, str]:
    """This process's environment without anything that names a Temporal server, S3 or pool."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN_ENV_PREFIXES)}


class KillableWorker:
    """One worker "slot": successive `python worker.py` processes sharing an env and a log file.

    `start()` after `kill()` is the replacement machine coming up; every process ever started is
    remembered in `pids`, so a test can prove that none of them is left running.
    """

    def __init__(self, env: Mapping[str, str], log_file: Path, *, name: str = "worker") -> None:
        self.name = name
        self.env = {**clean_environ(), **env, "PYTHONUNBUFFERED": "1"}
        self.log_file = log_file
        # Every process ever started in this slot: a test proves that none of them outlives it.
        self.processes: list[asyncio.subprocess.Process] = []
        self._proc: asyncio.subprocess.Process | None = None
        self._started_offset = 0

    # -- state ------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.processes]

    def running_pids(self) -> list[int]:
        # Our own process objects, not /proc: a reaped PID may belong to someone else by now.
        return [proc.pid for proc in self.processes if proc.returncode is None]

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    def log_text(self, *, since_start: bool = False) -> str:
        """The log (all incarnations), or only what the current process wrote."""
        try:
            with self.log_file.open("rb") as f:
                if since_start:
                    f.seek(self._started_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self, *, ready_timeout_s: float = 60.0) -> int:
        """Spawn a new process and wait until it logs that it serves its task queue."""
        if self.alive:
            raise WorkerStartError(f"{self.name} is already running (pid {self.pid})")
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("ab") as out:
            out.write(f"\n=== {time.strftime('%H:%M:%S')} starting {self.name}\n".encode())
            out.flush()
            self._started_offset = out.tell()
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                str(WORKER_PY),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                cwd=ROOT,
                env=self.env,
                start_new_session=True,
            )
        self.processes.append(self._proc)
        deadline = time.monotonic() + ready_timeout_s
        while READY_MARK not in self.log_text(since_start=True):
            if not self.alive:
                raise WorkerStartError(
                    f"{self.name} exited at start (code {self._returncode()}):\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                await self.kill()
                raise WorkerStartError(
                    f"{self.name} not ready after {ready_timeout_s:.0f}s:\n{self.log_tail()}"
                )
            await asyncio.sleep(0.05)
        return self._proc.pid

    async def kill(self) -> None:
        """`kill -9`: no cleanup of any kind runs in the worker."""
        await self._signal_and_reap(signal.SIGKILL, grace_s=10.0)

    async def terminate(self, *, grace_s: float = 15.0) -> int | None:
        """SIGTERM (the worker's graceful shutdown), SIGKILL after `grace_s`; the exit code."""
        return await self._signal_and_reap(signal.SIGTERM, grace_s=grace_s)

    async def _signal_and_reap(self, sig: signal.Signals, *, grace_s: float) -> int | None:
        proc = self._proc
        if proc is None:
            return None
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            try:
                await asyncio.wait_for(proc.wait(), timeout=grace_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                # Reaped here, so that no zombie looks alive to anyone counting processes.
                await asyncio.wait_for(proc.wait(), timeout=10.0)
        return proc.returncode

    def _returncode(self) -> int | None:
        return self._proc.returncode if self._proc is not None else None


class WorkerFleet:
    """All worker slots of one test; `stop_all` runs at teardown whatever happened."""

    def __init__(self, env: Mapping[str, str], log_dir: Path) -> None:
        self.env = dict(env)
        self.log_dir = log_dir
        self.workers: list[KillableWorker] = []

    def new(self, name: str | None = None) -> KillableWorker:
        name = name or f"worker-{len(self.workers) + 1}"
        worker = KillableWorker(self.env, self.log_dir / f"{name}.log", name=name)
        self.workers.append(worker)
        return worker

    async def start(self, name: str | None = None) -> KillableWorker:
        worker = self.new(name)
        await worker.start()
        return worker

    @property
    def all_pids(self) -> list[int]:
        return [pid for worker in self.workers for pid in worker.pids]

    def running_pids(self) -> list[int]:
        return [pid for worker in self.workers for pid in worker.running_pids()]

    async def stop_all(self) -> None:
        await asyncio.gather(*(w.terminate(grace_s=10.0) for w in self.workers))
