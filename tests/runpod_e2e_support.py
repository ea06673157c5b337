"""What the RunPod integration tests share: the RunPod simulator running our handler under
the real `runpod` worker loop (a ComfyUI simulator per worker, SeaweedFS for the bucket), a worker
of ours with a `runpod` pool, and the check that nothing is left running or billed.

The fixtures are made available to every test module by tests/conftest.py; a module that
uses them marks itself `pytest.mark.usefixtures("nothing_left_running")`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
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
from tests.runpod_sim_support import RunpodSim, run_runpod_sim
from worker import run_worker
from workflows.contracts import JobPolicy, JobRequest, JobState, JobStatus

API_KEY = "sim-runpod-key"
POOL = "gpu"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def runpod_sim(
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
async def runpod_worker(
    local_stack: RunningStack, runpod_sim: RunpodSim
) -> AsyncIterator[RunPodWorker]:
    task_queue = f"runpod-{uuid.uuid4().hex[:8]}"
    pool = PoolConfig(
        kind="runpod",
        url=f"{runpod_sim.base_url}/v2",
        endpoint_id=runpod_sim.endpoint_id,
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
            yield RunPodWorker(client, store, runpod_sim)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)


IDLE_TIMEOUT_S = 2.0


@pytest_asyncio.fixture(loop_scope="session")
async def nothing_left_running(runpod_worker: RunPodWorker) -> AsyncIterator[None]:
    """After each test: no RunPod job still queued or running, and once the idle timeout has
    passed, no worker billed beyond it after its last job."""
    yield
    async with asyncio.timeout(IDLE_TIMEOUT_S + 20):
        while True:
            ledger = await runpod_worker.sim.ledger()
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
