"""Stand-in activities for workflow tests on the time-skipping server.

Each fake records what the workflow asked of it and follows a script: fail some attempts with a
given error, or block (heartbeating) until the workflow cancels it.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from workflows.activity_io import (
    FollowHeartbeat,
    FollowInput,
    FollowResult,
    OffloadInput,
    OffloadResult,
    PreparedJob,
    PrepareInput,
    StopCheck,
    StopInput,
)
from workflows.contracts import (
    Artifact,
    Checkpoint,
    JobPolicy,
    JobRequest,
    JobStatus,
    ProgressReport,
)
from workflows.inference_job import InferenceJob
from workflows.job_input import JobInput
from workflows.shared import (
    QUERY_STATUS,
    SA_JOB_POOL,
    SA_JOB_PROGRESS,
    SA_JOB_STATE,
    SA_TENANT,
    SIGNAL_PROGRESS,
    WORKFLOW_TYPE,
    ErrorType,
)

GRAPH: dict[str, Any] = {
    "1": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
    "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "t"}},
}
SHA = "a" * 64
BLOCK_CAP_S = 60.0
HEARTBEAT_TIMEOUT = "heartbeat-timeout"


async def start_time_skipping() -> WorkflowEnvironment:
    server = Path(sys.executable).parent / "temporal-test-server"
    env = await WorkflowEnvironment.start_time_skipping(
        data_converter=pydantic_data_converter, test_server_existing_path=str(server)
    )
    await env.client.operator_service.add_search_attributes(
        AddSearchAttributesRequest(
            namespace=env.client.namespace,
            search_attributes={
                SA_JOB_STATE: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
                SA_JOB_PROGRESS: IndexedValueType.INDEXED_VALUE_TYPE_INT,
                SA_JOB_POOL: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
                SA_TENANT: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
            },
        )
    )
    return env


def artifact(job_id: str, segment: int, node: str = "2") -> Artifact:
    key = f"jobs/{job_id}/{segment}/{node}/t_00001_.png"
    return Artifact(
        key=key,
        uri=f"s3://bucket/{key}",
        size=10,
        sha256=SHA,
        content_type="image/png",
        node_id=node,
        segment=segment,
    )


@dataclass
class Script:
    """What the fake backend does. Failures are consumed in order, one per attempt."""

    block_in: str | None = None  # an activity name that waits until cancelled
    # Error types to fail follow attempts with, or HEARTBEAT_TIMEOUT to go silent.
    follow_failures: list[str] = field(default_factory=list)
    fatal_in: dict[str, str] = field(default_factory=dict)  # activity name -> error type
    follow_step: int = 3  # the step the first failed follow attempt reports having reached
    advance: bool = True  # whether each later attempt reports one step more (progress)
    # Stop checks that still find the prompt running before it is gone (-1: never gone).
    stop_running_checks: int = 0
    # Stop checks (the first ones) that cannot reach the backend at all.
    stop_unreachable_checks: int = 0
    # The submitted prompt waits in the backend's queue (at this place) instead of running.
    queued_at: int | None = None


class FakeBackend:
    def __init__(self, script: Script | None = None) -> None:
        self.script = script or Script()
        self.calls: list[str] = []
        self.prepared: list[PrepareInput] = []
        # The follow requests that submitted a prompt the backend did not hold yet.
        self.submitted: list[FollowInput] = []
        self.followed: list[FollowInput] = []
        self.offloaded: list[OffloadInput] = []
        self.teardowns: list[StopInput] = []
        self.known: set[str] = set()  # prompt ids the fake backend holds
        self.step_after_reports: int | None = None
        self.finished: set[str] = set()  # prompt ids that ran to their end
        self.blocked = asyncio.Event()
        self.interrupted = asyncio.Event()

    async def _enter(self, name: str) -> None:
        self.calls.append(name)
        if name in self.script.fatal_in:
            error_type = self.script.fatal_in[name]
            raise ApplicationError(f"{name} failed", type=error_type, non_retryable=True)
        if self.script.block_in == name:
            self.blocked.set()
            for _ in range(int(BLOCK_CAP_S / 0.1)):
                if name == "follow_prompt" and self.interrupted.is_set():
                    # What ComfyUI does to a running prompt it is told to interrupt.
                    raise ApplicationError(
                        "prompt interrupted", type=ErrorType.INTERRUPTED, non_retryable=True
                    )
                activity.heartbeat()
                await asyncio.sleep(0.1)
            raise ApplicationError("blocked too long", non_retryable=True)

    @activity.defn(name="prepare_prompt")
    async def prepare(self, req: PrepareInput) -> PreparedJob:
        self.prepared.append(req)
        await self._enter("prepare_prompt")
        return PreparedJob(
            pool=req.pool or "comfyui",
            kind="comfyui",
            graph=req.graph,
            sampler_steps={"1": 10},
            nodes_total=len(req.graph),
            output_nodes=["2"],
        )

    @activity.defn(name="follow_prompt")
    async def follow(self, req: FollowInput) -> FollowResult:
        self.followed.append(req)
        if req.graph is not None:
            # The follow activity submits first (socket open), unless the backend knows it.
            await self._enter("submit")
            if req.prompt_id not in self.known:
                self.known.add(req.prompt_id)
                self.submitted.append(req)
            # As the real follower does: the workflow hears that the backend has the prompt.
            queued = self.script.queued_at
            report = ProgressReport(
                attempt_client_id=req.client_id,
                stage="running" if queued is None else "queued",
                queue_position=queued,
                checkpoint=Checkpoint(
                    job_id=req.job_id,
                    segment=req.segment,
                    prompt_id=req.prompt_id,
                    client_id=req.client_id,
                    submitted_at=datetime.now(UTC),
                ),
            )
            handle = activity.client().get_workflow_handle(req.job_id)
            await handle.signal(SIGNAL_PROGRESS, report)
        await self._enter("follow_prompt")
        if self.script.follow_failures:
            failure = self.script.follow_failures.pop(0)
            checkpoint = Checkpoint(
                job_id=req.job_id,
                segment=req.segment,
                prompt_id=req.prompt_id,
                client_id=req.client_id,
                step=self.script.follow_step + (len(self.followed) if self.script.advance else 0),
                submitted_at=datetime.now(UTC),
            )
            if failure == ErrorType.PROMPT_LOST:
                self.known.discard(req.prompt_id)
            reached = FollowHeartbeat(checkpoint=checkpoint).model_dump(mode="json")
            if failure == HEARTBEAT_TIMEOUT:
                # A worker that dies mid-follow: its last heartbeat is all that is left.
                activity.heartbeat(reached)
                await asyncio.sleep(BLOCK_CAP_S)
            raise ApplicationError(
                f"follow attempt failed: {failure}",
                reached,
                type=failure,
                non_retryable=failure in (ErrorType.PROMPT_LOST, ErrorType.OUT_OF_MEMORY),
            )
        # A report from another (stale) socket must not count; the current one must.
        handle = activity.client().get_workflow_handle(req.job_id)
        stale = ProgressReport(attempt_client_id="someone-else", step=99, total_steps=10)
        await handle.signal(SIGNAL_PROGRESS, stale)
        current = ProgressReport(attempt_client_id=req.client_id, step=1, total_steps=10)
        await handle.signal(SIGNAL_PROGRESS, current)
        status = await handle.query(QUERY_STATUS, result_type=JobStatus)
        self.step_after_reports = status.progress.step
        self.finished.add(req.prompt_id)
        return FollowResult(
            prompt_id=req.prompt_id,
            outcome="success",
            artifacts=[artifact(req.job_id, req.segment)],
            checkpoint=Checkpoint(job_id=req.job_id, prompt_id=req.prompt_id, step=10),
        )

    @activity.defn(name="offload_outputs")
    async def offload(self, req: OffloadInput) -> OffloadResult:
        self.offloaded.append(req)
        await self._enter("offload_outputs" + (":partial" if req.partial else ""))
        return OffloadResult(artifacts=list(req.stored))

    @activity.defn(name="stop_prompt")
    async def stop(self, req: StopInput) -> StopCheck:
        self.teardowns.append(req)
        self.interrupted.set()
        await self._enter("stop_prompt")
        now = datetime.now(UTC)
        if len(self.teardowns) <= self.script.stop_unreachable_checks:
            return StopCheck(at=now, position="unreachable", message="ComfyUnavailable: refused")
        checks = self.script.stop_running_checks
        if checks < 0 or len(self.teardowns) <= checks:
            return StopCheck(at=now, position="running", action="interrupt_sent")
        if req.prompt_id not in self.known:
            return StopCheck(at=now, position="gone", ended="unknown")
        if req.prompt_id in self.finished:
            return StopCheck(at=now, position="gone", ended="success")
        return StopCheck(at=now, position="gone", ended="interrupted", node="1", node_type="X")

    def activities(self) -> list[Any]:
        return [self.prepare, self.follow, self.offload, self.stop]


@asynccontextmanager
async def job_worker(client: Client, backend: FakeBackend) -> AsyncIterator[str]:
    task_queue = f"tq-{uuid.uuid4()}"
    async with Worker(
        client,
        task_queue=task_queue,
        workflows=[InferenceJob],
        activities=backend.activities(),
        graceful_shutdown_timeout=timedelta(seconds=1),
    ):
        yield task_queue


async def start_job(
    client: Client, task_queue: str, request: JobRequest
) -> WorkflowHandle[Any, JobStatus]:
    return await client.start_workflow(
        WORKFLOW_TYPE,
        JobInput(request=request),
        id=f"job-{uuid.uuid4()}",
        task_queue=task_queue,
        result_type=JobStatus,
    )


async def outcome(handle: WorkflowHandle[Any, JobStatus]) -> tuple[JobStatus, BaseException | None]:
    """How the job ended: its final status, and the failure its result raised (None if none)."""
    error: BaseException | None = None
    try:
        await handle.result()
    except WorkflowFailureError as exc:
        error = exc
    return await handle.query(QUERY_STATUS, result_type=JobStatus), error


def request(**policy: Any) -> JobRequest:
    """A detached job unless the test sets `abandon_after_s`; short heartbeats, because an
    activity hears of a cancel only on its next sent heartbeat (at most every 0.8 x timeout)."""
    defaults = {"abandon_after_s": None, "heartbeat_timeout_s": 1}
    return JobRequest(graph=GRAPH, policy=JobPolicy.model_validate(defaults | policy))
