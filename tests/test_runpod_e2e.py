"""RunPod end to end: the real dev server, SeaweedFS, the RunPod simulator running our handler
(endpoint/handler.py) under the real `runpod` worker loop with a ComfyUI simulator per worker,
and our worker with a `runpod` pool. What the ledger shows is what would be billed."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from pydantic import SecretStr

from activities.settings import PoolConfig, WorkerSettings
from activities.storage import ArtifactStore
from devstack.models import RunningStack
from starter import JobClient
from starter.connection import connect_temporal
from tests.cli_support import example, s3_settings
from tests.runpod_sim_support import ENDPOINT_VENV_MISSING, RunpodSim, run_runpod_sim
from worker import run_worker
from workflows.contracts import JobPolicy, JobRequest, JobState, JobStatus

pytestmark = pytest.mark.skipif(
    ENDPOINT_VENV_MISSING is not None, reason=str(ENDPOINT_VENV_MISSING)
)

API_KEY = "sim-runpod-key"
POOL = "gpu"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def runpod(
    local_stack: RunningStack, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunpodSim]:
    bucket_env = {
        "BUCKET_ENDPOINT_URL": local_stack.s3_endpoint,
        "BUCKET_ACCESS_KEY_ID": local_stack.access_key_id,
        "BUCKET_SECRET_ACCESS_KEY": local_stack.secret_access_key.get_secret_value(),
        "BUCKET_REGION": local_stack.region,
    }
    # Names only on the command line (what `ps` shows); the values come from the environment.
    args = [f"--worker-env={name}" for name in bucket_env]
    async with run_runpod_sim(
        tmp_path_factory.mktemp("runpod"),
        *args,
        "--comfy-sim-per-worker",
        "--comfy-sim-args=--step-delay-ms 20",
        f"--idle-timeout={IDLE_TIMEOUT_S}",
        "--max-workers=2",
        handler="endpoint/handler.py",
        api_key=API_KEY,
        env=bucket_env,
    ) as sim:
        yield sim


class RunPodWorker:
    def __init__(self, client: JobClient, store: ArtifactStore, sim: RunpodSim) -> None:
        self.client = client
        self.store = store
        self.sim = sim


@pytest_asyncio.fixture(loop_scope="session")
async def worker(local_stack: RunningStack, runpod: RunpodSim) -> AsyncIterator[RunPodWorker]:
    task_queue = f"runpod-{uuid.uuid4().hex[:8]}"
    pool = PoolConfig(
        kind="runpod",
        url=f"{runpod.base_url}/v2",
        endpoint_id=runpod.endpoint_id,
        usd_per_second=0.0004,
        idle_timeout_s=IDLE_TIMEOUT_S,
    )
    settings = WorkerSettings(task_queue=task_queue, default_pool=POOL, pools={POOL: pool})
    temporal = await connect_temporal(local_stack.temporal_address, local_stack.namespace)
    stop = asyncio.Event()
    task = asyncio.create_task(
        run_worker(
            settings,
            s3_settings(local_stack),
            stop=stop,
            client=temporal,
            runpod_keys={POOL: SecretStr(API_KEY)},
        )
    )
    try:
        async with ArtifactStore(s3_settings(local_stack)) as store:
            client = JobClient(temporal, task_queue=task_queue, store=store)
            yield RunPodWorker(client, store, runpod)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)


IDLE_TIMEOUT_S = 2.0


@pytest_asyncio.fixture(autouse=True, loop_scope="session")
async def nothing_left_running(worker: RunPodWorker) -> AsyncIterator[None]:
    """After each test: no RunPod job still queued or running, and once the idle timeout has
    passed, no worker billed beyond it after its last job."""
    yield
    async with asyncio.timeout(IDLE_TIMEOUT_S + 20):
        while True:
            ledger = await worker.sim.ledger()
            busy = [j.id for j in ledger.jobs if j.status in ("IN_QUEUE", "IN_PROGRESS")]
            idle = [w.id for w in ledger.workers if w.exited_at is None]
            if not busy and not idle:
                break
            await asyncio.sleep(0.25)
    for provider_worker in ledger.workers:
        after = provider_worker.billed_after_last_job_s
        assert after is None or after <= IDLE_TIMEOUT_S + 1.0, provider_worker.model_dump()


def job(steps: int = 20, **policy: Any) -> JobRequest:
    settings = {"abandon_after_s": None, "heartbeat_timeout_s": 5} | policy
    return JobRequest(graph=example(steps=steps), policy=JobPolicy.model_validate(settings))


async def test_a_job_runs_on_the_runpod_endpoint_with_progress_and_a_verified_artifact(
    worker: RunPodWorker, tmp_path: Path
) -> None:
    started = await worker.client.submit(job(steps=250, progress_interval_s=0.5))
    seen: list[JobStatus] = []
    async for status in worker.client.watch(started.job_id):
        seen.append(status)
        if status.terminal:
            break
    final = seen[-1]
    assert final.state == JobState.COMPLETED, final.error
    assert any(0 < s.progress.step < s.progress.total_steps for s in seen), "step progress"
    assert final.backend is not None and final.backend.kind == "runpod"
    [artifact] = final.artifacts
    target = tmp_path / "out.png"
    await worker.store.download(artifact.key, target, expected_sha256=artifact.sha256)
    assert target.stat().st_size == artifact.size
    assert final.teardown.state == "CONFIRMED"

    ledger = await worker.sim.ledger()
    [provider_job] = [j for j in ledger.jobs if j.submission == final.checkpoint.prompt_id]  # type: ignore[union-attr]
    assert provider_job.status == "COMPLETED"
    [cost] = final.cost
    assert cost.provider_job_id == provider_job.id
    assert abs(cost.execution_s - provider_job.billed_s) <= 1.0, json.dumps(
        provider_job.model_dump(mode="json")
    )


async def provider_output(sim: RunpodSim, job_id: str) -> dict[str, Any]:
    """The RunPod job's `output`, as its `/status` shows it."""
    async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
        answer = await http.get(f"{sim.api_url}/status/{job_id}", headers=sim.headers)
    answer.raise_for_status()
    output = answer.json().get("output")
    assert isinstance(output, dict), answer.text
    return output


async def wait_for_state(
    worker: RunPodWorker, job_id: str, *states: JobState, within_s: float = 60
) -> JobStatus:
    async with asyncio.timeout(within_s):
        while True:
            status = await worker.client.status(job_id)
            if status.state in states:
                return status
            await asyncio.sleep(0.2)


async def test_cancel_mid_job_cancels_the_provider_job_and_frees_its_worker(
    worker: RunPodWorker,
) -> None:
    started = await worker.client.submit(job(steps=1500, progress_interval_s=0.5))
    running = await wait_for_state(worker, started.job_id, JobState.RUNNING)
    assert running.checkpoint is not None
    await worker.client.cancel(started.job_id, "changed my mind")
    final = await worker.client.wait(started.job_id)
    assert final.state == JobState.CANCELLED
    assert final.teardown.state == "CONFIRMED", final.teardown.detail
    ledger = await worker.sim.ledger()
    [provider_job] = [j for j in ledger.jobs if j.submission == running.checkpoint.prompt_id]
    assert provider_job.status == "CANCELLED"
    assert all(d.ended_at is not None for d in provider_job.deliveries), "no worker still at it"
    assert final.cost and final.cost[0].provider_job_id == provider_job.id


async def test_429_bursts_are_ridden_out(worker: RunPodWorker) -> None:
    await worker.sim.faults(burst_429=6)
    final = await worker.client.wait((await worker.client.submit(job(steps=20))).job_id)
    assert final.state == JobState.COMPLETED, final.error
    assert len(final.artifacts) == 1


async def test_a_dropped_run_answer_is_resubmitted_and_the_graph_runs_once(
    worker: RunPodWorker,
) -> None:
    await worker.sim.faults(drop_run_answer=1)
    final = await worker.client.wait((await worker.client.submit(job(steps=40))).job_id)
    assert final.state == JobState.COMPLETED, final.error
    assert final.checkpoint is not None
    ledger = await worker.sim.ledger()
    deliveries = [j for j in ledger.jobs if j.submission == final.checkpoint.prompt_id]
    assert len(deliveries) == 2, "the lost one and the resubmission"
    # Only one of them ran the graph: the other found the submission claimed (or its outcome
    # recorded) and returned without running anything.
    outputs = [await provider_output(worker.sim, j.id) for j in deliveries]
    ran = [o for o in outputs if o.get("status") == "success" and not o.get("replayed")]
    assert len(ran) == 1, outputs
    [other] = [o for o in outputs if o is not ran[0]]
    assert other.get("status") == "claimed_elsewhere" or other.get("replayed") is True, other
