"""`workflows/legacy.py` on its own: how runs started before v3 submit and stop.

Replaying the committed histories (tests/test_replay_histories.py) proves these paths stay
deterministic, but replay does not compare activity inputs: here the submit and teardown calls
are recorded and checked word for word.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta

import pytest
from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

from workflows import activity_calls, legacy
from workflows.activity_io import (
    PreparedJob,
    SubmitInput,
    SubmitResult,
    TeardownInput,
    TeardownResult,
)
from workflows.contracts import JobError, JobPolicy, JobState, JobStatus, Teardown
from workflows.job_book import JobBook
from workflows.shared import ErrorType

T0 = datetime(2026, 1, 1, tzinfo=UTC)
PREPARED = PreparedJob(pool="gpu", kind="comfyui", graph={})
GRAPH: dict[str, object] = {"1": {"class_type": "SaveImage", "inputs": {}}}


class Fake:
    def __init__(self) -> None:
        self.now = T0
        self.patched = True
        self.submits: list[SubmitInput] = []
        self.teardowns: list[TeardownInput] = []
        self.teardown_error: BaseException | None = None

    async def submit(self, req: SubmitInput, policy: JobPolicy) -> SubmitResult:
        self.submits.append(req)
        self.now += timedelta(seconds=3)
        return SubmitResult(prompt_id=req.prompt_id, outcome="submitted")

    async def teardown(self, req: TeardownInput) -> TeardownResult:
        self.teardowns.append(req)
        await asyncio.sleep(0)
        if self.teardown_error is not None:
            raise self.teardown_error
        return TeardownResult(teardown=Teardown(state="CONFIRMED", detail=req.reason))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Fake:
    f = Fake()
    monkeypatch.setattr(workflow, "now", lambda: f.now)
    monkeypatch.setattr(workflow, "uuid4", lambda: "u-1")
    monkeypatch.setattr(workflow, "patched", lambda patch_id: f.patched)
    monkeypatch.setattr(workflow, "upsert_search_attributes", lambda updates: None)
    monkeypatch.setattr(workflow, "set_current_details", lambda details: None)
    monkeypatch.setattr(workflow, "logger", logging.getLogger("legacy_test"))
    monkeypatch.setattr(activity_calls, "submit", f.submit)
    monkeypatch.setattr(activity_calls, "teardown", f.teardown)
    return f


def book() -> JobBook:
    return JobBook(JobStatus(job_id="j1", state=JobState.PREPARING))


async def test_submit_sends_the_recorded_prompt(fake: Fake) -> None:
    b = book()
    b.new_submission(3, "p-1", 20)
    await legacy.submit(b, JobPolicy(), PREPARED, GRAPH)
    assert fake.submits == [
        SubmitInput(
            job_id="j1", pool="gpu", prompt_id="p-1", client_id="dc-u-1", segment=3, graph=GRAPH
        )
    ]
    assert b.status.state == JobState.SUBMITTING
    assert b.last_progress_at == T0 + timedelta(seconds=3)  # submitted: that is progress


async def test_submit_without_a_recorded_prompt_sends_nothing(fake: Fake) -> None:
    b = book()
    b.prompt_id = "p-1"  # a prompt id, but no checkpoint recorded for it
    with pytest.raises(AssertionError):
        await legacy.submit(b, JobPolicy(), PREPARED, GRAPH)
    assert fake.submits == []


def teardown_input(reason: str, free_memory: bool = False) -> TeardownInput:
    return TeardownInput(
        job_id="j1", pool="gpu", prompt_id="p-1", reason=reason, free_memory=free_memory
    )


async def test_a_stop_tears_down_early_then_once_more_when_settled(fake: Fake) -> None:
    b = book()
    stop = legacy.TeardownStop(b)
    stop.begin("gpu", "p-1", JobState.CANCELLED, ErrorType.CANCELLED)
    await asyncio.sleep(0)
    assert fake.teardowns == [teardown_input("cancelled")]
    await stop.settle("gpu", "p-1", JobState.CANCELLED, None)
    assert fake.teardowns == [teardown_input("cancelled")] * 2
    assert b.status.teardown == Teardown(state="CONFIRMED", detail="cancelled")


@pytest.mark.parametrize(
    ("pool", "prompt_id", "patched"),
    [(None, "p-1", True), ("gpu", None, True), ("gpu", "p-1", False)],
)
async def test_no_early_teardown_without_a_prompt_or_before_the_patch(
    fake: Fake, pool: str | None, prompt_id: str | None, patched: bool
) -> None:
    fake.patched = patched
    stop = legacy.TeardownStop(book())
    stop.begin(pool, prompt_id, JobState.FAILED, ErrorType.TIMEOUT)
    await asyncio.sleep(0)
    assert fake.teardowns == []


async def test_out_of_memory_frees_the_backend_memory(fake: Fake) -> None:
    stop = legacy.TeardownStop(book())
    oom = JobError(type=ErrorType.OUT_OF_MEMORY, message="CUDA out of memory")
    await stop.settle("gpu", "p-1", JobState.FAILED, oom)
    other = JobError(type=ErrorType.EXECUTION_ERROR, message="boom")
    await stop.settle("gpu", "p-1", JobState.FAILED, other)
    assert fake.teardowns == [teardown_input("failed", True), teardown_input("failed", False)]


async def test_a_failed_teardown_is_recorded_not_raised(fake: Fake) -> None:
    b = book()
    error = ActivityError(
        "activity failed",
        scheduled_event_id=1,
        started_event_id=2,
        identity="w",
        activity_type="teardown",
        activity_id="1",
        retry_state=None,
    )
    error.__cause__ = ApplicationError("backend unreachable", type=ErrorType.BACKEND_UNAVAILABLE)
    fake.teardown_error = error
    fake.now = T0 + timedelta(seconds=5)
    stop = legacy.TeardownStop(b)
    await stop.settle("gpu", "p-1", JobState.ABANDONED, None)
    assert b.status.teardown == Teardown(state="FAILED", at=fake.now, detail="backend unreachable")
