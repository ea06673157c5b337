"""A submission whose answer was lost on a backend that cannot tell whether it took it (a RunPod
pool without claims): `on_ambiguous_submit` decides, and `pause` asks a person first."""

from __future__ import annotations

from typing import Any

import pytest
from temporalio.client import WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from faults.wait import eventually
from tests.support.workflow_fakes import FakeBackend, Script, job_worker, request, start_job
from workflows.contracts import JobState, JobStatus
from workflows.shared import QUERY_STATUS, SIGNAL_RESUME, UPDATE_RESUME, ErrorType


def ambiguous_once() -> FakeBackend:
    return FakeBackend(Script(follow_failures=[ErrorType.SUBMISSION_AMBIGUOUS]))


def submissions(backend: FakeBackend) -> int:
    """Follow attempts that carried the graph (submitted it), all of one prompt."""
    submitting = [f for f in backend.followed if f.graph is not None]
    assert len({f.prompt_id for f in submitting}) == 1
    return len(submitting)


async def test_pause_asks_and_only_a_resubmit_continues(env: WorkflowEnvironment) -> None:
    backend = ambiguous_once()
    async with job_worker(env.client, backend) as tq:
        handle = await start_job(env.client, tq, request())

        async def status() -> JobStatus:
            return JobStatus.model_validate(await handle.query(QUERY_STATUS))

        async def paused() -> bool:
            return (await status()).state == JobState.NEEDS_DECISION

        await eventually(paused, timeout_s=10, what="the job waits for a decision")
        decision = (await status()).decision
        assert decision is not None and not decision.reattach_possible
        assert "may or may not have prompt" in decision.reason
        assert "run it twice" in decision.reason
        assert "paid for twice" in decision.options["resume --resubmit"]
        # Nothing to re-attach to: a plain resume is refused (update) or noted (signal).
        with pytest.raises(WorkflowUpdateFailedError):
            await handle.execute_update(UPDATE_RESUME, {})
        await handle.signal(SIGNAL_RESUME, {"resubmit": False})

        async def noted() -> bool:
            return any("resubmit=true" in n.message for n in (await status()).notices)

        await eventually(noted, timeout_s=10, what="the plain resume is noted")
        assert (await status()).state == JobState.NEEDS_DECISION
        await handle.execute_update(UPDATE_RESUME, {"resubmit": True})
        final = await handle.result()
    assert final.state == JobState.COMPLETED
    assert submissions(backend) == 2, "the same prompt, submitted again"


async def test_resubmit_submits_again_without_asking(env: WorkflowEnvironment) -> None:
    backend = ambiguous_once()
    async with job_worker(env.client, backend) as tq:
        handle = await start_job(env.client, tq, request(on_ambiguous_submit="resubmit"))
        final = await handle.result()
    assert final.state == JobState.COMPLETED and final.decision is None
    assert submissions(backend) == 2


async def test_fail_ends_the_job_with_the_reason(env: WorkflowEnvironment) -> None:
    backend = ambiguous_once()
    async with job_worker(env.client, backend) as tq:
        handle = await start_job(env.client, tq, request(on_ambiguous_submit="fail"))
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
    cause: Any = failed.value.cause
    assert isinstance(cause, ApplicationError)
    assert cause.type == ErrorType.SUBMISSION_AMBIGUOUS
    assert "on_ambiguous_submit is 'fail'" in cause.message
    assert submissions(backend) == 1
