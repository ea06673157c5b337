"""End to end on the real local stack: Temporal dev server, SeaweedFS, the ComfyUI simulator.

A worker runs in this process on its own task queue; jobs go in through `JobClient` and the
`durable-comfy` CLI exactly as a user would send them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack.models import RunningStack
from starter import JobRequest, JobState
from tests.support.cli import (
    EXAMPLE,
    RunningWorker,
    cli_env,
    example,
    run_cli,
)
from workflows.contracts import JobPolicy, OutputSpec
from workflows.shared import ErrorType


async def sim_prompts(stack: RunningStack) -> dict[str, int]:
    async with httpx.AsyncClient(trust_env=False) as http:
        response = await http.get(f"{stack.comfyui_url}/sim/stats")
    response.raise_for_status()
    prompts: dict[str, int] = response.json()["prompts"]
    return prompts


async def sim_stats(stack: RunningStack) -> dict[str, Any]:
    async with httpx.AsyncClient(trust_env=False) as http:
        response = await http.get(f"{stack.comfyui_url}/sim/stats")
    response.raise_for_status()
    stats: dict[str, Any] = response.json()
    return stats


async def test_example_job_completes_with_verified_png_in_s3(
    worker: RunningWorker, local_stack: RunningStack
) -> None:
    client = worker.client
    before = await sim_prompts(local_stack)
    submitted = await client.submit(JobRequest(graph=example()))
    states = [s.state async for s in client.watch(submitted.job_id, poll_interval_s=0.05)]
    final = await client.result(submitted.job_id)

    assert final.state == JobState.COMPLETED, final.error
    assert JobState.RUNNING in states and states[-1] == JobState.COMPLETED
    assert final.teardown.state == "CONFIRMED"
    assert final.progress.fraction == 1.0 and final.progress.step == 8
    # Its prompt's run as the follow measured it (what a tenant's budget counts); no price.
    assert 0 < final.gpu_s < 60 and final.usd is None, final.gpu_s
    [artifact] = final.artifacts
    assert artifact.uri == f"s3://{local_stack.bucket}/{artifact.key}"
    assert artifact.key.startswith(f"jobs/{submitted.job_id}/0/9/")
    assert artifact.content_type == "image/png"
    assert artifact.url is not None
    async with httpx.AsyncClient(trust_env=False) as http:
        body = (await http.get(artifact.url)).content
    assert body.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(body) == artifact.size
    assert hashlib.sha256(body).hexdigest() == artifact.sha256
    after = await sim_prompts(local_stack)
    new = {k: v for k, v in after.items() if k not in before}
    assert list(new.values()) == [1], "exactly one prompt submitted"


async def test_same_job_id_twice_is_one_job(worker: RunningWorker) -> None:
    job_id = f"idem-{uuid.uuid4().hex[:8]}"
    request = JobRequest(graph=example())
    await worker.client.submit(request, job_id=job_id)
    again = await worker.client.submit(request, job_id=job_id)
    assert again.job_id == job_id
    final = await worker.client.wait(job_id)
    assert final.state == JobState.COMPLETED
    handle = worker.client.handle(job_id)
    assert (await handle.describe()).run_id == (await handle.describe()).run_id


BAD_GRAPHS: list[tuple[str, dict[str, Any], str | None, str]] = [
    (
        "unknown node class",
        {
            "1": {"class_type": "NoSuchNode", "inputs": {}},
            "2": {
                "class_type": "SaveImage",
                "inputs": {"images": ["1", 0], "filename_prefix": "x"},
            },
        },
        None,
        ErrorType.INVALID_GRAPH,
    ),
    (
        "missing input file",
        {
            "1": {"class_type": "LoadImage", "inputs": {"image": "not-uploaded.png"}},
            "2": {
                "class_type": "SaveImage",
                "inputs": {"images": ["1", 0], "filename_prefix": "x"},
            },
        },
        None,
        ErrorType.MISSING_INPUT,
    ),
    ("unknown pool", example(), "no-such-pool", ErrorType.UNKNOWN_POOL),
]


@pytest.mark.parametrize(
    ("graph", "pool", "error_type"),
    [case[1:] for case in BAD_GRAPHS],
    ids=[case[0] for case in BAD_GRAPHS],
)
async def test_bad_input_fails_typed_before_any_prompt(
    worker: RunningWorker,
    local_stack: RunningStack,
    graph: dict[str, Any],
    pool: str | None,
    error_type: str,
) -> None:
    before = await sim_prompts(local_stack)
    # Unchecked (the client would refuse an undeclared input file itself): the job must refuse
    # it too, for a client that skips the checks.
    submitted = await worker.client.submit(JobRequest.model_construct(graph=graph, pool=pool))
    final = await worker.client.wait(submitted.job_id)
    assert final.state == JobState.FAILED
    assert final.error is not None and final.error.type == error_type, final.error
    assert await sim_prompts(local_stack) == before, "no prompt may reach the backend"
    assert final.artifacts == []


async def test_cli_submit_watch_json_ends_completed_with_stored_artifacts(
    worker: RunningWorker, local_stack: RunningStack, tmp_path: Path
) -> None:
    graph_file = tmp_path / "graph.json"
    graph_file.write_text(json.dumps(example()))
    env = cli_env(local_stack, worker.task_queue)
    code, out, err = await run_cli("submit", str(graph_file), "--watch", "--json", env=env)
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert all("state" in line for line in lines)
    last = lines[-1]
    assert last["state"] == "COMPLETED"
    assert last["artifacts"]
    for artifact in last["artifacts"]:
        assert artifact["uri"].startswith("s3://")
        stored = await worker.store.head(artifact["key"])
        assert stored is not None and stored.size == artifact["size"]
    seqs = [line["seq"] for line in lines]
    assert seqs == sorted(seqs)

    code, out, err = await run_cli("status", last["job_id"], "--json", env=env)
    assert code == 0, err
    assert json.loads(out)["state"] == "COMPLETED"

    download = tmp_path / "download"
    code, out, err = await run_cli("result", last["job_id"], "--download", str(download), env=env)
    assert code == 0, err
    assert [p.suffix for p in download.rglob("*") if p.is_file()] == [".png"]


async def test_cli_rejects_editor_format_before_submitting(
    worker: RunningWorker, local_stack: RunningStack, tmp_path: Path
) -> None:
    graph_file = tmp_path / "editor.json"
    graph_file.write_text(json.dumps({"nodes": [{"id": 1}], "links": [], "version": 0.4}))
    env = cli_env(local_stack, worker.task_queue)
    code, out, err = await run_cli("submit", str(graph_file), "--json", env=env)
    assert code == 2
    assert out == ""
    assert "export the workflow in API format" in err


async def test_cli_missing_input_file_is_refused_before_submitting(
    worker: RunningWorker, local_stack: RunningStack, tmp_path: Path
) -> None:
    env = cli_env(local_stack, worker.task_queue)
    code, _out, err = await run_cli(
        "submit", str(EXAMPLE), "--input", "face.png=/nonexistent/face.png", env=env
    )
    assert code == 2
    assert "file not found: /nonexistent/face.png" in err


async def sim_post(stack: RunningStack, path: str, body: dict[str, Any]) -> None:
    async with httpx.AsyncClient(trust_env=False) as http:
        response = await http.post(f"{stack.comfyui_url}{path}", json=body)
    response.raise_for_status()


async def test_device_fault_fails_the_job_and_holds_the_pool_until_a_probe_passes(
    worker: RunningWorker, local_stack: RunningStack
) -> None:
    await sim_post(local_stack, "/sim/faults", {"cuda_error_next": True})
    broken = await worker.client.submit(JobRequest(graph=example()))
    failed = await worker.client.wait(broken.job_id)
    assert failed.state == JobState.FAILED
    assert failed.error is not None and failed.error.type == ErrorType.BACKEND_FAULT

    waiting = await worker.client.submit(JobRequest(graph=example()))
    await asyncio.sleep(3)
    held = await worker.client.status(waiting.job_id)
    assert held.state == JobState.SUBMITTING, "no work goes to a broken GPU"
    prompts = await sim_prompts(local_stack)
    assert held.checkpoint is not None and held.checkpoint.prompt_id not in prompts

    await sim_post(local_stack, "/free", {"unload_models": True, "free_memory": True})
    final = await asyncio.wait_for(worker.client.wait(waiting.job_id), timeout=60)
    assert final.state == JobState.COMPLETED


async def test_cli_list_finds_jobs_by_state(
    worker: RunningWorker, local_stack: RunningStack
) -> None:
    env = cli_env(local_stack, worker.task_queue)
    done = await worker.client.submit(JobRequest(graph=example()))
    await worker.client.wait(done.job_id)
    rows: list[dict[str, Any]] = []
    # Visibility is eventually consistent: give the search attributes a moment to land.
    for _ in range(50):
        code, out, err = await run_cli("list", "--state", "completed", "--json", env=env)
        assert code == 0, err
        rows = [json.loads(line) for line in out.splitlines()]
        if any(row["job_id"] == done.job_id for row in rows):
            break
        await asyncio.sleep(0.1)
    row = next(row for row in rows if row["job_id"] == done.job_id)
    assert row["state"] == "COMPLETED" and row["pool"] == "comfyui" and row["progress"] == 100


async def test_cli_cancel_stops_a_running_job(
    worker: RunningWorker, local_stack: RunningStack
) -> None:
    env = cli_env(local_stack, worker.task_queue)
    graph = example()
    # 60 s at 20 ms a step: a loaded machine may take seconds to start the CLI, and the cancel
    # ends the job long before, so the length costs nothing.
    graph["3"]["inputs"]["steps"] = 3000
    submitted = await worker.client.submit(JobRequest(graph=graph), detached=True)
    async for status in worker.client.watch(submitted.job_id, poll_interval_s=0.05):
        if status.state == JobState.RUNNING:
            break
    code, _out, err = await run_cli("cancel", submitted.job_id, "--reason", "not needed", env=env)
    assert code == 0, err
    final = await asyncio.wait_for(worker.client.wait(submitted.job_id), timeout=30)
    assert final.state == JobState.CANCELLED
    assert final.error is not None and final.error.message == "not needed"
    assert final.teardown.state == "CONFIRMED"
    assert final.progress.step < 500


def node_graph() -> dict[str, Any]:
    """No sampler: progress counts nodes, so a node whose events were missed shows."""
    return {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": 32, "height": 32, "batch_size": 1, "color": uuid.uuid4().int % 99},
        },
        "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "n"}},
    }


async def test_first_node_events_are_counted_on_an_idle_backend(worker: RunningWorker) -> None:
    # The socket opens before the prompt is submitted: even the first node's `executing`,
    # sent a few milliseconds after the submission, reaches the job.
    submitted = await worker.client.submit(JobRequest(graph=node_graph()))
    final = await worker.client.wait(submitted.job_id)
    assert final.state == JobState.COMPLETED, final.error
    assert final.checkpoint is not None
    assert sorted(final.checkpoint.nodes_done) == ["1", "2", "3"], final.checkpoint
    assert final.checkpoint.submitted_at is not None


async def test_a_prompt_queued_behind_another_waits_with_its_place_then_runs(
    worker: RunningWorker, local_stack: RunningStack
) -> None:
    # Someone else's prompt holds the backend for a while.
    blocker = {
        "1": {"class_type": "SimSleep", "inputs": {"seconds": 4.0}},
        "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}},
    }
    await sim_post(local_stack, "/prompt", {"prompt": blocker, "prompt_id": str(uuid.uuid4())})
    sockets_before = (await sim_stats(local_stack))["ws_connections"]
    # Polls every second, and a *running* prompt's socket silent for two polls is reopened:
    # a waiting prompt's socket must stay as it is.
    policy = JobPolicy(heartbeat_timeout_s=3.0, abandon_after_s=None)
    submitted = await worker.client.submit(JobRequest(graph=example(), policy=policy))
    seen = [s async for s in worker.client.watch(submitted.job_id, poll_interval_s=0.05)]
    states = [s.state for s in seen]
    assert states[-1] == JobState.COMPLETED, seen[-1].error
    waiting = [s for s in seen if s.state == JobState.WAITING]
    assert waiting, f"never reported as waiting on the backend: {states}"
    assert {s.progress.queue_position for s in waiting} == {1}
    # Waiting is not running: RUNNING comes only after WAITING.
    first_running = states.index(JobState.RUNNING)
    assert first_running > states.index(JobState.WAITING)
    assert all(s.progress.queue_position is None for s in seen[first_running:])
    sockets = (await sim_stats(local_stack))["ws_connections"] - sockets_before
    assert sockets == 1, f"the waiting job's socket was reopened {sockets - 1} time(s)"


async def test_a_save_prefix_linked_from_a_primitive_string_completes_with_its_artifact(
    worker: RunningWorker, local_stack: RunningStack
) -> None:
    graph = example()
    graph["30"] = {"class_type": "PrimitiveString", "inputs": {"value": "linked/render"}}
    graph["9"]["inputs"]["filename_prefix"] = ["30", 0]
    submitted = await worker.client.submit(JobRequest(graph=graph))
    final = await worker.client.wait(submitted.job_id)
    assert final.state == JobState.COMPLETED, final.error
    [artifact] = final.artifacts
    assert artifact.node_id == "9" and artifact.key.endswith(".png")
    assert artifact.key.rsplit("/", 1)[-1].startswith("render_")
    stored = await worker.store.head(artifact.key)
    assert stored is not None and stored.sha256 == artifact.sha256


async def test_a_graph_comfyui_rejects_fails_with_comfyuis_reason_and_queues_nothing(
    worker: RunningWorker, local_stack: RunningStack
) -> None:
    graph = example()
    graph["3"]["inputs"]["seed"] = -5
    before = await sim_prompts(local_stack)
    submitted = await worker.client.submit(JobRequest(graph=graph))
    final = await worker.client.wait(submitted.job_id)
    assert final.state == JobState.FAILED
    assert final.error is not None and final.error.type == ErrorType.PROMPT_REJECTED
    assert "node 3 (KSampler): input 'seed': Value -5 smaller than min of 0" in final.error.message
    assert await sim_prompts(local_stack) == before
    assert final.teardown.state == "CONFIRMED"
    assert [step.action for step in final.teardown.steps] == ["never_queued"]


async def test_temporal_cli_cancel_signal_without_input_tears_the_job_down(
    worker: RunningWorker, local_stack: RunningStack
) -> None:
    # The operator's way: Temporal's own CLI, no --input at all.
    graph = example()
    graph["3"]["inputs"]["steps"] = 500
    graph["3"]["inputs"]["seed"] = uuid.uuid4().int % 2**32  # never served from the cache
    submitted = await worker.client.submit(JobRequest(graph=graph), detached=True)
    async for status in worker.client.watch(submitted.job_id, poll_interval_s=0.05):
        if status.state == JobState.RUNNING and status.progress.step > 0:
            break
    temporal = Path(sys.executable).parent / "temporal"
    proc = await asyncio.create_subprocess_exec(
        str(temporal),
        "workflow",
        "signal",
        "--address",
        local_stack.temporal_address,
        "--namespace",
        local_stack.namespace,
        "--workflow-id",
        submitted.job_id,
        "--name",
        "cancel",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("TEMPORAL_")},
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, (out, err)
    final = await asyncio.wait_for(worker.client.wait(submitted.job_id), timeout=30)
    assert final.state == JobState.CANCELLED
    assert final.teardown.state == "CONFIRMED"
    assert [s.action for s in final.teardown.steps][:1] == ["interrupt_sent"]


async def test_presigned_links_live_as_long_as_the_request_asked(worker: RunningWorker) -> None:
    request = JobRequest(graph=example(), output=OutputSpec(presign_ttl_s=120))
    submitted = await worker.client.submit(request)
    final = await worker.client.result(submitted.job_id)
    assert final.artifacts and all(a.url for a in final.artifacts)
    assert all("X-Amz-Expires=120" in (a.url or "") for a in final.artifacts), final.artifacts
