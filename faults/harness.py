"""The chaos harness: a stack whose services may be killed, and one test's worth of moving parts.

- `ChaosStack`: a local stack of its own (own ports, own state dir) whose Temporal dev server and
  ComfyUI simulator a test kills and restarts (`services`, inject.py's `ServiceFaults`); the
  Temporal server comes back on the same `--db-filename`, so every workflow survives it, as it
  would with a real cluster's database.
- `ChaosCase`: what one test uses: a task queue of its own, worker subprocesses, the simulator's
  controls, faults and step watcher, a `JobClient`, timelines, and the "nothing left behind"
  checks.

Re-exports the pieces (`KillableWorker`, `Timeline`, `SimControl`, ...) so tests import from one
place; the faults themselves are inject.py's.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from pathlib import Path

from temporalio.client import Client, WorkflowExecutionStatus

from activities.storage import ArtifactStore, S3Settings
from devstack.config import StackConfig
from devstack.models import RunningStack
from devstack.processes import read_pid_file
from devstack.services import ServiceName, StackPaths
from devstack.stack import start_stack, stop_stack
from faults.inject import ComfyFaults, ServiceFaults
from faults.sim import SimControl, SimQueue, SimStats, StepWatcher
from faults.timeline import Timeline, TimelineEntry
from faults.wait import ChaosTimeout, eventually, until
from faults.worker_proc import KillableWorker, WorkerFleet, WorkerStartError
from starter.client import JobClient
from workflows.contracts import JobRequest

__all__ = [
    "ORPHAN_SWEEP_S",
    "ChaosCase",
    "ChaosStack",
    "ChaosTimeout",
    "KillableWorker",
    "SimControl",
    "SimQueue",
    "SimStats",
    "StepWatcher",
    "Timeline",
    "TimelineEntry",
    "WorkerFleet",
    "WorkerStartError",
    "eventually",
    "until",
    "with_step_delay",
]

OPEN = WorkflowExecutionStatus.RUNNING
ORPHAN_SWEEP_S = 2.0


def with_step_delay(config: StackConfig, step_delay_ms: int) -> StackConfig:
    """The same stack with the simulator's per-step delay changed (the length of a "GPU" step)."""
    sim = config.comfyui_sim.model_copy(update={"step_delay_ms": step_delay_ms})
    return config.model_copy(update={"comfyui_sim": sim})


class ChaosStack:
    """A running local stack that tests are allowed to break."""

    def __init__(self, config: StackConfig, base_dir: Path, running: RunningStack) -> None:
        self.config = config
        self.base_dir = base_dir
        self.running = running
        self.services = ServiceFaults(config, base_dir)

    @classmethod
    async def start(cls, config: StackConfig, base_dir: Path) -> ChaosStack:
        return cls(config, base_dir, await start_stack(config, base_dir))

    async def stop(self) -> None:
        await stop_stack(self.config, self.base_dir)

    async def ensure_up(self) -> None:
        """Start whatever an earlier test left stopped (start_stack skips what runs)."""
        await start_stack(self.config, self.base_dir)

    def log_file(self, name: ServiceName) -> Path:
        """The service's log (restarts append to the same file)."""
        return StackPaths.of(self.config, self.base_dir).log_file(name)

    def pid(self, name: ServiceName) -> int | None:
        paths = StackPaths.of(self.config, self.base_dir)
        record = read_pid_file(paths.pid_file(name))
        return record.pid if record is not None else None

    @property
    def sim_url(self) -> str:
        return self.running.comfyui_url

    def s3_settings(self) -> S3Settings:
        return S3Settings.from_env(self.running.worker_env())

    def worker_env(self, task_queue: str, comfyui_url: str | None = None) -> dict[str, str]:
        """What `python worker.py` needs to serve `task_queue` on this stack; its `comfyui`
        pool is the simulator unless `comfyui_url` names another ComfyUI."""
        pools = {"comfyui": {"kind": "comfyui", "url": comfyui_url or self.sim_url}}
        return {
            **self.running.worker_env(),
            "DURABLE_COMFY_TASK_QUEUE": task_queue,
            "DURABLE_COMFY_POOLS": json.dumps(pools),
            "DURABLE_COMFY_DEFAULT_POOL": "comfyui",
            # Seconds, not a minute: a test waits for the sweep.
            "DURABLE_COMFY_ORPHAN_SWEEP_S": str(ORPHAN_SWEEP_S),
        }


class ChaosCase:
    """One chaos test: its own task queue, workers, client and watcher on a shared ChaosStack.

    Per-test task queues keep a job from one test from ever being picked up by another test's
    worker, even if a failed test leaves a workflow behind.
    """

    def __init__(
        self,
        stack: ChaosStack,
        temporal: Client,
        store: ArtifactStore,
        sim: SimControl,
        watcher: StepWatcher,
        log_dir: Path,
        *,
        name: str = "chaos",
        comfyui_url: str | None = None,
    ) -> None:
        self.stack = stack
        self.temporal = temporal
        self.store = store
        self.sim = sim
        self.watcher = watcher
        self.name = name
        self.task_queue = f"{name}-{uuid.uuid4().hex[:8]}"
        self.workers = WorkerFleet(stack.worker_env(self.task_queue, comfyui_url), log_dir)
        self.client = JobClient(temporal, task_queue=self.task_queue, store=store)
        # The stack's simulator's: a case on another ComfyUI arms none.
        self.sim_faults = ComfyFaults(stack.sim_url, sim.http, stack.log_file("comfyui_sim"))
        self.job_ids: list[str] = []
        self.timelines: list[Timeline] = []

    async def submit(self, request: JobRequest, *, detached: bool = True) -> str:
        """Start a job on this case's task queue; detached unless the test is about contact."""
        job_id = f"{self.name}-{uuid.uuid4().hex[:10]}"
        self.job_ids.append(job_id)
        await self.client.submit(request, job_id=job_id, detached=detached)
        return job_id

    def timeline(self, job_id: str, *, keepalive_s: float | None = None) -> Timeline:
        timeline = Timeline(self.client, job_id, keepalive_s=keepalive_s)
        self.timelines.append(timeline)
        return timeline

    # -- "nothing left behind" --------------------------------------------------------------

    async def workflow_status(self, job_id: str) -> WorkflowExecutionStatus | None:
        return (await self.client.handle(job_id).describe()).status

    async def assert_nothing_left(self, job_id: str, *, output_prefix: str = "jobs") -> None:
        """The job's workflow is closed, the backend runs nothing, no multipart upload leaked."""
        status = await self.workflow_status(job_id)
        assert status is not None and status != OPEN, f"workflow {job_id} still {status}"
        queue = await self.sim.wait_idle(timeout_s=10.0)
        assert queue.empty, f"backend still busy: {queue}"
        leaked = await self.store.list_multipart_uploads(f"{output_prefix}/{job_id}/")
        assert leaked == [], f"unfinished multipart uploads left in S3: {leaked}"

    def report(self) -> str:
        """Every timeline and worker log tail: what one needs to see when the test failed."""
        parts = [f"==== timeline of {t.job_id} ====\n{t.render()}" for t in self.timelines]
        parts += [
            f"==== {w.name} log ({w.log_file}) ====\n{w.log_tail(80)}" for w in self.workers.workers
        ]
        return "\n".join(parts)

    async def cleanup(self) -> list[int]:
        """Teardown after a test, passed or not: stop leftovers so the next test starts clean.

        Returns the worker PIDs that were still running after stopping (should be none).
        """
        for job_id in self.job_ids:
            with contextlib.suppress(Exception):
                if await self.workflow_status(job_id) == OPEN:
                    # Only a failed test gets here: its job must not keep the backend busy.
                    await self.client.handle(job_id).terminate(reason="chaos test cleanup")
        await self.workers.stop_all()
        await self.sim.clear()
        return self.workers.running_pids()
