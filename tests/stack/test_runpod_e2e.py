"""RunPod end to end: the real dev server, SeaweedFS, the RunPod simulator running our handler
(endpoint/handler.py) under the real `runpod` worker loop with a ComfyUI simulator per worker,
and our worker with a `runpod` pool. What the ledger shows is what would be billed."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from activities.runpod.follow import one_chunk
from tests.support.runpod_e2e import (
    RunPodWorker,
    cost_matches,
    job,
    provider_output,
    settled_ledger,
    wait_for_state,
)
from tests.support.runpod_sim import ENDPOINT_VENV_MISSING
from workflows.contracts import JobState, JobStatus, S3Input

pytestmark = [
    pytest.mark.skipif(ENDPOINT_VENV_MISSING is not None, reason=str(ENDPOINT_VENV_MISSING)),
    pytest.mark.usefixtures("nothing_left_running"),
]


async def test_a_job_runs_on_the_runpod_endpoint_with_progress_and_a_verified_artifact(
    runpod_worker: RunPodWorker, tmp_path: Path
) -> None:
    started = await runpod_worker.client.submit(job(steps=250, progress_interval_s=0.5))
    seen: list[JobStatus] = []
    async for status in runpod_worker.client.watch(started.job_id):
        seen.append(status)
        if status.terminal:
            break
    final = seen[-1]
    assert final.state == JobState.COMPLETED, final.error
    assert any(0 < s.progress.step < s.progress.total_steps for s in seen), "step progress"
    assert final.backend is not None and final.backend.kind == "runpod"
    [artifact] = final.artifacts
    target = tmp_path / "out.png"
    await runpod_worker.store.download(artifact.key, target, expected_sha256=artifact.sha256)
    assert target.stat().st_size == artifact.size
    assert final.teardown.state == "CONFIRMED"

    ledger = await runpod_worker.sim.ledger()
    [provider_job] = [j for j in ledger.jobs if j.submission == final.checkpoint.prompt_id]  # type: ignore[union-attr]
    assert provider_job.status == "COMPLETED"
    [cost] = final.cost
    assert cost.provider_job_id == provider_job.id
    assert abs(cost.execution_s - provider_job.billed_s) <= 1.0, json.dumps(
        provider_job.model_dump(mode="json")
    )


async def test_an_input_too_large_for_the_run_body_travels_by_reference(
    runpod_worker: RunPodWorker,
) -> None:
    """12 MB of input, where RunPod's `/run` takes 10: staged in the job's folder, fetched by
    the handler on the GPU worker, and the job completes (the simulator answers 413 to a body
    over the limit, so the file cannot have travelled inline)."""
    store = runpod_worker.store
    data = b"\x89PNG\r\n\x1a\n" + os.urandom(12 * 1000 * 1000)
    key = f"uploads/{uuid.uuid4().hex}.png"
    await store.upload_stream(key, one_chunk(data), content_type="image/png")
    graph = {
        "1": {"class_type": "LoadImage", "inputs": {"image": "big.png"}},
        "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "big"}},
    }
    uri = f"s3://{store.settings.bucket}/{key}"
    request = job().model_copy(update={"graph": graph, "inputs": {"big.png": S3Input(uri=uri)}})
    final = await runpod_worker.client.wait((await runpod_worker.client.submit(request)).job_id)
    assert final.state == JobState.COMPLETED, final.error
    assert len(final.artifacts) == 1


async def test_cancel_mid_job_cancels_the_provider_job_and_frees_its_worker(
    runpod_worker: RunPodWorker,
) -> None:
    started = await runpod_worker.client.submit(job(steps=1500, progress_interval_s=0.5))
    running = await wait_for_state(runpod_worker, started.job_id, JobState.RUNNING)
    assert running.checkpoint is not None
    await runpod_worker.client.cancel(started.job_id, "changed my mind")
    final = await runpod_worker.client.wait(started.job_id)
    assert final.state == JobState.CANCELLED
    assert final.teardown.state == "CONFIRMED", final.teardown.detail
    ledger = await runpod_worker.sim.ledger()
    [provider_job] = [j for j in ledger.jobs if j.submission == running.checkpoint.prompt_id]
    assert provider_job.status == "CANCELLED"
    assert all(d.ended_at is not None for d in provider_job.deliveries), "no worker still at it"
    cost_matches(final.cost, await settled_ledger(runpod_worker.sim), running.checkpoint.prompt_id)


async def test_429_bursts_are_ridden_out(runpod_worker: RunPodWorker) -> None:
    await runpod_worker.sim.faults(burst_429=6)
    final = await runpod_worker.client.wait(
        (await runpod_worker.client.submit(job(steps=20))).job_id
    )
    assert final.state == JobState.COMPLETED, final.error
    assert len(final.artifacts) == 1
    assert final.checkpoint is not None
    ledger = await runpod_worker.sim.ledger()
    submitted = [j for j in ledger.jobs if j.submission == final.checkpoint.prompt_id]
    assert len(submitted) == 1, "one /run for the submission, however long RunPod throttles"
    cost_matches(final.cost, ledger, final.checkpoint.prompt_id)


async def test_a_dropped_run_answer_is_resubmitted_and_the_graph_runs_once(
    runpod_worker: RunPodWorker,
) -> None:
    await runpod_worker.sim.faults(drop_run_answer=1)
    final = await runpod_worker.client.wait(
        (await runpod_worker.client.submit(job(steps=40))).job_id
    )
    assert final.state == JobState.COMPLETED, final.error
    assert final.checkpoint is not None
    ledger = await runpod_worker.sim.ledger()
    deliveries = [j for j in ledger.jobs if j.submission == final.checkpoint.prompt_id]
    assert len(deliveries) == 2, "the lost one and the resubmission"
    # Only one of them ran the graph: the other found the submission claimed (or its outcome
    # recorded) and returned without running anything.
    outputs = [await provider_output(runpod_worker.sim, j.id) for j in deliveries]
    ran = [o for o in outputs if o.get("status") == "success" and not o.get("replayed")]
    assert len(ran) == 1, outputs
    [other] = [o for o in outputs if o is not ran[0]]
    assert other.get("status") == "claimed_elsewhere" or other.get("replayed") is True, other
    # Both are in the bill: the one whose answer was lost is found through its claim.
    cost_matches(final.cost, ledger, final.checkpoint.prompt_id)
