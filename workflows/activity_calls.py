"""Every activity the workflow runs, with its timeouts and retries stated in one place."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from workflows.activity_io import (
        FollowInput,
        FollowResult,
        OffloadInput,
        OffloadResult,
        PreparedJob,
        PrepareInput,
        StopCheck,
        StopInput,
        WebhookAttempt,
        WebhookDeliveryInput,
    )
    from workflows.contracts import JobPolicy
    from workflows.shared import (
        ACTIVITY_DELIVER_WEBHOOK,
        ACTIVITY_FOLLOW,
        ACTIVITY_OFFLOAD,
        ACTIVITY_PREPARE,
        ACTIVITY_STOP,
    )

QUICK_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=10,
)
# The workflow owns reconnects (durable, jittered, bounded by the horizon): one attempt each.
ONE_ATTEMPT = RetryPolicy(maximum_attempts=1)

R = TypeVar("R")


@dataclass(frozen=True)
class _Activity(Generic[R]):
    """One activity's name, result and options; `run` schedules it with a summary the Temporal UI
    shows, and the timeouts a caller decides at run time (the follow's come from the job)."""

    name: str
    result_type: type[R]
    retry: RetryPolicy
    timeout: timedelta | None = None
    heartbeat: timedelta | None = None
    cancellation: workflow.ActivityCancellationType = workflow.ActivityCancellationType.TRY_CANCEL

    async def run(
        self,
        arg: Any,
        summary: str,
        *,
        start_to_close: timedelta | None = None,
        heartbeat: timedelta | None = None,
    ) -> R:
        result: R = await workflow.execute_activity(
            self.name,
            arg,
            result_type=self.result_type,
            start_to_close_timeout=start_to_close or self.timeout,
            heartbeat_timeout=heartbeat or self.heartbeat,
            retry_policy=self.retry,
            cancellation_type=self.cancellation,
            summary=summary,
        )
        return result


_PREPARE = _Activity(ACTIVITY_PREPARE, PreparedJob, QUICK_RETRY, timeout=timedelta(minutes=2))
# Teardown must see the follow's real end state, not a cancel still on its way to the worker.
_FOLLOW = _Activity(
    ACTIVITY_FOLLOW,
    FollowResult,
    ONE_ATTEMPT,
    cancellation=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
)
# A worker that dies mid-upload is noticed long before the upload's own time limit.
_OFFLOAD = _Activity(
    ACTIVITY_OFFLOAD,
    OffloadResult,
    QUICK_RETRY,
    timeout=timedelta(minutes=30),
    heartbeat=timedelta(minutes=2),
)
_STOP = _Activity(ACTIVITY_STOP, StopCheck, ONE_ATTEMPT, timeout=timedelta(seconds=30))
_DELIVER_WEBHOOK = _Activity(
    ACTIVITY_DELIVER_WEBHOOK, WebhookAttempt, ONE_ATTEMPT, timeout=timedelta(seconds=30)
)


async def prepare(req: PrepareInput) -> PreparedJob:
    """Stage the request's input files (downloads and uploads of up to 100 MB) and check it,
    with retries; the job is seen PREPARING meanwhile. A request that stages nothing is not
    prepared: its first follow checks it (`FollowInput.prepare`)."""
    return await _PREPARE.run(req, "prepare")


async def follow(req: FollowInput, policy: JobPolicy) -> FollowResult:
    # Once, as long as the job may run: a dead worker is noticed after the job's heartbeat timeout.
    return await _FOLLOW.run(
        req,
        f"follow segment {req.segment}",
        # A check may wait in line first (`slot_wait_s`): its run keeps the whole timeout.
        start_to_close=timedelta(seconds=policy.execution_timeout_s + req.slot_wait_s),
        heartbeat=timedelta(seconds=policy.heartbeat_timeout_s),
    )


async def offload(req: OffloadInput) -> OffloadResult:
    partial = " (partial)" if req.partial else ""
    return await _OFFLOAD.run(req, f"offload segment {req.segment}{partial}")


async def stop(req: StopInput) -> StopCheck:
    # One check per call: the workflow repeats it on durable timers until the prompt is gone.
    last = " (last check)" if req.final else ""
    return await _STOP.run(req, f"stop prompt ({req.reason}){last}")


async def deliver_webhook(req: WebhookDeliveryInput) -> WebhookAttempt:
    # One attempt per call: the workflow schedules retries itself, jittered (workflows/webhooks.py).
    what = f"seq {req.entry.seq}" if req.entry is not None else "batch"
    summary = f"webhook {req.event} ({what}, attempt {req.attempt})"
    return await _DELIVER_WEBHOOK.run(req, summary)
