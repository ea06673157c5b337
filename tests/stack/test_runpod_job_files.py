"""A warm RunPod worker keeps no earlier job's files: the whole path (our worker with a `runpod`
pool, the RunPod simulator running endpoint/handler.py under the real `runpod` worker loop, a
ComfyUI simulator per worker whose folders the handler is told, SeaweedFS), on an endpoint of
one worker, so that jobs sent one after the other land on the same warm worker.

After each job, that worker's ComfyUI input, output and temp folders hold no file of it: not its
input (staged in S3 by the orchestrator, uploaded by the handler), not its outputs (stored in S3
first), not its preview; whether it completed, failed or was cancelled.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from activities.runpod.follow import one_chunk
from activities.storage import ArtifactStore
from devstack.models import RunningStack
from starter import JobClient
from tests.support.comfy_sim import make_png
from tests.support.runpod_e2e import (
    billing_matches,
    bucket_env,
    ended_statuses,
    endpoint_sim,
    job,
    runpod_pool,
    serving,
    settled_ledger,
)
from tests.support.runpod_sim import ENDPOINT_VENV_MISSING, RunpodSim
from workflows.contracts import JobState, JobStatus, S3Input

pytestmark = pytest.mark.skipif(
    ENDPOINT_VENV_MISSING is not None, reason=str(ENDPOINT_VENV_MISSING)
)

# Long enough that the second of two jobs sent one after the other finds the first's worker
# still warm, however slowly the orchestrator sees the first one end.
IDLE_S = 6.0
JOB_WITHIN_S = 60.0


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def one_worker_sim(
    local_stack: RunningStack, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunpodSim]:
    async with endpoint_sim(
        tmp_path_factory.mktemp("runpod-files"),
        "--max-workers=1",
        f"--idle-timeout={IDLE_S}",
        env=bucket_env(local_stack),
    ) as sim:
        yield sim


@dataclass
class Endpoint:
    client: JobClient
    store: ArtifactStore
    sim: RunpodSim


@pytest_asyncio.fixture(loop_scope="session")
async def endpoint(local_stack: RunningStack, one_worker_sim: RunpodSim) -> AsyncIterator[Endpoint]:
    """A worker of ours on the one-worker endpoint; afterwards, nothing running or billed
    past the idle timeout, and no worker billed beyond its jobs' costs."""
    pool = runpod_pool(one_worker_sim, idle_timeout_s=IDLE_S)
    started = time.time()
    async with serving(local_stack, {"gpu": pool}) as (client, store):
        yield Endpoint(client, store, one_worker_sim)
        ledger = await settled_ledger(one_worker_sim, idle_timeout_s=IDLE_S)
        billing_matches(ledger, await ended_statuses(client, since=started))


@dataclass(frozen=True)
class WorkerComfy:
    """A RunPod worker's ComfyUI folders (ComfySimPerWorker: `comfy/` in its directory) and
    its handler's log."""

    worker_dir: Path

    def files(self) -> list[str]:
        root = self.worker_dir / "comfy"
        return sorted(
            str(path.relative_to(root))
            for folder in ("input", "output", "temp")
            for path in (root / folder).rglob("*")
        )

    def removals(self) -> list[dict[str, Any]]:
        """The handler's `comfy_files_removed` log lines (JSON lines on its stdout)."""
        found = []
        for line in (self.worker_dir / "worker.log").read_text(errors="replace").splitlines():
            if '"comfy_files_removed"' in line:
                found.append(json.loads(line))
        return found


async def staged_job(endpoint: Endpoint, graph: dict[str, Any], **policy: Any) -> Any:
    """`graph` whose node "1" loads `in.png`, an input file the orchestrator stages in S3."""
    key = f"uploads/{uuid.uuid4().hex}.png"
    data = make_png(8, 8, (uuid.uuid4().int % 256, 40, 90))
    await endpoint.store.upload_stream(key, one_chunk(data), content_type="image/png")
    uri = f"s3://{endpoint.store.settings.bucket}/{key}"
    graph["1"] = {"class_type": "LoadImage", "inputs": {"image": "in.png"}}
    return job(**policy).model_copy(update={"graph": graph, "inputs": {"in.png": S3Input(uri=uri)}})


def saved_and_previewed() -> dict[str, Any]:
    return {
        "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "out"}},
        "4": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}},
    }


async def worker_of(endpoint: Endpoint, status: JobStatus) -> WorkerComfy:
    """The worker that ran the job's RunPod job, once its handler has let go of it (what the
    handler does after its answer is done by then)."""
    assert status.checkpoint is not None and status.checkpoint.prompt_id
    submission = status.checkpoint.prompt_id
    deadline = time.monotonic() + JOB_WITHIN_S
    while True:
        [provider_job] = (await endpoint.sim.ledger()).jobs_for(submission)
        delivery = provider_job.deliveries[-1] if provider_job.deliveries else None
        if delivery is not None and delivery.ended_at is not None:
            return WorkerComfy(endpoint.sim.work_dir / "workers" / delivery.worker_id)
        assert time.monotonic() < deadline, provider_job
        await asyncio.sleep(0.1)


async def finish(endpoint: Endpoint, request: Any) -> JobStatus:
    started = await endpoint.client.submit(request)
    return await asyncio.wait_for(endpoint.client.wait(started.job_id), JOB_WITHIN_S)


async def test_a_warm_worker_holds_no_file_of_the_job_before(
    endpoint: Endpoint, tmp_path: Path
) -> None:
    first = await finish(endpoint, await staged_job(endpoint, saved_and_previewed()))
    assert first.state == JobState.COMPLETED, first.error
    worker = await worker_of(endpoint, first)

    # The worker's ComfyUI had the job's input, its output and its preview; none is left.
    [removed] = worker.removals()
    assert (removed["inputs"], removed["outputs"], removed["previews"]) == (1, 1, 1), removed
    assert removed["removed"] == 3 and removed["folders"] == 1, removed  # and the run's folder
    assert worker.files() == [], worker.files()
    # The output is in S3, as the job says.
    [artifact] = first.artifacts
    target = tmp_path / "out.png"
    await endpoint.store.download(artifact.key, target, expected_sha256=artifact.sha256)
    assert target.read_bytes()[:4] == b"\x89PNG"

    # The next job, sent at once, runs on that same warm worker, and leaves nothing either.
    second = await finish(endpoint, await staged_job(endpoint, saved_and_previewed()))
    assert second.state == JobState.COMPLETED, second.error
    assert (await worker_of(endpoint, second)).worker_dir == worker.worker_dir, "a warm worker"
    assert len(worker.removals()) == 2
    assert worker.files() == [], worker.files()
    await endpoint.store.download(
        second.artifacts[0].key, tmp_path / "second.png", expected_sha256=second.artifacts[0].sha256
    )


async def test_a_failed_job_leaves_no_input_file(endpoint: Endpoint) -> None:
    """ComfyUI refuses the graph after the handler uploaded its input."""
    graph = saved_and_previewed()
    graph["2"] = {
        "class_type": "ImageBlur",
        "inputs": {"image": ["1", 0], "blur_radius": 0, "sigma": 1.0},
    }
    del graph["4"]  # with no valid output left, ComfyUI runs nothing
    final = await finish(endpoint, await staged_job(endpoint, graph))
    assert final.state == JobState.FAILED, final
    assert final.error is not None and "smaller than min" in final.error.message, final.error
    worker = await worker_of(endpoint, final)
    [removed] = worker.removals()
    assert removed["inputs"] == 1 and removed["removed"] == 1, removed
    assert worker.files() == [], worker.files()


async def test_a_cancelled_job_leaves_no_input_file(endpoint: Endpoint) -> None:
    graph = saved_and_previewed()
    # A slow sampler (20 ms a step on the worker's ComfyUI simulator) beside the load.
    graph |= {
        "10": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sim.safetensors"}},
        "11": {"class_type": "CLIPTextEncode", "inputs": {"text": "fox", "clip": ["10", 1]}},
        "12": {"class_type": "EmptyLatentImage",
               "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "13": {"class_type": "KSampler",
               "inputs": {"model": ["10", 0], "seed": 1, "steps": 1500, "cfg": 7.0,
                          "sampler_name": "euler", "scheduler": "normal",
                          "positive": ["11", 0], "negative": ["11", 0],
                          "latent_image": ["12", 0], "denoise": 1.0}},
        "14": {"class_type": "VAEDecode", "inputs": {"samples": ["13", 0], "vae": ["10", 2]}},
        "15": {"class_type": "SaveImage",
               "inputs": {"images": ["14", 0], "filename_prefix": "slow"}},
    }  # fmt: skip
    started = await endpoint.client.submit(await staged_job(endpoint, graph))
    # The sampler runs: the input is on the worker, the quick output stored.
    deadline = time.monotonic() + JOB_WITHIN_S
    while (await endpoint.client.status(started.job_id)).progress.step == 0:
        assert time.monotonic() < deadline, "the sampler never ran"
        await asyncio.sleep(0.1)
    await endpoint.client.cancel(started.job_id, "test: cancelled mid-run")
    final = await asyncio.wait_for(endpoint.client.wait(started.job_id), JOB_WITHIN_S)
    assert final.state == JobState.CANCELLED, final
    assert final.teardown.state == "CONFIRMED", final.teardown

    worker = await worker_of(endpoint, final)
    [removed] = worker.removals()
    assert removed["inputs"] == 1, removed
    assert worker.files() == [], worker.files()
