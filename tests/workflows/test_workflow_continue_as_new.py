"""The job's one argument (`JobInput`) and continue-as-new: a long job runs on in a new run
with its status and prepared graph carried over, and every run of the chain replays."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from tests.support.workflow_fakes import (
    GRAPH,
    FakeBackend,
    job_worker,
    request,
    start_job,
)
from workflows.activity_io import FollowInput, PreparedJob, StopInput
from workflows.contracts import JobPolicy, JobRequest, JobState, JobStatus
from workflows.inference_job import InferenceJob
from workflows.job_input import JobInput, history_is_long
from workflows.shared import WORKFLOW_TYPE


def three_segments() -> JobRequest:
    job = request(history_budget_events=10)
    widths = ({"1": {"width": w}} for w in (64, 96, 128))
    return job.model_copy(update={"segments": list(widths)})


async def run_histories(
    env: WorkflowEnvironment, job_id: str, run_id: str
) -> list[WorkflowHistory]:
    """Every run of the job from `run_id` on, following continue-as-new's links."""
    histories = []
    next_run: str | None = run_id
    while next_run:
        history = await env.client.get_workflow_handle(job_id, run_id=next_run).fetch_history()
        histories.append(history)
        last = history.events[-1]
        next_run = last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
    return histories


async def test_a_long_job_continues_as_new_with_its_status_and_replays(
    env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend()
    async with job_worker(env.client, backend) as task_queue:
        handle = await start_job(env.client, task_queue, three_segments())
        created = (await handle.describe()).start_time
        status = await handle.result()
        assert handle.first_execution_run_id is not None
        histories = await run_histories(env, handle.id, handle.first_execution_run_id)

    assert status.state == JobState.COMPLETED
    assert [a.segment for a in status.artifacts] == [0, 1, 2]
    assert status.progress.fraction == 1.0 and status.progress.segment == 2
    # Carried, not rebuilt: the first run's creation time, one prepare for the whole job.
    assert status.created_at is not None
    assert abs((status.created_at - created).total_seconds()) < 1
    assert backend.calls.count("prepare_prompt") == 1
    assert [f.segment for f in backend.followed] == [0, 1, 2]

    # A history of 10 events' budget: each segment after the first starts a new run.
    assert len(histories) == 3
    endings = [h.events[-1].event_type for h in histories]
    assert endings == [
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW,
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW,
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED,
    ]
    carried = [await start_input(h) for h in histories]
    assert [i.carry.next_segment if i.carry else None for i in carried] == [None, 1, 2]
    second = carried[1].carry
    assert second is not None and second.status.job_id == handle.id
    assert [a.segment for a in second.status.artifacts] == [0]

    replayer = Replayer(workflows=[InferenceJob], data_converter=pydantic_data_converter)
    for history in histories:
        await replayer.replay_workflow(history)


async def start_input(history: WorkflowHistory) -> JobInput:
    attributes = history.events[0].workflow_execution_started_event_attributes
    [job_input] = pydantic_data_converter.payload_converter.from_payloads(
        list(attributes.input.payloads), [JobInput]
    )
    assert isinstance(job_input, JobInput)
    return job_input


async def test_a_bare_request_starts_a_job_as_earlier_clients_sent_it(
    env: WorkflowEnvironment,
) -> None:
    """`temporal workflow start --input '{"graph": ...}'` and clients before JobInput."""
    bare: dict[str, Any] = {"graph": GRAPH, "policy": {"abandon_after_s": None}}
    async with job_worker(env.client, FakeBackend()) as task_queue:
        handle = await env.client.start_workflow(
            WORKFLOW_TYPE,
            bare,
            id=f"job-{uuid.uuid4()}",
            task_queue=task_queue,
            result_type=JobStatus,
        )
        status = await handle.result()
    assert status.state == JobState.COMPLETED and len(status.artifacts) == 1


def test_job_input_reads_both_forms() -> None:
    job = request()
    wrapped = JobInput.model_validate({"request": job.model_dump(mode="json")})
    bare = JobInput.model_validate(job.model_dump(mode="json"))
    assert wrapped == bare == JobInput(request=job) == JobInput.model_validate(job)
    assert bare.carry is None


@dataclass
class FakeInfo:
    length: int
    suggested: bool = False

    def get_current_history_length(self) -> int:
        return self.length

    def is_continue_as_new_suggested(self) -> bool:
        return self.suggested


@pytest.mark.parametrize(
    ("length", "suggested", "long"),
    [(50, False, False), (51, False, True), (10, True, True)],
)
def test_a_run_continues_past_half_its_history_budget_or_when_temporal_suggests(
    monkeypatch: pytest.MonkeyPatch, length: int, suggested: bool, long: bool
) -> None:
    monkeypatch.setattr(workflow, "info", lambda: FakeInfo(length, suggested))
    assert history_is_long(JobPolicy(history_budget_events=100).history_budget_events) is long


def test_an_earlier_versions_unnamed_pool_reads_as_none() -> None:
    """Earlier versions wrote a pool not named yet (the worker's default) as "": in a carry,
    and in the activity inputs an older workflow scheduled. Read here, it is None, and a
    backend never reads an input whose pool its activity did not name."""
    carried = PreparedJob.model_validate({"pool": "", "kind": "", "graph": GRAPH})
    assert (carried.pool, carried.kind) == (None, None)
    stop = StopInput.model_validate({"job_id": "j", "pool": "", "prompt_id": "p", "reason": "r"})
    assert stop.pool is None
    with pytest.raises(ValueError, match="without a pool"):
        _ = stop.named_pool
    follow = {"job_id": "j", "pool": "gpu", "prompt_id": "p", "client_id": "c", "run_tag": "t"}
    assert FollowInput.model_validate(follow | {"output": {}}).named_pool == "gpu"
