"""A worker cut off from S3 after its prompt succeeded hands its outputs over in its answer
(endpoint/handover.py), and the graph is not run again (finished work is never
redone): the real dev server, SeaweedFS, the RunPod simulator with the real `runpod` worker
loop, our handler and its watchdog beside a ComfyUI simulator of its own per worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from activities.storage import ArtifactStore
from devstack.models import RunningStack
from starter import JobClient
from tests.support.runpod_e2e import fencing_pool, job, settled_ledger
from tests.support.runpod_sim import ENDPOINT_VENV_MISSING, RunpodSim, completed_executions
from workflows.contracts import JobState

pytestmark = pytest.mark.skipif(
    ENDPOINT_VENV_MISSING is not None, reason=str(ENDPOINT_VENV_MISSING)
)

# Long enough that the prompt (150 steps of the simulator's 20 ms) ends well before the fence
# falls due (the lease's end less a quarter of it, counted from the last renewal).
LEASE_S = 10.0
FENCE_AFTER_S = 5.0
WITHIN_S = 120.0


@pytest_asyncio.fixture(loop_scope="session")
async def client(
    local_stack: RunningStack, runpod_sim: RunpodSim
) -> AsyncIterator[tuple[JobClient, ArtifactStore, RunpodSim]]:
    served = fencing_pool(local_stack, runpod_sim, lease_s=LEASE_S, fence_after_s=FENCE_AFTER_S)
    async with served as (job_client, store):
        yield job_client, store, runpod_sim


async def test_a_prompt_that_succeeded_while_cut_off_from_s3_is_handed_over_not_run_again(
    client: tuple[JobClient, ArtifactStore, RunpodSim], tmp_path: Path
) -> None:
    """Partitioned from S3 a second into a 3-second prompt: the prompt succeeds, its output
    cannot be stored nor the claim renewed. At the fence the handler answers with the output
    inline; the orchestrator stores it, and the job COMPLETES with one RunPod job and one
    execution (before, the worker fenced and the submission ran again elsewhere)."""
    job_client, store, sim = client
    await sim.faults(partition={"after_progress": 2})
    started = await job_client.submit(job(steps=150, progress_interval_s=0.5))
    final = await asyncio.wait_for(job_client.wait(started.job_id), WITHIN_S)
    assert final.state == JobState.COMPLETED, final.error
    assert final.checkpoint is not None and final.checkpoint.prompt_id
    submission = final.checkpoint.prompt_id
    ledger = await settled_ledger(sim)
    [worker] = [w for w in ledger.workers if w.events_of("partition")]
    sent = ledger.jobs_for(submission)
    assert len(sent) == 1, ("not submitted again", [(j.id, j.status) for j in sent])
    [provider_job] = sent
    assert provider_job.status == "COMPLETED" and provider_job.worker_id == worker.id
    assert await completed_executions(sim, submission) == 1
    [artifact] = final.artifacts
    [path] = await job_client.download(final, tmp_path)
    assert path.stat().st_size == artifact.size > 0
    head = await store.head(artifact.key)
    assert head is not None and head.sha256 == artifact.sha256
