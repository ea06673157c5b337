"""Three worker processes on one task queue: jobs spread over them, and a `kill -9`.

Three `python worker.py` subprocesses serve one task queue of the session's stack (Temporal dev
server, SeaweedFS); their ComfyUI pool is a simulator of this module's own in parallel mode (many
prompts at once, as many GPUs behind one API) with a short step delay, so that 60 jobs take
seconds and its counters are this module's alone. Each worker's identity is the SDK's default,
`<pid>@<host>`: the workflow histories say which process ran what.

- 60 short jobs: all complete with their artifact's sha256 verified, every worker ran some of
  them (`ActivityTaskStarted` / `WorkflowTaskCompleted` identities), one prompt per job, and the
  workers' metrics add up to one `jobs_ended` per job.
- A `kill -9` of the worker that follows the most running jobs: its jobs re-attach on the other
  two and complete, none resubmitted (one prompt, one execution each); a job terminated from
  outside at the same time is swept by the orphan sweep (which runs on every worker) and nothing
  else is interrupted: no live job's prompt, not even the dead worker's re-attaching ones.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowExecutionStatus

from activities.storage import ArtifactStore
from devstack.free_ports import free_port
from devstack.models import RunningStack
from devstack.processes import terminate
from faults.graphs import SAVE_NODE, chaos_policy, sampler_graph
from faults.harness import SimControl, eventually
from faults.worker_proc import KillableWorker
from starter.client import JobClient
from starter.connection import connect_temporal
from tests.stack.parallel_sim import start_parallel_sim
from tests.support.cli import s3_settings
from workflows.contracts import JobRequest, JobState, JobStatus

WORKERS = 3
JOBS = 60
QUICK_STEPS = 3  # a few sampler steps: a job is mostly orchestration, about a second
SLOW_STEPS = 600  # ~6 s of "GPU": long enough that a kill -9 lands mid-prompt
STEP_DELAY_MS = 10
SLOW_JOBS = 9
ORPHAN_STEPS = 10_000  # ComfyUI's largest: 100 s, so only the sweep ends it
ORPHAN_SWEEP_S = 2.0
# The slow jobs' heartbeat timeout: how soon a dead worker's follow is given to another. The
# quick jobs keep the product's default (20 s): 60 jobs at once on a loaded 2-core machine can
# hold a heartbeat past a few seconds, which would make them re-attach for no fault at all.
HEARTBEAT_S = 4.0
FOLLOW = "follow_prompt"


@dataclass
class Fleet:
    """The module's simulator, three worker slots on one task queue, and a client for them."""

    task_queue: str
    workers: list[KillableWorker]
    metrics_ports: dict[str, int]  # worker name -> its Prometheus port
    client: JobClient
    store: ArtifactStore
    sim: SimControl
    http: httpx.AsyncClient

    def owner(self, identity: str) -> KillableWorker | None:
        """The slot whose process has this SDK identity (`<pid>@<host>`)."""
        pid = identity.split("@", 1)[0]
        for worker in self.workers:
            if pid.isdigit() and int(pid) in worker.pids:
                return worker
        return None

    def owner_name(self, identity: str) -> str:
        owner = self.owner(identity)
        return owner.name if owner is not None else f"a stranger ({identity})"

    def report(self) -> str:
        return "\n".join(
            f"==== {w.name} ({w.log_file}) ====\n{w.log_tail(60)}" for w in self.workers
        )


def small_graph(steps: int) -> dict[str, Any]:
    """examples/txt2img.json with `steps` sampler steps, a fresh seed and a 64x64 image."""
    graph = sampler_graph(steps)
    graph["5"]["inputs"].update({"width": 64, "height": 64})
    return graph


def quick_request() -> JobRequest:
    """A job of a few steps on the product's default policy."""
    return JobRequest(graph=small_graph(QUICK_STEPS))


def slow_request(steps: int = SLOW_STEPS) -> JobRequest:
    """Seconds of sampling, with short timeouts so that a lost worker is noticed in seconds."""
    return JobRequest(
        graph=small_graph(steps), policy=chaos_policy(heartbeat_timeout_s=HEARTBEAT_S)
    )


def worker_env(
    stack: RunningStack, task_queue: str, sim_url: str, metrics_port: int
) -> dict[str, str]:
    return {
        **stack.worker_env(),
        "DURABLE_COMFY_TASK_QUEUE": task_queue,
        "DURABLE_COMFY_POOLS": json.dumps({"comfyui": {"kind": "comfyui", "url": sim_url}}),
        "DURABLE_COMFY_DEFAULT_POOL": "comfyui",
        "DURABLE_COMFY_ORPHAN_SWEEP_S": str(ORPHAN_SWEEP_S),
        "DURABLE_COMFY_METRICS_PORT": str(metrics_port),
    }


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fleet_module(
    local_stack: RunningStack, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Fleet]:
    base = tmp_path_factory.mktemp("many-workers")
    task_queue = f"many-{uuid.uuid4().hex[:8]}"
    sim_record, sim_url = await start_parallel_sim(
        base / "sim", step_delay_ms=STEP_DELAY_MS, parallel=JOBS + SLOW_JOBS
    )
    workers: list[KillableWorker] = []
    ports: dict[str, int] = {}
    try:
        for n in range(1, WORKERS + 1):
            name = f"worker-{n}"
            ports[name] = free_port()
            env = worker_env(local_stack, task_queue, sim_url, ports[name])
            workers.append(KillableWorker(env, base / f"{name}.log", name=name))
        temporal = await connect_temporal(local_stack.temporal_address, local_stack.namespace)
        async with (
            httpx.AsyncClient(trust_env=False) as http,
            ArtifactStore(s3_settings(local_stack)) as store,
        ):
            client = JobClient(temporal, task_queue=task_queue, store=store)
            yield Fleet(task_queue, workers, ports, client, store, SimControl(sim_url, http), http)
    finally:
        await asyncio.gather(*(w.terminate(grace_s=10.0) for w in workers))
        await terminate(sim_record, grace_s=10)
    leftovers = [pid for w in workers for pid in w.running_pids()]
    assert leftovers == [], f"worker processes still running: {leftovers}"


@pytest_asyncio.fixture(loop_scope="session")
async def fleet(fleet_module: Fleet) -> AsyncIterator[Fleet]:
    """All three workers up (started at once; a test may have killed one), counters at zero."""
    dead = [w for w in fleet_module.workers if not w.alive]
    await asyncio.gather(*(w.start() for w in dead))
    await fleet_module.sim.reset()
    yield fleet_module
    # Captured: pytest shows it only when the test failed.
    print(fleet_module.report())


# -- helpers ------------------------------------------------------------------------------------


async def submit_all(fleet: Fleet, requests: list[JobRequest], prefix: str) -> list[str]:
    ids = [f"{prefix}-{uuid.uuid4().hex[:10]}" for _ in requests]
    await asyncio.gather(
        *(fleet.client.submit(r, job_id=job_id) for r, job_id in zip(requests, ids, strict=True))
    )
    return ids


async def wait_all(fleet: Fleet, job_ids: list[str], timeout_s: float) -> list[JobStatus]:
    return await asyncio.wait_for(
        asyncio.gather(*(fleet.client.wait(job_id) for job_id in job_ids)), timeout=timeout_s
    )


async def history(fleet: Fleet, job_id: str) -> list[HistoryEvent]:
    return list((await fleet.client.handle(job_id).fetch_history()).events)


def activity_starts(events: list[HistoryEvent]) -> list[tuple[str, str]]:
    """(activity type, identity of the worker that ran it) for every recorded start."""
    types = {
        e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name
        for e in events
        if e.HasField("activity_task_scheduled_event_attributes")
    }
    return [
        (
            types[e.activity_task_started_event_attributes.scheduled_event_id],
            e.activity_task_started_event_attributes.identity,
        )
        for e in events
        if e.HasField("activity_task_started_event_attributes")
    ]


def workflow_task_identities(events: list[HistoryEvent]) -> list[str]:
    return [
        e.workflow_task_completed_event_attributes.identity
        for e in events
        if e.HasField("workflow_task_completed_event_attributes")
    ]


async def scrape(fleet: Fleet, worker: KillableWorker) -> str:
    port = fleet.metrics_ports[worker.name]
    response = await fleet.http.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0)
    assert response.status_code == 200, f"{worker.name}'s metrics: {response.status_code}"
    return response.text


def counter_sum(text: str, name: str, **labels: str) -> float:
    """The sum of `durable_comfy_<name>` over every label set that has `labels`."""
    total = 0.0
    for match in re.finditer(rf"^durable_comfy_{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        if all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


async def verify_artifact(fleet: Fleet, status: JobStatus, directory: Path) -> None:
    """One PNG per job in S3, whose bytes have the sha256 and size the job recorded."""
    [artifact] = status.artifacts
    assert artifact.node_id == SAVE_NODE and artifact.key.startswith(f"jobs/{status.job_id}/")
    path = await fleet.store.download(
        artifact.key, directory / f"{status.job_id}.png", expected_sha256=artifact.sha256
    )
    body = path.read_bytes()
    assert body.startswith(b"\x89PNG\r\n\x1a\n") and len(body) == artifact.size


def sweeps_of(worker: KillableWorker, prompt_id: str = "") -> int:
    """How many `orphan_swept` lines the worker's current process logged (for `prompt_id`)."""
    return sum(
        1
        for line in worker.log_text(since_start=True).splitlines()
        if "orphan_swept" in line and prompt_id in line
    )


def prompt_of(status: JobStatus) -> str:
    assert status.checkpoint is not None and status.checkpoint.prompt_id is not None, status
    return status.checkpoint.prompt_id


# -- the tests ----------------------------------------------------------------------------------


async def test_sixty_jobs_spread_over_three_workers(fleet: Fleet, tmp_path: Path) -> None:
    before = {w.name: await scrape(fleet, w) for w in fleet.workers}
    job_ids = await submit_all(fleet, [quick_request() for _ in range(JOBS)], "spread")
    started = time.monotonic()
    finals = await wait_all(fleet, job_ids, timeout_s=120)
    print(f"{JOBS} jobs done in {time.monotonic() - started:.1f} s")

    not_done = [f for f in finals if f.state != JobState.COMPLETED]
    assert not not_done, [(f.job_id, f.state, f.error) for f in not_done]
    await asyncio.gather(*(verify_artifact(fleet, f, tmp_path) for f in finals))

    # One prompt per job, run once; none left on the backend.
    stats = await fleet.sim.stats()
    prompts = [prompt_of(f) for f in finals]
    assert stats.prompts == dict.fromkeys(prompts, 1), stats.prompts
    assert stats.executions == dict.fromkeys(prompts, 1)
    assert set(stats.executed.values()) == {"success"}
    assert stats.interrupts == [] and stats.interrupted == []
    assert (await fleet.sim.queue()).empty

    # Who ran what, from the histories: every worker followed prompts and ran workflow tasks.
    histories = await asyncio.gather(*(history(fleet, job_id) for job_id in job_ids))
    follows: Counter[str] = Counter()
    workflow_tasks: Counter[str] = Counter()
    for events in histories:
        for activity_type, identity in activity_starts(events):
            owner = fleet.owner(identity)
            assert owner is not None, f"an activity ran on a stranger: {identity}"
            if activity_type == FOLLOW:
                follows[owner.name] += 1
        for identity in workflow_task_identities(events):
            owner = fleet.owner(identity)
            assert owner is not None, f"a workflow task ran on a stranger: {identity}"
            workflow_tasks[owner.name] += 1
    names = sorted(w.name for w in fleet.workers)
    print(f"follows per worker: {dict(follows)}; workflow tasks: {dict(workflow_tasks)}")
    assert sum(follows.values()) == JOBS
    assert sorted(follows) == names, f"a worker followed no prompt: {dict(follows)}"
    assert sorted(workflow_tasks) == names, f"a worker ran no workflow task: {dict(workflow_tasks)}"

    # Every worker serves its metrics; each job's end is counted once, on one of them.
    after = {w.name: await scrape(fleet, w) for w in fleet.workers}
    ended = sum(
        counter_sum(after[name], "jobs_ended", state="COMPLETED")
        - counter_sum(before[name], "jobs_ended", state="COMPLETED")
        for name in names
    )
    assert ended == JOBS, {n: counter_sum(after[n], "jobs_ended") for n in names}


async def test_kill_one_of_three_workers_jobs_reattach_on_the_others(
    fleet: Fleet, tmp_path: Path
) -> None:
    job_ids = await submit_all(fleet, [slow_request() for _ in range(SLOW_JOBS)], "kill")
    # A job that would sample for minutes, ended from outside below: its prompt is left to the
    # orphan sweep.
    [orphan] = await submit_all(fleet, [slow_request(ORPHAN_STEPS)], "orphan")

    # Every job is being followed, and we know by which worker (its pending follow activity).
    async def followers() -> dict[str, str]:
        found: dict[str, str] = {}
        for job_id in [*job_ids, orphan]:
            raw = (await fleet.client.handle(job_id).describe()).raw_description
            for pending in raw.pending_activities:
                if pending.activity_type.name == FOLLOW and pending.last_worker_identity:
                    found[job_id] = pending.last_worker_identity
        return found

    following = await eventually(
        followers,
        timeout_s=30,
        what="every job's prompt is followed",
        accept=lambda found: len(found) == SLOW_JOBS + 1,
    )
    # A follow is pending before it has posted its prompt: the orphan is ended only once the
    # simulator has its prompt, or there is nothing left for the sweep to find.
    await eventually(
        fleet.sim.stats,
        timeout_s=30,
        what="every job's prompt reached the simulator",
        accept=lambda stats: len(stats.prompts) == SLOW_JOBS + 1,
    )
    per_worker = Counter(fleet.owner_name(following[job_id]) for job_id in job_ids)
    print(f"running follows per worker before the kill: {dict(per_worker)}")
    victim = next(w for w in fleet.workers if w.name == per_worker.most_common(1)[0][0])
    victim_pid = victim.pid
    assert victim_pid is not None
    on_victim = [job_id for job_id in job_ids if fleet.owner(following[job_id]) is victim]
    await fleet.client.handle(orphan).terminate(reason="many-workers test: an orphan")
    await victim.kill()
    killed_at = time.monotonic()
    survivors = [w for w in fleet.workers if w is not victim]
    assert all(w.alive for w in survivors) and not victim.alive

    finals = await wait_all(fleet, job_ids, timeout_s=90)
    took = time.monotonic() - killed_at
    not_done = [f for f in finals if f.state != JobState.COMPLETED]
    assert not not_done, [(f.job_id, f.state, f.error) for f in not_done]
    await asyncio.gather(*(verify_artifact(fleet, f, tmp_path) for f in finals))
    print(f"{len(on_victim)} jobs on the killed worker; all done {took:.1f} s after the kill")

    # The orphan's prompt is stopped by the sweep, and nothing else is interrupted.
    queue = await fleet.sim.wait_idle(timeout_s=ORPHAN_SWEEP_S * 1.25 + 15)
    assert queue.empty
    status = await fleet.client.handle(orphan).describe()
    assert status.status == WorkflowExecutionStatus.TERMINATED
    stats = await fleet.sim.stats()
    prompts = {f.job_id: prompt_of(f) for f in finals}
    [orphan_prompt] = set(stats.prompts) - set(prompts.values())
    # None resubmitted: one prompt per job, each executed once, on the simulator.
    assert stats.prompts == dict.fromkeys([*prompts.values(), orphan_prompt], 1), stats.prompts
    assert stats.executions == dict.fromkeys([*prompts.values(), orphan_prompt], 1)
    assert {stats.executed[p] for p in prompts.values()} == {"success"}, stats.executed
    assert stats.executed[orphan_prompt] == "interrupted"
    assert stats.interrupted == [orphan_prompt], "the sweep stopped a live job's prompt"
    assert set(stats.interrupts) == {orphan_prompt}, stats.interrupts
    swept_lines = {w.name: sweeps_of(w, orphan_prompt) for w in survivors}
    assert sum(swept_lines.values()) >= 1, "no worker logged orphan_swept for the orphan's prompt"
    print(f"the orphan was swept by {swept_lines}; interrupts sent: {len(stats.interrupts)}")

    # The dead worker's jobs re-attached on the others: the follow that finished each of them
    # ran on a survivor, and its prompt is the one the victim was following.
    for job_id in on_victim:
        events = await history(fleet, job_id)
        follow_owners = [
            fleet.owner_name(ident) for kind, ident in activity_starts(events) if kind == FOLLOW
        ]
        assert follow_owners and follow_owners[-1] != victim.name, (
            f"{job_id}'s last follow ran on {follow_owners[-1]}, the killed worker ({victim.name})"
        )
    assert on_victim, "the killed worker followed no job"

    # The survivors' metrics still answer, and the sweep is counted where it ran.
    texts = {w.name: await scrape(fleet, w) for w in survivors}
    for worker in survivors:
        counted = counter_sum(texts[worker.name], "orphans_swept", action="interrupted")
        assert counted == sweeps_of(worker), (worker.name, counted, worker.log_tail())
    assert sum(counter_sum(t, "orphans_swept") for t in texts.values()) >= 1
