"""`JobBatch`: one batch of ordinary jobs, and the one place their ends are counted.

The client starts the batch's workflow with its jobs' IDs and, for a batch whose jobs differ
only in input values (by `count`, by `overrides`, or such `requests`), the jobs in short
(`BatchJobs`): the workflow then starts them itself (`start_batch_jobs`, an activity that
heartbeats how far it got, so a worker lost half-way is resumed where it stopped), and the
client's submission ends once the batch is recorded. Otherwise the client starts the jobs
(each carries the `batch` label), then says `submitted`. Each job tells the batch its end once
it is terminal (`job_ended`, workflows/batches.py `tell_batch`): state, error, cost, artifacts.
So the batch's status is one query, however many jobs it has. A job that ends without telling
(terminated from outside) or never started is found by the batch's own look (`ended_batch_jobs`,
a minute after its start, then less often while it finds nothing; one list call of Temporal's
visibility store, not a call per job).

`cancel` (an update) tells every unfinished job to stop, by the job's own `cancel` signal: each
stops as one cancelled job does, confirmed, its finished outputs kept. The batch ends when every
job has ended, `COMPLETED` or `CANCELLED`, and then fires its webhook once, with its summary,
retried on durable timers as a job's events are (workflows/webhooks.py's delay).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from datetime import timedelta
from typing import Any, Final

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from workflows import activity_calls as calls
    from workflows import shared
    from workflows.activity_io import WebhookAttempt, WebhookDeliveryInput
    from workflows.batches import (
        BatchCancel,
        BatchCost,
        BatchInput,
        BatchJob,
        BatchJobEnd,
        BatchJobs,
        BatchResults,
        BatchState,
        BatchStatus,
    )
    from workflows.contracts import JobError
    from workflows.failures import job_error
    from workflows.webhooks import retry_delay, webhook_id

# How often the batch looks for its jobs that ended without telling it (or never started): a
# minute after its start, then twice as long after each look that found nothing, to a half
# hour (a batch that waits for days does not fill its history with looks).
LOOK_EVERY_S: Final = 60.0
LOOK_AT_MOST_EVERY_S: Final = 1800.0
# A job not started this long after the batch was, with the client silent, never will be: the
# look records it as ended (FAILED, "never started") so the batch can end.
START_GRACE_S: Final = 600.0

_LOOK_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30)
)
# Starting the jobs: a lost worker (or a cancel, heard on a heartbeat) is noticed within 20 s,
# and the next attempt goes on from the last start heartbeated; tried until every job is started
# (or the batch cancelled).
START_HEARTBEAT_S: Final = 20.0
START_TIMEOUT_S: Final = 3600.0


@workflow.defn(name=shared.BATCH_WORKFLOW_TYPE)
class JobBatch:
    @workflow.init
    def __init__(self, batch: BatchInput) -> None:
        self._input = batch
        self._ids = set(batch.job_ids)
        self._ends: dict[str, BatchJobEnd] = {}
        # What `status` shows, kept as each end is heard: a query of a batch of 1,000 builds
        # nothing per job (a worker busy with the batch's jobs still answers it at once).
        self._jobs = {job_id: BatchJob.model_construct(job_id=job_id) for job_id in batch.job_ids}
        self._counts: Counter[str] = Counter()
        self._gpu_s = 0.0
        self._usd: float | None = None
        self._artifacts = 0
        self._cancel: BatchCancel | None = None
        self._submitted = False
        self._state = BatchState.RUNNING
        self._webhook: str | None = None
        self._seq = 0
        self._ended_at: Any = None

    @workflow.run
    async def run(self, batch: BatchInput) -> BatchStatus:
        starting = None
        if batch.jobs is not None:
            starting = asyncio.create_task(self._start_jobs(batch.jobs))
        look = asyncio.create_task(self._look_for_unheard())
        await workflow.wait_condition(lambda: self._all_ended or self._cancel is not None)
        if not self._all_ended:
            self._changed(BatchState.CANCELLING)
            if starting is not None and not starting.done():
                # Its starts stop first (the activity returns once none is in flight): a job
                # started after the cancel's look would be missed by it and run on.
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError, ActivityError):
                    await starting
            await self._cancel_jobs()
            await workflow.wait_condition(lambda: self._all_ended)
        look.cancel()
        self._ended_at = workflow.now()
        self._changed(BatchState.CANCELLED if self._cancel else BatchState.COMPLETED)
        if batch.webhook is not None:
            self._webhook = await self._deliver_webhook()
            self._changed(self._state)
        await workflow.wait_condition(workflow.all_handlers_finished)
        return self.status()

    @property
    def _all_ended(self) -> bool:
        return len(self._ends) >= len(self._ids)

    def _changed(self, state: BatchState) -> None:
        self._state = state
        self._seq += 1

    def _heard(self, end: BatchJobEnd) -> None:
        if end.job_id not in self._ids or end.job_id in self._ends:
            return  # not ours, or heard already (a look and the job's own word may cross)
        self._ends[end.job_id] = end
        self._jobs[end.job_id] = BatchJob.model_construct(
            job_id=end.job_id, state=end.state, error=end.error, artifacts=len(end.artifacts)
        )
        self._counts[str(end.state)] += 1
        self._gpu_s += end.gpu_s
        if end.usd is not None:
            self._usd = (self._usd or 0.0) + end.usd
        self._artifacts += len(end.artifacts)
        self._seq += 1

    # -- what it does -------------------------------------------------------------------------

    async def _start_jobs(self, jobs: BatchJobs) -> None:
        """Every job started (those that exist already are left as they are); then the batch
        knows that a job still missing never will start."""
        total = len(self._input.job_ids)
        await workflow.execute_activity(
            shared.ACTIVITY_START_BATCH_JOBS,
            args=[self._input.batch_id, jobs],
            result_type=int,
            start_to_close_timeout=timedelta(seconds=START_TIMEOUT_S),
            heartbeat_timeout=timedelta(seconds=START_HEARTBEAT_S),
            retry_policy=_LOOK_RETRY,
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            summary=f"start {total} jobs",
        )
        self._submitted = True
        self._seq += 1

    async def _cancel_jobs(self) -> None:
        """Every unfinished job told to stop; those that never started end here, cancelled."""
        assert self._cancel is not None
        open_ids = [job_id for job_id in self._input.job_ids if job_id not in self._ends]
        never_started: list[str] = await workflow.execute_activity(
            shared.ACTIVITY_CANCEL_BATCH_JOBS,
            args=[open_ids, self._cancel.reason],
            result_type=list[str],
            start_to_close_timeout=timedelta(minutes=5),
            retry_policy=_LOOK_RETRY,
            summary=f"cancel {len(open_ids)} jobs",
        )
        for job_id in never_started:
            self._heard(
                BatchJobEnd(
                    job_id=job_id,
                    state="CANCELLED",
                    ended_at=workflow.now(),
                    source="found",
                    error=JobError(type=shared.ErrorType.CANCELLED, message=self._cancel.reason),
                )
            )

    async def _look_for_unheard(self) -> None:
        """Jobs that ended without a word (or never started), found by a look now and then."""
        interval = LOOK_EVERY_S
        while True:
            await workflow.sleep(interval, summary="look for jobs ended unheard")
            unheard = [job_id for job_id in self._input.job_ids if job_id not in self._ends]
            created = self._input.created_at or workflow.info().start_time
            started_all = self._submitted or (
                (workflow.now() - created).total_seconds() > START_GRACE_S
            )
            try:
                found: list[BatchJobEnd] = await workflow.execute_activity(
                    shared.ACTIVITY_ENDED_BATCH_JOBS,
                    args=[self._input.batch_id, unheard, started_all],
                    result_type=list[BatchJobEnd],
                    start_to_close_timeout=timedelta(minutes=2),
                    retry_policy=_LOOK_RETRY,
                    summary=f"look at {len(unheard)} unfinished jobs",
                )
            except ActivityError:
                continue  # the next look tries again
            for end in found:
                self._heard(end)
            interval = LOOK_EVERY_S if found else min(interval * 2, LOOK_AT_MOST_EVERY_S)

    async def _deliver_webhook(self) -> str:
        """The batch's end, POSTed once (retried until delivered or given up)."""
        spec = self._input.webhook
        assert spec is not None
        summary = self.status().model_dump(mode="json", exclude={"jobs", "webhook", "seq"})
        event = "cancelled" if self._state == BatchState.CANCELLED else "completed"
        wid = webhook_id(self._input.batch_id, workflow.info().first_execution_run_id, (0, 0))
        deadline = workflow.now() + timedelta(seconds=spec.retry_horizon_s)
        attempt_no = 0
        while True:
            attempt_no += 1
            request = WebhookDeliveryInput(
                job_id=self._input.batch_id,
                tenant=self._input.tenant,
                url=spec.url,
                webhook_id=wid,
                event=event,
                attempt=attempt_no,
                batch=summary,
            )
            try:
                attempt = await calls.deliver_webhook(request)
            except ActivityError as err:
                message = job_error(err).message
                attempt = WebhookAttempt(outcome="retry", error=message, at=workflow.now())
            if attempt.outcome == "delivered":
                return "delivered"
            if attempt.outcome != "retry" or workflow.now() >= deadline:
                return f"failed: {attempt.error or attempt.status_code or attempt.outcome}"
            delay = retry_delay(attempt_no - 1, spec.retry_horizon_s, workflow.random().random())
            remaining = (deadline - workflow.now()).total_seconds()
            await workflow.sleep(
                max(0.001, min(delay, remaining)), summary=f"webhook retry {attempt_no}"
            )

    # -- what it says -------------------------------------------------------------------------

    def status(self) -> BatchStatus:
        total, ended = len(self._ids), len(self._ends)
        # Built without validation: every part was made by this workflow from read models.
        return BatchStatus.model_construct(
            batch_id=self._input.batch_id,
            state=self._state,
            tenant=self._input.tenant,
            total=total,
            ended=ended,
            counts=dict(self._counts),
            progress=round(ended / total, 4) if total else 1.0,
            cost=BatchCost(
                gpu_s=round(self._gpu_s, 3),
                usd=round(self._usd, 6) if self._usd is not None else None,
            ),
            artifacts=self._artifacts,
            jobs=list(self._jobs.values()),
            cancel_reason=self._cancel.reason if self._cancel else None,
            webhook=self._webhook,
            created_at=self._input.created_at or workflow.info().start_time,
            ended_at=self._ended_at,
            seq=self._seq,
        )

    # -- messages -------------------------------------------------------------------------------

    @workflow.query(name=shared.QUERY_BATCH_STATUS)
    def status_query(self, _ignored: Any = None) -> BatchStatus:
        return self.status()

    @workflow.query(name=shared.QUERY_BATCH_RESULTS)
    def results(self, _ignored: Any = None) -> BatchResults:
        ends = [self._ends[job_id] for job_id in self._input.job_ids if job_id in self._ends]
        return BatchResults(batch_id=self._input.batch_id, state=self._state, ends=ends)

    @workflow.signal(name=shared.SIGNAL_BATCH_JOB_ENDED)
    def job_ended(self, payload: Any = None) -> None:
        try:
            end = BatchJobEnd.model_validate(payload)
        except ValueError:
            workflow.logger.warning("batch_end_unreadable")
            return
        self._heard(end)

    @workflow.signal(name=shared.SIGNAL_BATCH_SUBMITTED)
    def submitted(self, _ignored: Any = None) -> None:
        self._submitted = True

    @workflow.update(name=shared.UPDATE_BATCH_CANCEL)
    def cancel(self, payload: Any = None) -> BatchStatus:
        """Stop every unfinished job (a batch that has ended, or is cancelling, stays as it
        is); answers at once: `status`/`watch` follow the stops."""
        if self._cancel is None and not self._state.terminal:
            self._cancel = BatchCancel.model_validate(payload or {})
            self._seq += 1
        return self.status()

    @cancel.validator
    def _validate_cancel(self, payload: Any = None) -> None:
        BatchCancel.model_validate(payload or {})
