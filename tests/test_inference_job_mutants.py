"""InferenceJob behaviour that mutation testing found unchecked (issue 8, `make mutate`).

On the time-skipping server with stand-in activities, like tests/test_workflow_durability.py:
the `jobs_ended` metric, the warning when keeping a stopped job's outputs fails, the outputs
kept for a job stopped in its second segment, and a Temporal cancel during the clean-up.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import MetricBuffer, Runtime, TelemetryConfig
from temporalio.testing import WorkflowEnvironment

from devstack.chaos.wait import eventually
from tests.workflow_fakes import (
    GRAPH,
    FakeBackend,
    Script,
    artifact,
    job_worker,
    request,
    start_job,
)
from workflows.activity_io import FollowInput, FollowResult
from workflows.contracts import CancelRequest, JobRequest, JobState, JobStatus, ProgressReport
from workflows.shared import QUERY_STATUS, SIGNAL_CANCEL, SIGNAL_PROGRESS, ErrorType


async def outcome(handle: WorkflowHandle[Any, JobStatus]) -> tuple[JobStatus, BaseException | None]:
    error: BaseException | None = None
    try:
        await handle.result()
    except WorkflowFailureError as exc:
        error = exc
    return await handle.query(QUERY_STATUS, result_type=JobStatus), error


async def following(backend: FakeBackend) -> bool:
    return backend.blocked.is_set()


async def checks_done(backend: FakeBackend, count: int) -> bool:
    return len(backend.teardowns) >= count


# -- the jobs_ended metric --------------------------------------------------------------------


async def test_jobs_ended_counts_each_job_once_by_its_end_state(env: WorkflowEnvironment) -> None:
    # What an operator's dashboard reads (README, activities/metrics.py): the counter
    # durable_comfy_jobs_ended{state}, with its help text, one per job.
    buffer = MetricBuffer(1000)
    runtime = Runtime(telemetry=TelemetryConfig(metrics=buffer))
    client = await Client.connect(
        env.client.service_client.config.target_host,
        namespace=env.client.namespace,
        data_converter=pydantic_data_converter,
        runtime=runtime,
    )
    ended: list[tuple[str, str, int, object]] = []
    for script, state in [
        (Script(), JobState.COMPLETED),
        (Script(fatal_in={"follow_prompt": ErrorType.OUT_OF_MEMORY}), JobState.FAILED),
    ]:
        backend = FakeBackend(script)
        async with job_worker(client, backend) as tq:
            status, _ = await outcome(await start_job(env.client, tq, request()))
        assert status.state == state
        ended += [
            (u.metric.name, u.metric.description or "", int(u.value), u.attributes.get("state"))
            for u in buffer.retrieve_updates()
            if "jobs" in u.metric.name.lower()
        ]
    assert ended == [
        ("durable_comfy_jobs_ended", "Jobs by end state", 1, "COMPLETED"),
        ("durable_comfy_jobs_ended", "Jobs by end state", 1, "FAILED"),
    ]


# -- keeping the finished outputs of a stopped job ----------------------------------------------


async def test_a_failed_partial_offload_is_logged_and_the_job_still_ends_cancelled(
    env: WorkflowEnvironment, caplog: pytest.LogCaptureFixture
) -> None:
    script = Script(
        block_in="follow_prompt", fatal_in={"offload_outputs:partial": ErrorType.STORAGE_ERROR}
    )
    backend = FakeBackend(script)
    caplog.set_level(logging.WARNING, logger="temporalio.workflow")
    async with job_worker(env.client, backend) as tq:
        handle = await start_job(env.client, tq, request())
        await eventually(lambda: following(backend), timeout_s=10, what="the job is following")
        await handle.signal(SIGNAL_CANCEL, CancelRequest(reason="stop it"))
        status, error = await outcome(handle)
    assert error is None and status.state == JobState.CANCELLED
    assert status.teardown.state == "CONFIRMED"
    assert backend.calls[-1] == "offload_outputs:partial"
    # The one trace, for the operator, that a stopped job's outputs were not kept.
    warnings = [r.getMessage() for r in caplog.records if r.name == "temporalio.workflow"]
    assert any(
        m.startswith("keeping finished outputs failed: offload_outputs:partial failed")
        for m in warnings
    ), warnings


class SecondSegmentBlocks(FakeBackend):
    """Segment 0 completes; segment 1 streams one finished output, then runs until stopped."""

    @activity.defn(name="follow_prompt")
    async def follow(self, req: FollowInput) -> FollowResult:
        if req.segment == 1:
            handle = activity.client().get_workflow_handle(req.job_id)
            streamed = ProgressReport(
                attempt_client_id=req.client_id, artifact=artifact(req.job_id, 1)
            )
            await handle.signal(SIGNAL_PROGRESS, streamed)
            self.script.block_in = "follow_prompt"
        return await super().follow(req)


async def test_a_job_stopped_in_its_second_segment_keeps_that_segments_outputs(
    env: WorkflowEnvironment,
) -> None:
    backend = SecondSegmentBlocks()
    job = JobRequest(
        graph=GRAPH,
        segments=[{"1": {"width": 8}}, {"1": {"width": 16}}],
        policy=request().policy,
    )
    async with job_worker(env.client, backend) as tq:
        handle = await start_job(env.client, tq, job)
        await eventually(lambda: following(backend), timeout_s=10, what="segment 1 is following")
        await handle.signal(SIGNAL_CANCEL, CancelRequest(reason="stop it"))
        status, error = await outcome(handle)
    assert error is None and status.state == JobState.CANCELLED
    second = backend.submitted[1]
    assert second.segment == 1
    kept = backend.offloaded[-1]
    assert kept.partial
    # The second segment's prompt, looked for in the folder that prompt saves into, with the
    # output already streamed from it (not uploaded twice).
    assert (kept.prompt_id, kept.segment) == (second.prompt_id, 1)
    assert second.graph is not None
    assert kept.run_tag == second.graph["2"]["inputs"]["filename_prefix"].split("/")[0]
    assert kept.stored == [artifact(handle.id, 1)]
    assert sorted(a.segment for a in status.artifacts) == [0, 1]


# -- the clean-up runs to its end -------------------------------------------------------------


async def test_a_temporal_cancel_during_the_clean_up_does_not_cut_it_short(
    env: WorkflowEnvironment,
) -> None:
    # The node ignores the interrupt for four checks; a Temporal cancel lands in between.
    backend = FakeBackend(Script(block_in="follow_prompt", stop_running_checks=4))
    async with job_worker(env.client, backend) as tq:
        handle = await start_job(env.client, tq, request())
        await eventually(lambda: following(backend), timeout_s=10, what="the job is following")
        await handle.signal(SIGNAL_CANCEL, CancelRequest(reason="stop it"))
        # The interrupt ended the follow activity at the first check; by the third, the work
        # is over and the clean-up (the stop's confirmation) is what runs.
        await eventually(lambda: checks_done(backend, 3), timeout_s=60, what="three stop checks")
        await handle.cancel()
        status, error = await outcome(handle)
    assert error is None, "the job ends as the cancel signal said"
    assert status.state == JobState.CANCELLED
    assert status.error is not None and status.error.message == "stop it"
    assert status.teardown.state == "CONFIRMED", status.teardown
    assert len(backend.teardowns) == 5 + 1, "four 'still running', one 'gone', one settled pass"
    assert backend.calls[-1] == "offload_outputs:partial"


# -- how a job ends: what the status says ----------------------------------------------------


async def test_a_temporal_cancel_without_a_reason_says_it_came_from_temporal(
    env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend(Script(block_in="follow_prompt"))
    async with job_worker(env.client, backend) as tq:
        handle = await start_job(env.client, tq, request())
        await eventually(lambda: following(backend), timeout_s=10, what="the job is following")
        await handle.cancel()
        status, error = await outcome(handle)
    assert isinstance(error, WorkflowFailureError)
    assert status.state == JobState.CANCELLED
    assert status.error is not None
    assert (status.error.type, status.error.message) == (
        ErrorType.CANCELLED,
        "cancelled via Temporal",
    )
