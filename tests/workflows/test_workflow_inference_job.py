"""InferenceJob on the time-skipping test server, with stand-in activities.

These check the workflow's own logic: state transitions, progress bookkeeping, errors, the
`jobs_ended` metric, teardown on every exit path (what a stopped job keeps of its outputs, a
Temporal cancel during the clean-up) and deterministic replay. The real activities are
exercised end to end in tests/stack/test_e2e_local_stack.py.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.runtime import MetricBuffer, Runtime, TelemetryConfig
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from faults.wait import eventually
from tests.support.workflow_fakes import (
    GRAPH,
    FakeBackend,
    Script,
    artifact,
    job_worker,
    outcome,
    request,
    start_job,
)
from workflows.activity_io import FollowInput, FollowResult, PrepareInput
from workflows.contracts import (
    CancelRequest,
    JobRequest,
    JobState,
    JobStatus,
    OutputSpec,
    ProgressReport,
    S3Input,
)
from workflows.inference_job import InferenceJob
from workflows.shared import (
    QUERY_STATUS,
    SA_JOB_POOL,
    SA_JOB_PROGRESS,
    SA_JOB_STATE,
    SIGNAL_CANCEL,
    SIGNAL_PROGRESS,
    WORKFLOW_TYPE,
    ErrorType,
)


async def run_job(
    client: Client, backend: FakeBackend, request: JobRequest
) -> tuple[str, JobStatus, BaseException | None]:
    task_queue = f"tq-{uuid.uuid4()}"
    job_id = f"job-{uuid.uuid4()}"
    async with Worker(
        client, task_queue=task_queue, workflows=[InferenceJob], activities=backend.activities()
    ):
        handle = await client.start_workflow(
            WORKFLOW_TYPE, request, id=job_id, task_queue=task_queue, result_type=JobStatus
        )
        error: BaseException | None = None
        try:
            await handle.result()
        except WorkflowFailureError as exc:
            error = exc
        status = await handle.query(QUERY_STATUS, result_type=JobStatus)
    return job_id, status, error


async def following(backend: FakeBackend) -> bool:
    return backend.blocked.is_set()


async def checks_done(backend: FakeBackend, count: int) -> bool:
    return len(backend.teardowns) >= count


# -- a job that runs through ----------------------------------------------------------------------


async def test_happy_path_completes_with_artifacts_and_confirmed_teardown(
    env: WorkflowEnvironment,
) -> None:
    """The follow submits, follows and stores the outputs: prepare and follow are the job's
    only activities."""
    backend = FakeBackend()
    job_id, status, error = await run_job(env.client, backend, JobRequest(graph=GRAPH))
    assert error is None
    assert status.state == JobState.COMPLETED
    assert [a.key for a in status.artifacts] == [f"jobs/{job_id}/0/2/t_00001_.png"]
    # The follow saw the prompt finish: the teardown is confirmed without asking again.
    assert status.teardown.state == "CONFIRMED"
    assert [s.action for s in status.teardown.steps] == ["finished"]
    assert "had already finished" in (status.teardown.detail or "")
    assert backend.calls == ["prepare_prompt", "submit", "follow_prompt"]
    # Mid-run, the stale attempt's report (step 99) was ignored and the current one counted.
    assert backend.step_after_reports == 1
    assert status.progress.step == status.progress.total_steps
    assert status.progress.fraction == 1.0
    submitted = backend.submitted[0]
    assert submitted.graph is not None
    prefix = submitted.graph["2"]["inputs"]["filename_prefix"]
    assert prefix.endswith("/t") and prefix != "t", "save prefix must be unique per run"
    assert status.backend is not None and status.backend.provider_job_id == submitted.prompt_id


async def test_prepare_is_sent_the_whole_request(env: WorkflowEnvironment) -> None:
    backend = FakeBackend()
    request = JobRequest(
        graph=GRAPH,
        pool="gpu-a",
        inputs={"in.png": S3Input(uri="s3://inputs/in.png")},
        segments=[{"1": {"width": 32}}],
        output=OutputSpec(prefix="renders"),
    )
    job_id, status, error = await run_job(env.client, backend, request)
    assert error is None
    assert backend.prepared == [
        PrepareInput(
            job_id=job_id,
            pool="gpu-a",
            graph=GRAPH,
            inputs=request.inputs,
            segments=request.segments,
            output=request.output,
            # When the job was accepted: a bounded pool's check asks for its slot in its place.
            accepted_at=status.created_at,
        )
    ]
    assert status.backend is not None and status.backend.pool == "gpu-a"


async def test_a_request_that_stages_nothing_is_checked_by_its_follow(
    env: WorkflowEnvironment,
) -> None:
    """No prepare activity (nor local activity) on the job's way to its GPU: the first follow
    checks the request, then names the pool that took it; the second segment's follow does
    not check it again."""
    backend = FakeBackend()
    request = JobRequest(graph=GRAPH, segments=[{}, {}])
    job_id, status, error = await run_job(env.client, backend, request)
    assert error is None and status.state == JobState.COMPLETED
    history = await env.client.get_workflow_handle(job_id).fetch_history()
    scheduled = [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes")
    ]
    assert scheduled == ["follow_prompt", "follow_prompt"]
    assert not any(e.HasField("marker_recorded_event_attributes") for e in history.events)
    first, second = backend.followed
    assert first.prepare is not None and first.prepare.graph == GRAPH and first.pool is None
    assert (second.prepare, second.pool) == (None, "comfyui")
    assert status.backend is not None
    assert (status.backend.pool, status.backend.kind) == ("comfyui", "comfyui")


async def test_segments_run_in_order_each_with_its_own_prompt(
    env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend()
    request = JobRequest(graph=GRAPH, segments=[{"1": {"width": 32}}, {"1": {"width": 16}}])
    _job_id, status, error = await run_job(env.client, backend, request)
    assert error is None and status.state == JobState.COMPLETED
    assert [s.segment for s in backend.submitted] == [0, 1]
    assert [(s.graph or {})["1"]["inputs"]["width"] for s in backend.submitted] == [32, 16]
    assert len({s.prompt_id for s in backend.submitted}) == 2
    assert len({s.client_id for s in backend.submitted}) == 2
    assert sorted(a.segment for a in status.artifacts) == [0, 1]


async def test_search_attributes_follow_the_state(env: WorkflowEnvironment) -> None:
    backend = FakeBackend()
    job_id, _status, _ = await run_job(env.client, backend, JobRequest(graph=GRAPH))
    described = await env.client.get_workflow_handle(job_id).describe()
    attributes = {k.name: v for k, v in described.typed_search_attributes}
    assert attributes[SA_JOB_STATE] == "COMPLETED"
    assert attributes[SA_JOB_POOL] == "comfyui"
    assert attributes[SA_JOB_PROGRESS] == 100


# -- the jobs_ended metric ------------------------------------------------------------------------


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


# -- a job that fails -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fail_in", "error_type", "teardown_state", "torn_down"),
    [
        ("prepare_prompt", ErrorType.UNKNOWN_POOL, "SKIPPED", False),
        ("submit", ErrorType.PROMPT_REJECTED, "CONFIRMED", True),
        ("follow_prompt", ErrorType.OUT_OF_MEMORY, "CONFIRMED", True),
    ],
)
async def test_failure_ends_failed_with_typed_error_after_teardown(
    env: WorkflowEnvironment,
    fail_in: str,
    error_type: str,
    teardown_state: str,
    torn_down: bool,
) -> None:
    backend = FakeBackend(Script(fatal_in={fail_in: error_type}))
    _job_id, status, error = await run_job(env.client, backend, JobRequest(graph=GRAPH))
    assert isinstance(error, WorkflowFailureError)
    assert isinstance(error.cause, ApplicationError) and error.cause.type == error_type
    # Not to be retried, and the failure carries the job's final status for the client.
    assert error.cause.non_retryable
    assert JobStatus.model_validate(error.cause.details[0]) == status
    assert status.state == JobState.FAILED
    assert status.error is not None and status.error.type == error_type
    assert status.teardown.state == teardown_state
    assert ("stop_prompt" in backend.calls) is torn_down
    if not torn_down:
        assert status.teardown.detail == "nothing was submitted"
        assert status.teardown.at is not None
    if torn_down:
        assert backend.teardowns[0].prompt_id is not None
        # What teardown saw is recorded, never "already finished" for a prompt never queued.
        expected = "never_queued" if fail_in == "submit" else "interrupted"
        assert [step.action for step in status.teardown.steps] == [expected]


async def test_invalid_payload_fails_the_workflow_instead_of_retrying(
    env: WorkflowEnvironment,
) -> None:
    editor_format: dict[str, Any] = {"graph": {"nodes": [], "links": []}}
    task_queue = f"tq-{uuid.uuid4()}"
    async with Worker(
        env.client,
        task_queue=task_queue,
        workflows=[InferenceJob],
        activities=FakeBackend().activities(),
    ):
        handle = await env.client.start_workflow(
            WORKFLOW_TYPE, editor_format, id=f"bad-{uuid.uuid4()}", task_queue=task_queue
        )
        with pytest.raises(WorkflowFailureError) as failure:
            await handle.result()
    assert "API format" in str(failure.value.cause)


# -- keeping the finished outputs of a stopped job ------------------------------------------------


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


# -- a Temporal cancel: the clean-up runs to its end, the status says where it came from ----------


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


# -- replay ---------------------------------------------------------------------------------------


async def test_history_replays_deterministically(env: WorkflowEnvironment) -> None:
    backend = FakeBackend()
    job_id, _status, _ = await run_job(env.client, backend, JobRequest(graph=GRAPH))
    history = await env.client.get_workflow_handle(job_id).fetch_history()
    replayer = Replayer(workflows=[InferenceJob], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(history)
