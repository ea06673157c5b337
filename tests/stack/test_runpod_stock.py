"""A stock endpoint, for real: the unmodified runpod-workers/worker-comfyui 5.8.5 handler (a test
fixture outside the repository, AGPL-3.0, run only as a separate process) under the RunPod
simulator and runpod 1.7.x's worker loop (.venv-stock), a ComfyUI simulator per worker, and a
worker of ours serving a `runpod` pool with `claims: false` on it.

The handler is launched by tests/runpod_handlers/worker_comfyui.py (which only points it at its
worker's ComfyUI). It probes `GET /` before each job, returns base64 images named by file name
only (no node id, no subfolder), sends no progress and never interrupts a cancelled prompt.
After every test the simulator's ledger shows nothing queued or running and no worker billed
past its idle timeout, nor more than the `JobStatus.cost` of the jobs it ran (`settled_ledger`,
`billing_matches`).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from devstack.models import RunningStack
from devstack.runpod_sim import Ledger
from starter import JobClient
from tests.support.runpod_e2e import (
    billing_matches,
    ended_statuses,
    endpoint_sim,
    job,
    provider_output,
    runpod_pool,
    serving,
    settled_ledger,
)
from tests.support.runpod_sim import (
    REPO_ROOT,
    STOCK_LAUNCHER,
    STOCK_MISSING,
    RunpodSim,
    run_runpod_sim,
    stock_fixture_dir,
)
from workflows.contracts import JobRequest, JobState, JobStatus
from workflows.graph import safe_tag

pytestmark = pytest.mark.skipif(STOCK_MISSING is not None, reason=str(STOCK_MISSING))

STOCK_POOL = "stock"
JOB_WITHIN_S = 120.0
# What the stock handler prints once its `GET /` probe answered 200.
READY_LINE = "worker-comfyui - API is reachable"
# A prompt of ~12 s on the worker's ComfyUI simulator (20 ms per sampler step).
LONG_STEPS = 600


def fixture_env() -> dict[str, str]:
    return {"STOCK_WORKER_COMFYUI": str(stock_fixture_dir())}


@pytest_asyncio.fixture(scope="module")
async def stock_sim(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunpodSim]:
    """No bucket for the workers: the handler answers base64 images, as most endpoints do."""
    async with endpoint_sim(
        tmp_path_factory.mktemp("runpod-stock"), handler=STOCK_LAUNCHER, env=fixture_env()
    ) as sim:
        yield sim


@pytest_asyncio.fixture
async def stock_client(local_stack: RunningStack, stock_sim: RunpodSim) -> AsyncIterator[JobClient]:
    await stock_sim.reset_faults()
    pools = {STOCK_POOL: runpod_pool(stock_sim, claims=False)}
    started = time.time()
    async with serving(local_stack, pools, default_pool=STOCK_POOL) as (client, _store):
        yield client
        ledger = await settled_ledger(stock_sim)
        billing_matches(ledger, await ended_statuses(client, since=started))


# -- helpers -------------------------------------------------------------------------------------


def model_free(*saves: str) -> dict[str, Any]:
    """EmptyImage, then one SaveImage per prefix, each behind its own number of ImageInverts so
    that every saved image has different bytes."""
    color = int(time.time_ns()) & 0xFFFFFF  # no cache hit from an earlier test's run
    graph: dict[str, Any] = {
        "1": {"class_type": "EmptyImage",
              "inputs": {"width": 48, "height": 32, "batch_size": 1, "color": color}},
    }  # fmt: skip
    source = ["1", 0]
    for index, save_prefix in enumerate(saves):
        if index:
            node = f"{10 + index}"
            graph[node] = {"class_type": "ImageInvert", "inputs": {"image": source}}
            source = [node, 0]
        graph[f"{20 + index}"] = {
            "class_type": "SaveImage",
            "inputs": {"images": source, "filename_prefix": save_prefix},
        }
    return graph


def stock_job(graph: dict[str, Any]) -> JobRequest:
    return job().model_copy(update={"graph": graph})


def written_for(sim: RunpodSim, job_id: str) -> dict[str, str]:
    """Every file the workers' ComfyUI simulators saved for the job (relative path -> sha256);
    the orchestrator puts each run's outputs under `dc_{job}_...` (workflows.graph.run_tag)."""
    found: dict[str, str] = {}
    for output in (sim.work_dir / "workers").glob("*/comfy/output"):
        for folder in output.glob(f"dc_{safe_tag(job_id)}_*"):
            for path in folder.rglob("*"):
                if path.is_file():
                    relative = str(path.relative_to(output))
                    found[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def submission_of(final: JobStatus) -> str:
    assert final.checkpoint is not None and final.checkpoint.prompt_id
    return final.checkpoint.prompt_id


async def finish(client: JobClient, request: JobRequest) -> JobStatus:
    started = await client.submit(request)
    return await asyncio.wait_for(client.wait(started.job_id), JOB_WITHIN_S)


def worker_logs(sim: RunpodSim) -> str:
    return "\n".join(p.read_text() for p in (sim.work_dir / "workers").glob("*/worker.log"))


def outside_files() -> dict[str, bool]:
    """Where runpod 1.7 (its job list, in the working directory) and the stock handler (the
    ComfyUI pid file it watches) would write, were the worker not given directories of its own."""
    places = (REPO_ROOT / ".runpod_jobs.pkl", Path("/tmp/comfyui.pid"))
    return {str(place): place.exists() for place in places}


def started_line(provider_job_id: str) -> str:
    """runpod 1.7's log line as the handler starts on a job (JSON, one per line)."""
    return f'{{"requestId": "{provider_job_id}", "message": "Started."'


def finished_line(provider_job_id: str) -> str:
    """... and once its result was posted."""
    return f'{{"requestId": "{provider_job_id}", "message": "Finished."'


async def running_status(client: JobClient, job_id: str) -> JobStatus | None:
    status = await client.status(job_id)
    assert not status.terminal, status.model_dump_json(indent=1)
    return status if status.state == JobState.RUNNING else None


async def until(check: Any, within_s: float, what: str) -> Any:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if value := await check():
            return value
        await asyncio.sleep(0.25)
    raise AssertionError(f"not within {within_s:g} s: {what}")


# -- the worker itself, through the public API only ------------------------------------------


async def test_the_stock_worker_gets_ready_and_runs_a_graph_through_the_public_api(
    tmp_path: Path,
) -> None:
    """Its `GET /` probe is answered (the ComfyUI simulator serves ComfyUI's front page), its
    base64 image is the file the worker's ComfyUI wrote, and nothing is left outside the
    simulator's directory (runpod 1.7's job list and the ComfyUI pid file stay in the worker's
    own temporary directory)."""
    before = outside_files()
    async with run_runpod_sim(
        tmp_path, "--comfy-sim-per-worker", "--worker-env=STOCK_WORKER_COMFYUI",
        "--idle-timeout=1", handler=STOCK_LAUNCHER, env=fixture_env(),
    ) as sim, httpx.AsyncClient(timeout=10, trust_env=False) as http:  # fmt: skip
        graph = model_free("probe/out")
        answer = await http.post(
            f"{sim.api_url}/run", headers=sim.headers, json={"input": {"workflow": graph}}
        )
        job_id = answer.json()["id"]

        async def ended() -> dict[str, Any] | None:
            status = (await http.get(f"{sim.api_url}/status/{job_id}", headers=sim.headers)).json()
            return None if status["status"] in ("IN_QUEUE", "IN_PROGRESS") else status

        status = await until(ended, 60, "the stock worker ends the job")
        assert status["status"] == "COMPLETED", (status, worker_logs(sim))
        [image] = status["output"]["images"]
        assert image["filename"] == "out_00001_.png" and image["type"] == "base64"
        [saved] = (sim.work_dir / "workers").glob("*/comfy/output/probe/out_00001_.png")
        assert base64.b64decode(image["data"]) == saved.read_bytes()
        logs = worker_logs(sim)
        assert READY_LINE in logs and "Version 1.7." in logs, logs
        ledger = await settled_ledger(sim, idle_timeout_s=1.0)
    [provider_worker] = ledger.workers
    assert provider_worker.ready_at is not None and provider_worker.jobs == [job_id]
    assert provider_worker.pings >= 1, "runpod 1.7's heartbeat reaches the ping route"
    [private] = (sim.work_dir / "workers").glob("*/tmp")
    assert (private / ".runpod_jobs.pkl").exists() and (private / "comfyui.pid").exists()
    assert outside_files() == before, "a worker wrote outside its own directory"


# -- through the orchestrator -------------------------------------------------------------------


async def test_a_stock_job_completes_with_the_bytes_its_comfyui_wrote(
    stock_client: JobClient, stock_sim: RunpodSim
) -> None:
    final = await finish(stock_client, stock_job(model_free("out")))
    assert final.state == JobState.COMPLETED, (final.error, worker_logs(stock_sim))
    written = written_for(stock_sim, final.job_id)
    assert len(written) == 1, written
    [artifact] = final.artifacts
    assert artifact.sha256 == next(iter(written.values()))
    ledger = await settled_ledger(stock_sim)
    [provider_job] = ledger.jobs_for(submission_of(final))
    assert provider_job.status == "COMPLETED" and len(provider_job.deliveries) == 1
    assert provider_job.deliveries[0].progress_updates == 0, "a stock worker sends no progress"
    [cost] = final.cost
    assert cost.provider_job_id == provider_job.id
    assert abs(cost.execution_s - provider_job.billed_s) <= 1.0, (cost, provider_job)


async def test_two_outputs_with_one_file_name_are_both_kept(
    stock_client: JobClient, stock_sim: RunpodSim
) -> None:
    """Prefixes `a/out` and `b/out`: the stock result holds two `out_00001_.png` with different
    bytes and nothing else to tell them apart; the job must keep both."""
    final = await finish(stock_client, stock_job(model_free("a/out", "b/out")))
    assert final.state == JobState.COMPLETED, final.error
    written = written_for(stock_sim, final.job_id)
    assert sorted(Path(p).name for p in written) == ["out_00001_.png"] * 2, written
    assert len(set(written.values())) == 2, "the two images differ"
    [provider_job] = (await stock_sim.ledger()).jobs_for(submission_of(final))
    output = await provider_output(stock_sim, provider_job.id)
    assert [i["filename"] for i in output["images"]] == ["out_00001_.png"] * 2
    assert sorted(a.sha256 for a in final.artifacts) == sorted(written.values()), final.artifacts
    assert len({a.key for a in final.artifacts}) == 2


async def test_a_cancel_mid_prompt_says_only_what_is_known(
    stock_client: JobClient, stock_sim: RunpodSim
) -> None:
    """The stock handler cannot be told to stop (runpod 1.7.x has no job-stop, the handler never
    interrupts): RunPod's job is cancelled, the prompt runs on to its end and its job-done comes
    late. The teardown must not claim an interrupt, and the cost is a lower bound."""
    request = job(steps=LONG_STEPS)
    started = await stock_client.submit(request)
    running = await until(
        lambda: running_status(stock_client, started.job_id), 60, "the job reaches RUNNING"
    )
    submission = submission_of(running)
    [provider_job] = (await stock_sim.ledger()).jobs_for(submission)

    async def prompt_queued() -> bool:
        # The handler's own log, from this job's start on (nothing else runs on its ComfyUI).
        _, _, since = worker_logs(stock_sim).partition(started_line(provider_job.id))
        return "Queued workflow with ID" in since

    await until(prompt_queued, 30, "the stock handler queues the prompt")
    await stock_client.cancel(started.job_id, "changed my mind")
    final = await asyncio.wait_for(stock_client.wait(started.job_id), JOB_WITHIN_S)
    assert final.state == JobState.CANCELLED

    teardown = final.teardown
    actions = [step.action for step in teardown.steps]
    assert not {"interrupt_sent", "interrupted"} & set(actions), teardown
    assert "interrupt" not in teardown.detail.lower(), teardown.detail
    assert "cancel_sent" in actions, teardown
    assert teardown.state == "UNCONFIRMED", teardown
    [cost] = final.cost
    assert cost.lower_bound and cost.note, cost

    async def late_post() -> Ledger | None:
        ledger = await stock_sim.ledger()
        [provider_job] = ledger.jobs_for(submission)
        return ledger if provider_job.late_posts else None

    ledger = await until(late_post, LONG_STEPS * 0.02 + 30, "the stock worker's late job-done")
    [provider_job] = ledger.jobs_for(submission)
    assert provider_job.status == "CANCELLED" and provider_job.late_posts == 1
    assert finished_line(provider_job.id) in worker_logs(stock_sim), "the prompt ran to its end"
    [delivery] = provider_job.deliveries
    provider_worker = ledger.worker(delivery.worker_id)
    assert cost.provider_job_id == provider_job.id
    assert cost.billed_s <= provider_worker.billed_s, "a lower bound of what the worker billed"
