"""RunPod under faults: the real dev server, SeaweedFS, the RunPod simulator with the real
`runpod` worker loop, and our workers, while things break (each fault faults/inject.py's, as in
`make soak`).

Three simulated endpoints, one each per module:
- `runpod_sim`: our handler (endpoint/handler.py) with a bucket: claims, progress, S3 outputs;
- `stock_sim`: a stock worker-comfyui stand-in (tests/runpod_handlers/stock_comfyui.py): no
  bucket, no progress, base64 results; our pool for it has `claims: false`;
- `gpuless_sim`: an endpoint that never gets a worker (`--max-workers=0`), its clock 10x fast,
  where jobs wait until RunPod's ttl deletes them.

After every test each simulator's ledger shows no job queued or running, no worker billed past
its idle timeout after its last job (`settled_ledger`), and none billed more than the
`JobStatus.cost` of the jobs it ran says (`billing_matches`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from activities.runpod import follow as runpod_follow
from activities.runpod.claims import claim_target, read_claim
from activities.storage import ArtifactStore
from devstack.models import RunningStack
from devstack.runpod_sim import Ledger
from devstack.runpod_sim.ledger import LedgerDelivery, LedgerJob
from devstack.runpod_sim.settings import DeathOutcome
from faults.inject import RunpodFaults, crash_worker
from faults.worker_proc import WorkerFleet
from protocol.runpod.contract import Claim
from starter import JobClient
from starter.connection import connect_temporal
from tests.support.runpod_e2e import (
    API_KEY,
    POOL,
    billing_matches,
    cost_matches,
    ended_statuses,
    endpoint_sim,
    job,
    provider_output,
    runpod_pool,
    serving,
    settled_ledger,
)
from tests.support.runpod_sim import ENDPOINT_VENV_MISSING, RunpodSim
from workflows.contracts import JobRequest, JobState, JobStatus, OutputSpec
from workflows.shared import ErrorType

pytestmark = pytest.mark.skipif(
    ENDPOINT_VENV_MISSING is not None, reason=str(ENDPOINT_VENV_MISSING)
)

STOCK_POOL = "stock"
GPULESS_POOL = "nogpu"
GPULESS_CLOCK = 10.0
# The shortest claim lease a job may ask for: a crashed holder's claim may be taken over this
# long after its last renewal (the default, a minute, would make each crash test wait for it).
SHORT_LEASE_S = 5.0
# And how long past a crashed holder's lease the takeover waits (the pools' `fence_after_s`; the
# default, 30 s, would add as much to each crash test). tests/stack/test_runpod_fencing.py checks
# that a holder is fenced within it.
FENCE_AFTER_S = 5.0
JOB_WITHIN_S = 120.0


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gpuless_sim(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunpodSim]:
    async with endpoint_sim(
        tmp_path_factory.mktemp("runpod-gpuless"),
        "--max-workers=0",
        f"--clock-speed={GPULESS_CLOCK}",
        handler=None,
    ) as sim:
        yield sim


@dataclass
class Endpoints:
    """The three simulators, a worker of ours serving a pool on each, and its client."""

    stack: RunningStack
    ours: RunpodSim
    stock: RunpodSim
    gpuless: RunpodSim
    client: JobClient
    store: ArtifactStore


@pytest_asyncio.fixture(loop_scope="session")
async def endpoints(
    local_stack: RunningStack,
    runpod_sim: RunpodSim,
    stock_sim: RunpodSim,
    gpuless_sim: RunpodSim,
) -> AsyncIterator[Endpoints]:
    for sim in (runpod_sim, stock_sim, gpuless_sim):
        await RunpodFaults(sim.base_url).reset()
    pools = {
        POOL: runpod_pool(runpod_sim, fence_after_s=FENCE_AFTER_S),
        STOCK_POOL: runpod_pool(stock_sim, claims=False),
        GPULESS_POOL: runpod_pool(gpuless_sim, execution_timeout_s=5),
    }
    started = time.time()
    async with serving(local_stack, pools) as (client, store):
        yield Endpoints(local_stack, runpod_sim, stock_sim, gpuless_sim, client, store)
        ledgers = [await settled_ledger(sim) for sim in (runpod_sim, stock_sim)]
        ledgers.append(await settled_ledger(gpuless_sim, idle_timeout_s=0.0))
        # While our worker still answers the status queries of the jobs the test ran.
        statuses = await ended_statuses(client, since=started)
    for ledger in ledgers:
        billing_matches(ledger, statuses)


@pytest.fixture
def short_lease(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(runpod_follow, "CLAIM_LEASE_S", SHORT_LEASE_S)
    return SHORT_LEASE_S


# -- helpers -------------------------------------------------------------------------------------


async def finish(client: JobClient, request: JobRequest) -> JobStatus:
    started = await client.submit(request)
    return await asyncio.wait_for(client.wait(started.job_id), JOB_WITHIN_S)


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


def submission_of(final: JobStatus) -> str:
    assert final.checkpoint is not None and final.checkpoint.prompt_id
    return final.checkpoint.prompt_id


def deliveries(ledger: Ledger, submission: str) -> list[tuple[LedgerJob, LedgerDelivery]]:
    return [(j, d) for j in ledger.jobs_for(submission) for d in j.deliveries]


async def graph_runs(
    sim: RunpodSim, ledger: Ledger, submission: str
) -> list[tuple[LedgerJob, LedgerDelivery]]:
    """The deliveries of `submission` that ran its graph to the end: completed, and answered
    with outputs of their own (not `claimed_elsewhere`, not a replay of a recorded outcome)."""
    runs = []
    for provider_job, delivery in deliveries(ledger, submission):
        if delivery.outcome != "completed":
            continue
        if provider_job.deliveries[-1] is delivery:
            output = await provider_output(sim, provider_job.id)
            if output.get("status") == "claimed_elsewhere" or output.get("replayed"):
                continue
        runs.append((provider_job, delivery))
    return runs


async def verified_artifact(store: ArtifactStore, final: JobStatus, tmp_path: Path) -> None:
    [artifact] = final.artifacts
    target = tmp_path / "out.png"
    await store.download(artifact.key, target, expected_sha256=artifact.sha256)
    assert target.stat().st_size == artifact.size


async def claim_of(store: ArtifactStore, final: JobStatus) -> Claim:
    target = claim_target(OutputSpec(), store.settings.bucket)
    claim = await read_claim(store, target, final.job_id, submission_of(final))
    assert claim is not None
    return claim


# -- our orchestrator worker dies ----------------------------------------------------------------


async def test_orchestrator_worker_kill_9_mid_job_completes_with_one_gpu_execution(
    endpoints: Endpoints, tmp_path: Path
) -> None:
    """`python worker.py` is SIGKILLed while the RunPod job runs; its replacement re-attaches to
    the same RunPod job by the heartbeated id instead of submitting again."""
    task_queue = f"runpod-kill-{uuid.uuid4().hex[:8]}"
    env = {
        **endpoints.stack.worker_env(),
        "DURABLE_COMFY_TASK_QUEUE": task_queue,
        "DURABLE_COMFY_POOLS": json.dumps(
            {POOL: runpod_pool(endpoints.ours).model_dump(mode="json", exclude_none=True)}
        ),
        "DURABLE_COMFY_DEFAULT_POOL": POOL,
        "RUNPOD_API_KEY": API_KEY,
    }
    fleet = WorkerFleet(env, tmp_path / "workers")
    temporal = await connect_temporal(endpoints.stack.temporal_address, endpoints.stack.namespace)
    client = JobClient(temporal, task_queue=task_queue, store=endpoints.store)
    try:
        first = await fleet.start("first")
        started = await client.submit(job(steps=400, progress_interval_s=0.5))
        running = await wait_until(
            client,
            started.job_id,
            lambda s: s.state == JobState.RUNNING and s.progress.step > 0,
        )
        await crash_worker(first)
        final = await asyncio.wait_for(client.wait(started.job_id), JOB_WITHIN_S)
    finally:
        await fleet.stop_all()
    assert fleet.running_pids() == []
    assert final.state == JobState.COMPLETED, final.error
    await verified_artifact(endpoints.store, final, tmp_path)
    assert running.progress.step < final.progress.step, "killed mid-job"

    ledger = await settled_ledger(endpoints.ours)
    submission = submission_of(final)
    [(provider_job, delivery)] = deliveries(ledger, submission)
    assert provider_job.status == "COMPLETED" and delivery.outcome == "completed"
    assert len(await graph_runs(endpoints.ours, ledger, submission)) == 1
    cost_matches(final.cost, ledger, submission)


# -- the endpoint's worker dies ------------------------------------------------------------------


@pytest.mark.parametrize("outcome", ["timed_out", "redeliver"])
async def test_endpoint_worker_crash_mid_job_completes_with_one_complete_gpu_execution(
    endpoints: Endpoints, short_lease: float, tmp_path: Path, outcome: DeathOutcome
) -> None:
    """The RunPod worker running the job is kill -9ed mid-sampling. TIMED_OUT: the orchestrator
    waits out the dead holder's claim lease and submits the same submission again, and the new
    delivery takes the claim over. Re-delivery: RunPod hands the same job to another worker,
    whose handler waits out the lease and takes the claim over."""
    await RunpodFaults(endpoints.ours.base_url).crash(outcome, after_progress=8)
    final = await finish(endpoints.client, job(steps=300, progress_interval_s=0.5))
    assert final.state == JobState.COMPLETED, final.error
    await verified_artifact(endpoints.store, final, tmp_path)

    ledger = await settled_ledger(endpoints.ours)
    submission = submission_of(final)
    everything = deliveries(ledger, submission)
    crashed = [(j, d) for j, d in everything if d.outcome == "worker_lost"]
    [(crashed_job, crashed_delivery)] = crashed
    assert crashed_delivery.progress_updates >= 8, "it crashed mid-job"
    runs = await graph_runs(endpoints.ours, ledger, submission)
    assert len(runs) == 1, [d for _, d in everything]
    [(ran_job, ran_delivery)] = runs
    assert ran_delivery.worker_id != crashed_delivery.worker_id
    if outcome == "timed_out":
        assert crashed_job.status == "TIMED_OUT"
        assert ran_job.id != crashed_job.id, "the same submission, sent again"
    else:
        assert ran_job.id == crashed_job.id, "the same RunPod job, delivered again"
        assert [d.outcome for d in crashed_job.deliveries] == ["worker_lost", "completed"]
    claim = await claim_of(endpoints.store, final)
    assert claim.holder == ran_job.id and claim.takeovers == 1
    assert claim.outcome is not None and claim.outcome.state == "completed"
    if outcome == "timed_out":
        # Both RunPod jobs are in the bill, the crashed one too.
        cost_matches(final.cost, ledger, submission)
    else:
        # One RunPod job; its executionTime is its last delivery's. The crashed delivery's
        # seconds are added from the claim (its holder, to its lease's end at most).
        [cost] = final.cost
        assert cost.execution_s + 1.0 >= crashed_job.billed_s, (cost, crashed_job)
        assert cost.execution_s <= crashed_job.billed_s + short_lease + 1.0, (cost, crashed_job)
        assert "1 earlier delivery" in cost.note, cost


# -- a stock endpoint (claims: false) ------------------------------------------------------------


async def test_a_dropped_run_answer_without_claims_asks_and_resubmits_on_resume(
    endpoints: Endpoints,
) -> None:
    """Without claims nobody can tell whether the lost `/run` made a job: NEEDS_DECISION; a
    person's `resume --resubmit` sends it again (and pays twice, as the decision says)."""
    await RunpodFaults(endpoints.stock.base_url).drop_run_answer()
    client = endpoints.client
    started = await client.submit(job(steps=20).model_copy(update={"pool": STOCK_POOL}))
    asked = await wait_until(
        client, started.job_id, lambda s: s.state == JobState.NEEDS_DECISION, within_s=60
    )
    assert asked.decision is not None and "resume --resubmit" in asked.decision.options
    assert not asked.decision.reattach_possible
    await client.resume(started.job_id, resubmit=True)
    final = await asyncio.wait_for(client.wait(started.job_id), JOB_WITHIN_S)
    assert final.state == JobState.COMPLETED, final.error
    assert len(final.artifacts) == 1

    ledger = await settled_ledger(endpoints.stock)
    sent = ledger.jobs_for(submission_of(final))
    assert len(sent) == 2, "the one whose answer was lost, and the resubmission"
    assert all(j.status == "COMPLETED" for j in sent), "both ran: the price of resubmitting"
    # The lost one's id was never heard: only the resubmission is in the bill.
    cost_matches(final.cost, ledger, submission_of(final), known={sent[1].id})


async def test_a_stock_base64_result_is_completed_with_its_artifact_stored_in_s3(
    endpoints: Endpoints, tmp_path: Path
) -> None:
    final = await finish(endpoints.client, job(steps=20).model_copy(update={"pool": STOCK_POOL}))
    assert final.state == JobState.COMPLETED, final.error
    await verified_artifact(endpoints.store, final, tmp_path)

    ledger = await settled_ledger(endpoints.stock)
    submission = submission_of(final)
    [(provider_job, delivery)] = deliveries(ledger, submission)
    assert delivery.progress_updates == 0, "a stock worker sends no progress"
    output = await provider_output(endpoints.stock, provider_job.id)
    [image] = output["images"]
    assert image["type"] == "base64" and set(image) == {"filename", "type", "data"}
    cost_matches(final.cost, ledger, submission)


# -- RunPod's own limits and losses --------------------------------------------------------------


async def test_a_job_whose_ttl_runs_out_in_the_queue_fails_as_a_queue_timeout(
    endpoints: Endpoints,
) -> None:
    """No worker ever comes; RunPod deletes the job at its ttl (queue timeout + execution
    timeout, 10 simulated seconds) before the workflow's own queue watchdog (5 s) fires."""
    request = job(steps=20, queue_timeout_s=5).model_copy(update={"pool": GPULESS_POOL})
    final = await finish(endpoints.client, request)
    assert final.state == JobState.FAILED
    assert final.error is not None and final.error.type == ErrorType.QUEUE_TIMEOUT
    assert "ttl" in final.error.message, final.error.message
    ledger = await settled_ledger(endpoints.gpuless, idle_timeout_s=0.0)
    [provider_job] = ledger.jobs_for(submission_of(final))
    assert provider_job.gone == "ttl" and provider_job.deliveries == []
    assert ledger.workers == []


async def test_a_job_still_in_runpods_queue_at_start_by_s_expires_with_its_job_withdrawn(
    endpoints: Endpoints,
) -> None:
    """No worker ever comes: at `start_by_s` the job's RunPod job, still IN_QUEUE, is cancelled
    (confirmed), nothing ran, nothing billed, and the job ends EXPIRED."""
    request = job(steps=20, start_by_s=3).model_copy(update={"pool": GPULESS_POOL})
    final = await finish(endpoints.client, request)
    assert final.state == JobState.EXPIRED, final.error
    assert final.error is not None and final.error.type == ErrorType.EXPIRED
    assert "in the backend's queue" in final.error.message, final.error.message
    assert final.teardown.state == "CONFIRMED", final.teardown
    assert final.cost == [] or all(c.execution_s == 0 for c in final.cost)
    ledger = await settled_ledger(endpoints.gpuless, idle_timeout_s=0.0)
    [provider_job] = ledger.jobs_for(submission_of(final))
    assert provider_job.status == "CANCELLED" and provider_job.deliveries == []
    assert ledger.workers == []


async def test_completed_without_output_is_not_a_success(endpoints: Endpoints) -> None:
    """RunPod refused the worker's job-done (as after a result too big for it) and reports the
    job COMPLETED with no output: the job fails, typed, instead of completing empty."""
    await RunpodFaults(endpoints.ours.base_url).lost_result()
    final = await finish(endpoints.client, job(steps=20))
    assert final.state == JobState.FAILED
    assert final.error is not None and final.error.type == ErrorType.OUTPUT_MISSING
    ledger = await settled_ledger(endpoints.ours)
    [(provider_job, delivery)] = deliveries(ledger, submission_of(final))
    assert provider_job.status == "COMPLETED" and delivery.outcome == "result_lost"
    cost_matches(final.cost, ledger, submission_of(final))
