"""The RunPod handler's job logic (endpoint/job.py) driven directly, as the SDK would call it,
against the ComfyUI simulator and a real S3 (SeaweedFS). A list stands in for the SDK's
`progress_update`; `runpod` itself is never imported here (see test_layers.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from botocore.exceptions import ClientError
from structlog.testing import capture_logs

from endpoint.claims import ClaimStore, fresh_claim
from endpoint.job import run_job
from endpoint.nodes import PUBLISHER, publish_at_start
from endpoint.s3 import S3
from endpoint.settings import EndpointSettings
from protocol.comfyui.events import ending_of
from protocol.keys import artifact_key
from protocol.runpod.contract import (
    ArtifactRecord,
    Claim,
    NodesTarget,
    ProgressUpdate,
    PublishedNodes,
    S3Target,
    claim_key,
    inputs_folder,
    nodes_key,
)
from tests.support.comfy_sim import (
    REPO_ROOT,
    basic_graph,
    ksampler_graph,
    make_png,
    png_size,
)
from tests.support.endpoint import (
    Bucket,
    Progress,
    endpoint_settings,
    orchestrated_input,
    read_claim,
    sha256,
    sim_get,
    sim_post,
    take_over,
    until,
)

EP_PYTHON = REPO_ROOT / ".venv-endpoint" / "bin" / "python"


def job(job_input: Any, job_id: str | None = None) -> dict[str, Any]:
    return {"id": job_id or f"rp-{uuid.uuid4().hex[:10]}", "input": job_input}


def prefix() -> str:
    return f"ep/{uuid.uuid4().hex[:8]}"


def slow_graph(steps: int) -> dict[str, Any]:
    """txt2img whose KSampler takes `steps` x 10 ms (the simulator's step delay here) and
    checks for interrupts at every step."""
    graph: dict[str, Any] = ksampler_graph(prefix(), steps=steps, seed=uuid.uuid4().int % 10**9)
    return graph


async def prompt_runs(sim: str, prompt_id: str) -> int:
    return int((await sim_get(sim, "/sim/stats"))["prompts"].get(prompt_id, 0))


# --- the orchestrated path ---------------------------------------------------------------------


async def test_outputs_are_streamed_to_s3_verified_and_recorded_in_the_claim(
    sim: str, bucket: Bucket, settings: EndpointSettings
) -> None:
    graph = slow_graph(steps=30)
    # A second output node over 8 MiB: stored by multipart upload, hashed while streaming.
    graph["8"] = {
        "class_type": "SimLargeOutput",
        "inputs": {"size_mib": 9, "seed": 7, "filename_prefix": prefix()},
    }
    job_input = orchestrated_input(
        graph, bucket.name, sampler_steps={"5": 30}, nodes_total=len(graph)
    )
    block = job_input["durable_comfy"]
    progress = Progress()
    runpod_job = job(job_input)

    result = await run_job(runpod_job, settings, progress)

    assert result["status"] == "success", result
    assert result["submission"] == block["submission"]
    assert result["claim_holder"] == runpod_job["id"]
    assert result["prompt_id"] == block["prompt_id"]
    assert "error" not in result and not result.get("errors")
    records = result["images"]
    assert {r["node_id"] for r in records} == {"7", "8"}
    for record in records:
        expected_key = artifact_key(
            "jobs", block["job_id"], 0, record["node_id"], record["filename"]
        )
        assert record["type"] == "s3_url"
        assert record["key"] == expected_key and record["bucket"] == bucket.name
        assert record["data"] == f"s3://{bucket.name}/{expected_key}"
        body, head = bucket.read(expected_key)
        assert sha256(body) == record["sha256"] and len(body) == record["size"]
        assert head["Metadata"]["sha256"] == record["sha256"]
        assert head["ContentType"] == record["content_type"]
    png = next(r for r in records if r["node_id"] == "7")
    assert png["content_type"] == "image/png"
    assert png_size(bucket.read(png["key"])[0]) == (256, 192)
    assert next(r for r in records if r["node_id"] == "8")["size"] == 9 * 2**20

    # Progress: numbered, the step count moving, each artifact announced as it was stored.
    updates = progress.updates
    assert [u.seq for u in updates] == list(range(1, len(updates) + 1))
    assert all(u.submission == block["submission"] and u.worker_id == "worker-a" for u in updates)
    assert "running" in progress.stages()
    assert any(0 < u.step < 30 and u.total_steps == 30 for u in updates)
    assert [len(u.artifacts) for u in updates if u.artifacts][-1] == 2
    # Bounded: stage changes + artifacts + one per 0.2 s of a ~0.5 s run, not one per step.
    assert len(updates) < 20

    claim = await read_claim(bucket, block)
    assert claim is not None and claim.outcome is not None
    assert claim.holder == runpod_job["id"] and claim.worker_id == "worker-a"
    assert claim.outcome.state == "completed"
    assert [r.model_dump(mode="json", exclude_none=True) for r in claim.outcome.images] == records
    assert await prompt_runs(sim, block["prompt_id"]) == 1


class ClaimAtEachUpdate(Progress):
    """A progress sink that reads the claim as each update goes out (a blocking read: the
    handler's loop waits for it, so nothing is written in between)."""

    def __init__(self, bucket: Bucket, block: dict[str, Any]) -> None:
        super().__init__()
        self.key = claim_key(
            S3Target.model_validate(block["output"]), block["job_id"], block["submission"]
        )
        self.s3 = bucket.client()
        self.bucket = bucket.name
        self.seen: list[tuple[ProgressUpdate, Claim | None]] = []

    def __call__(self, update: dict[str, Any]) -> None:
        super().__call__(update)
        try:
            body = self.s3.get_object(Bucket=self.bucket, Key=self.key)["Body"].read()
        except ClientError:
            body = None
        claim = Claim.model_validate_json(body) if body is not None else None
        self.seen.append((self.updates[-1], claim))


async def test_no_progress_update_says_more_than_the_claim_holds(
    sim: str, bucket: Bucket, settings: EndpointSettings
) -> None:
    """An output is reported once the claim lists it, and "uploading" once the claim has the
    prompt's end: a worker lost right after any update leaves a takeover nothing to redo that
    the update called done."""
    graph = slow_graph(steps=20)
    graph["8"] = {
        "class_type": "SimLargeOutput",
        "inputs": {"size_mib": 1, "seed": 3, "filename_prefix": prefix()},
    }
    job_input = orchestrated_input(
        graph, bucket.name, sampler_steps={"5": 20}, nodes_total=len(graph)
    )
    block = job_input["durable_comfy"]
    progress = ClaimAtEachUpdate(bucket, block)

    result = await run_job(job(job_input), settings, progress)

    assert result["status"] == "success", result
    reported = [(u, c) for u, c in progress.seen if u.artifacts or u.stage == "uploading"]
    assert any(len(u.artifacts) == 2 for u, _ in reported), "both outputs were reported"
    assert any(u.stage == "uploading" for u, _ in reported)
    for update, claim in reported:
        assert claim is not None, update
        held = {r.key for r in claim.stored}
        assert {a.key for a in update.artifacts} <= held, (update.seq, update.artifacts, held)
        if update.stage == "uploading":
            assert claim.prompt_end is not None, update.seq


async def test_a_second_delivery_reports_the_holder_and_a_later_one_replays_the_outcome(
    sim: str, bucket: Bucket, settings: EndpointSettings
) -> None:
    job_input = orchestrated_input(slow_graph(steps=150), bucket.name, sampler_steps={"5": 150})
    block = job_input["durable_comfy"]
    first = job(job_input, "rp-first")
    running = asyncio.create_task(run_job(first, settings, Progress()))
    await until(lambda: prompt_runs(sim, block["prompt_id"]))

    # The orchestrator resubmitted after a lost /run answer: a new RunPod job, the same token.
    started = time.monotonic()
    second = await run_job(job(job_input, "rp-second"), endpoint_settings(sim, bucket), Progress())
    assert time.monotonic() - started < 3
    assert second["status"] == "claimed_elsewhere"
    assert second["claim_holder"] == "rp-first"
    assert second["submission"] == block["submission"] and second["images"] == []
    assert not running.done()

    done = await running
    assert done["status"] == "success"

    # Any later delivery of the token returns the recorded outcome, and runs nothing.
    progress = Progress()
    third = await run_job(job(job_input, "rp-third"), settings, progress)
    assert third["replayed"] is True and third["status"] == "success"
    assert third["images"] == done["images"] and third["claim_holder"] == "rp-first"
    # It ran nothing: at most it said, while reading the claim, that it was claiming.
    assert set(progress.stages()) <= {"claiming"}, progress.stages()
    assert await prompt_runs(sim, block["prompt_id"]) == 1


async def test_a_restarted_handler_reattaches_to_its_running_prompt(
    sim: str, bucket: Bucket, settings: EndpointSettings
) -> None:
    """The handler process died mid-job; the platform re-delivered the same job to the same
    worker, whose ComfyUI still runs the prompt the dead handler submitted."""
    # 4 s of sampling: the restarted handler takes its claim over (S3 calls) and reopens the
    # socket before the prompt ends, with steps still to see, even on a loaded machine (0.8 s
    # was not always enough).
    graph = slow_graph(steps=400)
    job_input = orchestrated_input(graph, bucket.name, sampler_steps={"5": 400})
    block = job_input["durable_comfy"]
    # What the dead handler left: its claim (live lease) and its prompt on ComfyUI.
    key = claim_key(S3Target.model_validate(block["output"]), block["job_id"], block["submission"])
    store = ClaimStore(S3(bucket.settings), bucket.name)
    now = datetime.now(UTC)
    dead = Claim(
        submission=block["submission"],
        job_id=block["job_id"],
        prompt_id=block["prompt_id"],
        holder="rp-restarted",
        worker_id="worker-a",
        lease_until=now,
        renewed_at=now,
    )
    await store.create(key, fresh_claim(dead, 60))
    await sim_post(
        sim,
        "/prompt",
        {"prompt": graph, "prompt_id": block["prompt_id"], "client_id": block["client_id"]},
    )
    await until(lambda: _running(sim, block["prompt_id"]))

    progress = Progress()
    result = await run_job(job(job_input, "rp-restarted"), settings, progress)

    assert result["status"] == "success", result
    assert await prompt_runs(sim, block["prompt_id"]) == 1  # followed, not posted again
    assert len(result["images"]) == 1
    assert any(u.step > 0 for u in progress.updates)
    claim = await read_claim(bucket, block)
    assert claim is not None and claim.takeovers == 1
    assert claim.outcome is not None and claim.outcome.state == "completed"


async def test_cancel_mid_run_interrupts_the_prompt_and_cancels_the_claim(
    sim: str, bucket: Bucket, settings: EndpointSettings
) -> None:
    job_input = orchestrated_input(slow_graph(steps=400), bucket.name, sampler_steps={"5": 400})
    block = job_input["durable_comfy"]
    progress = Progress()
    task = asyncio.create_task(run_job(job(job_input), settings, progress))
    await until(lambda: any(u.step > 5 for u in progress.updates))

    task.cancel()  # what the SDK does when the platform's job-stop arrives
    with pytest.raises(asyncio.CancelledError):
        await task

    stats = await sim_get(sim, "/sim/stats")
    assert block["prompt_id"] in stats["interrupts"]  # prompt-scoped, not global
    assert None not in stats["interrupts"]
    entry = (await sim_get(sim, f"/history/{block['prompt_id']}"))[block["prompt_id"]]
    assert ending_of(entry).outcome == "interrupted"
    claim = await read_claim(bucket, block)
    assert claim is not None and claim.outcome is not None
    assert claim.outcome.state == "cancelled"
    assert claim.outcome.stop is not None and claim.outcome.stop.prompt == "interrupted"
    assert claim.outcome.stop.node == "5" and claim.outcome.stop.node_type == "KSampler"

    # A re-delivery of the cancelled submission does not run it again.
    again = await run_job(job(job_input), settings, Progress())
    assert again["error_type"] == "Cancelled" and again["replayed"] is True
    assert await prompt_runs(sim, block["prompt_id"]) == 1


async def test_cancel_while_queued_dequeues_the_prompt(
    sim: str, bucket: Bucket, settings: EndpointSettings
) -> None:
    # Someone else's prompt occupies ComfyUI, so ours waits in the queue.
    blocker = str(uuid.uuid4())
    await sim_post(sim, "/prompt", {"prompt": slow_graph(steps=150), "prompt_id": blocker})
    job_input = orchestrated_input(slow_graph(steps=10), bucket.name)
    block = job_input["durable_comfy"]
    progress = Progress()
    task = asyncio.create_task(run_job(job(job_input), settings, progress))
    await until(lambda: "queued" in progress.stages())
    assert next(u.queue_position for u in progress.updates if u.stage == "queued") == 1

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    queue = await sim_get(sim, "/queue")
    queued = [item[1] for item in queue["queue_pending"] + queue["queue_running"]]
    assert block["prompt_id"] not in queued
    assert await sim_get(sim, f"/history/{block['prompt_id']}") == {}  # never ran
    claim = await read_claim(bucket, block)
    assert claim is not None and claim.outcome is not None
    assert claim.outcome.state == "cancelled"
    assert claim.outcome.stop is not None and claim.outcome.stop.prompt == "dequeued"
    await until(lambda: _finished(sim, blocker))


async def test_a_lost_claim_stops_the_prompt(
    sim: str, bucket: Bucket, settings: EndpointSettings
) -> None:
    job_input = orchestrated_input(
        slow_graph(steps=800), bucket.name, sampler_steps={"5": 800}, lease_s=5.0
    )
    block = job_input["durable_comfy"]
    progress = Progress()
    task = asyncio.create_task(run_job(job(job_input, "rp-slow"), settings, progress))
    await until(lambda: any(u.step > 0 for u in progress.updates))

    # As if our lease had lapsed and another delivery had taken the submission over.
    key = claim_key(S3Target.model_validate(block["output"]), block["job_id"], block["submission"])
    await take_over(bucket, key, "rp-taker", "worker-b")

    result = await asyncio.wait_for(task, timeout=10)
    assert result["status"] == "claimed_elsewhere" and result["claim_holder"] == "rp-taker"
    stats = await sim_get(sim, "/sim/stats")
    assert block["prompt_id"] in stats["interrupted"]
    claim = await read_claim(bucket, block)
    assert claim is not None and claim.holder == "rp-taker" and claim.outcome is None


@pytest.mark.parametrize(
    "fault",
    [{"drop_ws_after_events": 3}, {"stall_ws_s": 2.5, "stall_after_events": 2}],
    ids=["socket-dropped", "socket-silent"],
)
async def test_a_lost_or_silent_socket_is_reopened_and_the_run_completes(
    sim: str, bucket: Bucket, settings: EndpointSettings, fault: dict[str, Any]
) -> None:
    connections = (await sim_get(sim, "/sim/stats"))["ws_connections"]
    await sim_post(sim, "/sim/faults", fault)
    # Long enough (4 s) to still run after two silent polls (1 s each here) of a 2.5 s stall.
    job_input = orchestrated_input(slow_graph(steps=400), bucket.name, sampler_steps={"5": 400})
    progress = Progress()
    result = await run_job(job(job_input), settings, progress)
    assert result["status"] == "success", result
    assert len(result["images"]) == 1
    assert await prompt_runs(sim, job_input["durable_comfy"]["prompt_id"]) == 1
    assert (await sim_get(sim, "/sim/stats"))["ws_connections"] >= connections + 2
    assert progress.updates[-1].artifacts == [ArtifactRecord(**result["images"][0])]


async def test_a_cuda_fault_asks_for_a_new_worker_and_fails_the_claim(
    sim: str, bucket: Bucket, settings: EndpointSettings
) -> None:
    await sim_post(sim, "/sim/faults", {"cuda_error_next": True})
    try:
        job_input = orchestrated_input(slow_graph(steps=5), bucket.name)
        result = await run_job(job(job_input), settings, Progress())
    finally:
        await sim_post(sim, "/sim/reset", {})
    assert result["refresh_worker"] is True
    assert result["error_type"] == "BackendFault"
    assert "illegal memory access" in result["error"]
    claim = await read_claim(bucket, job_input["durable_comfy"])
    assert claim is not None and claim.outcome is not None
    assert claim.outcome.state == "failed" and claim.outcome.error_type == "BackendFault"


async def test_out_of_memory_frees_comfyui_then_fails(
    sim: str, bucket: Bucket, settings: EndpointSettings
) -> None:
    frees = (await sim_get(sim, "/sim/stats"))["frees"]
    await sim_post(sim, "/sim/faults", {"oom_next": True})
    result = await run_job(job(orchestrated_input(slow_graph(5), bucket.name)), settings)
    assert result["error_type"] == "OutOfMemory" and not result["refresh_worker"]
    assert "out of memory" in result["error"].lower()
    assert (await sim_get(sim, "/sim/stats"))["frees"] == frees + 1


async def test_claims_without_a_bucket_are_refused_and_without_claims_run(sim: str) -> None:
    no_bucket = endpoint_settings(sim, None)
    job_input = orchestrated_input(basic_graph(prefix()), "some-bucket")
    refused = await run_job(job(job_input), no_bucket)
    assert refused["error_type"] == "BackendError" and "BUCKET_ENDPOINT_URL" in refused["error"]

    job_input["durable_comfy"]["claims"] = False
    progress = Progress()
    result = await run_job(job(job_input), no_bucket, progress)
    assert result["status"] == "success" and result["images"][0]["type"] == "base64"
    assert progress.updates  # still a checkpoint for the orchestrator


# --- the stock (worker-comfyui) path -----------------------------------------------------------


async def test_a_stock_input_gets_worker_comfyuis_answer(sim: str) -> None:
    source = make_png(16, 12, (200, 10, 10))
    graph = {
        "1": {"class_type": "LoadImage", "inputs": {"image": "stock-in.png"}},
        "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "s"}},
    }
    data_uri = "data:image/png;base64," + base64.b64encode(source).decode()
    stock = {"workflow": json.dumps(graph), "images": [{"name": "stock-in.png", "image": data_uri}]}
    progress = Progress()

    result = await run_job(job(stock), endpoint_settings(sim, None), progress)

    assert set(result) == {"images"}, result  # no status, no errors: worker-comfyui's success
    (image,) = result["images"]
    assert image["type"] == "base64" and image["filename"].endswith(".png")
    body = base64.b64decode(image["data"])
    assert png_size(body) == (16, 12) and sha256(body) == image["sha256"]
    assert progress.updates == []  # worker-comfyui sends no progress


async def test_a_stock_input_without_outputs_says_so(sim: str) -> None:
    graph = {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": 0},
        },
        "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}},
    }
    result = await run_job(job({"workflow": graph}), endpoint_settings(sim, None))
    assert result == {"images": [], "status": "success_no_images"}


async def test_a_stock_input_with_a_bucket_gets_presigned_urls(sim: str, bucket: Bucket) -> None:
    settings = endpoint_settings(sim, bucket, default_bucket=True)
    runpod_job = job({"workflow": basic_graph(prefix())})
    result = await run_job(runpod_job, settings)
    (image,) = result["images"]
    assert image["type"] == "s3_url" and image["data"].startswith("http")
    assert image["key"].startswith(f"runpod/{runpod_job['id']}/0/3/")
    body, _ = bucket.read(image["key"])
    assert sha256(body) == image["sha256"]


@pytest.mark.parametrize(
    ("job_input", "says"),
    [
        (None, "no input"),
        ({"images": []}, "missing 'workflow'"),
        ({"workflow": "{not json"}, "workflow"),
        ({"workflow": {}, "images": [{"name": "a.png", "image": "***"}]}, "not valid base64"),
        ({"workflow": {}, "images": [{"image": "AAAA"}]}, "images.0.name"),
        ({"workflow": {}, "durable_comfy": {"job_id": "j"}}, "durable_comfy.submission"),
    ],
)
async def test_bad_input_says_what_to_fix(sim: str, job_input: Any, says: str) -> None:
    result = await run_job(job(job_input), endpoint_settings(sim, None))
    assert result["error_type"] == "InvalidRequest", result
    assert says in result["error"]


async def test_a_rejected_workflow_returns_comfyuis_reason(sim: str, bucket: Bucket) -> None:
    graph = {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": 0, "height": 8, "batch_size": 1, "color": 0},
        },
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "x"}},
    }
    stock = await run_job(job({"workflow": graph}), endpoint_settings(sim, None))
    assert stock["error_type"] == "PromptRejected" and "smaller than min" in stock["error"]
    job_input = orchestrated_input(graph, bucket.name)
    result = await run_job(job(job_input), endpoint_settings(sim, bucket))
    assert result["error_type"] == "PromptRejected" and result["claim_recorded"] is True
    # The reason once, per node, in plain words, however a reader joins error and details.
    told = " ".join([result["error"], *result.get("details", [])])
    assert told.count("smaller than min") == 1, told
    assert "node 1 (EmptyImage): input 'width'" in result["error"]
    claim = await read_claim(bucket, job_input["durable_comfy"])
    assert claim is not None and claim.outcome is not None and claim.outcome.state == "failed"


def staged_input_job(bucket: Bucket, data: bytes, **ref: Any) -> tuple[dict[str, Any], str]:
    """An orchestrated job whose LoadImage reads a file staged in the job's `_inputs/` folder
    (put there now); `ref` overrides the reference the job carries."""
    name = f"staged-{uuid.uuid4().hex[:8]}.png"
    graph = {
        "1": {"class_type": "LoadImage", "inputs": {"image": name}},
        "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "in"}},
    }
    job_input = orchestrated_input(graph, bucket.name)
    block = job_input["durable_comfy"]
    key = f"{inputs_folder(S3Target.model_validate(block['output']), block['job_id'])}/{name}"
    bucket.client().put_object(Bucket=bucket.name, Key=key, Body=data)
    block["inputs"] = [{"name": name, "key": key, "size": len(data), "sha256": sha256(data)} | ref]
    return job_input, name


async def test_staged_inputs_are_fetched_checked_and_given_to_comfyui(
    sim: str, bucket: Bucket, settings: EndpointSettings
) -> None:
    """Past RunPod's 10 MB body an input travels by reference: the handler fetches it with its
    own credentials and ComfyUI gets the very bytes."""
    data = make_png(16, 12, (10, 200, 10)) + os.urandom(12 * 1000 * 1000)
    job_input, name = staged_input_job(bucket, data)

    result = await run_job(job(job_input), settings)

    assert result["status"] == "success", result
    async with httpx.AsyncClient(base_url=sim, timeout=30) as http:
        staged = await http.get("/view", params={"filename": name, "type": "input"})
    assert staged.status_code == 200 and sha256(staged.content) == sha256(data)


@pytest.mark.parametrize(
    ("ref", "error_type", "says"),
    [
        ({"key": "jobs/another-job/_inputs/x.png"}, "InvalidRequest", "not in this job's inputs"),
        ({"sha256": "0" * 64}, "InvalidRequest", "changed after it was staged"),
        ({"size": 5}, "InvalidRequest", "changed after it was staged"),
        ({"name": "x.png", "key": "{folder}/gone.png"}, "MissingInput", "does not exist"),
    ],
)
async def test_a_staged_input_that_is_elsewhere_changed_or_gone_is_refused_before_running(
    sim: str,
    bucket: Bucket,
    settings: EndpointSettings,
    ref: dict[str, Any],
    error_type: str,
    says: str,
) -> None:
    job_input, _ = staged_input_job(bucket, make_png(8, 8, (1, 2, 3)))
    block = job_input["durable_comfy"]
    folder = block["inputs"][0]["key"].rsplit("/", 1)[0]
    block["inputs"][0] |= {k: v.format(folder=folder) if k == "key" else v for k, v in ref.items()}

    result = await run_job(job(job_input), settings)

    assert result["error_type"] == error_type, result
    assert says in result["error"]
    assert await prompt_runs(sim, block["prompt_id"]) == 0


async def test_waiting_for_comfyui_without_a_process_has_a_deadline(bucket: Bucket) -> None:
    settings = endpoint_settings("http://127.0.0.1:9", None, comfy_start_timeout_s=0.6)
    started = time.monotonic()
    result = await run_job(job({"workflow": basic_graph(prefix())}), settings)
    assert result["error_type"] == "BackendUnavailable" and result["refresh_worker"] is True
    assert time.monotonic() - started < 5


# --- the real SDK, in the endpoint's own venv ----------------------------------------------------


@pytest.mark.skipif(not EP_PYTHON.exists(), reason="no .venv-endpoint: `make install` builds it")
async def test_the_sdk_runs_the_handler_script_in_the_endpoints_venv(
    sim: str, bucket: Bucket
) -> None:
    """`python endpoint/handler.py` from the repository root with PYTHONPATH unset, through the
    SDK's own job runner (its local `--test_input` mode: no platform, the same `run_job`), with
    runpod's boto3 against the real S3: claim, upload and outcome."""
    job_input = orchestrated_input(basic_graph(prefix()), bucket.name)
    block = job_input["durable_comfy"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    s = bucket.settings
    env |= {
        "COMFY_URL": sim,
        "BUCKET_ENDPOINT_URL": s.endpoint_url,
        "BUCKET_ACCESS_KEY_ID": s.access_key_id.get_secret_value(),
        "BUCKET_SECRET_ACCESS_KEY": s.secret_access_key.get_secret_value(),
        "BUCKET_REGION": s.region or "",
        "RUNPOD_POD_ID": "worker-sdk",
        "RUNPOD_SKIP_GPU_CHECK": "true",
        "RUNPOD_SKIP_AUTO_SYSTEM_CHECKS": "true",
    }
    proc = await asyncio.create_subprocess_exec(
        str(EP_PYTHON),
        "endpoint/handler.py",
        "--test_input",
        json.dumps({"id": "rp-sdk-local", "input": job_input}),
        cwd=REPO_ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=120)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    assert "Job rp-sdk-local completed successfully" in text

    claim = await read_claim(bucket, block)
    assert claim is not None and claim.holder == "rp-sdk-local"
    assert claim.worker_id == "worker-sdk"
    assert claim.outcome is not None and claim.outcome.state == "completed"
    (record,) = claim.outcome.images
    assert record.key is not None and sha256(bucket.read(record.key)[0]) == record.sha256


async def _running(sim: str, prompt_id: str) -> bool:
    queue = await sim_get(sim, "/queue")
    return prompt_id in [item[1] for item in queue["queue_running"]]


async def _finished(sim: str, prompt_id: str) -> bool:
    return bool(await sim_get(sim, f"/history/{prompt_id}"))


# --- the node registry -----------------------------------------------------------------------


async def published(bucket: Bucket, key: str, within: float = 15.0) -> PublishedNodes:
    async def look() -> PublishedNodes | None:
        try:
            body, _ = await asyncio.to_thread(bucket.read, key)
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "NoSuchKey":
                raise
            return None
        return PublishedNodes.model_validate_json(body)

    found: PublishedNodes = await until(look, within=within, interval=0.2)
    return found


async def test_a_job_naming_a_nodes_target_publishes_the_registry_once_per_process(
    sim: str, bucket: Bucket
) -> None:
    key = f"_durable_comfy/endpoints/ep-{uuid.uuid4().hex[:8]}/object_info.json"
    settings = endpoint_settings(sim, bucket, endpoint_id="ep-x")
    nodes = {"bucket": bucket.name, "key": key}
    job_input = orchestrated_input(basic_graph(prefix()), bucket.name, nodes=nodes)
    result = await run_job(job(job_input), settings)
    assert result["status"] == "success", result

    document = await published(bucket, key)
    assert {"KSampler", "SaveImage", "SimSleep"} <= set(document.object_info)
    assert document.object_info["KSampler"]["input"]["required"]["steps"][0] == "INT"
    assert document.worker_id == "worker-a" and document.endpoint_id == "ep-x"

    again = orchestrated_input(basic_graph(prefix()), bucket.name, nodes=nodes)
    assert (await run_job(job(again), settings))["status"] == "success"
    await asyncio.sleep(1.0)
    assert (await published(bucket, key)).published_at == document.published_at


async def test_a_failed_publication_leaves_the_job_alone_and_a_later_one_tries_again(
    sim: str, bucket: Bucket
) -> None:
    settings = endpoint_settings(sim, bucket)
    # A bucket name S3 refuses: the put fails at once, for good.
    refused = {"bucket": "no such bucket!", "key": "_durable_comfy/endpoints/ep/object_info.json"}
    with capture_logs() as logs:
        result = await run_job(
            job(orchestrated_input(basic_graph(prefix()), bucket.name, nodes=refused)), settings
        )
        assert result["status"] == "success", result
        await until(lambda: any(e["event"] == "nodes_not_published" for e in logs))

    # A failed target is not done: the next try (ComfyUI down, then up) publishes it.
    target = NodesTarget(bucket=bucket.name, key=f"_durable_comfy/endpoints/{uuid.uuid4()}.json")
    down = endpoint_settings("http://127.0.0.1:9", bucket, comfy_start_timeout_s=0.3)
    first = PUBLISHER.publish(down, target)
    assert first is not None
    await asyncio.to_thread(first.join, 10)
    second = PUBLISHER.publish(settings, target)
    assert second is not None and PUBLISHER.publish(settings, target) is None
    assert "SaveImage" in (await published(bucket, target.key)).object_info


async def test_a_worker_with_durable_comfy_bucket_publishes_at_start(
    sim: str, bucket: Bucket
) -> None:
    endpoint_id = f"ep-{uuid.uuid4().hex[:8]}"
    settings = endpoint_settings(sim, bucket, endpoint_id=endpoint_id, nodes_bucket=bucket.name)
    thread = publish_at_start(settings)
    assert thread is not None and thread.daemon  # never keeps the worker's process alive
    document = await published(bucket, nodes_key(endpoint_id))
    assert document.endpoint_id == endpoint_id and "KSampler" in document.object_info
    assert publish_at_start(endpoint_settings(sim, bucket)) is None  # no DURABLE_COMFY_BUCKET
