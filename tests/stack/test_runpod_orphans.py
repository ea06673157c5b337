"""RunPod pools against the real dev server, SeaweedFS and the RunPod simulator:

- orphans: `temporal workflow terminate` mid-job leaves a RunPod job nobody stops; the
  orphan sweep finds it in the registry of live submissions (and, with claims, through the
  claim) and cancels it within its interval, on our handler's endpoint and on a stock one;
- the node registry: once a worker of the endpoint has published its ComfyUI's
  `/object_info`, a typo'd class is refused at prepare, before any RunPod job exists.

After every test the simulator's ledger shows no job queued or running and no worker billed past
its idle timeout (`settled_ledger`).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import pytest_asyncio

from activities.runpod.submissions import pool_folder
from activities.storage import ArtifactStore
from devstack.models import RunningStack
from protocol.runpod.contract import nodes_key
from starter import JobClient
from tests.support.runpod_e2e import (
    POOL,
    bucket_env,
    endpoint_sim,
    job,
    runpod_pool,
    serving,
    settled_ledger,
)
from tests.support.runpod_sim import ENDPOINT_VENV_MISSING, RunpodSim
from workflows.contracts import JobRequest, JobState, JobStatus
from workflows.shared import ErrorType

pytestmark = pytest.mark.skipif(
    ENDPOINT_VENV_MISSING is not None, reason=str(ENDPOINT_VENV_MISSING)
)

# How often the worker sweeps (each interval is jittered by +-25 %).
SWEEP_S = 2.0
# From the terminate to a CANCELLED RunPod job: the longest interval, the sweep's own requests
# (a list, a describe, a status and a cancel), and the ledger's poll.
CANCELLED_WITHIN_S = SWEEP_S * 1.25 + 8.0
# Steps of a job that would run for a minute (the simulated ComfyUI takes 20 ms a step): far
# longer than the sweep takes to cancel it.
LONG_STEPS = 3000
JOB_WITHIN_S = 120.0
PUBLISHED_WITHIN_S = 30.0


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def ours_sim(
    local_stack: RunningStack, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunpodSim]:
    """Our handler, with a bucket, told where to publish its node registry at start."""
    env = bucket_env(local_stack) | {"DURABLE_COMFY_BUCKET": local_stack.bucket}
    async with endpoint_sim(tmp_path_factory.mktemp("runpod-orphans"), env=env) as sim:
        yield sim


async def wait_until(
    client: JobClient, job_id: str, ok: Callable[[JobStatus], bool], within_s: float = 90
) -> JobStatus:
    async with asyncio.timeout(within_s):
        while True:
            status = await client.status(job_id)
            if ok(status):
                return status
            assert not status.terminal, status.model_dump_json(indent=1)
            await asyncio.sleep(0.2)


async def eventually(check: Callable[[], Awaitable[bool]], within_s: float) -> None:
    async with asyncio.timeout(within_s):
        while True:
            if await check():
                return
            await asyncio.sleep(0.2)


async def runpod_job_of(sim: RunpodSim, status: JobStatus) -> str:
    """The RunPod job running the job's submission, once the simulator has one in progress."""
    assert status.checkpoint is not None and status.checkpoint.prompt_id
    submission = status.checkpoint.prompt_id
    async with asyncio.timeout(60):
        while True:
            ledger = await sim.ledger()
            running = [j.id for j in ledger.jobs_for(submission) if j.status == "IN_PROGRESS"]
            if running:
                [runpod_job_id] = running
                return runpod_job_id
            await asyncio.sleep(0.2)


# -- orphans -------------------------------------------------------------------------------------


@pytest.mark.parametrize("claims", [True, False], ids=["our-handler", "stock"])
async def test_a_terminated_jobs_runpod_job_is_cancelled_within_the_sweep_interval(
    local_stack: RunningStack, ours_sim: RunpodSim, stock_sim: RunpodSim, claims: bool
) -> None:
    sim = ours_sim if claims else stock_sim
    pools = {POOL: runpod_pool(sim, claims=claims)}
    async with serving(local_stack, pools, orphan_sweep_interval_s=SWEEP_S) as (client, store):
        started = await client.submit(job(steps=LONG_STEPS, progress_interval_s=0.5))
        running = await wait_until(
            client,
            started.job_id,
            lambda s: (
                s.state == JobState.RUNNING
                and s.checkpoint is not None
                and bool(s.checkpoint.prompt_id)
                and (s.progress.step > 0 or not claims)
            ),  # a stock worker reports no steps
        )
        runpod_job_id = await runpod_job_of(sim, running)
        records = await store.list_keys(pool_folder(POOL))
        assert any(started.job_id in key for key in records), records

        await client.handle(started.job_id).terminate(reason="test: an orphan on a runpod pool")

        async def cancelled() -> bool:
            return (await sim.ledger()).job(runpod_job_id).status != "IN_PROGRESS"

        async def forgotten() -> bool:
            return not any(started.job_id in k for k in await store.list_keys(pool_folder(POOL)))

        await eventually(cancelled, CANCELLED_WITHIN_S)
        provider_job = (await sim.ledger()).job(runpod_job_id)
        assert provider_job.status == "CANCELLED", provider_job.model_dump()
        # And the sweep forgets the submission once RunPod says it has ended.
        await eventually(forgotten, CANCELLED_WITHIN_S)
    ledger = await settled_ledger(sim)
    [delivery] = ledger.job(runpod_job_id).deliveries
    assert delivery.outcome != "completed", "stopped mid-job, not run to its end"


# -- the node registry ---------------------------------------------------------------------------


def with_class(request: JobRequest, node: str, class_type: str) -> JobRequest:
    graph = copy.deepcopy(request.graph)
    graph[node]["class_type"] = class_type
    return request.model_copy(update={"graph": graph})


async def published(store: ArtifactStore, endpoint_id: str) -> None:
    async def found() -> bool:
        return await store.head(nodes_key(endpoint_id)) is not None

    await eventually(found, PUBLISHED_WITHIN_S)


async def test_a_typo_is_refused_before_any_runpod_job_once_the_endpoint_published(
    local_stack: RunningStack, ours_sim: RunpodSim
) -> None:
    async with serving(local_stack, {POOL: runpod_pool(ours_sim)}) as (client, store):
        # What another endpoint (or an earlier run) published is not this one's.
        await store.delete(nodes_key(ours_sim.endpoint_id))
        first = await client.submit(job(steps=2))
        done = await asyncio.wait_for(client.wait(first.job_id), JOB_WITHIN_S)
        assert done.state == JobState.COMPLETED, done.error
        # Needs the handler's publishing (endpoint/): at worker start with DURABLE_COMFY_BUCKET
        # set, or on the first job that names the target.
        await published(store, ours_sim.endpoint_id)
        before = {j.id for j in (await ours_sim.ledger()).jobs}

        typo = await client.submit(with_class(job(steps=2), "3", "KSamplerr"))
        final = await asyncio.wait_for(client.wait(typo.job_id), JOB_WITHIN_S)
    assert final.state == JobState.FAILED
    assert final.error is not None and final.error.type == ErrorType.INVALID_GRAPH
    assert "node 3: class 'KSamplerr' is not installed" in final.error.message
    assert final.teardown is not None and final.teardown.state == "SKIPPED"
    ledger = await settled_ledger(ours_sim)
    assert {j.id for j in ledger.jobs} == before, "no RunPod job for the refused graph"
