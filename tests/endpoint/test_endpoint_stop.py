"""A stopped job on our RunPod handler (endpoint/job.py, endpoint/stopping.py), driven as the SDK
drives it: its task cancelled, again and again while it lets go (the platform re-sends job-stop
until the worker does), against the ComfyUI simulator and a real S3 (SeaweedFS).

The promise: the handler's task ends only once the worker's ComfyUI no longer holds the prompt,
with the claim renewed meanwhile and its outcome saying how the prompt ended; a prompt that
outlives the job's stop horizon is recorded as still running and its worker replaced.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
from structlog.testing import capture_logs

from endpoint.claims import ClaimStore
from endpoint.job import run_job
from endpoint.s3 import S3
from endpoint.settings import EndpointSettings
from protocol.runpod.contract import Claim, S3Target, claim_key
from tests.support.endpoint import (
    Bucket,
    Progress,
    endpoint_settings,
    orchestrated_input,
    sim_get,
)

# Re-sent job-stops reach the handler this often (the RunPod simulator: every 1.5 s).
RESTOP_S = 0.4


def deaf_graph(seconds: float) -> dict[str, Any]:
    """EmptyImage -> SimSleep (no progress hook: an interrupt lands only at its end, when
    SaveImage is about to run) -> SaveImage."""
    return {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 0},
        },
        "2": {"class_type": "SimSleep", "inputs": {"seconds": seconds, "images": ["1", 0]}},
        "3": {
            "class_type": "SaveImage",
            "inputs": {"images": ["2", 0], "filename_prefix": f"stop/{uuid.uuid4().hex[:8]}"},
        },
    }


def job(job_input: Any) -> dict[str, Any]:
    return {"id": f"rp-{uuid.uuid4().hex[:10]}", "input": job_input}


def key_of(block: dict[str, Any]) -> str:
    return claim_key(S3Target.model_validate(block["output"]), block["job_id"], block["submission"])


async def until(check: Any, within: float = 20.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {within}s")


async def queue_holds(sim: str, prompt_id: str) -> bool:
    queue = await sim_get(sim, "/queue")
    return prompt_id in [item[1] for item in queue["queue_pending"] + queue["queue_running"]]


async def is_running(sim: str, prompt_id: str) -> bool:
    return await running_prompt(sim) == prompt_id


async def running_prompt(sim: str) -> str | None:
    queue = await sim_get(sim, "/queue")
    return str(queue["queue_running"][0][1]) if queue["queue_running"] else None


async def stop_repeatedly(task: asyncio.Task[Any]) -> float:
    """Cancel `task` as the SDK does on each job-stop, until it ends; when it ended (epoch s)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RESTOP_S)
    return time.time()


async def test_a_stop_during_a_deaf_node_ends_only_once_comfyui_let_go_of_the_prompt(
    sim: str, bucket: Bucket, settings: EndpointSettings
) -> None:
    """The node ignores interrupts for far longer than the claim's lease: the handler keeps
    interrupting and renewing until /queue no longer holds the prompt, however often the
    platform stops the job meanwhile, then records "interrupted" in the claim."""
    sleep_s, lease_s = 12.0, 5.0
    job_input = orchestrated_input(deaf_graph(sleep_s), bucket.name, lease_s=lease_s)
    block = job_input["durable_comfy"]
    store = ClaimStore(S3(bucket.settings), bucket.name)
    progress = Progress()
    task = asyncio.create_task(run_job(job(job_input), settings, progress))
    await until(lambda: is_running(sim, block["prompt_id"]))
    await asyncio.sleep(1.0)  # well inside the sleep

    claims: list[tuple[Claim, bool]] = []

    async def watch_claim() -> None:
        while not task.done():
            stored = await store.read(key_of(block))
            assert stored is not None
            claims.append((stored.claim, stored.expired))
            await asyncio.sleep(0.5)

    watching = asyncio.create_task(watch_claim())
    stopped_at = time.time()
    with capture_logs() as logs:
        ended_at = await stop_repeatedly(task)
    held_after = await queue_holds(sim, block["prompt_id"])
    await watching
    with pytest.raises(asyncio.CancelledError):
        task.result()

    stats = await sim_get(sim, "/sim/stats")
    assert not held_after
    assert stats["ended_at"][block["prompt_id"]] <= ended_at  # gone before the handler ended
    assert ended_at - stopped_at > lease_s  # it took longer than a lease, and held the claim
    assert block["prompt_id"] in stats["interrupts"] and None not in stats["interrupts"]

    # Renewed throughout the stop, stopping_since written at once and kept.
    assert len(claims) > 2 * lease_s and not any(expired for _claim, expired in claims)
    marked = [c.stopping_since is not None for c, _ in claims if c.outcome is None]
    assert all(marked[2:]) and len(marked) > 2  # (the first look may come before the write)
    claim = (await store.read(key_of(block))).claim  # type: ignore[union-attr]
    assert claim.outcome is not None and claim.outcome.state == "cancelled"
    stop = claim.outcome.stop
    assert stop is not None and stop.prompt == "interrupted", stop
    assert claim.stopping_since == stop.started_at
    assert stop.requests >= 2 and stop.checks > stop.requests  # interrupts re-sent while deaf
    assert stop.node in ("2", "3") and stop.worker_id == "worker-a" and not stop.worker_replaced
    assert stop.at.timestamp() <= ended_at

    # The repeated stops were noted once, and no clean-up was cut short or used a closed client.
    events = [entry["event"] for entry in logs]
    assert events.count("stop_repeated") == 1
    assert not {"cleanup_left_running", "cleanup_failed", "stop_failed"} & set(events)
    assert await run_count(sim, block["prompt_id"]) == 1


async def test_a_prompt_still_running_at_the_horizon_is_recorded_then_its_worker_replaced(
    sim: str, bucket: Bucket, settings: EndpointSettings
) -> None:
    job_input = orchestrated_input(deaf_graph(8.0), bucket.name, lease_s=5.0, stop_horizon_s=1.5)
    block = job_input["durable_comfy"]
    replaced: list[Claim] = []

    def replace_worker() -> None:
        # At the moment of replacement, the claim already says why.
        body, _ = bucket.read(key_of(block))
        replaced.append(Claim.model_validate_json(body))

    progress = Progress()
    task = asyncio.create_task(
        run_job(job(job_input), settings, progress, replace_worker=replace_worker)
    )
    await until(lambda: is_running(sim, block["prompt_id"]))
    await asyncio.sleep(1.0)
    started = time.monotonic()
    with capture_logs() as logs:
        await stop_repeatedly(task)
    took = time.monotonic() - started
    still_held = await queue_holds(sim, block["prompt_id"])
    with pytest.raises(asyncio.CancelledError):
        task.result()

    assert still_held  # the handler did not wait for the prompt past the horizon
    assert 1.5 <= took < 6
    (claim,) = replaced
    assert claim.outcome is not None and claim.outcome.state == "cancelled"
    stop = claim.outcome.stop
    assert stop is not None and stop.prompt == "still_running" and stop.worker_replaced
    assert stop.node == "2" and stop.node_type == "SimSleep" and stop.requests >= 1
    assert "still running" in stop.detail
    (note,) = [e for e in logs if e["event"] == "worker_replaced"]
    assert note["job_id"] == block["job_id"] and note["prompt_id"] == block["prompt_id"]
    assert note["worker_id"] == "worker-a"
    await until(lambda: finished(sim, block["prompt_id"]), within=20)


@pytest.mark.parametrize("kind", ["stock", "unclaimed"])
async def test_a_stop_without_a_claim_stops_the_prompt_all_the_same(
    sim: str, bucket: Bucket, kind: str
) -> None:
    if kind == "stock":
        job_input: dict[str, Any] = {"workflow": deaf_graph(3.0)}
        settings = endpoint_settings(sim, None)
    else:
        job_input = orchestrated_input(deaf_graph(3.0), bucket.name, claims=False)
        settings = endpoint_settings(sim, bucket)
    task = asyncio.create_task(run_job(job(job_input), settings, Progress()))
    prompt_id = await until(lambda: running_prompt(sim))
    await asyncio.sleep(0.5)

    ended_at = await stop_repeatedly(task)
    with pytest.raises(asyncio.CancelledError):
        task.result()

    stats = await sim_get(sim, "/sim/stats")
    assert not await queue_holds(sim, prompt_id)
    assert stats["ended_at"][prompt_id] <= ended_at
    assert prompt_id in stats["interrupts"]
    if kind == "unclaimed":
        key = key_of(job_input["durable_comfy"])
        assert await ClaimStore(S3(bucket.settings), bucket.name).read(key) is None


async def run_count(sim: str, prompt_id: str) -> int:
    return int((await sim_get(sim, "/sim/stats"))["prompts"].get(prompt_id, 0))


async def finished(sim: str, prompt_id: str) -> bool:
    return bool(await sim_get(sim, f"/history/{prompt_id}"))
