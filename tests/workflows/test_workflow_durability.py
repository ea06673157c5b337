"""InferenceJob under churn, on the time-skipping server with stand-in activities.

Reconnect backoff (bounded, jittered, deterministic on replay), the reconnect horizon, lost
prompts and NEEDS_DECISION, abandonment, cancel in every state, and compensation on every exit.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError, CancelledError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from faults.wait import eventually
from tests.support.workflow_fakes import (
    GRAPH,
    HEARTBEAT_TIMEOUT,
    FakeBackend,
    Script,
    job_worker,
    outcome,
    request,
    start_job,
    start_time_skipping,
)
from workflows.contracts import (
    CancelRequest,
    JobPolicy,
    JobRequest,
    JobState,
    JobStatus,
    ReconnectPolicy,
    ResumeRequest,
    S3Input,
)
from workflows.inference_job import InferenceJob
from workflows.shared import (
    QUERY_STATUS,
    SIGNAL_CANCEL,
    SIGNAL_CLIENT_SEEN,
    SIGNAL_RESUME,
    ErrorType,
    reconnect_delay,
)


@pytest_asyncio.fixture(loop_scope="session")
async def clean_env() -> AsyncIterator[WorkflowEnvironment]:
    """A server of its own: an activity still running anywhere on the test server (say, one a
    cancelled test left behind) stops its clock from skipping, and these tests need it to."""
    environment = await start_time_skipping()
    yield environment
    await environment.shutdown()


async def timers(handle: WorkflowHandle[Any, JobStatus]) -> list[tuple[str, float]]:
    """(summary, seconds) of every timer the workflow started, in order."""
    found: list[tuple[str, float]] = []
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_TIMER_STARTED:
            summary = ""
            if event.user_metadata.HasField("summary"):
                summary = pydantic_data_converter.payload_converter.from_payload(
                    event.user_metadata.summary, str
                )
            seconds = event.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta()
            found.append((summary, seconds.total_seconds()))
    return found


def test_delay_formula_is_bounded_and_jittered() -> None:
    assert reconnect_delay(0, 1, 30, 0.0) == 0.5
    assert reconnect_delay(3, 1, 30, 0.999999) == pytest.approx(8.0, rel=1e-5)
    assert reconnect_delay(10, 1, 30, 0.5) == 22.5
    assert all(15 <= reconnect_delay(n, 1, 30, 0.3) <= 30 for n in range(5, 200))
    with pytest.raises(ValueError):
        reconnect_delay(0, 1, 30, 1.0)


async def test_connection_losses_back_off_on_durable_timers_then_complete(
    env: WorkflowEnvironment,
) -> None:
    lost = [ErrorType.CONNECTION_LOST] * 4
    backend = FakeBackend(Script(follow_failures=lost))
    async with job_worker(env.client, backend) as tq:
        handle = await start_job(
            env.client, tq, request(reconnect={"base_delay_s": 1, "max_delay_s": 4})
        )
        status, error = await outcome(handle)
        started = await timers(handle)
        history = await handle.fetch_history()
    assert error is None and status.state == JobState.COMPLETED
    assert status.reconnects == 4
    reconnects = [(s, d) for s, d in started if s.startswith("reconnect")]
    assert [s for s, _ in reconnects] == [
        "reconnect 1",
        "reconnect 2",
        "reconnect 3",
        "reconnect 4",
    ]
    for attempt, (_summary, seconds) in enumerate(reconnects):
        ceiling = min(1 * 2**attempt, 4)
        assert ceiling / 2 <= seconds <= ceiling, (attempt, seconds)
    # Each retry re-attached from the checkpoint the failed attempt left, never resubmitted.
    assert len(backend.submitted) == 1
    assert [f.checkpoint.step if f.checkpoint else None for f in backend.followed][1:] == [
        4,
        5,
        6,
        7,
    ]
    assert len({f.client_id for f in backend.followed}) == 1
    # The same history replays to the same timers: the jitter comes from workflow.random().
    await Replayer(
        workflows=[InferenceJob], data_converter=pydantic_data_converter
    ).replay_workflow(history)


async def test_no_progress_past_the_horizon_fails_saying_what_was_tried(
    env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend(Script(follow_failures=[ErrorType.CONNECTION_LOST] * 50, advance=False))
    async with job_worker(env.client, backend) as tq:
        policy = {"reconnect": {"base_delay_s": 1, "max_delay_s": 8, "horizon_s": 30}}
        status, error = await outcome(await start_job(env.client, tq, request(**policy)))
    assert status.state == JobState.FAILED
    assert isinstance(error, WorkflowFailureError)
    assert status.error is not None and status.error.type == ErrorType.CONNECTION_LOST
    assert "reconnect horizon 30 s" in status.error.message
    assert "reconnect attempt(s)" in status.error.message
    assert 3 <= status.reconnects < 50
    assert status.teardown.state == "CONFIRMED"
    assert "offload_outputs:partial" in backend.calls


async def test_worker_death_re_attaches_from_the_last_heartbeat(env: WorkflowEnvironment) -> None:
    backend = FakeBackend(Script(follow_failures=[HEARTBEAT_TIMEOUT], follow_step=6))
    async with job_worker(env.client, backend) as tq:
        status, error = await outcome(
            await start_job(env.client, tq, request(heartbeat_timeout_s=1))
        )
    assert error is None and status.state == JobState.COMPLETED
    assert status.reconnects == 1 and len(backend.submitted) == 1
    retry = backend.followed[1].checkpoint
    assert retry is not None and retry.step == 7, "resumed from the dead attempt's heartbeat"


async def test_lost_prompt_is_resubmitted_once_then_completes(env: WorkflowEnvironment) -> None:
    backend = FakeBackend(Script(follow_failures=[ErrorType.PROMPT_LOST]))
    async with job_worker(env.client, backend) as tq:
        status, error = await outcome(await start_job(env.client, tq, request()))
    assert error is None and status.state == JobState.COMPLETED
    assert len(backend.submitted) == 2
    assert backend.submitted[0].prompt_id == backend.submitted[1].prompt_id
    # The same prompt ID again: this time the backend is asked first whether it holds it.
    assert [s.first_post for s in backend.submitted] == [True, False]


async def test_lost_twice_pauses_for_a_decision_and_resume_resubmits(
    env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend(Script(follow_failures=[ErrorType.PROMPT_LOST] * 2))
    async with job_worker(env.client, backend) as tq:
        handle = await start_job(env.client, tq, request())

        async def paused() -> bool:
            status: JobStatus = await handle.query(QUERY_STATUS, result_type=JobStatus)
            return status.state == JobState.NEEDS_DECISION

        await eventually(paused, timeout_s=10, what="the job waits for a decision")
        await handle.signal(SIGNAL_RESUME, ResumeRequest(resubmit=True))
        status, error = await outcome(handle)
    assert error is None and status.state == JobState.COMPLETED
    assert len(backend.submitted) == 3


async def test_lost_twice_with_fail_policy_fails(env: WorkflowEnvironment) -> None:
    backend = FakeBackend(Script(follow_failures=[ErrorType.PROMPT_LOST] * 2))
    async with job_worker(env.client, backend) as tq:
        status, _ = await outcome(
            await start_job(env.client, tq, request(on_ambiguous_submit="fail"))
        )
    assert status.state == JobState.FAILED
    assert status.error is not None and status.error.type == ErrorType.PROMPT_LOST


def reconnecting_forever() -> FakeBackend:
    """A job stuck re-attaching on long durable timers: time skips (a running activity would
    pause the test server's clock)."""
    return FakeBackend(Script(follow_failures=[ErrorType.CONNECTION_LOST] * 100))


SLOW_RECONNECTS = {"reconnect": {"base_delay_s": 50, "max_delay_s": 50, "horizon_s": 100_000}}


async def test_abandoned_just_after_the_deadline_without_contact(
    clean_env: WorkflowEnvironment,
) -> None:
    backend = reconnecting_forever()
    async with job_worker(clean_env.client, backend) as tq:
        handle = await start_job(
            clean_env.client, tq, request(abandon_after_s=600, **SLOW_RECONNECTS)
        )
        status, error = await outcome(handle)
        started = await timers(handle)
    assert error is None
    assert status.state == JobState.ABANDONED
    assert status.error is not None and status.error.type == ErrorType.ABANDONED
    assert status.teardown.state == "CONFIRMED"
    assert backend.teardowns[0].prompt_id == backend.submitted[0].prompt_id
    assert "offload_outputs:partial" in backend.calls
    assert status.created_at is not None and status.updated_at is not None
    elapsed = (status.updated_at - status.created_at).total_seconds()
    assert 600 <= elapsed < 630
    assert ("abandon watchdog", 600.0) in started


async def test_contact_just_before_the_deadline_keeps_the_job(
    clean_env: WorkflowEnvironment,
) -> None:
    backend = reconnecting_forever()
    async with job_worker(clean_env.client, backend) as tq:
        handle = await start_job(
            clean_env.client, tq, request(abandon_after_s=600, **SLOW_RECONNECTS)
        )
        await clean_env.sleep(590)
        await handle.signal(SIGNAL_CLIENT_SEEN)
        await clean_env.sleep(20)  # past the first deadline
        state = (await handle.query(QUERY_STATUS, result_type=JobStatus)).state
        assert state in (JobState.RUNNING, JobState.RECONNECTING)
        status, _ = await outcome(handle)
    assert status.state == JobState.ABANDONED
    assert status.created_at and status.updated_at
    assert (status.updated_at - status.created_at).total_seconds() >= 1190


async def test_detached_job_is_never_abandoned(env: WorkflowEnvironment) -> None:
    backend = FakeBackend(Script(follow_failures=[ErrorType.CONNECTION_LOST]))
    async with job_worker(env.client, backend) as tq:
        handle = await start_job(env.client, tq, request(abandon_after_s=None))
        status, error = await outcome(handle)
        started = await timers(handle)
    assert error is None and status.state == JobState.COMPLETED and status.detached
    assert not any(summary == "abandon watchdog" for summary, _ in started)


STAGES = [
    ("prepare_prompt", JobState.PREPARING, "SKIPPED"),
    ("submit", JobState.SUBMITTING, "CONFIRMED"),
    ("follow_prompt", JobState.RUNNING, "CONFIRMED"),
]


@pytest.mark.parametrize("via", ["signal", "temporal"])
@pytest.mark.parametrize(("block_in", "state", "teardown"), STAGES, ids=[s[0] for s in STAGES])
async def test_cancel_in_every_state_tears_down_and_keeps_artifacts(
    env: WorkflowEnvironment, block_in: str, state: JobState, teardown: str, via: str
) -> None:
    backend = FakeBackend(Script(block_in=block_in))
    job = request()
    if block_in == "prepare_prompt":
        # Only a request that stages input files has a prepare of its own.
        job = job.model_copy(update={"inputs": {"in.png": S3Input(uri="s3://inputs/in.png")}})
    async with job_worker(env.client, backend) as tq:
        handle = await start_job(env.client, tq, job)

        async def reached() -> bool:
            current = await handle.query(QUERY_STATUS, result_type=JobStatus)
            return current.state == state and backend.blocked.is_set()

        await eventually(reached, timeout_s=10, what="the job reached the step")
        if via == "signal":
            await handle.signal(SIGNAL_CANCEL, CancelRequest(reason="test says stop"))
        else:
            await handle.cancel()
        status, error = await outcome(handle)
    assert status.state == JobState.CANCELLED
    assert status.teardown.state == teardown
    if via == "signal":
        assert error is None
        assert status.error is not None and status.error.message == "test says stop"
    else:
        assert isinstance(error, WorkflowFailureError) and isinstance(error.cause, CancelledError)
    if teardown == "CONFIRMED":
        assert backend.teardowns[-1].prompt_id is not None
        assert backend.calls[-1] == "offload_outputs:partial", backend.calls
    if block_in == "offload_outputs":
        # The artifact streamed while running is kept in the status.
        assert [a.node_id for a in status.artifacts] == ["2"]


async def test_the_first_stop_decides_a_second_cancel_changes_nothing(
    env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend(Script(block_in="follow_prompt"))
    async with job_worker(env.client, backend) as tq:
        handle = await start_job(env.client, tq, request())

        async def following() -> bool:
            return backend.blocked.is_set()

        await eventually(following, timeout_s=10, what="the job is following")
        await handle.signal(SIGNAL_CANCEL, CancelRequest(reason="first reason"))
        await handle.signal(SIGNAL_CANCEL, CancelRequest(reason="second reason"))
        status, error = await outcome(handle)
    assert error is None and status.state == JobState.CANCELLED
    assert status.error is not None and status.error.message == "first reason"


async def test_cancel_while_reconnecting_and_while_paused(env: WorkflowEnvironment) -> None:
    for failures, state in [
        ([ErrorType.CONNECTION_LOST] * 3, JobState.RECONNECTING),
        ([ErrorType.PROMPT_LOST] * 2, JobState.NEEDS_DECISION),
    ]:
        backend = FakeBackend(Script(follow_failures=list(failures)))
        async with job_worker(env.client, backend) as tq:
            handle = await start_job(
                env.client, tq, request(reconnect={"base_delay_s": 100, "max_delay_s": 100})
            )

            async def reached(
                target: JobState = state, job: WorkflowHandle[Any, JobStatus] = handle
            ) -> bool:
                current: JobStatus = await job.query(QUERY_STATUS, result_type=JobStatus)
                return current.state == target

            await eventually(reached, timeout_s=10, what="the job reached the step")
            await handle.signal(SIGNAL_CANCEL, CancelRequest())
            status, _ = await outcome(handle)
        assert status.state == JobState.CANCELLED, state
        assert status.teardown.state == "CONFIRMED"


@pytest.mark.parametrize(
    ("script", "error_type"),
    [
        (Script(fatal_in={"follow_prompt": ErrorType.OUT_OF_MEMORY}), ErrorType.OUT_OF_MEMORY),
        (Script(fatal_in={"submit": ErrorType.PROMPT_REJECTED}), ErrorType.PROMPT_REJECTED),
        # The follow stores the outputs: a storage failure is the follow's.
        (Script(fatal_in={"follow_prompt": ErrorType.STORAGE_ERROR}), ErrorType.STORAGE_ERROR),
    ],
)
async def test_failures_compensate_before_failing(
    env: WorkflowEnvironment, script: Script, error_type: str
) -> None:
    backend = FakeBackend(script)
    async with job_worker(env.client, backend) as tq:
        status, error = await outcome(await start_job(env.client, tq, request()))
    assert status.state == JobState.FAILED and isinstance(error, WorkflowFailureError)
    assert isinstance(error.cause, ApplicationError) and error.cause.type == error_type
    assert status.teardown.state == "CONFIRMED"
    assert backend.teardowns[0].free_memory is (error_type == ErrorType.OUT_OF_MEMORY)


async def test_execution_deadline_cancels_the_work_and_compensates(
    clean_env: WorkflowEnvironment,
) -> None:
    backend = reconnecting_forever()
    async with job_worker(clean_env.client, backend) as tq:
        status, _ = await outcome(
            await start_job(
                clean_env.client,
                tq,
                request(execution_timeout_s=120, heartbeat_timeout_s=1, **SLOW_RECONNECTS),
            )
        )
    assert status.state == JobState.FAILED
    assert status.error is not None and status.error.type == ErrorType.TIMEOUT
    assert status.teardown.state == "CONFIRMED"
    assert backend.teardowns[0].reason == "after the execution deadline"


async def test_segments_continue_as_new_and_resume_at_the_next_segment(
    env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend()
    segments = [{"1": {"width": 8 * (i + 1)}} for i in range(4)]
    job = JobRequest(
        graph=GRAPH,
        segments=segments,
        policy=JobPolicy(history_budget_events=10),  # forces continue-as-new at every boundary
    )
    async with job_worker(env.client, backend) as tq:
        handle = await start_job(env.client, tq, job)
        first_run = (await handle.describe()).run_id
        status, error = await outcome(handle)
        runs = await env.client.get_workflow_handle(handle.id).describe()
    assert error is None and status.state == JobState.COMPLETED
    assert runs.run_id != first_run, "the job continued as new"
    assert [s.segment for s in backend.submitted] == [0, 1, 2, 3]
    assert [(s.graph or {})["1"]["inputs"]["width"] for s in backend.submitted] == [8, 16, 24, 32]
    assert len({s.prompt_id for s in backend.submitted}) == 4
    assert sorted(a.segment for a in status.artifacts) == [0, 1, 2, 3]
    assert backend.calls.count("prepare_prompt") == 1, "continue-as-new carries the preparation"


def test_reconnect_policy_rejects_max_below_base() -> None:
    with pytest.raises(ValueError, match="max_delay_s"):
        ReconnectPolicy(base_delay_s=5, max_delay_s=1)


async def test_cancel_while_still_queued_runs_nothing(env: WorkflowEnvironment) -> None:
    backend = FakeBackend()
    async with job_worker(env.client, backend) as tq:
        handle = await env.client.start_workflow(
            "InferenceJob",
            request(),
            id=f"queued-{uuid.uuid4()}",
            task_queue=tq,
            result_type=JobStatus,
            start_signal=SIGNAL_CANCEL,
            start_signal_args=[CancelRequest(reason="changed my mind")],
        )
        status, error = await outcome(handle)
    assert error is None and status.state == JobState.CANCELLED
    assert backend.calls == []
    assert status.teardown.state == "SKIPPED"


async def test_stop_interrupts_the_prompt_before_the_follow_activity_settles(
    env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend(Script(block_in="follow_prompt"))
    async with job_worker(env.client, backend) as tq:
        handle = await start_job(env.client, tq, request(heartbeat_timeout_s=30))
        await asyncio.wait_for(backend.blocked.wait(), 10)
        await handle.signal(SIGNAL_CANCEL, CancelRequest())
        # The follow activity hears of the cancel only on a heartbeat up to 24 s away; the
        # interrupt must not wait for it.
        await asyncio.wait_for(_first_teardown(backend), 10)
        status, _ = await outcome(handle)
    assert status.state == JobState.CANCELLED
    assert len(backend.teardowns) == 2, "an early interrupt, then the confirming teardown"


async def _first_teardown(backend: FakeBackend) -> None:
    while not backend.teardowns:  # noqa: ASYNC110
        await asyncio.sleep(0.02)


# -- a stop is confirmed, not requested ----------------------------------------------------------


@pytest.mark.parametrize("via", ["signal", "temporal"])
async def test_stop_keeps_confirming_until_the_prompt_is_gone(
    clean_env: WorkflowEnvironment, via: str
) -> None:
    # A node that ignores the interrupt for four checks: the job ends only once it is gone.
    backend = FakeBackend(Script(block_in="follow_prompt", stop_running_checks=4))
    async with job_worker(clean_env.client, backend) as tq:
        handle = await start_job(clean_env.client, tq, request())
        await eventually(
            lambda: _is_set(backend.blocked), timeout_s=10, what="the follow activity is running"
        )
        if via == "signal":
            await handle.signal(SIGNAL_CANCEL, CancelRequest(reason="stop it"))
        else:
            await handle.cancel()
        status, _ = await outcome(handle)
        started = await timers(handle)
    assert status.state == JobState.CANCELLED
    assert status.teardown.state == "CONFIRMED", status.teardown
    assert len(backend.teardowns) == 5 + 1, "four 'still running', one 'gone', one settled pass"
    assert status.teardown.checks == 6
    assert [s.action for s in status.teardown.steps] == ["interrupt_sent", "interrupted"]
    assert status.teardown.steps[-1].node == "1"
    assert status.teardown.detail.startswith("after cancel: interrupt sent, interrupted at node 1")
    checks = [seconds for summary, seconds in started if summary.startswith("stop check")]
    assert len(checks) == 4, started
    assert all(0 < seconds <= 15 for seconds in checks), checks
    assert "offload_outputs:partial" in backend.calls


async def test_stop_past_the_teardown_horizon_fails_the_teardown_naming_the_prompt(
    clean_env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend(Script(block_in="follow_prompt", stop_running_checks=-1))
    async with job_worker(clean_env.client, backend) as tq:
        handle = await start_job(clean_env.client, tq, request(teardown_horizon_s=120))
        await eventually(
            lambda: _is_set(backend.blocked), timeout_s=10, what="the follow activity is running"
        )
        await handle.signal(SIGNAL_CANCEL, CancelRequest(reason="stop it"))

        async def stopping() -> bool:
            current: JobStatus = await handle.query(QUERY_STATUS, result_type=JobStatus)
            return current.state == JobState.STOPPING and current.teardown.state == "STOPPING"

        await eventually(stopping, timeout_s=10, what="the job is STOPPING")
        status, _ = await outcome(handle)
    prompt_id = backend.submitted[0].prompt_id
    assert status.state == JobState.CANCELLED
    assert status.teardown.state == "FAILED", status.teardown
    assert prompt_id in status.teardown.detail and "'comfyui'" in status.teardown.detail
    assert status.teardown.steps[-1].action == "still_running"
    assert status.teardown.started_at is not None and status.teardown.at is not None
    spent = (status.teardown.at - status.teardown.started_at).total_seconds()
    assert 120 <= spent < 150, spent
    # The worker is told on the last check, so it can keep new work off the pool.
    finals = [t for t in backend.teardowns if getattr(t, "final", False)]
    assert finals and all(t.prompt_id == prompt_id for t in finals)


async def _is_set(event: asyncio.Event) -> bool:
    return event.is_set()


async def test_stop_checks_go_on_while_the_backend_cannot_be_reached(
    clean_env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend(Script(block_in="follow_prompt", stop_unreachable_checks=3))
    async with job_worker(clean_env.client, backend) as tq:
        handle = await start_job(clean_env.client, tq, request())
        await eventually(
            lambda: _is_set(backend.blocked), timeout_s=10, what="the follow activity is running"
        )
        await handle.signal(SIGNAL_CANCEL, CancelRequest(reason="stop it"))
        status, _ = await outcome(handle)
    assert status.state == JobState.CANCELLED
    assert status.teardown.state == "CONFIRMED", status.teardown
    assert [s.action for s in status.teardown.steps] == ["check_failed", "interrupted"]
    assert "refused" in status.teardown.steps[0].detail


async def test_a_prompt_waiting_past_queue_timeout_fails_the_job_and_is_dequeued(
    clean_env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend(Script(block_in="follow_prompt", queued_at=3))
    async with job_worker(clean_env.client, backend) as tq:
        # Short: time does not skip while the (blocked) follow activity runs.
        handle = await start_job(clean_env.client, tq, request(queue_timeout_s=3))

        async def waiting() -> bool:
            current: JobStatus = await handle.query(QUERY_STATUS, result_type=JobStatus)
            return current.state == JobState.WAITING and current.progress.queue_position == 3

        await eventually(waiting, timeout_s=10, what="the job is WAITING")
        status, error = await outcome(handle)
        started = await timers(handle)
    assert status.state == JobState.FAILED
    assert status.error is not None and status.error.type == ErrorType.QUEUE_TIMEOUT
    assert "place 3" in status.error.message and "(3 s)" in status.error.message
    assert isinstance(error, WorkflowFailureError)
    assert ("queue timeout", 3.0) in started
    assert status.teardown.state == "CONFIRMED"
