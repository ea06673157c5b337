"""InferenceJob on the time-skipping test server, with stand-in activities.

These check the workflow's own logic: state transitions, progress bookkeeping, errors, teardown on
every exit path and deterministic replay. The real activities are exercised end to end in
tests/test_e2e_local_stack.py.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from temporalio.client import Client, WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from tests.workflow_fakes import GRAPH, FakeBackend, Script
from workflows.activity_io import PrepareInput
from workflows.contracts import JobRequest, JobState, JobStatus, OutputSpec, S3Input
from workflows.inference_job import InferenceJob
from workflows.shared import (
    QUERY_STATUS,
    SA_JOB_POOL,
    SA_JOB_PROGRESS,
    SA_JOB_STATE,
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
        )
    ]
    assert status.backend is not None and status.backend.pool == "gpu-a"


async def test_search_attributes_follow_the_state(env: WorkflowEnvironment) -> None:
    backend = FakeBackend()
    job_id, _status, _ = await run_job(env.client, backend, JobRequest(graph=GRAPH))
    described = await env.client.get_workflow_handle(job_id).describe()
    attributes = {k.name: v for k, v in described.typed_search_attributes}
    assert attributes[SA_JOB_STATE] == "COMPLETED"
    assert attributes[SA_JOB_POOL] == "comfyui"
    assert attributes[SA_JOB_PROGRESS] == 100


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


async def test_history_replays_deterministically(env: WorkflowEnvironment) -> None:
    backend = FakeBackend()
    job_id, _status, _ = await run_job(env.client, backend, JobRequest(graph=GRAPH))
    history = await env.client.get_workflow_handle(job_id).fetch_history()
    replayer = Replayer(workflows=[InferenceJob], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(history)
