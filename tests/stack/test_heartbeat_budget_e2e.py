"""A worker following more jobs than its heartbeat budget still gives each job a visible step at
least once a second, counted in the heartbeat details the server returns (the heartbeat budget:
activities/heartbeat_budget.py).

On the session's local stack (Temporal dev server, SeaweedFS): one `python worker.py` process
whose budget is 4 heartbeats a second, and a ComfyUI simulator of this module's own in parallel
mode (every prompt at once, as many GPUs behind one API) at 50 ms a step. Ten jobs of 160 steps
(8 s of sampling each) run together; every 0.2 s the test reads each job's description, as a
client does (`starter.progress.follow_heartbeats`), and records the step of its pending follow
activity's heartbeat. Over a window of a few seconds in which every job is running, it counts
the new steps each job showed:

- at least one a second, less one for where the window cuts (the 1 s floor: 10 prompts on a
  budget of 4 a second would otherwise get one every 2.5 s);
- at most 1.5 a second, plus one (the budget: without it each prompt would heartbeat every
  `heartbeat_throttle_s`, 0.4 s, 2.5 a second);

and the worker logged that its budget was exceeded. No duration is asserted: steps are counted.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest_asyncio
from temporalio.client import WorkflowExecutionStatus

from activities.storage import ArtifactStore
from devstack.models import RunningStack
from devstack.processes import is_alive, terminate
from faults.graphs import sampler_graph
from faults.worker_proc import KillableWorker
from starter.client import JobClient
from starter.connection import connect_temporal
from starter.progress import follow_heartbeats
from tests.stack.parallel_sim import start_parallel_sim
from tests.support.cli import s3_settings
from workflows.contracts import JobRequest, JobState

BUDGET_PER_S = 4  # heartbeats a second for the whole worker
JOBS = 10  # followed at once: more than the budget allows at one a second each
STEPS = 160
STEP_DELAY_MS = 50  # 8 s of sampling per job
SAMPLE_EVERY_S = 0.2
WINDOW_S = 4  # counted while every job is running
MOST_PER_S = 1.5  # what the budget allows (1 a second) with room for a late heartbeat


@dataclass
class Rig:
    client: JobClient
    worker: KillableWorker


@dataclass
class Seen:
    """What one job's descriptions showed: (when, heartbeat step, total steps) per read."""

    reads: list[tuple[float, int, int]] = field(default_factory=list)

    def running_at(self, at: float) -> bool:
        """Its last read at or before `at` showed a step under way (not the first, not the end)."""
        before = [(step, total) for when, step, total in self.reads if when <= at]
        return bool(before) and 0 < before[-1][0] < before[-1][1]

    def new_steps(self, start: float, end: float) -> list[int]:
        """The steps read in [start, end] that differ from the read before them."""
        steps: list[int] = []
        last: int | None = None
        for when, step, _total in self.reads:
            if start <= when <= end and last is not None and step != last:
                steps.append(step)
            if when <= end:
                last = step
        return steps


@pytest_asyncio.fixture(loop_scope="session")
async def rig(local_stack: RunningStack, tmp_path: Path) -> AsyncIterator[Rig]:
    task_queue = f"budget-{uuid.uuid4().hex[:8]}"
    sim_record, sim_url = await start_parallel_sim(
        tmp_path / "sim", step_delay_ms=STEP_DELAY_MS, parallel=JOBS
    )
    env = {
        **local_stack.worker_env(),
        "DURABLE_COMFY_TASK_QUEUE": task_queue,
        "DURABLE_COMFY_POOLS": json.dumps({"comfyui": {"kind": "comfyui", "url": sim_url}}),
        "DURABLE_COMFY_DEFAULT_POOL": "comfyui",
        "DURABLE_COMFY_HEARTBEAT_BUDGET": str(BUDGET_PER_S),
    }
    worker = KillableWorker(env, tmp_path / "worker.log", name="budget-worker")
    try:
        await worker.start()
        temporal = await connect_temporal(local_stack.temporal_address, local_stack.namespace)
        async with ArtifactStore(s3_settings(local_stack)) as store:
            yield Rig(JobClient(temporal, task_queue=task_queue, store=store), worker)
    finally:
        await worker.terminate(grace_s=10.0)
        await terminate(sim_record, grace_s=10)
        # Captured: pytest shows it only when the test failed.
        print(f"==== {worker.log_file} ====\n{worker.log_tail(60)}")
    assert worker.running_pids() == [], "the worker is still running"
    assert not is_alive(sim_record), "the simulator is still running"


def small_graph() -> dict[str, Any]:
    graph = sampler_graph(STEPS)
    graph["5"]["inputs"].update({"width": 64, "height": 64})
    return graph


@dataclass
class Read:
    """One description of a job, as a client reads it."""

    running: bool
    step: int | None = None  # its follow activity's heartbeat step (None: no heartbeat)
    total: int = STEPS


async def read(client: JobClient, job_id: str) -> Read:
    description = await client.handle(job_id).describe()
    running = description.status == WorkflowExecutionStatus.RUNNING
    beats = await follow_heartbeats(description)
    if not beats:
        return Read(running)
    checkpoint = max((beat.checkpoint for beat in beats), key=lambda c: c.step)
    return Read(running, checkpoint.step, checkpoint.total_steps or STEPS)


async def test_each_job_shows_a_new_step_every_second_past_the_budget(rig: Rig) -> None:
    job_ids = [f"budget-{n}-{uuid.uuid4().hex[:8]}" for n in range(JOBS)]
    await asyncio.gather(
        *(rig.client.submit(JobRequest(graph=small_graph()), job_id=j) for j in job_ids)
    )
    seen = {job_id: Seen() for job_id in job_ids}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        reads = await asyncio.gather(*(read(rig.client, j) for j in job_ids))
        at = time.monotonic()
        for job_id, got in zip(job_ids, reads, strict=True):
            if got.step is not None:
                seen[job_id].reads.append((at, got.step, got.total))
        if not any(got.running for got in reads):
            break
        await asyncio.sleep(SAMPLE_EVERY_S)
    finals = await asyncio.wait_for(
        asyncio.gather(*(rig.client.wait(j) for j in job_ids)), timeout=60
    )
    assert [f.state for f in finals] == [JobState.COMPLETED] * JOBS, [
        (f.job_id, f.state, f.error) for f in finals
    ]

    # The window: from the first read at which every job was under way, WINDOW_S long; every
    # job must still be under way at its end (else the jobs did not overlap enough to count).
    times = sorted({when for s in seen.values() for when, _, _ in s.reads})
    start = next((t for t in times if all(s.running_at(t) for s in seen.values())), None)
    assert start is not None, "the jobs never all ran at once"
    end = start + WINDOW_S
    assert times[-1] >= end and all(s.running_at(end) for s in seen.values()), (
        "a job ended inside the window: the jobs did not run long enough together"
    )
    shown = {job_id: s.new_steps(start, end) for job_id, s in seen.items()}
    print({job_id: len(steps) for job_id, steps in shown.items()})
    for job_id, steps in shown.items():
        assert steps == sorted(steps), f"{job_id}: a step went backwards: {steps}"
        assert len(steps) >= WINDOW_S - 1, (
            f"{job_id} showed {len(steps)} new steps in a {WINDOW_S} s window (at least one a "
            f"second expected): {steps}"
        )
        assert len(steps) <= MOST_PER_S * WINDOW_S + 1, (
            f"{job_id} showed {len(steps)} new steps in a {WINDOW_S} s window: more than the "
            f"budget of {BUDGET_PER_S}/s over {JOBS} jobs allows ({steps})"
        )

    assert "heartbeat_budget_exceeded" in rig.worker.log_text(), rig.worker.log_tail(60)
