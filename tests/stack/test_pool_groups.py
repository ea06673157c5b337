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

import pytest
import pytest_asyncio

from configuration.pools import PoolConfig
from devstack.models import RunningStack
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
