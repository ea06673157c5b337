"""A comfyui pool of two servers on the real Temporal server, S3 and two worker processes.

Each server is a ComfyUI simulator of this module's own that runs one prompt at a time, as a
GPU does. The pool's queue (workflows/pool_queue.py) gives each job its server: jobs spread over
both, never two at once on one; a drained server finishes what it runs and gets nothing new; a
server killed with `kill -9` mid-prompt takes no new job (its health watch says so) while its
waiting jobs run on the other, and its own job, re-attached once it is back, completes with one
execution on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from activities.storage import ArtifactStore
from configuration.settings import S3Settings
from devstack.models import RunningStack
from devstack.processes import PidRecord, terminate
from faults.graphs import chaos_policy, sampler_graph
from faults.wait import eventually
from faults.worker_proc import KillableWorker
from starter.client import JobClient
from starter.connection import connect_temporal
from starter.errors import NoPoolQueue
from tests.stack.parallel_sim import start_parallel_sim
from workflows import shared
from workflows.admission import PoolQueueView
from workflows.contracts import JobRequest, JobState, JobStatus

POOL = "farm"
STEP_DELAY_MS = 40
WORKERS = 2


@dataclass
class Sim:
    base: Path
    record: PidRecord
    url: str

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@dataclass
class Farm:
    stack: RunningStack
    task_queue: str
    workers: list[KillableWorker]
    sims: list[Sim]
    http: httpx.AsyncClient
    client: JobClient

    async def stats(self, sim: Sim) -> dict[str, Any]:
        stats: dict[str, Any] = (await self.http.get(f"{sim.url}/sim/stats", timeout=5)).json()
        return stats

    async def queue(self) -> PoolQueueView:
        handle = self.client.temporal.get_workflow_handle(
            shared.pool_queue_id(self.task_queue, POOL)
        )
        view: PoolQueueView = await handle.query(shared.QUERY_POOL_QUEUE, result_type=PoolQueueView)
        return view

    async def submit(self, steps: int, count: int, prefix: str) -> list[str]:
        ids = [f"{prefix}-{uuid.uuid4().hex[:8]}" for _ in range(count)]
        for job_id in ids:
            # One after the other: the order they join the line is the order they start.
            await self.client.submit(request(steps), job_id=job_id)
        return ids

    async def wait_all(self, ids: list[str], timeout_s: float = 120) -> list[JobStatus]:
        return await asyncio.wait_for(
            asyncio.gather(*(self.client.wait(i) for i in ids)), timeout=timeout_s
        )

    def report(self) -> str:
        return "\n".join(f"==== {w.name} ====\n{w.log_tail(40)}" for w in self.workers)


def request(steps: int) -> JobRequest:
    graph = sampler_graph(steps)
    graph["5"]["inputs"].update({"width": 64, "height": 64})
    return JobRequest(graph=graph, pool=POOL, policy=chaos_policy(heartbeat_timeout_s=4.0))


async def start_sim(base: Path, port: int | None = None) -> Sim:
    record, url = await start_parallel_sim(base, step_delay_ms=STEP_DELAY_MS, parallel=1, port=port)
    return Sim(base, record, url)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def farm_fleet(
    local_stack: RunningStack, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Farm]:
    """The process's stack (Temporal, S3), two simulators of the module's own, and two worker
    processes on a task queue of their own whose pool `farm` is the two simulators."""
    base = tmp_path_factory.mktemp("server-pools")
    task_queue = f"farm-{uuid.uuid4().hex[:8]}"
    sims = [await start_sim(base / f"sim-{n}") for n in (1, 2)]
    pools = {POOL: {"kind": "comfyui", "urls": [s.url for s in sims]}}
    env = {
        **local_stack.worker_env(),
        "DURABLE_COMFY_TASK_QUEUE": task_queue,
        "DURABLE_COMFY_POOLS": json.dumps(pools),
        "DURABLE_COMFY_DEFAULT_POOL": POOL,
    }
    workers = [
        KillableWorker(env, base / f"worker-{n}.log", name=f"worker-{n}")
        for n in range(1, WORKERS + 1)
    ]
    try:
        await asyncio.gather(*(w.start() for w in workers))
        temporal = await connect_temporal(local_stack.temporal_address, local_stack.namespace)
        async with (
            httpx.AsyncClient(trust_env=False) as http,
            ArtifactStore(S3Settings.from_env(local_stack.worker_env())) as store,
        ):
            client = JobClient(temporal, task_queue=task_queue, store=store)
            yield Farm(local_stack, task_queue, workers, sims, http, client)
    finally:
        await asyncio.gather(*(w.terminate(grace_s=10.0) for w in workers))
        for sim in sims:
            await terminate(sim.record, grace_s=10)
    assert [pid for w in workers for pid in w.running_pids()] == []


@pytest_asyncio.fixture(loop_scope="session")
async def farm(farm_fleet: Farm) -> AsyncIterator[Farm]:
    """Both servers up and undrained, their counters at zero."""
    for sim in farm_fleet.sims:
        await farm_fleet.http.post(f"{sim.url}/sim/reset", timeout=5)
        with contextlib.suppress(NoPoolQueue):  # before the pool's first job: nothing drained
            await farm_fleet.client.undrain_pool(POOL, sim.url)
    yield farm_fleet
    print(farm_fleet.report())


def ran_on(status: JobStatus) -> str | None:
    return status.backend.server if status.backend is not None else None


async def test_jobs_spread_over_both_servers_one_at_a_time_on_each(farm: Farm) -> None:
    ids = await farm.submit(steps=20, count=6, prefix="spread")
    ended = await farm.wait_all(ids)
    assert [s.state for s in ended] == [JobState.COMPLETED] * len(ids), farm.report()
    first, second = farm.sims
    stats = {sim.url: await farm.stats(sim) for sim in farm.sims}
    for status in ended:
        server = ran_on(status)
        assert server in stats, status.backend
        # The status names the server that really ran the prompt, and it ran there once.
        assert status.checkpoint is not None and status.checkpoint.server == server
        assert stats[server]["executions"].get(status.checkpoint.prompt_id) == 1
    for sim in (first, second):
        # Each server had work (neither sat idle while the other had a line), one at a time:
        # our queue, not ComfyUI's, held the rest.
        assert len(stats[sim.url]["prompts"]) >= 2, stats
        assert stats[sim.url]["peak_in_queue"] == 1, stats[sim.url]["peak_in_queue"]
    view = await farm.queue()
    assert view.max_running == 2
    assert sorted(s.url for s in view.servers) == sorted(stats)
    assert all(s.health == "healthy" for s in view.servers)


async def test_a_drained_server_finishes_its_job_and_gets_no_new_one(farm: Farm) -> None:
    first, second = farm.sims
    long_ids = await farm.submit(steps=60, count=2, prefix="before-drain")
    statuses = await _running_on_both(farm, long_ids)
    on_second = next(s.job_id for s in statuses if ran_on(s) == second.url)
    view = await farm.client.drain_pool(POOL, second.url, by="test")
    assert {s.url: s.health for s in view.servers}[second.url] == "drained"
    later = await farm.submit(steps=10, count=3, prefix="after-drain")
    ended = await farm.wait_all(long_ids + later)
    assert [s.state for s in ended] == [JobState.COMPLETED] * len(ended), farm.report()
    by_id = {s.job_id: s for s in ended}
    # The job it ran when drained finished there; every later job went to the other server.
    assert ran_on(by_id[on_second]) == second.url
    assert [ran_on(by_id[i]) for i in later] == [first.url] * len(later)
    second_stats = await farm.stats(second)
    assert len(second_stats["prompts"]) == 1, second_stats["prompts"]
    # Both workers' jobs got their servers from the one queue: the drain held for all of them.
    await farm.client.undrain_pool(POOL, second.url)
    after = await farm.submit(steps=10, count=2, prefix="undrained")
    ended = await farm.wait_all(after)
    assert {ran_on(s) for s in ended} == {first.url, second.url}


async def test_a_server_killed_mid_prompt_sends_its_line_to_the_other_and_its_job_completes(
    farm: Farm,
) -> None:
    first, second = farm.sims
    long_ids = await farm.submit(steps=80, count=2, prefix="long")
    statuses = await _running_on_both(farm, long_ids)
    victim = next(s.job_id for s in statuses if ran_on(s) == second.url)
    waiting = await farm.submit(steps=10, count=3, prefix="waiting")
    await terminate(second.record, sig=signal.SIGKILL, grace_s=5)
    try:
        await eventually(
            lambda: _health_is(farm, second.url, "unhealthy"),
            timeout_s=20,
            what="the killed server marked unhealthy",
        )
        # While it is down, the line runs on the other server.
        done = await farm.wait_all(waiting, timeout_s=90)
        assert [s.state for s in done] == [JobState.COMPLETED] * len(done), farm.report()
        assert {ran_on(s) for s in done} == {first.url}
        assert (await farm.client.status(victim)).state != JobState.COMPLETED
    finally:
        restarted = await start_sim(second.base, port=second.port)
        farm.sims[1] = restarted
    await eventually(
        lambda: _health_is(farm, second.url, "healthy"),
        timeout_s=20,
        what="the restarted server healthy again",
    )
    final = await asyncio.wait_for(farm.client.wait(victim), timeout=120)
    assert final.state == JobState.COMPLETED, farm.report()
    assert ran_on(final) == second.url
    assert final.checkpoint is not None and final.checkpoint.prompt_id is not None
    # Its prompt was provably gone (a restarted server holds neither queue nor history): sent
    # again to the same server, where it ran once, to its end.
    stats = await farm.stats(restarted)
    assert stats["executions"] == {final.checkpoint.prompt_id: 1}, stats
    assert stats["executed"] == {final.checkpoint.prompt_id: "success"}, stats
    assert (await farm.stats(first))["executions"].get(final.checkpoint.prompt_id) is None
    long_other = next(i for i in long_ids if i != victim)
    other = await asyncio.wait_for(farm.client.wait(long_other), timeout=60)
    assert other.state == JobState.COMPLETED and ran_on(other) == first.url


async def _running_on_both(farm: Farm, ids: list[str]) -> list[JobStatus]:
    """Until each of the two jobs runs (past its first steps) on a server of its own."""
    found: list[JobStatus] = []

    async def both_running() -> bool:
        nonlocal found
        found = list(await asyncio.gather(*(farm.client.status(i) for i in ids)))
        # Both servers named (a status read in a follow's quiet start has the heartbeat's step
        # before the job has heard which server: not yet).
        servers = {ran_on(s) for s in found}
        named = servers == {sim.url for sim in farm.sims}
        return named and all(s.progress.step >= 2 for s in found)

    await eventually(both_running, timeout_s=60, what="both jobs running on a server each")
    return found


async def _health_is(farm: Farm, server: str, health: str) -> bool:
    view = await farm.queue()
    return {s.url: s.health for s in view.servers}.get(server) == health


async def test_an_unhealthy_idle_server_is_given_no_job_until_it_answers_again(
    farm: Farm,
) -> None:
    first, second = farm.sims
    await terminate(second.record, sig=signal.SIGKILL, grace_s=5)
    try:
        await eventually(
            lambda: _health_is(farm, second.url, "unhealthy"),
            timeout_s=20,
            what="the killed server marked unhealthy",
        )
        # Its slot is free, but it takes no job: every one runs on the other server.
        ids = await farm.submit(steps=10, count=3, prefix="around")
        done = await farm.wait_all(ids, timeout_s=90)
        assert [s.state for s in done] == [JobState.COMPLETED] * len(done), farm.report()
        assert {ran_on(s) for s in done} == {first.url}
    finally:
        farm.sims[1] = await start_sim(second.base, port=second.port)
    await eventually(
        lambda: _health_is(farm, second.url, "healthy"),
        timeout_s=20,
        what="the restarted server healthy again",
    )
    ids = await farm.submit(steps=10, count=2, prefix="back")
    done = await farm.wait_all(ids)
    assert {ran_on(s) for s in done} == {first.url, second.url}
