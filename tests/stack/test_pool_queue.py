"""Our queue in front of a bounded pool, on the real Temporal server with three worker processes.

The pool is a ComfyUI simulator of this module's own in parallel mode (every prompt it holds
runs at once, as if each had a GPU): without a bound every job's prompt would be there at once.
The simulator counts the most prompts it held at once (`peak_in_queue`, queued + running); with
`max_running` it must never pass the bound, across a `kill -9` of the busiest worker and a
`temporal workflow terminate` of a holder.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from temporalio.service import RPCError

from activities.storage import ArtifactStore
from devstack.free_ports import free_port
from devstack.processes import terminate
from faults.graphs import chaos_policy, sampler_graph
from faults.harness import ChaosStack
from faults.wait import eventually
from faults.worker_proc import KillableWorker
from starter.client import JobClient
from starter.connection import connect_temporal
from starter.errors import JobAlreadyEnded, JobNotFound, QueueFull
from tests.conftest import StackConfigFactory
from tests.stack.parallel_sim import start_parallel_sim
from tests.support.cli import ROOT, cli_env, run_cli
from workflows import shared
from workflows.admission import PoolQueueView
from workflows.contracts import JobRequest, JobState, JobStatus

WORKERS = 3
MAX_RUNNING = 3
STEP_DELAY_MS = 10
RECLAIM_S = 2.0
POOL = "gpu"
ONE = "one"
TINY = "tiny"


@dataclass
class Fleet:
    stack: ChaosStack
    task_queue: str
    workers: list[KillableWorker]
    store: ArtifactStore
    sim_url: str
    http: httpx.AsyncClient
    metrics_ports: list[int]
    client: JobClient = field(init=False)

    async def metrics(self) -> str:
        """Every worker's /metrics, one after the other."""
        texts = [
            (await self.http.get(f"http://127.0.0.1:{port}/metrics", timeout=5)).text
            for port in self.metrics_ports
        ]
        return "\n".join(texts)

    async def sim_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = (await self.http.get(f"{self.sim_url}/sim/stats", timeout=5)).json()
        return stats

    async def queue(self, pool: str = POOL) -> PoolQueueView:
        handle = self.client.temporal.get_workflow_handle(
            shared.pool_queue_id(self.task_queue, pool)
        )
        view: PoolQueueView = await handle.query(shared.QUERY_POOL_QUEUE, result_type=PoolQueueView)
        return view

    def report(self) -> str:
        return "\n".join(f"==== {w.name} ====\n{w.log_tail(40)}" for w in self.workers)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fleet(
    stack_config_factory: StackConfigFactory, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Fleet]:
    """A stack of the module's own (its Temporal server is restarted by a test), three workers
    with two bounded pools on one parallel simulator: `gpu` (3 slots) and `one` (1 slot)."""
    config = stack_config_factory("pool-queue")
    stack = await ChaosStack.start(config, Path(config.state_dir).parent)
    base = tmp_path_factory.mktemp("pool-queue")
    task_queue = f"queue-{uuid.uuid4().hex[:8]}"
    sim_record, sim_url = await start_parallel_sim(
        base / "sim", step_delay_ms=STEP_DELAY_MS, parallel=100
    )
    pools = {
        POOL: {"kind": "comfyui", "url": sim_url, "max_running": MAX_RUNNING},
        ONE: {"kind": "comfyui", "url": sim_url, "max_running": 1},
        TINY: {"kind": "comfyui", "url": sim_url, "max_running": 1, "max_pending": 1},
    }
    env = {
        **stack.running.worker_env(),
        "DURABLE_COMFY_TASK_QUEUE": task_queue,
        "DURABLE_COMFY_POOLS": json.dumps(pools),
        "DURABLE_COMFY_DEFAULT_POOL": POOL,
        "DURABLE_COMFY_ORPHAN_SWEEP_S": str(RECLAIM_S),
        "DURABLE_COMFY_TENANTS": json.dumps({"capped": {"max_pending": 2, "max_priority": 2}}),
    }
    ports = [free_port() for _ in range(WORKERS)]
    workers = [
        KillableWorker(
            {**env, "DURABLE_COMFY_METRICS_PORT": str(port)},
            base / f"worker-{n}.log",
            name=f"worker-{n}",
        )
        for n, port in enumerate(ports, start=1)
    ]
    try:
        await asyncio.gather(*(w.start() for w in workers))
        async with (
            httpx.AsyncClient(trust_env=False) as http,
            ArtifactStore(stack.s3_settings()) as store,
        ):
            fleet = Fleet(stack, task_queue, workers, store, sim_url, http, ports)
            yield fleet
    finally:
        await asyncio.gather(*(w.terminate(grace_s=10.0) for w in workers))
        await terminate(sim_record, grace_s=10)
        await stack.stop()
    assert [pid for w in workers for pid in w.running_pids()] == []


@pytest_asyncio.fixture(loop_scope="session")
async def queue(fleet: Fleet) -> AsyncIterator[Fleet]:
    """Every worker and service up, the simulator's counters at zero, a fresh client."""
    await fleet.stack.ensure_up()
    await asyncio.gather(*(w.start() for w in fleet.workers if not w.alive))
    await fleet.http.post(f"{fleet.sim_url}/sim/reset", timeout=5)
    running = fleet.stack.running
    temporal = await connect_temporal(running.temporal_address, running.namespace)
    fleet.client = JobClient(temporal, task_queue=fleet.task_queue, store=fleet.store)
    yield fleet
    print(fleet.report())


def request(steps: int, **fields: Any) -> JobRequest:
    graph = sampler_graph(steps)
    graph["5"]["inputs"].update({"width": 64, "height": 64})
    return JobRequest(graph=graph, policy=chaos_policy(heartbeat_timeout_s=4.0), **fields)


async def submit(fleet: Fleet, requests: list[JobRequest], prefix: str) -> list[str]:
    ids = [f"{prefix}-{uuid.uuid4().hex[:8]}" for _ in requests]
    await asyncio.gather(
        *(fleet.client.submit(r, job_id=i) for r, i in zip(requests, ids, strict=True))
    )
    return ids


async def wait_all(fleet: Fleet, ids: list[str], timeout_s: float) -> list[JobStatus]:
    return await asyncio.wait_for(
        asyncio.gather(*(fleet.client.wait(i) for i in ids)), timeout=timeout_s
    )


async def test_the_bound_holds_across_three_workers_and_the_others_wait_pending(
    queue: Fleet,
) -> None:
    fleet = queue
    ids = await submit(fleet, [request(60) for _ in range(15)], "bound")
    # The queue fills: some job is PENDING with its place in line, nothing of it at the pool.
    pending: JobStatus | None = None
    for _ in range(200):
        statuses = await asyncio.gather(*(fleet.client.status(i) for i in ids))
        pending = next((s for s in statuses if s.state == JobState.PENDING), None)
        if pending is not None and pending.admission and pending.admission.position:
            break
        await asyncio.sleep(0.1)
    assert pending is not None and pending.admission is not None, "no job was seen PENDING"
    assert pending.admission.pool == POOL
    assert pending.admission.position is not None and pending.admission.position >= 1
    assert pending.checkpoint is None or pending.checkpoint.submitted_at is None
    view = await fleet.queue()
    assert view.max_running == MAX_RUNNING and view.running <= MAX_RUNNING
    ended = await wait_all(fleet, ids, 180)
    assert [s.state for s in ended] == [JobState.COMPLETED] * len(ids)
    stats = await fleet.sim_stats()
    assert 1 <= stats["peak_in_queue"] <= MAX_RUNNING, stats["peak_in_queue"]
    assert sum(stats["prompts"].values()) == len(ids)
    await eventually(lambda: _queue_is_empty(fleet), timeout_s=10, what="the queue empty")
    # The queue's metrics, summed over the three workers: a start and a wait per job, or a
    # few more: workflow code's metrics count again when Temporal runs a workflow task again
    # (a speculative task of an `ask` update whose completion a concurrent signal displaced;
    # the history holds one grant per job all the same).
    text = await fleet.metrics()
    labels = {"pool": POOL, "tenant": "local"}
    starts = metric_sum(text, "durable_comfy_queue_starts", labels)
    assert len(ids) <= starts <= 2 * len(ids), starts
    waits = metric_sum(text, "durable_comfy_queue_wait_seconds_count", labels)
    assert waits == starts, (waits, starts)
    # The dashboard in the repository asks only for metrics the workers export.
    dashboard = json.loads((ROOT / "docs" / "grafana" / "queue.json").read_text())
    asked = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"durable_comfy_\w+", target["expr"])
    }
    exported = set(re.findall(r"^(durable_comfy_\w+)", text, re.M))
    assert asked and asked <= exported, asked - exported


def metric_sum(text: str, name: str, labels: dict[str, str]) -> float:
    """The sum of `name` over every series that has `labels`."""
    total = 0.0
    for match in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        if all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


async def _queue_is_empty(fleet: Fleet) -> bool:
    view = await fleet.queue()
    return view.running == 0 and view.waiting == 0


class PeakWatch:
    """Samples the simulator's queue (pending + running) every 50 ms: the most it ever held."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self.peak = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> PeakWatch:
        self._task = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()

    async def _watch(self) -> None:
        while True:
            try:
                answer = (
                    await self._fleet.http.get(f"{self._fleet.sim_url}/queue", timeout=2)
                ).json()
                held = len(answer["queue_running"]) + len(answer["queue_pending"])
                self.peak = max(self.peak, held)
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)


async def terminate_a_holder(fleet: Fleet, ids: list[str]) -> str | None:
    """Terminate a RUNNING job (one that ended between its status and the terminate does not
    count: the next is tried)."""
    for job_id in await running_ids(fleet, ids):
        try:
            await fleet.client.handle(job_id).terminate("a holder terminated from outside")
        except RPCError:
            continue
        return job_id
    return None


def busiest(fleet: Fleet) -> KillableWorker:
    """The worker that started the most follows since its start."""
    return max(fleet.workers, key=lambda w: w.log_text(since_start=True).count("follow_start"))


async def running_ids(fleet: Fleet, ids: list[str]) -> list[str]:
    statuses = await asyncio.gather(*(fleet.client.status(i) for i in ids))
    return [s.job_id for s in statuses if s.state == JobState.RUNNING]


async def test_the_bound_holds_across_a_kill_a_temporal_restart_and_a_terminate(
    queue: Fleet,
) -> None:
    fleet = queue
    ids = await submit(fleet, [request(300) for _ in range(12)], "chaos")
    async with PeakWatch(fleet) as watch:
        await eventually(
            lambda: running_ids(fleet, ids), timeout_s=60, what="a job running", interval_s=0.2
        )
        victim = busiest(fleet)
        await victim.kill()
        await asyncio.sleep(1.0)
        await victim.start()
        await fleet.stack.services.kill("temporal")
        await asyncio.sleep(1.0)
        await fleet.stack.services.start("temporal")
        running = fleet.stack.running
        temporal = await connect_temporal(running.temporal_address, running.namespace)
        fleet.client = JobClient(temporal, task_queue=fleet.task_queue, store=fleet.store)
        holder = await eventually(
            lambda: terminate_a_holder(fleet, ids), timeout_s=60, what="a holder terminated"
        )
        others = [i for i in ids if i != holder]
        ended = await wait_all(fleet, others, 240)
    assert [s.state for s in ended] == [JobState.COMPLETED] * len(others)
    stats = await fleet.sim_stats()
    assert watch.peak <= MAX_RUNNING and stats["peak_in_queue"] <= MAX_RUNNING, (
        watch.peak,
        stats["peak_in_queue"],
    )
    # Every job ran its prompt once (the killed worker's re-attached), the terminated one's too.
    assert sorted(stats["executions"].values()) == [1] * len(stats["executions"])
    # The terminated holder's slot came back once the orphan sweep ended its prompt.
    # (The view itself, so that a failure shows who still holds or waits.)
    await eventually(
        lambda: fleet.queue(),
        timeout_s=6 * RECLAIM_S,
        what="reclaimed",
        accept=lambda view: view.running == 0 and view.waiting == 0,
    )


async def test_a_priority_1_job_behind_a_full_queue_starts_at_the_next_free_slot(
    queue: Fleet,
) -> None:
    fleet = queue
    # Jobs of 4 s: all nine in line before the first holder ends, even when their checks
    # straggle under load (at 1 s, a loaded CI machine once saw the line drain first).
    ids = await submit(fleet, [request(400) for _ in range(9)], "line")
    await eventually(
        lambda: fleet.queue(),
        timeout_s=60,
        what="3 running and 6 waiting",
        accept=lambda view: view.running == MAX_RUNNING and view.waiting == 6,
    )
    [urgent] = await submit(fleet, [request(20, priority=1)], "urgent")
    # Those still waiting once the urgent job is in line (a holder may have ended and let one
    # of them in before it got there: that one started before it, rightly).
    joined = await eventually(
        lambda: fleet.queue(),
        timeout_s=60,
        what="the urgent job in the queue",
        accept=lambda view: any(e.job_id == urgent for e in view.entries),
    )
    waiting_then = [e.job_id for e in joined.entries if e.state == "waiting" and e.job_id in ids]
    assert len(waiting_then) >= MAX_RUNNING, joined
    ended = await wait_all(fleet, [*ids, urgent], 240)
    assert all(s.state == JobState.COMPLETED for s in ended)
    started = (await fleet.sim_stats())["started_at"]
    start_of = {s.job_id: started[prompt_of(s)] for s in ended}
    # It takes the next slot freed. The holders, started together, may end together: the slots
    # freed in that same pass go to it and to the next in line, whose prompts reach ComfyUI in
    # either order. So at most MAX_RUNNING - 1 of those waiting start before it (without the
    # priority, all of them would).
    before = [i for i in waiting_then if start_of[i] < start_of[urgent]]
    assert len(before) <= MAX_RUNNING - 1, (before, waiting_then, start_of)


async def test_a_job_that_waited_longer_than_its_execution_timeout_still_runs(
    queue: Fleet,
) -> None:
    fleet = queue
    blockers = await submit(fleet, [request(400, pool=ONE)], "blocker")
    await eventually(
        lambda: fleet.queue(ONE),
        timeout_s=60,
        what="one running",
        accept=lambda view: view.running == 1,
    )
    late = request(5, pool=ONE)
    late.policy.execution_timeout_s = 3.0
    [waiter] = await submit(fleet, [late], "waiter")
    status = await eventually(
        lambda: fleet.client.status(waiter),
        timeout_s=30,
        what="PENDING",
        accept=lambda s: s.state == JobState.PENDING,
    )
    assert status.admission is not None and status.admission.position == 1
    [first, second] = await wait_all(fleet, [*blockers, waiter], 120)
    assert first.state == second.state == JobState.COMPLETED, second


async def test_an_unconfirmed_stop_keeps_its_slot_until_pool_release_settles_it(
    queue: Fleet,
) -> None:
    fleet = queue
    # The prompt will not hear its interrupt for a minute: the stop cannot be confirmed.
    await fleet.http.post(f"{fleet.sim_url}/sim/faults", json={"ignore_interrupt_s": 60}, timeout=5)
    deaf = request(8000, pool=ONE)
    deaf.policy.teardown_horizon_s = 2.0
    [holder] = await submit(fleet, [deaf], "deaf")
    await eventually(
        lambda: fleet.client.status(holder),
        timeout_s=60,
        what="RUNNING",
        accept=lambda s: s.state == JobState.RUNNING,
    )
    [next_job] = await submit(fleet, [request(5, pool=ONE)], "next")
    await fleet.client.cancel(holder, "stop it")
    ended = await fleet.client.wait(holder)
    assert ended.state == JobState.CANCELLED and ended.teardown.state == "FAILED", ended.teardown
    # Past two reclaim sweeps the slot is still held, unsettled, and the next job waits.
    await asyncio.sleep(3 * RECLAIM_S)
    view = await fleet.queue(ONE)
    [entry] = [e for e in view.entries if e.job_id == holder]
    assert entry.state == "unsettled" and "FAILED" in entry.detail
    assert (await fleet.client.status(next_job)).state == JobState.PENDING
    # The operator settles it; the next job starts.
    code, out, err = await run_cli(
        "pool", "release", ONE, holder, env=cli_env(fleet.stack.running, fleet.task_queue)
    )
    assert code == 0, err
    assert holder in out
    done = await asyncio.wait_for(fleet.client.wait(next_job), 60)
    assert done.state == JobState.COMPLETED


def prompt_of(status: JobStatus) -> str:
    assert status.checkpoint is not None and status.checkpoint.prompt_id is not None
    return status.checkpoint.prompt_id


async def test_a_job_still_pending_at_start_by_s_expires_with_nothing_submitted(
    queue: Fleet,
) -> None:
    fleet = queue
    [blocker] = await submit(fleet, [request(6000, pool=ONE)], "blocker")
    await eventually(
        lambda: fleet.queue(ONE),
        timeout_s=60,
        what="one running",
        accept=lambda view: view.running == 1,
    )
    late = request(5, pool=ONE)
    late.policy.start_by_s = 3.0
    [waiter] = await submit(fleet, [late], "expiring")
    ended = await asyncio.wait_for(fleet.client.wait(waiter), 60)
    assert ended.state == JobState.EXPIRED, ended.error
    assert ended.error is not None and "queue of pool one" in ended.error.message
    # Its follow waited in line itself, so the stop asked the pool: nothing was ever queued.
    teardown = ended.teardown
    assert teardown.state == "CONFIRMED", teardown
    assert "never_queued" in {step.action for step in teardown.steps}, teardown
    checkpoint = ended.checkpoint
    assert checkpoint is None or (checkpoint.submitted_at, checkpoint.submit_sent_at) == (
        None,
        None,
    )
    # Its place in line went back: the queue holds the blocker alone.
    view = await fleet.queue(ONE)
    assert [e.job_id for e in view.entries] == [blocker]
    await fleet.client.cancel(blocker, "done with it")
    await fleet.client.wait(blocker)
    stats = await fleet.sim_stats()
    if checkpoint is not None:
        assert checkpoint.prompt_id not in stats["prompts"], "it never reached the pool"


async def test_above_max_pending_a_submission_is_refused_queue_full_and_nothing_starts(
    queue: Fleet, tmp_path: Path
) -> None:
    fleet = queue
    capped = {"tenant": "capped"}
    [blocker] = await submit(fleet, [request(6000, pool=ONE, labels=capped)], "blocker")
    await eventually(
        lambda: fleet.queue(ONE),
        timeout_s=60,
        what="one running",
        accept=lambda view: view.running == 1,
    )
    first_waiting = request(5, pool=ONE, labels=capped)
    waiting = await submit(fleet, [first_waiting, request(5, pool=ONE, labels=capped)], "w")
    await eventually(
        lambda: fleet.queue(ONE), timeout_s=30, what="2 waiting", accept=lambda v: v.waiting == 2
    )
    with pytest.raises(QueueFull) as refused:
        await fleet.client.submit(request(5, pool=ONE, labels=capped), job_id="one-too-many")
    assert refused.value.tenant == "capped" and "max_pending is 2" in str(refused.value)
    with pytest.raises(JobNotFound):
        await fleet.client.status("one-too-many")
    # Another tenant still has room; an idempotent resubmission of a waiting job is no refusal.
    await fleet.client.submit(request(5, pool=ONE), job_id=f"other-{uuid.uuid4().hex[:6]}")
    again = await fleet.client.start(first_waiting, job_id=waiting[0])
    assert again.existed
    # A tenant's max_priority: priority 1 is refused before anything runs, typed.
    [too_urgent] = await submit(fleet, [request(5, pool=POOL, labels=capped, priority=1)], "urgent")
    refused_job = await asyncio.wait_for(fleet.client.wait(too_urgent), 60)
    assert refused_job.state == JobState.FAILED and refused_job.error is not None
    assert refused_job.error.type == "PriorityNotAllowed", refused_job.error
    # The CLI: a pool's own max_pending, exit 5 with the same words.
    # The blocker holds the slot before the waiter asks (submitted together, the short one
    # might take the slot, end, and leave room).
    [tiny_blocker] = await submit(fleet, [request(6000, pool=TINY)], "tiny-blocker")
    await eventually(
        lambda: fleet.queue(TINY), timeout_s=60, what="tiny held", accept=lambda v: v.running == 1
    )
    [tiny_waiter] = await submit(fleet, [request(5, pool=TINY)], "tiny-waiter")
    await eventually(
        lambda: fleet.queue(TINY), timeout_s=60, what="tiny full", accept=lambda v: v.waiting == 1
    )
    graph = tmp_path / "graph.json"
    graph.write_text(json.dumps(request(5).graph))
    env = cli_env(fleet.stack.running, fleet.task_queue)
    code, out, err = await run_cli("submit", str(graph), "--pool", TINY, env=env)
    assert code == 5, (code, out, err, await fleet.queue(TINY))
    assert "queue full" in err and "max_pending is 1" in err
    for job_id in [blocker, tiny_blocker, *waiting, tiny_waiter]:
        # A slow machine may have let a blocker end and its waiters run by now.
        with contextlib.suppress(JobAlreadyEnded):
            await fleet.client.cancel(job_id, "the test is over")
