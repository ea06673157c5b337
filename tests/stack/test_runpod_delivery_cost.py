"""A cancelled job's cost names every RunPod job it had, each at least what it billed:
the real dev server, SeaweedFS, the RunPod simulator with the real `runpod` worker loop, and our
handler beside a ComfyUI simulator of its own per worker.

Two deliveries the workflow cannot know from its follow, which the cancel cut short: a RunPod job
whose `/run` answer was lost (only its delivery marker names it), and the first delivery of a
RunPod job that RunPod delivered again after its worker was lost (RunPod's figures count the
last delivery only; the claim names the earlier holder).
"""

from __future__ import annotations

import asyncio

import pytest

from devstack.runpod_sim import Ledger
from starter import JobClient
from tests.support.runpod_e2e import (
    FENCING_FENCE_AFTER_S,
    FENCING_LEASE_S,
    job,
    settled_ledger,
)
from tests.support.runpod_sim import ENDPOINT_VENV_MISSING, RunpodSim
from workflows.contracts import JobState, JobStatus

pytestmark = pytest.mark.skipif(
    ENDPOINT_VENV_MISSING is not None, reason=str(ENDPOINT_VENV_MISSING)
)

LEASE_S = FENCING_LEASE_S
FENCE_AFTER_S = FENCING_FENCE_AFTER_S
WITHIN_S = 120.0
# Long enough to be cancelled mid-run: 1,500 steps of the simulator's 20 ms.
LONG_STEPS = 1500
# What the simulator's ledger and RunPod's figures may differ by per delivery (clock reads).
SLACK_S = 1.0


async def submission_once_running(client: JobClient, job_id: str) -> str:
    """The job's submission (its prompt id), once its prompt has made a step."""
    async with asyncio.timeout(WITHIN_S):
        while True:
            status = await client.status(job_id)
            if status.state == JobState.RUNNING and status.progress.step > 0:
                assert status.checkpoint is not None and status.checkpoint.prompt_id
                return status.checkpoint.prompt_id
            assert not status.terminal, status.model_dump_json(indent=1)
            await asyncio.sleep(0.2)


async def cancelled(client: JobClient, job_id: str) -> JobStatus:
    await client.cancel(job_id, "changed my mind")
    final = await asyncio.wait_for(client.wait(job_id), WITHIN_S)
    assert final.state == JobState.CANCELLED, final.error
    return final


def assert_cost_covers_the_bill(final: JobStatus, ledger: Ledger, submission: str) -> None:
    """An entry per RunPod job of the submission, none below what the simulator billed for it
    (every delivery of it), each also in `deliveries`."""
    billed = {j.id: (j.billed_s, len(j.deliveries)) for j in ledger.jobs_for(submission)}
    costs = {c.provider_job_id: c for c in final.cost}
    assert set(costs) >= set(billed), (final.cost, billed)
    for job_id, (seconds, deliveries) in billed.items():
        assert costs[job_id].billed_s + SLACK_S * deliveries >= seconds, (costs[job_id], seconds)
    assert {d.provider_job_id for d in final.deliveries} == set(costs)


async def test_a_cancel_counts_the_runpod_job_whose_run_answer_was_lost(
    fenced: tuple[JobClient, RunpodSim],
) -> None:
    """The first `/run`'s answer is lost, so the follow sends the submission again; whichever
    delivery claims it runs it, the other finds it claimed. Cancelled mid-run, before the
    follow ever returned: the job's cost has both RunPod jobs (the stop reads the deliveries'
    markers)."""
    job_client, sim = fenced
    await sim.faults(drop_run_answer=1)
    started = await job_client.submit(job(steps=LONG_STEPS, progress_interval_s=0.5))
    submission = await submission_once_running(job_client, started.job_id)
    final = await cancelled(job_client, started.job_id)
    ledger = await settled_ledger(sim)
    assert len(ledger.jobs_for(submission)) == 2, "the lost one and the one sent again"
    assert_cost_covers_the_bill(final, ledger, submission)


async def test_a_cancel_after_a_redelivery_counts_the_lost_workers_delivery(
    fenced: tuple[JobClient, RunpodSim],
) -> None:
    """The worker dies mid-run and RunPod delivers the same job again (`redeliver`): its new
    delivery waits out the dead holder's lease, and is cancelled meanwhile. RunPod's figures for
    the job count only that delivery; the cost covers the dead worker's too (from the claim)."""
    job_client, sim = fenced
    await sim.faults(crash={"after_progress": 6, "outcome": "redeliver"})
    started = await job_client.submit(job(steps=LONG_STEPS, progress_interval_s=0.5))
    submission = await submission_once_running(job_client, started.job_id)
    async with asyncio.timeout(WITHIN_S):
        while True:
            if any(w.events_of("crash") for w in (await sim.ledger()).workers):
                break
            await asyncio.sleep(0.2)
    final = await cancelled(job_client, started.job_id)
    ledger = await settled_ledger(sim)
    [provider_job] = ledger.jobs_for(submission)
    assert provider_job.deliveries[0].outcome == "worker_lost", provider_job.deliveries
    assert_cost_covers_the_bill(final, ledger, submission)
    [cost] = final.cost
    assert "earlier delivery" in cost.note, cost
