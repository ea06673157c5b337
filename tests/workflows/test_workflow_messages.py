"""No message can wedge a job: every handler, from a plain client with the default converter.

A plain `temporalio.client.Client` (or `temporal workflow signal`) sends no argument, `{}`, a
bare value, misspelt fields or huge strings. Signals must use what they can and note the rest;
updates must refuse with a reason; no workflow task may ever fail over a message.
"""

from __future__ import annotations

from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import (
    Client,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowUpdateFailedError,
)
from temporalio.converter import DataConverter
from temporalio.exceptions import CancelledError
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from faults.wait import eventually
from tests.support.workflow_fakes import (
    FakeBackend,
    Script,
    job_worker,
    request,
    start_job,
)
from workflows.contracts import JobState, JobStatus
from workflows.shared import (
    QUERY_STATUS,
    SIGNAL_CANCEL,
    SIGNAL_CANCEL_REASON,
    SIGNAL_CLIENT_SEEN,
    SIGNAL_PROGRESS,
    SIGNAL_RESUME,
    UPDATE_ATTACH,
    UPDATE_RESUME,
    ErrorType,
)


def plain(env: WorkflowEnvironment) -> Client:
    """What a user's own script has: the default data converter, no pydantic models."""
    config = env.client.config()
    config["data_converter"] = DataConverter.default
    return Client(**config)


async def status_of(handle: WorkflowHandle[Any, Any]) -> JobStatus:
    return JobStatus.model_validate(await handle.query(QUERY_STATUS))


async def workflow_task_failures(handle: WorkflowHandle[Any, Any]) -> int:
    failed = EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
    events = [event async for event in handle.fetch_history_events()]
    return sum(1 for event in events if event.event_type == failed)


async def running_job(env: WorkflowEnvironment, backend: FakeBackend, tq: str) -> str:
    handle = await start_job(env.client, tq, request())
    await eventually(
        lambda: _true(backend.blocked.is_set()), timeout_s=10, what="the follow activity is running"
    )
    return handle.id


async def _true(value: bool) -> bool:
    return value


MALFORMED_SIGNALS: list[tuple[str, tuple[Any, ...]]] = [
    (SIGNAL_CLIENT_SEEN, ()),
    (SIGNAL_CLIENT_SEEN, ({},)),
    (SIGNAL_CLIENT_SEEN, ({"unexpected": True},)),
    (SIGNAL_RESUME, ()),  # not NEEDS_DECISION: ignored and noted
    (SIGNAL_RESUME, ({"resubmit": "perhaps"},)),
    (SIGNAL_RESUME, (17,)),
    (SIGNAL_PROGRESS, ()),
    (SIGNAL_PROGRESS, ({"step": "many"},)),
    (SIGNAL_CANCEL_REASON, ({"why": "no reason field"},)),
]


async def test_malformed_signals_and_queries_never_fail_a_workflow_task(
    env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend(Script(block_in="follow_prompt"))
    client = plain(env)
    async with job_worker(env.client, backend) as tq:
        handle = client.get_workflow_handle(await running_job(env, backend, tq))
        for name, args in MALFORMED_SIGNALS:
            await handle.signal(name, *args)
        # Queries too: an argument the query does not take is ignored.
        assert (JobStatus.model_validate(await handle.query(QUERY_STATUS, 42))).job_id == handle.id
        status = await status_of(handle)
        assert status.state == JobState.RUNNING, status
        notes = [n.message for n in status.notices]
        assert any("resume: ignored, the job is RUNNING" in n for n in notes), notes
        assert any("resubmit='perhaps'" in n for n in notes), notes
        assert any("progress: ignored a malformed report" in n for n in notes), notes
        assert any("unknown field 'why'" in n for n in notes), notes
        # A bare signal with no argument at all: the job is torn down and CANCELLED.
        await handle.signal(SIGNAL_CANCEL)
        await handle.result()  # ended by the job itself: Completed, with JobState CANCELLED
        final = await status_of(handle)
        assert await workflow_task_failures(handle) == 0
    assert final.state == JobState.CANCELLED
    assert final.teardown.state == "CONFIRMED"
    assert final.error is not None and final.error.message == "cancelled by a client"


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ({}, "cancelled by a client"),
        ("wrong seed", "wrong seed"),  # a bare string is the reason
        ({"reason": "r" * 5000}, "r" * 500),  # cut to the limit, not dropped
        ({"why": "typo", "reason": "kept"}, "kept"),
        ({"reason": 12}, "cancelled by a client"),
    ],
)
async def test_cancel_signal_takes_what_a_plain_client_sends(
    env: WorkflowEnvironment, payload: Any, reason: str
) -> None:
    backend = FakeBackend(Script(block_in="follow_prompt"))
    client = plain(env)
    async with job_worker(env.client, backend) as tq:
        handle = client.get_workflow_handle(await running_job(env, backend, tq))
        await handle.signal(SIGNAL_CANCEL, payload)
        await handle.result()
        final = await status_of(handle)
        assert await workflow_task_failures(handle) == 0
    assert final.state == JobState.CANCELLED
    assert final.error is not None and final.error.message == reason
    if payload not in ({}, "wrong seed"):
        assert final.notices, "what was dropped or cut is noted"


async def test_updates_refuse_bad_payloads_with_a_reason_and_the_job_goes_on(
    env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend(Script(block_in="follow_prompt"))
    client = plain(env)
    async with job_worker(env.client, backend) as tq:
        handle = client.get_workflow_handle(await running_job(env, backend, tq))
        attached = JobStatus.model_validate(await handle.execute_update(UPDATE_ATTACH))
        assert attached.state == JobState.RUNNING
        assert JobStatus.model_validate(await handle.execute_update(UPDATE_ATTACH, {})).job_id
        refusals = [
            (UPDATE_ATTACH, {"force": True}, "attach takes no argument"),
            (UPDATE_RESUME, None, "the job is RUNNING"),
            (UPDATE_RESUME, {"resubmit": True}, "resume only continues a job that waits"),
            (UPDATE_RESUME, {"resubmt": True}, "unknown field(s) 'resubmt'"),
            (UPDATE_RESUME, "yes", "resume takes an object"),
        ]
        for name, payload, expected in refusals:
            args = () if payload is None else (payload,)
            with pytest.raises((WorkflowUpdateFailedError, RPCError)) as refused:
                await handle.execute_update(name, *args)
            assert expected in _message(refused.value), (name, payload, _message(refused.value))
        assert (await status_of(handle)).state == JobState.RUNNING
        assert await workflow_task_failures(handle) == 0
        await handle.signal(SIGNAL_CANCEL)


def _message(error: BaseException) -> str:
    parts = [str(error)]
    cause = error.__cause__ or getattr(error, "cause", None)
    while cause is not None:
        parts.append(str(cause))
        cause = getattr(cause, "cause", None) or cause.__cause__
    return " | ".join(parts)


async def test_needs_decision_says_why_and_resume_explains_itself(
    env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend(Script(follow_failures=[ErrorType.PROMPT_LOST] * 2))
    client = plain(env)
    async with job_worker(env.client, backend) as tq:
        job_id = (await start_job(env.client, tq, request())).id
        handle = client.get_workflow_handle(job_id)

        async def paused() -> bool:
            return (await status_of(handle)).state == JobState.NEEDS_DECISION

        await eventually(paused, timeout_s=10, what="the job waits for a decision")
        status = await status_of(handle)
        assert status.decision is not None
        assert "lost prompt" in status.decision.reason
        assert set(status.decision.options) == {"resume --resubmit", "cancel"}
        assert "from the start" in status.decision.options["resume --resubmit"]
        # A plain resume cannot re-attach to a prompt the backend lost: it says so.
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(UPDATE_RESUME, {})
        assert "cannot re-attach" in _message(refused.value)
        assert "resubmit=true" in _message(refused.value)
        resumed = JobStatus.model_validate(
            await handle.execute_update(UPDATE_RESUME, {"resubmit": True})
        )
        assert resumed.state != JobState.NEEDS_DECISION
        await handle.result()
        final = await status_of(handle)
    assert final.state == JobState.COMPLETED
    assert len(backend.submitted) == 3


async def test_cancel_reason_then_temporal_cancel_ends_canceled_with_that_reason(
    env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend(Script(block_in="follow_prompt"))
    async with job_worker(env.client, backend) as tq:
        handle = env.client.get_workflow_handle(await running_job(env, backend, tq))
        await handle.signal(SIGNAL_CANCEL_REASON, {"reason": "wrong prompt"})
        await handle.cancel()
        with pytest.raises(WorkflowFailureError) as ended:
            await handle.result()
        final = await status_of(handle)
    assert isinstance(ended.value.cause, CancelledError), "Temporal shows the job as Canceled"
    assert final.state == JobState.CANCELLED
    assert final.error is not None and final.error.message == "wrong prompt"
    assert final.teardown.state == "CONFIRMED"


async def test_current_details_follow_progress(
    env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend(Script(block_in="follow_prompt"))
    async with job_worker(env.client, backend) as tq:
        handle = env.client.get_workflow_handle(await running_job(env, backend, tq))
        status = await status_of(handle)
        assert status.checkpoint is not None
        report = {"attempt_client_id": status.checkpoint.client_id, "step": 4, "total_steps": 10}
        await handle.signal(SIGNAL_PROGRESS, report)

        async def shows_progress() -> bool:
            return "4/10 nodes" in await current_details(handle)

        await eventually(shows_progress, timeout_s=10, what="the status shows progress")
        details = await current_details(handle)
        assert details.startswith("**RUNNING** — 40 %"), details
        assert "pool `comfyui`" in details
        await handle.signal(SIGNAL_CANCEL)
        # The job's own result: no query of a closed workflow (that replays it on the test
        # server; see the stop-5 note on a nondeterminism error seen once there).
        final = JobStatus.model_validate(await handle.result())
    assert final.state == JobState.CANCELLED and final.teardown.state == "CONFIRMED"


async def current_details(handle: WorkflowHandle[Any, Any]) -> str:
    metadata = await handle.query("__temporal_workflow_metadata")
    return str(metadata.current_details)
