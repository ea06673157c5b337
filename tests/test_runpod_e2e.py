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
    args = [f"--worker-env={k}={v}" for k, v in bucket_env.items()]
    async with run_runpod_sim(
        tmp_path_factory.mktemp("runpod"),
        *args,
        "--comfy-sim-per-worker",
        "--comfy-sim-args=--step-delay-ms 20",
        "--idle-timeout=2",
        "--max-workers=2",
        handler="endpoint/handler.py",
        api_key=API_KEY,
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
        idle_timeout_s=2,
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
