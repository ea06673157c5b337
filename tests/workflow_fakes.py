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
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

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
from workflows.contracts import Artifact, Checkpoint, JobRequest, JobStatus, Teardown
from workflows.inference_job import InferenceJob
from workflows.shared import (
    SA_JOB_POOL,
    SA_JOB_PROGRESS,
    SA_JOB_STATE,
    SA_TENANT,
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


class FakeBackend:
    def __init__(self, script: Script | None = None) -> None:
        self.script = script or Script()
        self.calls: list[str] = []
        self.submitted: list[SubmitInput] = []
        self.followed: list[FollowInput] = []
        self.offloaded: list[OffloadInput] = []
        self.teardowns: list[TeardownInput] = []
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
        await self._enter("prepare_prompt")
        return PreparedJob(
            pool=req.pool or "comfyui",
            kind="comfyui",
            graph=req.graph,
            sampler_steps={"1": 10},
            nodes_total=len(req.graph),
            output_nodes=["2"],
        )

    @activity.defn(name="submit_prompt")
    async def submit(self, req: SubmitInput) -> SubmitResult:
        await self._enter("submit_prompt")
        self.submitted.append(req)
        return SubmitResult(prompt_id=req.prompt_id, outcome="submitted", number=1)

    @activity.defn(name="follow_prompt")
    async def follow(self, req: FollowInput) -> FollowResult:
        self.followed.append(req)
        await self._enter("follow_prompt")
        if self.script.follow_failures:
            failure = self.script.follow_failures.pop(0)
            checkpoint = Checkpoint(
                job_id=req.job_id,
                segment=req.segment,
                prompt_id=req.prompt_id,
                client_id=req.client_id,
                step=self.script.follow_step + (len(self.followed) if self.script.advance else 0),
            )
            if failure == HEARTBEAT_TIMEOUT:
                # A worker that dies mid-follow: its last heartbeat is all that is left.
                activity.heartbeat(checkpoint.model_dump(mode="json"), [])
                await asyncio.sleep(BLOCK_CAP_S)
            raise ApplicationError(
                f"follow attempt failed: {failure}",
                checkpoint.model_dump(mode="json"),
                [],
                type=failure,
                non_retryable=failure in (ErrorType.PROMPT_LOST, ErrorType.OUT_OF_MEMORY),
            )
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

    @activity.defn(name="teardown_prompt")
    async def teardown(self, req: TeardownInput) -> TeardownResult:
        self.teardowns.append(req)
        self.interrupted.set()
        await self._enter("teardown_prompt")
        return TeardownResult(teardown=Teardown(state="CONFIRMED", detail=req.reason))

    def activities(self) -> list[Any]:
        return [self.prepare, self.submit, self.follow, self.offload, self.teardown]


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
        request,
        id=f"job-{uuid.uuid4()}",
        task_queue=task_queue,
        result_type=JobStatus,
    )
