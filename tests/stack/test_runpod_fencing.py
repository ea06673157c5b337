"""A RunPod worker alive but silent, or lost after its work (docs/architecture.md,
*Fencing*): the real dev server, SeaweedFS, the RunPod simulator with the real `runpod` worker
loop, our handler and its watchdog beside a ComfyUI simulator of its own per worker (each in its
own process, so a frozen handler's ComfyUI runs on).

Each test asks for a fault on the job's first delivery and checks what fencing promises: the
job COMPLETED; its graph run to its end once across every worker (the ComfyUI simulators'
counters); the silent worker taken down, its billing ended, within `fence_after_s` and the idle
timeout of its lease's end; and `JobStatus.cost` listing every RunPod job of the job, each at
least what the simulator billed for it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from devstack.runpod_sim import Ledger
from devstack.runpod_sim.ledger import LedgerWorker
from starter import JobClient
from tests.support.cli import example
from tests.support.runpod_e2e import (
    FENCING_FENCE_AFTER_S,
    FENCING_LEASE_S,
    IDLE_TIMEOUT_S,
    job,
    settled_ledger,
)
from tests.support.runpod_sim import (
    ENDPOINT_VENV_MISSING,
    RunpodSim,
    completed_executions,
    prompt_executions,
)
from workflows.contracts import JobRequest, JobState, JobStatus

pytestmark = pytest.mark.skipif(
    ENDPOINT_VENV_MISSING is not None, reason=str(ENDPOINT_VENV_MISSING)
)

# Short, so each test waits seconds for a silent holder, not the defaults' 90 s.
LEASE_S = FENCING_LEASE_S
FENCE_AFTER_S = FENCING_FENCE_AFTER_S
JOB_WITHIN_S = 180.0
# A prompt that outlives the fence: 750 steps of the simulator's 20 ms, 15 s. The fault comes
# about 3 s in (6 progress updates, one per half second), the lease ends at most LEASE_S after
# it and the watchdog is done within half of FENCE_AFTER_S and half a second past that: the
# first delivery's prompt still has 4 s and more to run when it is fenced. Every delivery after
# it runs the whole prompt again, so each step here is paid twice.
LONG_STEPS = 750
SLACK_S = 3.0


async def finish(client: JobClient, request: JobRequest) -> JobStatus:
    started = await client.submit(request)
    return await asyncio.wait_for(client.wait(started.job_id), JOB_WITHIN_S)


def submission_of(final: JobStatus) -> str:
    assert final.checkpoint is not None and final.checkpoint.prompt_id
    return final.checkpoint.prompt_id


def faulted_worker(ledger: Ledger, kind: str) -> LedgerWorker:
    [worker] = [w for w in ledger.workers if w.events_of(kind)]
    return worker


def assert_every_job_costed(final: JobStatus, ledger: Ledger) -> None:
    """A cost entry per RunPod job of the submission, none below what the simulator billed."""
    billed = {j.id: j.billed_s for j in ledger.jobs_for(submission_of(final))}
    costs = {c.provider_job_id: c for c in final.cost}
    assert set(costs) >= set(billed), (final.cost, billed)
    for job_id, seconds in billed.items():
        assert costs[job_id].execution_s >= seconds - 1.0, (costs[job_id], seconds)
    assert {d.provider_job_id for d in final.deliveries} == set(costs)


def assert_taken_down_in_time(worker: LedgerWorker, kind: str) -> None:
    """The silent worker went (its watchdog took it down) no later than the fence bound after
    its lease ran out, and billed no idle time after."""
    [fault] = worker.events_of(kind)
    assert worker.exited_at is not None, worker
    bound = LEASE_S + FENCE_AFTER_S + IDLE_TIMEOUT_S + SLACK_S
    assert worker.exited_at - fault.at <= bound, (worker.exited_at - fault.at, worker)


@pytest.mark.parametrize(
    "fault",
    [
        {"freeze": {"after_progress": 6}},
        {"partition": {"after_progress": 6}},
    ],
    ids=["frozen-handler", "cut-off-from-s3"],
)
async def test_a_silent_holder_is_fenced_and_its_graph_completes_once(
    fenced: tuple[JobClient, RunpodSim], fault: dict[str, Any]
) -> None:
    """Its handler stops renewing the claim while its ComfyUI runs on. Nobody runs the graph
    again until the holder is fenced (its prompt interrupted, its worker taken down by its
    watchdog); then the submission goes out again and completes, the graph run once."""
    job_client, sim = fenced
    await sim.faults(**fault)
    final = await finish(job_client, job(steps=LONG_STEPS, progress_interval_s=0.5))
    assert final.state == JobState.COMPLETED, final.error
    ledger = await settled_ledger(sim)
    assert await completed_executions(sim, submission_of(final)) == 1
    kind = next(iter(fault))
    worker = faulted_worker(ledger, kind)
    # A frozen handler is taken down by its watchdog; one cut off from S3 stops its prompt
    # itself, answers RunPod (which it still reaches) and goes idle.
    assert worker.stop_reason == ("watchdog" if kind == "freeze" else "idle"), worker
    assert_taken_down_in_time(worker, kind)
    assert_every_job_costed(final, ledger)
    assert len(final.deliveries) == 2, final.deliveries
    assert final.deliveries[-1].outcome == "completed"


async def test_a_stuck_crash_puts_both_runpod_jobs_in_the_cost(
    fenced: tuple[JobClient, RunpodSim],
) -> None:
    """The worker dies and RunPod keeps its job IN_PROGRESS (`stuck`): it is cancelled once
    fenced, and paid for, so it is in the cost beside the job that completed."""
    job_client, sim = fenced
    await sim.faults(crash={"after_progress": 6, "outcome": "stuck"})
    final = await finish(job_client, job(steps=LONG_STEPS, progress_interval_s=0.5))
    assert final.state == JobState.COMPLETED, final.error
    ledger = await settled_ledger(sim)
    assert len(ledger.jobs_for(submission_of(final))) == 2
    assert_every_job_costed(final, ledger)
    assert await completed_executions(sim, submission_of(final)) == 1
    # Its container died: its ComfyUI's prompt stopped with it, not run on until the
    # simulator stopped that ComfyUI too.
    crashed = faulted_worker(ledger, "crash").id
    runs = await prompt_executions(sim, submission_of(final))
    for run in (r for r in runs if r.worker_id == crashed):
        started = run.executions > 0
        assert run.outcome == ("interrupted" if started else None), runs


def two_saves(steps: int, slow_steps: int = 60) -> dict[str, Any]:
    """The example graph, saved twice: a quick branch, then a slow one (its own sampler of
    `slow_steps`), so the first output is stored seconds before the second."""
    graph: dict[str, Any] = example(steps)
    graph["12"] = {
        "class_type": "KSampler",
        "inputs": graph["3"]["inputs"] | {"steps": slow_steps, "seed": 7},
    }
    graph["10"] = {"class_type": "VAEDecode", "inputs": {"samples": ["12", 0], "vae": ["4", 2]}}
    graph["11"] = {
        "class_type": "SaveImage",
        "inputs": {"images": ["10", 0], "filename_prefix": "second"},
    }
    return graph


async def test_a_worker_lost_after_storing_its_outputs_is_not_run_again(
    fenced: tuple[JobClient, RunpodSim],
) -> None:
    """Lost after its prompt succeeded and every output was stored: the job completes from
    what the claim and the bucket show, with one execution and no RunPod job more."""
    job_client, sim = fenced
    # At "uploading" the claim holds the prompt's end, and an update lists an output once the
    # claim holds it: the crash comes after both, however the uploads and the end interleave.
    await sim.faults(crash={"after_artifacts": 2, "in_stage": "uploading", "outcome": "stuck"})
    request = job(steps=10).model_copy(update={"graph": two_saves(10)})
    final = await finish(job_client, request)
    assert final.state == JobState.COMPLETED, final.error
    assert len(final.artifacts) == 2
    ledger = await settled_ledger(sim)
    runpod_jobs = {j.id for j in ledger.jobs_for(submission_of(final))}
    crashes = [e for w in ledger.workers for e in w.events_of("crash") if e.job_id in runpod_jobs]
    assert len(crashes) == 1, "the worker was lost at its uploading update"
    assert await completed_executions(sim, submission_of(final)) == 1
    assert len(ledger.jobs_for(submission_of(final))) == 1, "nothing submitted again"
    assert_every_job_costed(final, ledger)


async def test_a_worker_lost_between_its_uploads_has_only_the_missing_work_redone(
    fenced: tuple[JobClient, RunpodSim],
) -> None:
    """Lost after one of two outputs was stored: the new delivery runs only the output node
    whose file is missing, and the job has both outputs."""
    job_client, sim = fenced
    await sim.faults(crash={"after_artifacts": 1, "outcome": "stuck"})
    request = job(steps=10).model_copy(update={"graph": two_saves(10)})
    final = await finish(job_client, request)
    assert final.state == JobState.COMPLETED, final.error
    assert sorted(a.node_id for a in final.artifacts) == ["11", "9"]
    ledger = await settled_ledger(sim)
    assert len(ledger.jobs_for(submission_of(final))) == 2
    assert_every_job_costed(final, ledger)
