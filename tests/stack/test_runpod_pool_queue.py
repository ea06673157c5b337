"""Our queue in front of a `runpod` pool: the RunPod simulator's ledger never holds more of the
pool's jobs at once (queued or in progress) than `max_running`, and the others waited PENDING
with nothing at the provider."""

from __future__ import annotations

import asyncio

import pytest

from devstack.models import RunningStack
from tests.support.runpod_e2e import (
    POOL,
    job,
    most_at_once,
    provider_spans,
    runpod_pool,
    serving,
    settled_ledger,
)
from tests.support.runpod_sim import ENDPOINT_VENV_MISSING, RunpodSim
from workflows.contracts import JobState

pytestmark = pytest.mark.skipif(
    ENDPOINT_VENV_MISSING is not None, reason=str(ENDPOINT_VENV_MISSING)
)

MAX_RUNNING = 2
JOBS = 7


async def test_the_ledger_never_holds_more_of_the_pools_jobs_than_max_running(
    local_stack: RunningStack, runpod_sim: RunpodSim
) -> None:
    pools = {POOL: runpod_pool(runpod_sim, max_running=MAX_RUNNING)}
    async with serving(local_stack, pools) as (client, _store):
        started = await asyncio.gather(*(client.submit(job(steps=30)) for _ in range(JOBS)))
        seen_pending = False
        for _ in range(300):
            statuses = await asyncio.gather(*(client.status(s.job_id) for s in started))
            seen_pending = seen_pending or any(s.state == JobState.PENDING for s in statuses)
            if all(s.terminal for s in statuses):
                break
            await asyncio.sleep(0.2)
        ended = await asyncio.wait_for(
            asyncio.gather(*(client.wait(s.job_id) for s in started)), 180
        )
    assert [s.state for s in ended] == [JobState.COMPLETED] * JOBS
    assert seen_pending, "with 7 jobs on 2 slots, some job must have waited PENDING"
    spans = provider_spans(await settled_ledger(runpod_sim), ended)
    assert len(spans) == JOBS
    # Queued or in progress at RunPod, from `/run` to its end: never more than the bound.
    assert most_at_once(spans) == MAX_RUNNING, spans
