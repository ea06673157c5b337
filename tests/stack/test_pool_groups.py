"""A group of pools with failover, on the real Temporal server and S3, the RunPod simulator (our
handler) and the stack's ComfyUI simulator.

Group `farm` = [`rp` (a runpod pool, one job at a time), `local` (the ComfyUI simulator)]. Jobs
name the group; each goes to `rp` while its endpoint takes work. Then every idle worker of the
endpoint fails its health check (the simulator's `unhealthy_workers`): the pool's queue reads
`/health` on its own cadence, finds that no worker can take a job, and tells its waiting jobs,
which leave for `local` and complete there. The job already IN_PROGRESS on RunPod stays and
completes there; the simulator's ledger holds that one RunPod job and no other.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from configuration.pools import PoolConfig
from devstack.models import RunningStack
from devstack.processes import terminate
from faults.wait import eventually
from tests.stack.parallel_sim import start_parallel_sim
from tests.support.runpod_e2e import bucket_env, endpoint_sim, job, runpod_pool, serving
from tests.support.runpod_sim import ENDPOINT_VENV_MISSING, RunpodSim
from workflows.contracts import JobState

pytestmark = pytest.mark.skipif(
    ENDPOINT_VENV_MISSING is not None, reason=str(ENDPOINT_VENV_MISSING)
)

GROUP, RP, LOCAL = "farm", "rp", "local"


@pytest_asyncio.fixture(loop_scope="session")
async def two_worker_sim(
    local_stack: RunningStack, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunpodSim]:
    """An endpoint that keeps two workers up (RunPod's active workers): one runs a job while
    the other idles, so the fault has a worker to make unhealthy."""
    async with endpoint_sim(
        tmp_path_factory.mktemp("runpod-group"),
        "--min-workers=2",
        env=bucket_env(local_stack),
    ) as sim:
        yield sim


async def test_pending_jobs_leave_an_unhealthy_endpoint_for_the_groups_next_pool(
    local_stack: RunningStack, two_worker_sim: RunpodSim
) -> None:
    sim = two_worker_sim
    pools = {
        RP: runpod_pool(sim, max_running=1),
        LOCAL: PoolConfig(kind="comfyui", url=local_stack.comfyui_url),
    }
    async with serving(local_stack, pools, default_pool=GROUP, groups={GROUP: [RP, LOCAL]}) as (
        client,
        _store,
    ):
        # Long enough to outlast the fault's detection: a job granted rp just before it would
        # wait in RunPod's queue, where it does not move (docs/pools.md "Not yet").
        running = await client.submit(job(steps=1500))
        async with asyncio.timeout(90):
            while True:
                first = await client.status(running.job_id)
                on_rp = first.backend is not None and first.backend.pool == RP
                if on_rp and first.state == JobState.RUNNING and first.progress.step > 0:
                    break
                await asyncio.sleep(0.2)
        waiting = [await client.submit(job(steps=5)) for _ in range(3)]
        async with asyncio.timeout(60):
            while True:
                statuses = [await client.status(s.job_id) for s in waiting]
                if all(
                    s.state == JobState.PENDING and s.admission and s.admission.pool == RP
                    for s in statuses
                ):
                    break
                await asyncio.sleep(0.2)
        await sim.faults(unhealthy_workers=True)
        try:
            moved = await asyncio.wait_for(
                asyncio.gather(*(client.wait(s.job_id) for s in waiting)), 90
            )
            still = await client.status(running.job_id)
        finally:
            await sim.faults(unhealthy_workers=False)
        final = await asyncio.wait_for(client.wait(running.job_id), 120)
        view = await client.pool_queue(RP)
    for status in moved:
        assert status.state == JobState.COMPLETED, status.model_dump_json(indent=1)
        assert status.backend is not None and status.backend.pool == LOCAL, status.backend
        assert status.admission is not None
        [move] = status.admission.moves
        assert (move.from_pool, move.to_pool) == (RP, LOCAL), move
        assert "no worker can take a job" in move.reason, move
    # The job RunPod was running never moved: it was still there when the others had left.
    assert still.backend is not None and still.backend.pool == RP
    assert final.state == JobState.COMPLETED, final.model_dump_json(indent=1)
    assert final.admission is None or final.admission.moves == []
    # One RunPod job in the ledger: the running one's. None of the moved jobs reached RunPod.
    ledger = await sim.ledger()
    assert final.checkpoint is not None
    assert [j.id for j in ledger.jobs] == [final.checkpoint.provider_job_id], ledger.jobs
    assert view.endpoint is not None


async def test_a_job_with_a_start_deadline_passes_a_pool_that_would_start_it_too_late(
    local_stack: RunningStack, tmp_path: Path
) -> None:
    """Group [busy (one job at a time, its line long by its recent holds), spare (a simulator of
    its own)]: a job whose `start_by_s` its estimate there would pass goes to `spare` at once;
    one without a deadline waits its turn in `busy`."""
    record, spare_url = await start_parallel_sim(tmp_path / "spare", step_delay_ms=20, parallel=1)
    pools = {
        "busy": PoolConfig(kind="comfyui", url=local_stack.comfyui_url, max_running=1),
        "spare": PoolConfig(kind="comfyui", url=spare_url),
    }
    try:
        await _deadline_passes_busy(local_stack, pools)
    finally:
        await terminate(record, grace_s=10)


async def _deadline_passes_busy(local_stack: RunningStack, pools: dict[str, PoolConfig]) -> None:
    async with serving(
        local_stack, pools, default_pool=GROUP, groups={GROUP: ["busy", "spare"]}
    ) as (client, _store):
        # One hold of a few seconds gives `busy` its pace; then a long one holds its slot.
        warm = await asyncio.wait_for(client.wait((await client.submit(job(steps=250))).job_id), 60)
        assert warm.backend is not None and warm.backend.pool == "busy"
        blocker = await client.submit(job(steps=3000))
        await eventually(
            lambda: client.status(blocker.job_id),
            timeout_s=60,
            what="the blocker running",
            accept=lambda s: s.state == JobState.RUNNING,
        )
        patient = await client.submit(job(steps=5))
        hurried = await client.submit(job(steps=5, start_by_s=5.0))
        done = await asyncio.wait_for(client.wait(hurried.job_id), 60)
        waiting = await client.status(patient.job_id)
        for job_id in (blocker.job_id, patient.job_id):
            await client.cancel(job_id, "the test is over")
    assert done.state == JobState.COMPLETED, done.model_dump_json(indent=1)
    assert done.backend is not None and done.backend.pool == "spare"
    assert waiting.state == JobState.PENDING and waiting.admission is not None
    assert waiting.admission.pool == "busy"
