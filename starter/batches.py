"""Batches on the client's side: starting one (its workflow, then its jobs), reading it, cancelling
it, collecting its results. `JobClient.submit_batch` and its neighbours call these.

Every job of a batch is checked before anything starts (its overrides, its size, the room its
pool's queue has for all of them at once): a bad batch starts nothing. Then the batch's workflow
starts with the jobs' IDs (`<batch>-0001`, ...). Jobs that differ only in input values (a batch
by `count` or `overrides`, or such `requests`) go with it in short (`BatchJobs`: one request and
each job's differing inputs), and the batch's workflow starts them, each an ordinary job with the
`batch` label: the submission ends once the batch is recorded, a fraction of a second however
many jobs it has. Other batches' jobs are started by this client, several at once, and then it
says `submitted`. Submitting the same batch again under its ID starts only what is missing (the
client stopped half-way) and changes nothing else.

The batch's status is one query of its workflow (the ended jobs: how, what they cost and made)
and, while jobs still run, one list call of Temporal's visibility store for their states now
(the `JobState` and `JobProgress` search attributes every job keeps).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

import structlog
from pydantic import BaseModel, ConfigDict
from temporalio.client import (
    Client,
    RPCTimeoutOrCancelledError,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowQueryRejectedError,
    WorkflowUpdateFailedError,
)
from temporalio.common import (
    QueryRejectCondition,
    SearchAttributeKey,
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from starter import errors
from starter.budgets import BudgetCheck, budget_exceeded
from starter.queues import queue_room
from starter.requests import check_segment_overrides, request_sha256
from starter.staging import stage_inputs
from workflows.batches import (
    BATCH_ID_PATTERN,
    MAX_BATCH_JOBS,
    BatchCancel,
    BatchInput,
    BatchJob,
    BatchJobs,
    BatchRequest,
    BatchResults,
    BatchStatus,
    batch_job_id,
    compact_jobs,
)
from workflows.contracts import JobRequest, JobState, JobStatus
from workflows.errors import GraphFormatError
from workflows.shared import (
    BATCH_LABEL,
    BATCH_WORKFLOW_TYPE,
    DEFAULT_TENANT,
    PROGRESS_KEY,
    QUERY_BATCH_RESULTS,
    QUERY_BATCH_STATUS,
    SA_JOB_STATE,
    SA_TENANT,
    SIGNAL_BATCH_SUBMITTED,
    STATE_KEY,
    TENANT_LABEL,
    UPDATE_BATCH_CANCEL,
)

if TYPE_CHECKING:
    from activities.storage import ArtifactStore

log = structlog.get_logger(__name__)

# Jobs started at once: enough to keep the server busy, few enough not to crowd out the jobs
# already running (measured by `make bench BENCH=batch`).
STARTS_AT_ONCE: Final = 32
# The most a batch's jobs in short may take in its workflow's input (its history holds them
# twice: the input, and the start activity's): a quarter of Temporal's warning size per event.
# A batch whose jobs take more is started by the client.
MAX_BATCH_JOBS_BYTES: Final = 128 * 1024
MEMO_BATCH_SHA256: Final = "batch_sha256"
# A batch whose workflow starts its jobs: how many it holds (a reader asking for one of them
# before it is started hears QUEUED, not "no such job").
MEMO_BATCH_STARTS: Final = "batch_starts"
# A batch's job's ID: the batch's, and its number (`batch_job_id`).
_BATCH_JOB_ID: Final = re.compile(r"^(?P<batch>.+)-(?P<number>\d{4})$")
# While a reader waits for a batch's job to be started by its batch.
_START_POLL_S: Final = 0.5
_TENANT_KEY: Final = SearchAttributeKey.for_keyword(SA_TENANT)
# What a job that has not ended may show (its `JobState` search attribute).
LIVE_STATES: Final = tuple(state for state in JobState if not state.terminal)


class BatchSubmitted(BaseModel):
    """What `JobClient.submit_batch` did."""

    model_config = ConfigDict(extra="forbid")

    batch_id: str
    # True: a batch with this ID and these jobs existed; only jobs missing from it were started.
    existed: bool
    job_ids: list[str]
    # Jobs this call started (all of them for a new batch).
    started: int
    status: BatchStatus


def checked_batch_id(batch_id: str) -> str:
    if not re.match(BATCH_ID_PATTERN, batch_id):
        raise errors.InvalidJobId(
            f"batch id {batch_id!r} is not valid: use 1-190 characters from A-Z a-z 0-9 _ . : -"
        )
    return batch_id


def batch_requests(batch: BatchRequest | Sequence[JobRequest]) -> tuple[list[JobRequest], Any]:
    """The jobs' requests, and the batch's webhook."""
    if isinstance(batch, BatchRequest):
        if batch.request is not None and batch.overrides is not None:
            # As a segment's: an input the node lacks would be ignored by ComfyUI, silently.
            try:
                check_segment_overrides(batch.request.graph, batch.overrides, what="override")
            except errors.InvalidOverride as exc:
                raise errors.InvalidBatch(f"the batch's overrides: {exc}") from None
        try:
            return batch.expanded(), batch.webhook
        except GraphFormatError as exc:
            raise errors.InvalidBatch(
                f"the batch's overrides do not fit its graph: {exc}"
            ) from None
    requests = list(batch)
    if not requests:
        raise errors.InvalidBatch("the batch has no jobs: send at least one request")
    if len(requests) > MAX_BATCH_JOBS:
        raise errors.InvalidBatch(
            f"the batch has {len(requests):,} jobs; a batch holds at most {MAX_BATCH_JOBS:,}: "
            "send several batches"
        )
    return requests, None


def _tenant_of(requests: Sequence[JobRequest]) -> str:
    tenants = {request.labels.get(TENANT_LABEL) or DEFAULT_TENANT for request in requests}
    if len(tenants) > 1:
        raise errors.InvalidBatch(
            f"a batch belongs to one tenant, and its requests name {len(tenants)} "
            f"({', '.join(sorted(tenants)[:5])}): send one batch per tenant"
        )
    return tenants.pop()


def _detached(request: JobRequest) -> JobRequest:
    """As a detached job runs: never abandoned for want of a client."""
    policy = request.policy.model_copy(update={"abandon_after_s": None})
    return request.model_copy(update={"policy": policy})


def _fingerprint(fingerprints: Sequence[str], webhook: Any) -> str:
    shown = webhook.model_dump(mode="json") if webhook is not None else None
    canonical = json.dumps([list(fingerprints), shown], separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def queued_in_batch(job_id: str) -> JobStatus:
    """The status of a job its batch's workflow has yet to start. Detached: there is nothing to
    keep alive yet (a batch's jobs are detached unless its client asked otherwise)."""
    return JobStatus(job_id=job_id, state=JobState.QUEUED, detached=True)


class BatchMethods:
    """`JobClient`'s batch methods (it inherits them): what they need of the client is declared
    here, so this module never imports the client's."""

    temporal: Client
    task_queue: str
    store: ArtifactStore | None
    default_pool: str | None

    async def _check_size(self, request: JobRequest) -> None:
        raise NotImplementedError

    async def _start_new(self, request: JobRequest, job_id: str, fingerprint: str) -> Any:
        raise NotImplementedError

    async def _submit_batch(
        self,
        batch: BatchRequest | Sequence[JobRequest],
        *,
        batch_id: str | None = None,
        detached: bool = True,
    ) -> BatchSubmitted:
        batch_id = checked_batch_id(batch_id or f"batch-{uuid.uuid4().hex[:16]}")
        requests, webhook = batch_requests(batch)
        tenant = _tenant_of(requests)
        job_ids = [batch_job_id(batch_id, index) for index in range(len(requests))]
        prepared: list[tuple[JobRequest, str]] = []
        checked: list[JobRequest] = []  # as fingerprinted: staged and labelled, not detached
        for index, request in enumerate(requests):
            try:
                check_segment_overrides(request.graph, request.segments)
            except errors.InvalidOverride as exc:
                raise errors.InvalidBatch(f"job {index + 1} of the batch: {exc}") from None
            labels = {**request.labels, BATCH_LABEL: batch_id}
            request = request.model_copy(update={"labels": labels})
            request = await stage_inputs(request, self.store)
            checked.append(request)
            fingerprint = request_sha256(request)
            request = _detached(request) if detached else request
            await self._check_size(request)
            prepared.append((request, fingerprint))
        fingerprints = [fingerprint for _, fingerprint in prepared]
        sha = _fingerprint(fingerprints, webhook)
        jobs = await self._in_short(checked, fingerprints, detached=detached)
        try:
            await self._refuse_batch_when_full([request for request, _ in prepared], tenant)
            # Its tenant's budget spent, `over_budget: refuse`: nothing of it starts.
            usage = await BudgetCheck(self.temporal).refusal(tenant)
            if usage is not None:
                raise budget_exceeded(usage)
        except (errors.QueueFull, errors.BudgetExceeded):
            if not await self._batch_exists(batch_id):
                raise  # a resubmission of a batch that got in is never refused
        existed = await self._start_batch_workflow(batch_id, tenant, job_ids, webhook, sha, jobs)
        if jobs is not None:
            # Its workflow starts them (and, sent again, goes on with what it had not started).
            started = 0 if existed else len(job_ids)
        else:
            started = await self._start_jobs(batch_id, job_ids, prepared, existed=existed)
        log.info(
            "batch_submitted",
            batch_id=batch_id,
            jobs=len(job_ids),
            started=started,
            by="batch" if jobs is not None else "client",
        )
        # A new batch is what this call just made: said here, not asked of its workflow, whose
        # worker is busy starting the jobs just sent (its answer took seconds at 1,000 jobs,
        # `make bench BENCH=batch`). A batch sent again is read: some of its jobs may have ended.
        status = BatchStatus(
            batch_id=batch_id,
            tenant=tenant,
            total=len(job_ids),
            jobs=[BatchJob(job_id=job_id) for job_id in job_ids],
            created_at=datetime.now(UTC),
        )
        if existed:
            try:
                status = await self._batch_status(batch_id)
            except (RPCError, WorkflowQueryFailedError) as exc:
                log.warning("batch_status_unanswered", batch_id=batch_id, error=str(exc)[:200])
        return BatchSubmitted(
            batch_id=batch_id,
            existed=existed,
            job_ids=job_ids,
            started=started,
            status=status,
        )

    async def _in_short(
        self, checked: Sequence[JobRequest], fingerprints: Sequence[str], *, detached: bool
    ) -> BatchJobs | None:
        """The jobs in short for the batch's workflow to start, or None (they differ in more
        than input values, or take too much room in its history)."""
        jobs = compact_jobs(checked, detached=detached)
        if jobs is None:
            return None
        # What the workflow will rebuild is each job exactly: the same fingerprint.
        for index, fingerprint in enumerate(fingerprints):
            if request_sha256(jobs.request(index)) != fingerprint:
                return None
        payloads = await self.temporal.data_converter.encode([jobs])
        if sum(payload.ByteSize() for payload in payloads) > MAX_BATCH_JOBS_BYTES:
            return None
        return jobs

    async def _start_jobs(
        self,
        batch_id: str,
        job_ids: Sequence[str],
        prepared: Sequence[tuple[JobRequest, str]],
        *,
        existed: bool,
    ) -> int:
        """This client starts the batch's jobs, then says `submitted`: how many it started."""
        gate = asyncio.Semaphore(STARTS_AT_ONCE)

        async def start(job_id: str, request: JobRequest, fingerprint: str) -> bool:
            async with gate:
                outcome = await self._start_new(request, job_id, fingerprint)
                return not outcome.existed

        started = await asyncio.gather(
            *(
                start(job_id, request, fingerprint)
                for job_id, (request, fingerprint) in zip(job_ids, prepared, strict=True)
            )
        )
        try:
            await self.temporal.get_workflow_handle(batch_id).signal(SIGNAL_BATCH_SUBMITTED)
        except RPCError as exc:
            # A batch sent again after every job ended: its workflow has closed, nothing to say.
            if not (existed and exc.status == RPCStatusCode.NOT_FOUND):
                raise
        return sum(started)

    async def start_batch_job(self, request: JobRequest, job_id: str, detached: bool) -> str:
        """One job of a batch, for the batch's workflow (activities/batches.py
        `StartBatchJob`): "started", "existed", or "not started: <why>"."""
        fingerprint = request_sha256(request)
        try:
            outcome = await self._start_new(
                _detached(request) if detached else request, job_id, fingerprint
            )
        except (errors.JobConflict, errors.RequestTooLarge) as exc:
            return f"not started: {exc}"
        return "existed" if outcome.existed else "started"

    async def _queued_in_batch(self, job_id: str) -> str | None:
        """The tenant of the running batch that holds `job_id` and starts its jobs itself, when
        the job does not exist yet: it is queued, its batch's workflow has yet to start it.
        None: no such batch (the job is not found)."""
        match = _BATCH_JOB_ID.match(job_id)
        if match is None:
            return None
        try:
            description = await self.temporal.get_workflow_handle(match["batch"]).describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return None
            raise
        if description.workflow_type != BATCH_WORKFLOW_TYPE:
            return None
        if description.status != WorkflowExecutionStatus.RUNNING:
            return None
        holds = await description.memo_value(MEMO_BATCH_STARTS, 0)
        if not 1 <= int(match["number"]) <= holds:
            return None
        return description.typed_search_attributes.get(_TENANT_KEY) or DEFAULT_TENANT

    async def _until_started(self, job_id: str) -> None:
        """Return once the job exists; while its batch has yet to start it, wait (a batch's
        workflow starts about 30 jobs a second). `JobNotFound` when no batch holds it."""
        while True:
            try:
                await self.temporal.get_workflow_handle(job_id).describe()
                return
            except RPCError as exc:
                if exc.status != RPCStatusCode.NOT_FOUND:
                    raise
            if await self._queued_in_batch(job_id) is None:
                raise errors.JobNotFound(job_id)
            await asyncio.sleep(_START_POLL_S)

    async def _batch_exists(self, batch_id: str) -> bool:
        try:
            await self.temporal.get_workflow_handle(batch_id).describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return False
            raise
        return True

    async def _start_batch_workflow(
        self,
        batch_id: str,
        tenant: str,
        job_ids: list[str],
        webhook: Any,
        sha: str,
        jobs: BatchJobs | None,
    ) -> bool:
        """Start the batch's workflow; True when one with the same jobs exists (BatchConflict
        when the ID holds another batch)."""
        inp = BatchInput(
            batch_id=batch_id,
            tenant=tenant,
            job_ids=job_ids,
            webhook=webhook,
            created_at=datetime.now(UTC),
            jobs=jobs,
        )
        try:
            await self.temporal.start_workflow(
                BATCH_WORKFLOW_TYPE,
                inp,
                id=batch_id,
                task_queue=self.task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                search_attributes=TypedSearchAttributes([SearchAttributePair(_TENANT_KEY, tenant)]),
                memo={
                    MEMO_BATCH_SHA256: sha,
                    **({MEMO_BATCH_STARTS: len(job_ids)} if jobs is not None else {}),
                },
                static_summary=f"batch of {len(job_ids)} jobs (tenant {tenant})",
            )
            return False
        except WorkflowAlreadyStartedError:
            pass
        description = await self.temporal.get_workflow_handle(batch_id).describe()
        if await description.memo_value(MEMO_BATCH_SHA256, None) != sha:
            raise errors.BatchConflict(batch_id)
        return True

    async def _refuse_batch_when_full(self, requests: Sequence[JobRequest], tenant: str) -> None:
        """`QueueFull` before anything starts when a pool's queue has no room for all of the
        batch's jobs for it (a batch is never half-admitted)."""
        by_pool = Counter(request.pool or self.default_pool for request in requests)
        for pool, wanted in by_pool.items():
            if pool is None:
                continue
            room = await queue_room(self.temporal, self.task_queue, pool, tenant)
            if room.full:
                reason = room.reason
            elif room.headroom is not None and room.headroom < wanted:
                reason = (
                    f"the batch has {wanted} jobs for pool {pool!r}, and its queue has room for "
                    f"{room.headroom} more of tenant {tenant!r}"
                )
            else:
                continue
            raise errors.QueueFull(pool, tenant, reason, room.retry_after_s)

    async def _batch_status(self, batch_id: str, *, jobs: bool = False) -> BatchStatus:
        """The batch's own record, with how many of its unfinished jobs show each state now
        (and with `jobs`, each one's state and percent)."""
        handle = self.temporal.get_workflow_handle(
            checked_batch_id(batch_id), result_type=BatchStatus
        )
        try:
            # An ended batch's query would replay its whole history on a worker: its result
            # (its last status) is read from its record instead, with no worker at all.
            status: BatchStatus = await handle.query(
                QUERY_BATCH_STATUS,
                result_type=BatchStatus,
                reject_condition=QueryRejectCondition.NOT_OPEN,
            )
        except WorkflowQueryRejectedError:
            return await self._ended_batch(handle)
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                raise errors.BatchNotFound(batch_id) from None
            raise
        if status.terminal:
            return status
        if jobs:
            return await self._with_live_states(status)
        return await self._with_live_counts(status)

    async def _with_live_counts(self, status: BatchStatus) -> BatchStatus:
        """Counts of the unfinished jobs by the state they show (their `JobState` search
        attribute): one count call per state, all at once. Listing 1,000 jobs costs the
        dev server ~200 ms of CPU; these counts ~20 ms together."""
        if status.ended >= status.total:
            return status
        prefix = f'WorkflowId STARTS_WITH "{status.batch_id}-" AND ExecutionStatus = "Running"'
        answers = await asyncio.gather(
            *(
                self.temporal.count_workflows(f'{prefix} AND {SA_JOB_STATE} = "{state.value}"')
                for state in LIVE_STATES
            )
        )
        counts = Counter(status.counts)
        for state, answer in zip(LIVE_STATES, answers, strict=True):
            if answer.count:
                counts[state.value] += answer.count
        return status.model_copy(update={"counts": dict(counts)})

    async def _ended_batch(self, handle: WorkflowHandle[Any, BatchStatus]) -> BatchStatus:
        try:
            result: BatchStatus = await handle.result(follow_runs=False)
            return result
        except WorkflowFailureError:
            # Terminated from outside: its last word is its query's (on a worker, replayed).
            ended: BatchStatus = await handle.query(QUERY_BATCH_STATUS, result_type=BatchStatus)
            return ended

    async def _with_live_states(self, status: BatchStatus) -> BatchStatus:
        unfinished = {job.job_id for job in status.jobs if job.state is None}
        if not unfinished:
            return status
        live: dict[str, tuple[str, int]] = {}
        query = f'WorkflowId STARTS_WITH "{status.batch_id}-" AND ExecutionStatus = "Running"'
        async for execution in self.temporal.list_workflows(query, page_size=1000):
            if execution.id not in unfinished:
                continue
            if execution.status != WorkflowExecutionStatus.RUNNING:
                continue
            attributes = execution.typed_search_attributes
            live[execution.id] = (
                attributes.get(STATE_KEY) or JobState.QUEUED.value,
                attributes.get(PROGRESS_KEY) or 0,
            )
        jobs: list[BatchJob] = []
        counts = Counter(status.counts)
        progress = float(status.ended)
        for job in status.jobs:
            if job.state is None and job.job_id in live:
                state, percent = live[job.job_id]
                job = job.model_copy(update={"state": state, "percent": percent})
                counts[state] += 1
                progress += min(100, max(0, percent)) / 100
            jobs.append(job)
        total = status.total or 1
        return status.model_copy(
            update={"jobs": jobs, "counts": dict(counts), "progress": round(progress / total, 4)}
        )

    async def _cancel_batch(self, batch_id: str, reason: str) -> BatchStatus:
        handle = self.temporal.get_workflow_handle(checked_batch_id(batch_id))
        try:
            await handle.execute_update(
                UPDATE_BATCH_CANCEL, BatchCancel(reason=reason), result_type=BatchStatus
            )
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            # Not found, or closed already (every job ended): its record says which.
        except WorkflowUpdateFailedError as exc:
            raise errors.InvalidBatch(f"cancel refused: {exc.cause}") from None
        return await self._batch_status(batch_id)

    async def _batch_results(self, batch_id: str) -> BatchResults:
        handle = self.temporal.get_workflow_handle(checked_batch_id(batch_id))
        try:
            results: BatchResults = await handle.query(
                QUERY_BATCH_RESULTS, result_type=BatchResults
            )
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                raise errors.BatchNotFound(batch_id) from None
            raise
        return results

    async def _watch_batch(self, batch_id: str, interval_s: float) -> AsyncIterator[BatchStatus]:
        last: tuple[Any, ...] | None = None
        while True:
            try:
                status = await self._batch_status(batch_id)
            except (WorkflowQueryFailedError, RPCTimeoutOrCancelledError) as exc:
                # Its worker busy past the query's time (a batch's own jobs keep it so): the
                # batch is there all the same, and is asked again.
                log.warning("batch_query_unanswered", batch_id=batch_id, error=str(exc)[:200])
                await asyncio.sleep(interval_s)
                continue
            except RPCError as exc:
                if exc.status != RPCStatusCode.DEADLINE_EXCEEDED:
                    raise
                log.warning("batch_query_unanswered", batch_id=batch_id, error=exc.message)
                await asyncio.sleep(interval_s)
                continue
            shown = (status.state, status.seq, tuple(sorted(status.counts.items())))
            if shown != last or status.terminal:
                last = shown
                yield status
            if status.terminal:
                return
            await asyncio.sleep(interval_s)
