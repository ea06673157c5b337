"""Every activity the workflow runs, with its timeouts and retries stated in one place."""

from __future__ import annotations

from datetime import timedelta

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


async def prepare(req: PrepareInput) -> PreparedJob:
    """Stage the request's input files (downloads and uploads of up to 100 MB) and check it,
    with retries; the job is seen PREPARING meanwhile. A request that stages nothing is not
    prepared: its first follow checks it (`FollowInput.prepare`)."""
    result: PreparedJob = await workflow.execute_activity(
        ACTIVITY_PREPARE,
        req,
        result_type=PreparedJob,
        start_to_close_timeout=timedelta(minutes=2),
        retry_policy=QUICK_RETRY,
        summary="prepare",
    )
    return result


async def follow(req: FollowInput, policy: JobPolicy) -> FollowResult:
    result: FollowResult = await workflow.execute_activity(
        ACTIVITY_FOLLOW,
        req,
        result_type=FollowResult,
        start_to_close_timeout=timedelta(seconds=policy.execution_timeout_s),
        heartbeat_timeout=timedelta(seconds=policy.heartbeat_timeout_s),
        retry_policy=ONE_ATTEMPT,
        # Teardown must see the real end state, not a cancel still on its way to the worker.
        cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        summary=f"follow segment {req.segment}",
    )
    return result


async def offload(req: OffloadInput) -> OffloadResult:
    result: OffloadResult = await workflow.execute_activity(
        ACTIVITY_OFFLOAD,
        req,
        result_type=OffloadResult,
        start_to_close_timeout=timedelta(minutes=30),
        heartbeat_timeout=timedelta(minutes=2),
        retry_policy=QUICK_RETRY,
        summary=f"offload segment {req.segment}" + (" (partial)" if req.partial else ""),
    )
    return result


async def stop(req: StopInput) -> StopCheck:
    # One check per call: the workflow repeats it on durable timers until the prompt is gone.
    result: StopCheck = await workflow.execute_activity(
        ACTIVITY_STOP,
        req,
        result_type=StopCheck,
        start_to_close_timeout=timedelta(seconds=30),
        retry_policy=ONE_ATTEMPT,
        summary=f"stop prompt ({req.reason})" + (" (last check)" if req.final else ""),
    )
    return result


async def deliver_webhook(req: WebhookDeliveryInput) -> WebhookAttempt:
    # One attempt per call: the workflow schedules retries itself, jittered (workflows/webhooks.py).
    result: WebhookAttempt = await workflow.execute_activity(
        ACTIVITY_DELIVER_WEBHOOK,
        req,
        result_type=WebhookAttempt,
        start_to_close_timeout=timedelta(seconds=30),
        retry_policy=ONE_ATTEMPT,
        summary=f"webhook {req.event} (seq {req.entry.seq}, attempt {req.attempt})",
    )
    return result
