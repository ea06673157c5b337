"""Worker processes: one subprocess per RunPod worker, running the configured command under the
unmodified `runpod.serverless.start` loop with the platform's variables pointing here.

A worker is billed from the moment it is launched (its cold start included) until the platform
decides to stop it (idle, refresh, execution timeout, shutdown) or, when it dies on its own, until
it is found dead. Stopping is SIGTERM to the worker (the SDK finishes its in-flight job, then
exits), SIGKILL to its process group after the grace period.

Beside its process a worker may have a watchdog (worker_watchdog.py: its own session, stopped
once the worker's process is gone) and an S3 proxy (s3_proxy.py: its BUCKET_ENDPOINT_URL goes
through it, for the `partition` fault).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import structlog

from .clock import Changes, SimClock
from .env_factories import WorkerEnvFactory, WorkerSlot
from .procs import ChildProcess
from .s3_proxy import TcpProxy, proxied_url, upstream_of
from .settings import DeathOutcome, SimSettings
from .worker_watchdog import WorkerWatchdog

log = structlog.get_logger("runpod_sim.workers")

WorkerState = Literal["initializing", "idle", "running", "stopping", "stopped"]
# Any GPU query string will do: the SDK appends its own parameters with "&".
GPU_QUERY = "gpu=SIMULATED"
# What a worker inherits from the simulator's environment; everything else it gets from the
# platform (RUNPOD_*), --worker-env and the env factories, as a container gets only its
# endpoint's variables. A handler cannot come to depend on the developer's shell by accident.
INHERITED_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ")
# Real seconds a stopping worker is given to collect its job-stop signals before SIGTERM: the SDK
# re-polls job-stop at least every second (its floor delay after an empty answer).
STOP_SIGNAL_WAIT_S = 2.0
FENCE_VARIABLE = "DURABLE_COMFY_FENCE_FILE"
# Real seconds a worker's watchdog may outlive its handler (salvaging a prompt that finished
# while the handler was frozen: endpoint/salvage.py ends by the lease's end and fence_after_s).
WATCHDOG_OUTLIVES_S = 120.0
# Real seconds a handler may take to be seen gone after its watchdog exited (having killed it).
WATCHDOG_FOLLOW_S = 1.0
BUCKET_VARIABLE = "BUCKET_ENDPOINT_URL"


@dataclass(frozen=True)
class WorkerEvent:
    """Something done to a worker or seen of it, for the ledger: a fault (crash, freeze, thaw,
    partition, heal, partition_skipped) or its watchdog's end (watchdog_exited,
    watchdog_failed). `at` is simulator time."""

    kind: str
    at: float
    job_id: str | None = None
    detail: str = ""


@dataclass
class Worker:
    id: str
    index: int
    slot: WorkerSlot
    started_at: float
    cold_start_s: float
    log_path: Path
    state: WorkerState = "initializing"
    process: ChildProcess | None = None
    ready_at: float | None = None
    idle_since: float | None = None
    jobs: set[str] = field(default_factory=set)
    job_history: list[str] = field(default_factory=list)
    last_job_end_at: float | None = None
    # Jobs the worker must stop -> when the signal last went out (real time; None: not yet).
    # Re-sent until the worker lets go of the job: runpod 1.12.0 drops a stop for a job it has
    # taken but not started yet (it sits in the SDK's own queue for up to 0.1 s).
    to_stop: dict[str, float | None] = field(default_factory=dict)
    stop_requested_at: float | None = None
    exited_at: float | None = None
    stop_reason: str | None = None
    exit_code: int | None = None
    # What its jobs become should it die now (a crash fault's, or a freeze's or partition's
    # choice; None: --worker-death).
    death_outcome: DeathOutcome | None = None
    # The simulator itself killed it (the crash fault): not its watchdog.
    sim_killed: bool = False
    pings: int = 0
    last_ping_at: float | None = None
    last_ping_jobs: list[str] = field(default_factory=list)
    fitness_failures: list[dict[str, str]] = field(default_factory=list)
    env_keys: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # its handler's (and watchdog's)
    comfy_url: str | None = None  # from the env factories' COMFY_URL / COMFY_PID
    comfy_pid: int | None = None
    watchdog: WorkerWatchdog | None = None
    s3_proxy: TcpProxy | None = None
    s3_url: str | None = None  # the BUCKET_ENDPOINT_URL it was given (its proxy's)
    # The freeze and partition faults: in effect now, and when they end (simulator time; None:
    # with the worker).
    frozen: bool = False
    thaw_at: float | None = None
    partitioned: bool = False
    heal_at: float | None = None
    events: list[WorkerEvent] = field(default_factory=list)

    def record(self, kind: str, at: float, job_id: str | None = None, detail: str = "") -> None:
        self.events.append(WorkerEvent(kind, at, job_id, detail))
        log.warning("worker event", worker_id=self.id, kind=kind, job_id=job_id, detail=detail)

    @property
    def alive(self) -> bool:
        return self.state in ("initializing", "idle", "running")

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def billing_end(self) -> float | None:
        return self.stop_requested_at if self.stop_requested_at is not None else self.exited_at

    def billed_s(self, now: float) -> float:
        end = self.billing_end()
        return (end if end is not None else now) - self.started_at


class WorkerPool:
    def __init__(
        self,
        settings: SimSettings,
        clock: SimClock,
        factories: list[WorkerEnvFactory],
        work_dir: Path,
        changes: Changes,
        on_exit: Callable[[Worker], None],
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.factories = factories
        self.work_dir = work_dir
        self.changes = changes
        self.on_exit = on_exit
        self.workers: dict[str, Worker] = {}
        # The workers' RUNPOD_AI_API_KEY: not the public API key, as on RunPod.
        self.worker_key = secrets.token_hex(16)
        self._tasks: set[asyncio.Task[None]] = set()
        self._count = 0

    def alive(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.alive]

    def launch(self, extra_cold_start_s: float = 0.0) -> Worker:
        self._count += 1
        worker_id = f"sim-worker-{self._count}-{secrets.token_hex(3)}"
        folder = self.work_dir / "workers" / worker_id
        worker = Worker(
            id=worker_id,
            index=self._count,
            slot=WorkerSlot(worker_id, self._count, folder),
            started_at=self.clock.now(),
            cold_start_s=self.settings.cold_start_s + extra_cold_start_s,
            log_path=folder / "worker.log",
        )
        self.workers[worker_id] = worker
        log.info("worker launched", worker_id=worker_id, cold_start_s=worker.cold_start_s)
        task = asyncio.create_task(self._run(worker), name=f"runpod-sim-{worker_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self.changes.notify()
        return worker

    def _runpod_env(self, worker: Worker) -> dict[str, str]:
        s = self.settings
        host = "127.0.0.1" if s.host in ("", "0.0.0.0", "::") else s.host
        v2 = f"http://{host}:{s.port}/v2/{s.endpoint_id}"
        # The worker's directory is the image's root: `python endpoint/handler.py` imports
        # `endpoint.*` from it.
        pythonpath = str(s.worker_cwd)
        return {
            "RUNPOD_POD_ID": worker.id,
            "RUNPOD_POD_HOSTNAME": worker.id,
            "RUNPOD_ENDPOINT_ID": s.endpoint_id,
            "RUNPOD_AI_API_KEY": self.worker_key,
            # The templates as the platform gives them: the SDK substitutes $ID (job-take: the
            # worker id; job-done/job-stream: the job id) and $RUNPOD_POD_ID itself.
            "RUNPOD_WEBHOOK_GET_JOB": f"{v2}/job-take/$ID?{GPU_QUERY}",
            "RUNPOD_WEBHOOK_POST_OUTPUT": f"{v2}/job-done/$RUNPOD_POD_ID/$ID?{GPU_QUERY}",
            "RUNPOD_WEBHOOK_POST_STREAM": f"{v2}/job-stream/$RUNPOD_POD_ID/$ID?{GPU_QUERY}",
            "RUNPOD_WEBHOOK_PING": f"{v2}/ping/$RUNPOD_POD_ID?{GPU_QUERY}",
            "RUNPOD_PING_INTERVAL": str(s.ping_interval_ms),
            "RUNPOD_SKIP_GPU_CHECK": "true",
            "RUNPOD_SKIP_AUTO_SYSTEM_CHECKS": "true",
            "RUNPOD_LOG_LEVEL": s.runpod_log_level,
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": pythonpath,
            # A container's /tmp is its own: two workers (or a worker and the developer's
            # machine) never share temporary files.
            "TMPDIR": str(worker.slot.work_dir / "tmp"),
        }

    async def _start_process(self, worker: Worker) -> ChildProcess | None:
        # The cold start, cut short when the worker is stopped meanwhile.
        deadline = time.monotonic() + self.clock.real_seconds(worker.cold_start_s)
        while worker.state == "initializing" and (left := deadline - time.monotonic()) > 0:
            await self.changes.wait(left)
        extra: dict[str, str] = {}
        for factory in self.factories:
            if worker.state != "initializing":
                return None
            extra.update(await factory.start(worker.slot))
        if worker.state != "initializing":
            return None
        # The platform's variables win over the factories' and the simulator's own environment.
        inherited = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
        env = {**inherited, **extra, **self._runpod_env(worker)}
        own = await self._own_env(worker, env)
        env.update(own)
        worker.env_keys = sorted({*extra, *own})
        worker.comfy_url = extra.get("COMFY_URL")
        worker.comfy_pid = int(extra["COMFY_PID"]) if extra.get("COMFY_PID", "").isdigit() else None
        (worker.slot.work_dir / "tmp").mkdir(parents=True, exist_ok=True)
        with worker.log_path.open("ab") as out:
            out.write(f"=== {worker.id}: {' '.join(self.settings.worker_command)}\n".encode())
        worker.env = env
        return await ChildProcess.spawn(
            self.settings.worker_command,
            env=env,
            cwd=self.settings.worker_cwd,
            log_path=worker.log_path,
        )

    async def _own_env(self, worker: Worker, env: dict[str, str]) -> dict[str, str]:
        """What the simulator itself adds: the fence file shared by the handler and its
        watchdog, and the bucket through this worker's own S3 proxy."""
        own: dict[str, str] = {}
        watchdog_argv = self.settings.watchdog_argv()
        if watchdog_argv is not None:
            worker.watchdog = WorkerWatchdog(watchdog_argv, worker.slot.work_dir)
            own[FENCE_VARIABLE] = str(worker.watchdog.fence_file)
        bucket_url = env.get(BUCKET_VARIABLE)
        if self.settings.s3_proxy and bucket_url:
            upstream = upstream_of(bucket_url)
            if upstream is None:
                log.warning("no S3 proxy for an https bucket", worker_id=worker.id)
            else:
                worker.s3_proxy = TcpProxy(*upstream, name=worker.id)
                own[BUCKET_VARIABLE] = proxied_url(bucket_url, await worker.s3_proxy.start())
        worker.s3_url = own.get(BUCKET_VARIABLE, bucket_url)
        return own

    async def _start_watchdog(self, worker: Worker) -> None:
        watchdog, process = worker.watchdog, worker.process
        if watchdog is None or process is None:
            return

        def exited(code: int) -> None:
            # One that follows its handler out (endpoint/watchdog.py exits once --pid is gone,
            # or once it has killed it) is no news; one that leaves a live handler unwatched
            # is. The handler's end may reach us a moment after the watchdog's.
            at = self.clock.now()

            def judge() -> None:
                if process.returncode is None:
                    worker.record("watchdog_exited", at, detail=f"exit code {code}")
                    self.changes.notify()

            asyncio.get_running_loop().call_later(WATCHDOG_FOLLOW_S, judge)

        try:
            await watchdog.start(process.pid, worker.env, self.settings.worker_cwd, exited)
        except Exception as exc:  # the worker runs on without one, as on an image without
            worker.record("watchdog_failed", self.clock.now(), detail=repr(exc))
            return
        log.info("watchdog started", worker_id=worker.id, pid=watchdog.pid)

    async def _run(self, worker: Worker) -> None:
        code: int | None = None
        try:
            worker.process = await self._start_process(worker)
            if worker.process is not None:
                log.info("worker process started", worker_id=worker.id, pid=worker.process.pid)
                await self._start_watchdog(worker)
                if worker.state == "stopping":  # stopped while its process was being spawned
                    await worker.process.terminate(self.settings.stop_grace_s)
                code = await worker.process.wait()
        except Exception as exc:  # a factory or the spawn failed: the worker never came up
            log.error("worker failed to start", worker_id=worker.id, error=repr(exc))
            worker.stop_reason = worker.stop_reason or "start_failed"
        finally:
            if worker.process is not None:
                worker.process.kill_group()
            if worker.watchdog is not None:
                # The container lives until its watchdog is done too (endpoint/start.sh).
                await worker.watchdog.outlived(WATCHDOG_OUTLIVES_S)
            worker.exited_at = self.clock.now()
            worker.exit_code = code
            if worker.stop_reason is None:
                worker.stop_reason = _death_reason(worker, code)
            worker.state = "stopped"
            worker.frozen = worker.partitioned = False
            # The platform learns of it at once (its jobs are lost now, not once the
            # companions are down), as RunPod sees a container exit.
            self.on_exit(worker)
            self.changes.notify()
            await self._stop_companions(worker)
            log.info(
                "worker stopped",
                worker_id=worker.id,
                reason=worker.stop_reason,
                exit_code=code,
                billed_s=round(worker.billed_s(self.clock.now()), 3),
            )

    async def _stop_companions(self, worker: Worker) -> None:
        """Whatever lived beside the worker's process goes with it: its watchdog, its S3 proxy,
        what the factories started (its ComfyUI). Its own group's last members (orphans of a
        killed handler, reaped by whoever adopts them) are waited for too: a simulator that
        has stopped leaves nothing of its workers behind."""
        if worker.process is not None:
            await worker.process.group_gone()
        if worker.watchdog is not None:
            with contextlib.suppress(Exception):
                await worker.watchdog.stop(self.settings.stop_grace_s)
        if worker.s3_proxy is not None:
            with contextlib.suppress(Exception):
                await worker.s3_proxy.close()
        for factory in self.factories:
            with contextlib.suppress(Exception):
                await factory.stop(worker.slot)

    def _mark_stopping(self, worker: Worker, reason: str) -> bool:
        """Synchronously, so no job-take can hand the worker a job once it is being stopped."""
        if not worker.alive:
            return False
        worker.state = "stopping"
        worker.stop_requested_at = self.clock.now()
        worker.stop_reason = reason
        log.info("stopping worker", worker_id=worker.id, reason=reason)
        self.changes.notify()  # wakes its long-polls, which now answer at once
        return True

    async def _terminate(self, worker: Worker) -> None:
        # A job-stop signal waiting for this worker goes out first: after SIGTERM the SDK polls
        # job-stop no more, and its handler would run on until the SIGKILL.
        deadline = time.monotonic() + STOP_SIGNAL_WAIT_S
        while worker.process is not None and time.monotonic() < deadline:
            if all(sent is not None for sent in worker.to_stop.values()):
                break
            await self.changes.wait(deadline - time.monotonic())
        if worker.process is not None:
            await worker.process.terminate(self.settings.stop_grace_s)

    async def stop(self, worker: Worker, reason: str) -> None:
        """The platform stops a worker; billing ends now."""
        if self._mark_stopping(worker, reason):
            await self._terminate(worker)

    def stop_soon(self, worker: Worker, reason: str) -> None:
        if not self._mark_stopping(worker, reason):
            return
        task = asyncio.create_task(self._terminate(worker))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def crash(self, worker: Worker, outcome: DeathOutcome, job_id: str | None = None) -> None:
        """kill -9 the worker's whole process group and its watchdog (the crash fault): the
        container dies with everything in it."""
        if worker.process is None or not worker.alive:
            return
        log.warning("fault: killing worker", worker_id=worker.id, pid=worker.process.pid)
        worker.death_outcome = outcome
        worker.sim_killed = True
        worker.record("crash", self.clock.now(), job_id, f"kill -9; the job {outcome}")
        worker.process.kill_group()
        if worker.watchdog is not None:
            worker.watchdog.kill()
        if worker.comfy_url is not None:
            # Its ComfyUI runs in a session of its own, and is stopped only with the worker's
            # companions (after its counters are read): meanwhile a dead container's GPU must
            # not finish the prompt, so it is interrupted and its queue cleared at once.
            task = asyncio.create_task(_halt_comfy(worker.comfy_url))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def shutdown(self) -> None:
        await asyncio.gather(
            *(self.stop(w, "shutdown") for w in list(self.workers.values())),
            return_exceptions=True,
        )
        # Each worker's own task does the final sweep and stops its factories.
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def pids(self) -> list[dict[str, Any]]:
        return [{"worker_id": w.id, "pid": w.pid} for w in self.workers.values() if w.pid]


def _death_reason(worker: Worker, code: int | None) -> str:
    """Why a worker the platform did not stop is gone. Killed by a signal the simulator did not
    send while it had a watchdog: its watchdog killed it (nothing else in here kills a
    handler; an OOM killer would read the same, and is not simulated)."""
    if worker.sim_killed:
        return "crash"
    if code is not None and code < 0 and worker.watchdog is not None and worker.watchdog.started:
        return "watchdog"
    return "crash" if code != 0 else "exited"


async def _halt_comfy(url: str) -> None:
    """Stop whatever a crashed worker's ComfyUI runs or holds: it died with its container."""
    with contextlib.suppress(httpx.HTTPError):
        async with httpx.AsyncClient(base_url=url, timeout=5, trust_env=False) as http:
            await http.post("/queue", json={"clear": True})
            await http.post("/interrupt")
