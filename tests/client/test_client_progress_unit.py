"""`JobClient`'s reading of a running job's step from the follow activity's heartbeat, and of a
final status from the job's result, without a server: descriptions built from the proto the
server answers, a fake Temporal client for `wait`.

- `overlaid`: a newer heartbeat of the current submission moves the step; a stale one (fewer
  steps, an earlier submission, another prompt or segment) and a job not following a prompt
  change nothing;
- `follow_heartbeats`: read from the description's pending activities, only the follow's;
- `watch`: between milestones one describe per poll, the query only when the history grew, and
  a heartbeat-only change is yielded;
- `wait`: the result (or a FAILED job's error details) is the final status; a cancel through
  Temporal falls back to the status query.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, cast

import pytest
from temporalio.api.enums.v1 import WorkflowExecutionStatus as RawStatus
from temporalio.api.workflowservice.v1 import DescribeWorkflowExecutionResponse
from temporalio.client import (
    Client,
    WorkflowExecutionDescription,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import encode_search_attributes
from temporalio.exceptions import ApplicationError, CancelledError

from starter import JobClient
from starter.execution import bare_status
from starter.progress import follow_heartbeats, heartbeat_status, overlaid
from workflows.activity_io import FollowHeartbeat
from workflows.contracts import Artifact, Checkpoint, JobError, JobState, JobStatus, Progress
from workflows.shared import ACTIVITY_FOLLOW, STATE_KEY

JOB = "job-overlay"
PROMPT = "prompt-1"
CLIENT = "dc-client-1"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def checkpoint(step: int, *, at: float = 0.0, **changes: Any) -> Checkpoint:
    base: dict[str, Any] = {
        "job_id": JOB,
        "prompt_id": PROMPT,
        "client_id": CLIENT,
        "step": step,
        "total_steps": 5000,
        "updated_at": T0 + timedelta(seconds=at),
    }
    return Checkpoint.model_validate(base | changes)


def running(step: int, *, state: JobState = JobState.RUNNING, seq: int = 7) -> JobStatus:
    """The job's own answer: step `step` told at its last milestone (at t=step/100 s)."""
    return JobStatus(
        job_id=JOB,
        state=state,
        seq=seq,
        progress=Progress(step=step, total_steps=5000, fraction=step / 5000),
        checkpoint=checkpoint(step, at=step / 100),
        updated_at=T0 + timedelta(seconds=step / 100),
    )


def beat(
    step: int,
    *,
    at: float | None = None,
    stage: Literal["queued", "running"] | None = None,
    queue_position: int | None = None,
    **changes: Any,
) -> FollowHeartbeat:
    return FollowHeartbeat(
        checkpoint=checkpoint(step, at=step / 100 if at is None else at, **changes),
        stage=stage,
        queue_position=queue_position,
    )


# -- overlaid ---------------------------------------------------------------------------------


def test_a_newer_heartbeat_of_the_submission_moves_the_step() -> None:
    status = overlaid(running(1000), [beat(1234)])
    assert status.progress.step == 1234 and status.progress.fraction == pytest.approx(0.2468)
    assert status.checkpoint is not None and status.checkpoint.step == 1234
    assert status.updated_at == T0 + timedelta(seconds=12.34)
    assert status.seq == 7, "seq stays the job's own"


def test_the_fraction_counts_the_segments() -> None:
    base = running(0)
    base.progress = Progress(segment=1, segments=4, step=0, total_steps=100, fraction=0.25)
    base.checkpoint = checkpoint(0, segment=1, total_steps=100)
    moved = overlaid(base, [beat(50, segment=1, total_steps=100)]).progress
    assert moved.step == 50 and moved.fraction == pytest.approx(0.375)


def test_a_stale_heartbeat_never_moves_progress_backwards() -> None:
    status = running(2000)
    assert overlaid(status, [beat(1500)]) == status
    assert overlaid(status, [beat(2000, at=5.0)]) == status, "as far, and older"


def test_the_furthest_of_several_heartbeats_wins() -> None:
    assert overlaid(running(100), [beat(300), beat(200), beat(250)]).progress.step == 300


@pytest.mark.parametrize(
    "other",
    [
        {"prompt_id": "prompt-0"},  # an earlier prompt's follow
        {"client_id": "dc-client-0"},  # the same prompt's earlier submission (restarts at 0)
        {"segment": 1},  # the next segment's
        {"prompt_id": None},
    ],
)
def test_a_heartbeat_of_another_submission_is_ignored(other: dict[str, Any]) -> None:
    status = running(100)
    assert overlaid(status, [beat(4000, **other)]) == status


def test_no_pending_activity_leaves_the_answer_as_it_is() -> None:
    status = running(100)
    assert overlaid(status, []) == status


@pytest.mark.parametrize(
    "state", [JobState.UPLOADING, JobState.STOPPING, JobState.NEEDS_DECISION, JobState.COMPLETED]
)
def test_only_a_job_following_its_prompt_is_overlaid(state: JobState) -> None:
    status = running(100, state=state)
    assert overlaid(status, [beat(4000)]) == status


def test_a_submitting_job_shows_the_stage_its_heartbeat_says() -> None:
    """A follow attempt tells the workflow nothing in its first second: meanwhile the heartbeat
    of the current submission says whether the backend has the prompt queued (and where) or
    running, and the status shows it."""
    submitting = running(0, state=JobState.SUBMITTING)
    queued = overlaid(submitting, [beat(0, stage="queued", queue_position=3)])
    assert (queued.state, queued.progress.queue_position) == (JobState.WAITING, 3)
    started = overlaid(submitting, [beat(4, stage="running")])
    assert (started.state, started.progress.step) == (JobState.RUNNING, 4)
    assert overlaid(submitting, [beat(4)]).state == JobState.SUBMITTING, "no stage: as it is"
    other = beat(4, stage="running", client_id="dc-earlier")
    assert overlaid(submitting, [other]).state == JobState.SUBMITTING, "another submission's"
    # The job's own word wins once it has one: a RUNNING job is not sent back to WAITING.
    assert overlaid(running(5), [beat(6, stage="queued")]).state == JobState.RUNNING


def test_reconnecting_shows_the_checkpoint_the_job_recovered() -> None:
    # The workflow took the failed attempt's last heartbeat as its checkpoint: further than its
    # last milestone. No follow runs meanwhile, so heartbeats are not asked for, nor used.
    status = running(1000, state=JobState.RECONNECTING)
    status.checkpoint = checkpoint(1400, at=20.0)
    shown = overlaid(status, [beat(4000)])
    assert shown.progress.step == 1400 and shown.state == JobState.RECONNECTING


def test_a_job_without_a_checkpoint_is_left_alone() -> None:
    status = running(0)
    status.checkpoint = None
    assert overlaid(status, [beat(10)]) == status


# -- follow_heartbeats --------------------------------------------------------------------------


async def description(
    *beats: tuple[str, FollowHeartbeat | None],
    history_length: int = 10,
    status: RawStatus.ValueType = RawStatus.WORKFLOW_EXECUTION_STATUS_RUNNING,
    run_id: str = "run-1",
    state: JobState | None = None,
) -> WorkflowExecutionDescription:
    """What `describe()` returns, built from the server's answer: pending activities (type,
    heartbeat) and the history's length."""
    raw = DescribeWorkflowExecutionResponse()
    info = raw.workflow_execution_info
    info.execution.workflow_id, info.execution.run_id = JOB, run_id
    info.type.name = "InferenceJob"
    info.status = status
    info.history_length = history_length
    if state is not None:
        encode_search_attributes(
            TypedSearchAttributes([SearchAttributePair(STATE_KEY, state.value)]),
            info.search_attributes,
        )
    for activity_type, heartbeat in beats:
        pending = raw.pending_activities.add()
        pending.activity_type.name = activity_type
        if heartbeat is not None:
            payloads = await pydantic_data_converter.encode([heartbeat.model_dump(mode="json")])
            pending.heartbeat_details.payloads.extend(payloads)
    return await WorkflowExecutionDescription._from_raw_description(
        raw, namespace="default", converter=pydantic_data_converter
    )


async def test_heartbeats_are_read_from_the_pending_follow_activity_only() -> None:
    described = await description(
        (ACTIVITY_FOLLOW, beat(42)), ("stop_prompt", beat(99)), (ACTIVITY_FOLLOW, None)
    )
    assert [b.checkpoint.step for b in await follow_heartbeats(described)] == [42]
    assert await follow_heartbeats(await description()) == []


async def test_an_unreadable_heartbeat_is_no_heartbeat() -> None:
    described = await description((ACTIVITY_FOLLOW, None))
    pending = described.raw_description.pending_activities[0]
    pending.heartbeat_details.payloads.extend(await pydantic_data_converter.encode(["junk"]))
    assert await follow_heartbeats(described) == []


# -- watch ----------------------------------------------------------------------------------------


class Calls:
    """A JobClient whose query and describe are scripted, and what it asked. A closed
    workflow's record (its result) is the last answer."""

    def __init__(self, answers: list[JobStatus], descriptions: list[WorkflowExecutionDescription]):
        self.answers, self.descriptions = answers, descriptions
        self.asked: list[str] = []
        self.client = JobClient(cast(Client, object()))

        async def query(job_id: str) -> JobStatus:
            self.asked.append("query")
            return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

        async def describe(job_id: str) -> WorkflowExecutionDescription:
            self.asked.append("describe")
            found = self.descriptions
            return found.pop(0) if len(found) > 1 else found[0]

        async def client_seen(job_id: str) -> None:
            self.asked.append("client_seen")

        async def recorded_end(
            job_id: str, description: WorkflowExecutionDescription
        ) -> JobStatus | None:
            if description.status == WorkflowExecutionStatus.RUNNING:
                return None
            self.asked.append("result")
            return self.answers[-1]

        self.client._query = query  # type: ignore[method-assign]
        self.client._describe = describe  # type: ignore[method-assign]
        self.client._client_seen = client_seen  # type: ignore[method-assign]
        self.client._recorded_end = recorded_end  # type: ignore[method-assign]


async def test_watch_reads_steps_from_heartbeats_and_queries_only_when_history_grew() -> None:
    done = running(5000, seq=12)
    done.state = JobState.COMPLETED
    calls = Calls(
        answers=[running(1000), done],
        descriptions=[
            await description((ACTIVITY_FOLLOW, beat(1000)), history_length=40),
            await description((ACTIVITY_FOLLOW, beat(1100)), history_length=40),
            await description((ACTIVITY_FOLLOW, beat(1200)), history_length=40),
            await description((ACTIVITY_FOLLOW, beat(1200)), history_length=40),
            await description((ACTIVITY_FOLLOW, beat(1300)), history_length=40),
            await description(
                history_length=52, status=RawStatus.WORKFLOW_EXECUTION_STATUS_COMPLETED
            ),
        ],
    )
    seen = [
        (s.state, s.progress.step)
        async for s in calls.client.watch(JOB, poll_interval_s=0, keepalive_s=3600)
    ]
    assert seen == [
        (JobState.RUNNING, 1000),
        (JobState.RUNNING, 1100),
        (JobState.RUNNING, 1200),
        (JobState.RUNNING, 1300),  # nothing new at 1200 twice: not yielded twice
        (JobState.COMPLETED, 5000),
    ]
    # The first answer (after the first describe, history 40), then none: the history grew
    # when the job ended, and an ended job's status is read from its record (a query of a
    # closed workflow would have a worker replay its whole history).
    assert calls.asked[:2] == ["describe", "query"]
    assert calls.asked.count("query") == 1
    assert calls.asked[-2:] == ["describe", "result"]
    assert calls.asked.count("describe") == 6


async def test_watch_never_goes_back_while_the_jobs_own_status_stays_the_same() -> None:
    """A heartbeat showed RUNNING at step 4 before the job heard; the attempt then failed (no
    pending activity to read) and the job has not yet recovered its checkpoint: the watch keeps
    showing what it showed, until the job's own status moves."""
    submitting = running(0, state=JobState.SUBMITTING, seq=3)
    recovered = running(8, state=JobState.RECONNECTING, seq=4)
    done = running(40, seq=9)
    done.state = JobState.COMPLETED
    calls = Calls(
        answers=[submitting, recovered, done],
        descriptions=[
            await description((ACTIVITY_FOLLOW, beat(4, stage="running")), history_length=10),
            await description(history_length=10),  # the attempt failed: nothing pending
            await description(history_length=14),
            await description(
                history_length=30, status=RawStatus.WORKFLOW_EXECUTION_STATUS_COMPLETED
            ),
        ],
    )
    seen = [
        (s.state, s.progress.step)
        async for s in calls.client.watch(JOB, poll_interval_s=0, keepalive_s=3600)
    ]
    assert seen == [
        (JobState.RUNNING, 4),
        (JobState.RECONNECTING, 8),
        (JobState.COMPLETED, 40),
    ]


async def test_watch_keeps_a_step_of_the_submission_when_the_jobs_own_status_moves_first() -> None:
    """A heartbeat showed step 4; the attempt failed in its quiet start and the job wrote a new
    status (its seq moved) still at step 0 before it recovered the checkpoint: the step stays.
    A new submission (another client id) starts again from 0."""
    submitting = running(0, state=JobState.SUBMITTING, seq=3)
    moved = running(0, state=JobState.SUBMITTING, seq=4)
    resubmitted = running(0, state=JobState.SUBMITTING, seq=6)
    resubmitted.checkpoint = checkpoint(0, client_id="dc-client-2")
    done = running(40, seq=9)
    done.state = JobState.COMPLETED
    calls = Calls(
        answers=[submitting, moved, resubmitted, done],
        descriptions=[
            await description((ACTIVITY_FOLLOW, beat(4, stage="running")), history_length=10),
            await description(history_length=12),  # the attempt failed: nothing pending
            await description(history_length=16),
            await description(
                history_length=30, status=RawStatus.WORKFLOW_EXECUTION_STATUS_COMPLETED
            ),
        ],
    )
    seen = [
        (s.state, s.progress.step)
        async for s in calls.client.watch(JOB, poll_interval_s=0, keepalive_s=3600)
    ]
    assert seen == [
        (JobState.RUNNING, 4),
        (JobState.SUBMITTING, 4),
        (JobState.SUBMITTING, 0),
        (JobState.COMPLETED, 40),
    ]


async def test_watch_ends_a_job_terminated_from_outside_while_it_followed() -> None:
    calls = Calls(
        answers=[running(1000)],
        descriptions=[
            await description((ACTIVITY_FOLLOW, beat(1000))),
            await description(status=RawStatus.WORKFLOW_EXECUTION_STATUS_TERMINATED),
        ],
    )
    seen = [s async for s in calls.client.watch(JOB, poll_interval_s=0, keepalive_s=3600)]
    assert seen[-1].state == JobState.TERMINATED


async def test_a_cancel_that_lands_in_an_update_call_ends_the_watch() -> None:
    """The SDK turns a cancel during an update call into an RPC error; the watch must not take
    it for a failure to retry (a Ctrl-C in `submit --watch` would be swallowed, and the CLI end
    as if the job had been watched to its end)."""
    calls = Calls(
        answers=[running(1000)], descriptions=[await description((ACTIVITY_FOLLOW, beat(1000)))]
    )
    in_call = asyncio.Event()

    async def describe_then_cancelled(job_id: str) -> WorkflowExecutionDescription:
        in_call.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError as err:
            raise WorkflowUpdateRPCTimeoutOrCancelledError() from err
        raise AssertionError("not cancelled")

    async def watch() -> None:
        async for _ in calls.client.watch(JOB, poll_interval_s=0, keepalive_s=3600):
            calls.client._describe = describe_then_cancelled  # type: ignore[method-assign]

    watching = asyncio.create_task(watch())
    await asyncio.wait_for(in_call.wait(), timeout=5)
    watching.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(watching, timeout=5)


async def test_status_overlays_the_heartbeat_from_the_describe_it_makes_anyway() -> None:
    calls = Calls(
        answers=[running(1000)], descriptions=[await description((ACTIVITY_FOLLOW, beat(1700)))]
    )
    status = await calls.client.status(JOB)
    assert status.progress.step == 1700
    assert calls.asked == ["query", "describe"]


@pytest.mark.parametrize("task_under_way", [True, False], ids=["task-pending", "task-done"])
async def test_status_asks_again_when_the_follow_ended_between_its_two_calls(
    task_under_way: bool,
) -> None:
    # The query saw the first attempt submitting (its step only in the heartbeat); by the
    # describe the attempt had failed, and the task that reads its checkpoint was under way, or
    # had already run (under load, between the two calls).
    submitting = running(0, state=JobState.SUBMITTING)
    recovered = running(0, state=JobState.RECONNECTING)
    recovered.checkpoint = checkpoint(8, at=20.0)
    described = await description()
    if task_under_way:
        described.raw_description.pending_workflow_task.attempt = 1
    calls = Calls(answers=[submitting, recovered], descriptions=[described])
    status = await calls.client.status(JOB)
    assert calls.asked == ["query", "describe", "query"]
    assert status.state == JobState.RECONNECTING and status.progress.step == 8


async def test_status_in_a_backoff_between_attempts_is_the_jobs_second_answer() -> None:
    submitting = running(0, state=JobState.SUBMITTING)
    calls = Calls(answers=[submitting, submitting], descriptions=[await description()])
    status = await calls.client.status(JOB)
    assert calls.asked == ["query", "describe", "query"]
    assert status.state == JobState.SUBMITTING and status.progress.step == 0


# -- wait ---------------------------------------------------------------------------------------


class FakeDescription:
    """A job started without a webhook: its memo says nothing of one."""

    async def memo_value(self, key: str, default: Any = None) -> Any:
        return default


class FakeHandle:
    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome

    async def describe(self) -> FakeDescription:
        return FakeDescription()

    async def result(self) -> Any:
        if isinstance(outcome := self.outcome, BaseException):
            raise outcome
        return outcome


class FakeTemporal:
    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome

    def get_workflow_handle(self, job_id: str, **_: Any) -> FakeHandle:
        return FakeHandle(self.outcome)


def waiting_client(outcome: Any) -> tuple[JobClient, list[str]]:
    asked: list[str] = []
    client = JobClient(cast(Client, FakeTemporal(outcome)))

    async def status(job_id: str) -> JobStatus:
        asked.append("status")
        return JobStatus(job_id=job_id, state=JobState.CANCELLED)

    client.status = status  # type: ignore[method-assign]
    return client, asked


def final(state: JobState, **changes: Any) -> dict[str, Any]:
    status = JobStatus(job_id=JOB, state=state, seq=30, **changes)
    return status.model_dump(mode="json")


async def test_wait_returns_the_result_without_asking_again() -> None:
    client, asked = waiting_client(final(JobState.COMPLETED))
    status = await client.wait(JOB)
    assert (status.state, status.seq) == (JobState.COMPLETED, 30)
    assert asked == []


async def test_wait_reads_a_failed_jobs_status_from_its_error() -> None:
    error = JobError(type="InvalidGraph", message="no such node")
    failure = ApplicationError(
        "no such node", final(JobState.FAILED, error=error), type="InvalidGraph"
    )
    client, asked = waiting_client(WorkflowFailureError(cause=failure))
    status = await client.wait(JOB)
    assert status.state == JobState.FAILED and status.error == error
    assert asked == []


@pytest.mark.parametrize(
    "outcome",
    [
        WorkflowFailureError(cause=CancelledError("cancelled through Temporal")),
        WorkflowFailureError(cause=ApplicationError("no status in it")),
        {"not": "a status"},
        final(JobState.RUNNING),  # never a job's end
        JobStatus(job_id="another-job", state=JobState.COMPLETED).model_dump(mode="json"),
    ],
)
async def test_wait_asks_the_job_when_its_ending_carries_no_status(outcome: Any) -> None:
    client, asked = waiting_client(outcome)
    status = await client.wait(JOB)
    assert status.state == JobState.CANCELLED and asked == ["status"]


async def test_a_late_query_answer_does_not_hold_up_the_heartbeats_steps() -> None:
    """A worker busy with other jobs answers the status query late: meanwhile the watch shows
    the last answer with each newer heartbeat, then the answer when it comes."""
    released = asyncio.Event()
    done = running(5000, seq=12)
    done.state = JobState.COMPLETED
    answers = [running(1000), done]
    descriptions = [
        await description((ACTIVITY_FOLLOW, beat(1000)), history_length=40),
        # The history grew (a milestone): the query is asked again, and hangs.
        *[await description((ACTIVITY_FOLLOW, beat(s)), history_length=44) for s in (1100, 1200)],
        await description((ACTIVITY_FOLLOW, beat(1300)), history_length=44),
    ]
    calls = Calls(answers=answers, descriptions=descriptions)
    asked = 0

    async def slow_query(job_id: str) -> JobStatus:
        nonlocal asked
        asked += 1
        if asked > 1:
            await released.wait()
        return answers[min(asked, len(answers)) - 1]

    calls.client._query = slow_query  # type: ignore[method-assign]
    seen: list[tuple[str, int]] = []
    async with asyncio.timeout(10):  # a watch stuck on the query would never see 1300
        async for status in calls.client.watch(JOB, poll_interval_s=0.02, keepalive_s=3600):
            seen.append((status.state, status.progress.step))
            if status.progress.step == 1300:
                released.set()
    assert seen == [
        (JobState.RUNNING, 1000),
        (JobState.RUNNING, 1100),
        (JobState.RUNNING, 1200),
        (JobState.RUNNING, 1300),
        (JobState.COMPLETED, 5000),
    ]
    assert asked == 2  # one query in flight at a time, however many polls it took


# -- before the job's first answer: the record -----------------------------------------------


def recorded(state: JobState) -> JobStatus:
    """What `bare_status` reads from the record: the state search attribute, no checkpoint."""
    return JobStatus(job_id=JOB, state=state, progress=Progress(fraction=0.2))


def test_the_records_state_is_taken_to_the_heartbeats_submission_and_step() -> None:
    stored = Artifact(
        key="k", uri="s3://b/k", size=1, sha256="0" * 64, content_type="image/png", node_id="9"
    )
    heartbeat = beat(1234, stage="running")
    heartbeat.artifacts = [stored]
    status = heartbeat_status(recorded(JobState.RUNNING), [beat(7, job_id="other"), heartbeat])
    assert (status.state, status.progress.step) == (JobState.RUNNING, 1234)
    assert status.checkpoint == heartbeat.checkpoint
    assert status.artifacts == [stored]
    assert status.progress.fraction == pytest.approx(1234 / 5000)
    assert status.seq == 0, "the seq is the job's to say"


def test_the_record_of_a_later_segment_counts_that_segment() -> None:
    status = heartbeat_status(
        recorded(JobState.RUNNING), [beat(50, segment=2, total_steps=100, stage="queued")]
    )
    assert status.state == JobState.WAITING
    assert (status.progress.segment, status.progress.step) == (2, 50)
    assert status.progress.segments >= 3 and status.progress.fraction <= 1.0


@pytest.mark.parametrize(
    "heartbeats",
    [[], [beat(5, job_id="another-job")], [beat(5, prompt_id=None)]],
    ids=["none", "another job's", "no prompt yet"],
)
def test_the_record_without_a_heartbeat_of_the_job_is_left_alone(
    heartbeats: list[FollowHeartbeat],
) -> None:
    assert heartbeat_status(recorded(JobState.RUNNING), heartbeats) == recorded(JobState.RUNNING)


@pytest.mark.parametrize("state", [JobState.STOPPING, JobState.COMPLETED, JobState.RECONNECTING])
def test_the_record_of_a_job_past_following_takes_no_heartbeat(state: JobState) -> None:
    assert heartbeat_status(recorded(state), [beat(5, stage="running")]) == recorded(state)


async def test_bare_status_reads_the_state_the_job_recorded() -> None:
    described = await description(state=JobState.RUNNING)
    assert bare_status(JOB, described).state == JobState.RUNNING


async def late_answering(released: asyncio.Event) -> Calls:
    """A job whose heartbeat moves 1100, 1200, then 1300 (where the record's state becomes
    RUNNING), whose query answers (step 1300, seq 9) only once `released` is set."""
    answer = running(1300, seq=9)
    descriptions = [
        await description((ACTIVITY_FOLLOW, beat(s, stage="running")), state=JobState.SUBMITTING)
        for s in (1100, 1200)
    ]
    descriptions.append(
        await description((ACTIVITY_FOLLOW, beat(1300, stage="running")), state=JobState.RUNNING)
    )
    calls = Calls(answers=[answer], descriptions=descriptions)

    async def late_query(job_id: str) -> JobStatus:
        calls.asked.append("query")
        await released.wait()
        return answer

    calls.client._query = late_query  # type: ignore[method-assign]
    return calls


async def test_a_late_first_answer_shows_the_records_status_meanwhile() -> None:
    """A worker following a thousand jobs answers a new watch's first query in seconds: the
    watch shows the record's state with the heartbeat's steps meanwhile, with no contact sent
    for a job not yet known to be attached, then the job's own answer."""
    released = asyncio.Event()
    calls = await late_answering(released)
    seen: list[tuple[str, int, int]] = []
    asked_meanwhile: list[str] = []

    def answer() -> None:
        asked_meanwhile.extend(calls.asked)
        released.set()

    asyncio.get_running_loop().call_later(0.3, answer)  # the query stays out over many polls
    async with asyncio.timeout(10):
        async for status in calls.client.watch(JOB, poll_interval_s=0.02, keepalive_s=0):
            seen.append((status.state, status.progress.step, status.seq))
            if status.seq == 9:
                break
    assert seen == [
        (JobState.RUNNING, 1100, 0),
        (JobState.RUNNING, 1200, 0),
        (JobState.RUNNING, 1300, 0),
        (JobState.RUNNING, 1300, 9),
    ]
    assert asked_meanwhile.count("query") == 1, "one query in flight, however many polls"
    assert asked_meanwhile.count("describe") > 2
    assert "client_seen" not in asked_meanwhile
    assert "client_seen" in calls.asked, "an attached job's answer is followed by contact"


async def test_the_records_status_keeps_what_submit_said_of_the_jobs_attachment() -> None:
    """`submit --watch` interrupted before the job's first answer must still say the job will
    be abandoned: the record holds no policy, so the status submit answered lends it."""
    released = asyncio.Event()
    calls = await late_answering(released)
    submitted = JobStatus(job_id=JOB, state=JobState.QUEUED, abandon_after_s=120.0)
    before_answer: list[tuple[int, bool, float | None]] = []
    asyncio.get_running_loop().call_later(0.3, released.set)
    async with asyncio.timeout(10):
        async for status in calls.client.watch(
            JOB, poll_interval_s=0.02, keepalive_s=0, since=submitted
        ):
            if status.seq == 9:
                break
            before_answer.append((status.progress.step, status.detached, status.abandon_after_s))
    assert before_answer, "no status from the record before the answer"
    assert {(detached, after) for _, detached, after in before_answer} == {(False, 120.0)}
    assert before_answer[-1][0] == 1300


async def test_without_record_first_the_first_status_is_the_jobs_answer() -> None:
    """The gateway's watch: its journal cursor starts at the first status's `seq`."""
    released = asyncio.Event()
    calls = await late_answering(released)
    updates = calls.client.watch(JOB, poll_interval_s=0.02, keepalive_s=3600, record_first=False)
    first = asyncio.ensure_future(anext(aiter(updates)))
    await asyncio.sleep(0.3)
    assert not first.done(), "a status was shown before the job's answer"
    released.set()
    async with asyncio.timeout(10):
        status = await first
    assert (status.state, status.progress.step, status.seq) == (JobState.RUNNING, 1300, 9)
    await updates.aclose()  # type: ignore[attr-defined]
