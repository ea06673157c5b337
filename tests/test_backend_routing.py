"""The job activities reach each pool through the backend of its kind, and only through it."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from temporalio.exceptions import ApplicationError

from activities.backend import Backend, Backends, JobActivities
from activities.settings import PoolConfig
from workflows.activity_io import (
    FollowInput,
    FollowResult,
    OffloadInput,
    OffloadResult,
    PreparedJob,
    PrepareInput,
    StopCheck,
    StopInput,
)
from workflows.contracts import Checkpoint, OutputSpec
from workflows.shared import ErrorType

GRAPH = {"1": {"class_type": "EmptyImage", "inputs": {}}}


class RecordingBackend:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.calls: list[tuple[str, str]] = []

    async def prepare(self, req: PrepareInput, pool: str) -> PreparedJob:
        self.calls.append(("prepare", pool))
        return PreparedJob(pool=pool, kind=self.kind, graph=req.graph, nodes_total=1)

    async def follow(self, req: FollowInput) -> FollowResult:
        self.calls.append(("follow", req.pool))
        checkpoint = Checkpoint(job_id=req.job_id, prompt_id=req.prompt_id)
        return FollowResult(prompt_id=req.prompt_id, outcome="success", checkpoint=checkpoint)

    async def offload(self, req: OffloadInput) -> OffloadResult:
        self.calls.append(("offload", req.pool))
        return OffloadResult(artifacts=[])

    async def stop(self, req: StopInput) -> StopCheck:
        self.calls.append(("stop", req.pool))
        return StopCheck(at=datetime.now(UTC), position="gone")


def routed() -> tuple[JobActivities, RecordingBackend, RecordingBackend]:
    comfy, runpod = RecordingBackend("comfyui"), RecordingBackend("runpod")
    pools = {
        "local": PoolConfig(kind="comfyui", url="http://127.0.0.1:1"),
        "cloud": PoolConfig(kind="runpod", endpoint_id="abc"),
    }
    by_kind: dict[str, Backend] = {"comfyui": comfy, "runpod": runpod}
    return JobActivities(Backends(pools, "local", by_kind)), comfy, runpod


def follow_input(pool: str) -> FollowInput:
    checkpoint = Checkpoint(job_id="j", prompt_id="p")
    return FollowInput(
        job_id="j",
        pool=pool,
        prompt_id="p",
        client_id="c",
        segment=0,
        segments=1,
        run_tag="t",
        sampler_steps={},
        nodes_total=1,
        output=OutputSpec(),
        progress_interval_s=1.0,
        checkpoint=checkpoint,
        stored=[],
    )


async def test_each_call_goes_to_its_pools_kind() -> None:
    jobs, comfy, runpod = routed()
    prepared = await jobs.prepare_prompt(PrepareInput(job_id="j", pool="cloud", graph=GRAPH))
    assert prepared.kind == "runpod"
    await jobs.follow_prompt(follow_input("local"))
    stop = StopInput(job_id="j", pool="cloud", prompt_id="p", reason="after cancel")
    await jobs.stop_prompt(stop)
    offload = OffloadInput(
        job_id="j", pool="local", prompt_id="p", segment=0, run_tag="t", output=OutputSpec()
    )
    await jobs.offload_outputs(offload)
    assert runpod.calls == [("prepare", "cloud"), ("stop", "cloud")]
    assert comfy.calls == [("follow", "local"), ("offload", "local")]


async def test_a_request_without_a_pool_goes_to_the_default_one() -> None:
    jobs, comfy, runpod = routed()
    prepared = await jobs.prepare_prompt(PrepareInput(job_id="j", pool=None, graph=GRAPH))
    assert (prepared.pool, prepared.kind) == ("local", "comfyui")
    assert comfy.calls == [("prepare", "local")] and runpod.calls == []


async def test_an_unknown_pool_fails_for_good_naming_the_configured_ones() -> None:
    jobs, _, _ = routed()
    with pytest.raises(ApplicationError) as caught:
        await jobs.prepare_prompt(PrepareInput(job_id="j", pool="gpu9", graph=GRAPH))
    error = caught.value
    assert error.type == ErrorType.UNKNOWN_POOL and error.non_retryable
    assert (
        error.message
        == "pool 'gpu9' is not configured on this worker (configured pools: cloud, local)"
    )


async def test_a_kind_this_worker_has_no_backend_for_fails_for_good() -> None:
    pools = {"cloud": PoolConfig(kind="runpod", endpoint_id="abc")}
    jobs = JobActivities(Backends(pools, "cloud", {"comfyui": RecordingBackend("comfyui")}))
    with pytest.raises(ApplicationError) as caught:
        await jobs.follow_prompt(follow_input("cloud"))
    assert caught.value.type == ErrorType.UNKNOWN_POOL and caught.value.non_retryable
    assert "of kind 'runpod', which this worker cannot run" in str(caught.value)
