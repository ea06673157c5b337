"""InferenceJob on the time-skipping test server, with stand-in activities.

These check the workflow's own logic: state transitions, progress bookkeeping, errors, teardown on
every exit path and deterministic replay. The real activities are exercised end to end in
tests/test_e2e_local_stack.py.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from tests.workflow_fakes import GRAPH, artifact, start_time_skipping
from workflows.activity_io import (
    FollowInput,
    FollowResult,
    OffloadInput,
    OffloadResult,
    PreparedJob,
    PrepareInput,
    SubmitInput,
    SubmitResult,
    TeardownInput,
    TeardownResult,
)
from workflows.contracts import (
    Checkpoint,
    JobRequest,
    JobState,
    JobStatus,
    ProgressReport,
    Teardown,
)
from workflows.inference_job import InferenceJob
from workflows.shared import (
    QUERY_STATUS,
    SA_JOB_POOL,
    SA_JOB_PROGRESS,
    SA_JOB_STATE,
    SIGNAL_PROGRESS,
    WORKFLOW_TYPE,
    ErrorType,
)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def time_env() -> AsyncIterator[WorkflowEnvironment]:
    env = await start_time_skipping()
    yield env
    await env.shutdown()


class FakeBackend:
    """Stand-in activities that record what the workflow asked of them."""

    def __init__(self, *, fail_in: str | None = None, error_type: str = "") -> None:
        self.fail_in = fail_in
        self.error_type = error_type
        self.calls: list[str] = []
        self.teardowns: list[TeardownInput] = []
        self.submitted: list[SubmitInput] = []

    def _maybe_fail(self, name: str) -> None:
        self.calls.append(name)
        if self.fail_in == name:
            raise ApplicationError(f"{name} failed", type=self.error_type, non_retryable=True)

    @activity.defn(name="prepare_prompt")
    async def prepare(self, req: PrepareInput) -> PreparedJob:
        self._maybe_fail("prepare_prompt")
        return PreparedJob(
            pool=req.pool or "comfyui",
            kind="comfyui",
            graph=req.graph,
            sampler_steps={},
            nodes_total=len(req.graph),
            output_nodes=["2"],
        )

    @activity.defn(name="submit_prompt")
    async def submit(self, req: SubmitInput) -> SubmitResult:
        self._maybe_fail("submit_prompt")
        self.submitted.append(req)
        return SubmitResult(prompt_id=req.prompt_id, outcome="submitted", number=1)

    @activity.defn(name="follow_prompt")
    async def follow(self, req: FollowInput) -> FollowResult:
        self._maybe_fail("follow_prompt")
        handle = activity.client().get_workflow_handle(req.job_id)
        stale = ProgressReport(attempt_client_id="someone-else", step=99, total_steps=2)
        await handle.signal(SIGNAL_PROGRESS, stale)
        report = ProgressReport(attempt_client_id=req.client_id, step=1, total_steps=2)
        await handle.signal(SIGNAL_PROGRESS, report)
        return FollowResult(
            prompt_id=req.prompt_id,
            outcome="success",
            artifacts=[artifact(req.job_id, req.segment)],
            checkpoint=Checkpoint(job_id=req.job_id, prompt_id=req.prompt_id, step=2),
        )

    @activity.defn(name="offload_outputs")
    async def offload(self, req: OffloadInput) -> OffloadResult:
        self._maybe_fail("offload_outputs")
        return OffloadResult(artifacts=list(req.stored))

    @activity.defn(name="teardown_prompt")
    async def teardown(self, req: TeardownInput) -> TeardownResult:
        self.calls.append("teardown_prompt")
        self.teardowns.append(req)
        return TeardownResult(teardown=Teardown(state="CONFIRMED", detail=req.reason))

    def activities(self) -> list[Any]:
        return [self.prepare, self.submit, self.follow, self.offload, self.teardown]


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
    time_env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend()
    job_id, status, error = await run_job(time_env.client, backend, JobRequest(graph=GRAPH))
    assert error is None
    assert status.state == JobState.COMPLETED
    assert [a.key for a in status.artifacts] == [f"jobs/{job_id}/0/2/t_00001_.png"]
    assert status.teardown.state == "CONFIRMED"
    assert backend.calls == [
        "prepare_prompt",
        "submit_prompt",
        "follow_prompt",
        "offload_outputs",
        "teardown_prompt",
    ]
    # The stale attempt's report (step 99) was ignored; the current one counted.
    assert status.progress.step == status.progress.total_steps
    assert status.progress.fraction == 1.0
    submitted = backend.submitted[0]
    prefix = submitted.graph["2"]["inputs"]["filename_prefix"]
    assert prefix.endswith("/t") and prefix != "t", "save prefix must be unique per run"
    assert status.backend is not None and status.backend.provider_job_id == submitted.prompt_id


async def test_search_attributes_follow_the_state(time_env: WorkflowEnvironment) -> None:
    backend = FakeBackend()
    job_id, _status, _ = await run_job(time_env.client, backend, JobRequest(graph=GRAPH))
    described = await time_env.client.get_workflow_handle(job_id).describe()
    attributes = {k.name: v for k, v in described.typed_search_attributes}
    assert attributes[SA_JOB_STATE] == "COMPLETED"
    assert attributes[SA_JOB_POOL] == "comfyui"
    assert attributes[SA_JOB_PROGRESS] == 100


@pytest.mark.parametrize(
    ("fail_in", "error_type", "teardown_state", "torn_down"),
    [
        ("prepare_prompt", ErrorType.UNKNOWN_POOL, "SKIPPED", False),
        ("submit_prompt", ErrorType.PROMPT_REJECTED, "CONFIRMED", True),
        ("follow_prompt", ErrorType.OUT_OF_MEMORY, "CONFIRMED", True),
        ("offload_outputs", ErrorType.STORAGE_ERROR, "CONFIRMED", True),
    ],
)
async def test_failure_ends_failed_with_typed_error_after_teardown(
    time_env: WorkflowEnvironment,
    fail_in: str,
    error_type: str,
    teardown_state: str,
    torn_down: bool,
) -> None:
    backend = FakeBackend(fail_in=fail_in, error_type=error_type)
    _job_id, status, error = await run_job(time_env.client, backend, JobRequest(graph=GRAPH))
    assert isinstance(error, WorkflowFailureError)
    assert isinstance(error.cause, ApplicationError) and error.cause.type == error_type
    assert status.state == JobState.FAILED
    assert status.error is not None and status.error.type == error_type
    assert status.teardown.state == teardown_state
    assert ("teardown_prompt" in backend.calls) is torn_down
    if torn_down:
        assert backend.teardowns[0].prompt_id is not None


async def test_invalid_payload_fails_the_workflow_instead_of_retrying(
    time_env: WorkflowEnvironment,
) -> None:
    editor_format: dict[str, Any] = {"graph": {"nodes": [], "links": []}}
    task_queue = f"tq-{uuid.uuid4()}"
    async with Worker(
        time_env.client,
        task_queue=task_queue,
        workflows=[InferenceJob],
        activities=FakeBackend().activities(),
    ):
        handle = await time_env.client.start_workflow(
            WORKFLOW_TYPE, editor_format, id=f"bad-{uuid.uuid4()}", task_queue=task_queue
        )
        with pytest.raises(WorkflowFailureError) as failure:
            await handle.result()
    assert "API format" in str(failure.value.cause)


async def test_segments_run_in_order_each_with_its_own_prompt(
    time_env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend()
    request = JobRequest(graph=GRAPH, segments=[{"1": {"width": 32}}, {"1": {"width": 16}}])
    _job_id, status, error = await run_job(time_env.client, backend, request)
    assert error is None and status.state == JobState.COMPLETED
    assert [s.segment for s in backend.submitted] == [0, 1]
    assert [s.graph["1"]["inputs"]["width"] for s in backend.submitted] == [32, 16]
    assert len({s.prompt_id for s in backend.submitted}) == 2
    assert len({s.client_id for s in backend.submitted}) == 2
    assert sorted(a.segment for a in status.artifacts) == [0, 1]


async def test_history_replays_deterministically(time_env: WorkflowEnvironment) -> None:
    backend = FakeBackend()
    job_id, _status, _ = await run_job(time_env.client, backend, JobRequest(graph=GRAPH))
    history = await time_env.client.get_workflow_handle(job_id).fetch_history()
    replayer = Replayer(workflows=[InferenceJob], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(history)
