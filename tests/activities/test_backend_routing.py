"""The job activities reach each pool through the backend of its kind, and only through it."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from temporalio.exceptions import ApplicationError

from activities.backend import Backend, Backends, JobActivities
from configuration.pools import PoolConfig
from configuration.settings import S3Settings
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
from workflows.failures import refused_before_submission
from workflows.shared import ErrorType

GRAPH = {"1": {"class_type": "EmptyImage", "inputs": {}}}
STORAGE = S3Settings.from_env({}, bucket="artifacts")


class RecordingBackend:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.calls: list[tuple[str, str]] = []

    async def prepare(self, req: PrepareInput, pool: str) -> PreparedJob:
        self.calls.append(("prepare", pool))
        return PreparedJob(pool=pool, kind=self.kind, graph=req.graph, nodes_total=1)

    async def follow(self, req: FollowInput) -> FollowResult:
        self.calls.append(("follow", req.named_pool))  # the activity named it
        checkpoint = Checkpoint(job_id=req.job_id, prompt_id=req.prompt_id)
        return FollowResult(prompt_id=req.prompt_id, outcome="success", checkpoint=checkpoint)

    async def offload(self, req: OffloadInput) -> OffloadResult:
        self.calls.append(("offload", req.named_pool))
        return OffloadResult(artifacts=[])

    async def stop(self, req: StopInput) -> StopCheck:
        self.calls.append(("stop", req.named_pool))
        return StopCheck(at=datetime.now(UTC), position="gone")


def routed() -> tuple[JobActivities, RecordingBackend, RecordingBackend]:
    comfy, runpod = RecordingBackend("comfyui"), RecordingBackend("runpod")
    pools = {
        "local": PoolConfig(kind="comfyui", url="http://127.0.0.1:1"),
        "cloud": PoolConfig(kind="runpod", endpoint_id="abc"),
    }
    by_kind: dict[str, Backend] = {"comfyui": comfy, "runpod": runpod}
    return JobActivities(Backends(pools, "local", by_kind), None, STORAGE), comfy, runpod


def follow_input(pool: str | None) -> FollowInput:
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
    jobs = JobActivities(
        Backends(pools, "cloud", {"comfyui": RecordingBackend("comfyui")}), None, STORAGE
    )
    with pytest.raises(ApplicationError) as caught:
        await jobs.follow_prompt(follow_input("cloud"))
    assert caught.value.type == ErrorType.UNKNOWN_POOL and caught.value.non_retryable
    assert "of kind 'runpod', which this worker cannot run" in str(caught.value)


# -- a follow that checks the request first (a request that stages no input file) -------------


def checking(pool: str | None) -> FollowInput:
    return follow_input(None).model_copy(
        update={"prepare": PrepareInput(job_id="j", pool=pool, graph=GRAPH)}
    )


@pytest.mark.parametrize(
    ("asked", "pool", "kind"), [(None, "local", "comfyui"), ("cloud", "cloud", "runpod")]
)
async def test_a_follow_checks_the_request_then_names_the_pool_that_took_it(
    asked: str | None, pool: str, kind: str
) -> None:
    jobs, comfy, runpod = routed()
    result = await jobs.follow_prompt(checking(asked))
    assert (result.pool, result.kind) == (pool, kind)
    # Checked on the pool, then followed there under its configured name, never None.
    backend = comfy if kind == "comfyui" else runpod
    assert backend.calls == [("prepare", pool), ("follow", pool)]


async def test_a_follow_whose_check_refuses_the_request_submits_nothing() -> None:
    jobs, comfy, runpod = routed()
    with pytest.raises(ApplicationError) as caught:
        await jobs.follow_prompt(checking("gpu9"))
    refusal = caught.value
    assert refusal.type == ErrorType.UNKNOWN_POOL and refusal.non_retryable
    assert "pool 'gpu9' is not configured" in refusal.message
    assert refused_before_submission(refusal)
    assert comfy.calls == [] and runpod.calls == []


async def test_a_check_that_fails_retryably_is_not_a_refusal() -> None:
    """A pool slow or down: the workflow backs off and its next attempt checks again."""

    class Down(RecordingBackend):
        async def prepare(self, req: PrepareInput, pool: str) -> PreparedJob:
            raise ApplicationError("down", type=ErrorType.BACKEND_UNAVAILABLE)

    pools = {"local": PoolConfig(kind="comfyui", url="http://127.0.0.1:1")}
    down = Down("comfyui")
    jobs = JobActivities(Backends(pools, "local", {"comfyui": down}), None, STORAGE)
    with pytest.raises(ApplicationError) as caught:
        await jobs.follow_prompt(checking(None))
    assert not caught.value.non_retryable and not refused_before_submission(caught.value)
    assert down.calls == []


async def test_activities_without_a_pool_run_on_the_default_one_by_name() -> None:
    """A job whose check its follow has not done yet names no pool (None); an earlier
    version wrote that as "", which reads the same."""
    jobs, comfy, _ = routed()
    await jobs.follow_prompt(follow_input(None))
    await jobs.follow_prompt(
        FollowInput.model_validate(follow_input(None).model_dump() | {"pool": ""})
    )
    check = await jobs.stop_prompt(
        StopInput(job_id="j", pool=None, prompt_id="p", reason="after cancel")
    )
    assert comfy.calls == [("follow", "local"), ("follow", "local"), ("stop", "local")]
    # A job stopped before its follow named the pool learns it from the stop.
    assert (check.pool, check.kind) == ("local", "comfyui")
    named = await jobs.stop_prompt(
        StopInput(job_id="j", pool="cloud", prompt_id="p", reason="after cancel")
    )
    assert (named.pool, named.kind) == (None, None)
