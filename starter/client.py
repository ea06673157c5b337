"""`JobClient`: submit a job, find it again by ID, follow it, fetch its artifacts.

Everything goes through the Temporal client SDK; the job's state lives in its workflow, so any
client (this one after a restart, another machine, the Temporal UI) sees the same job.

The job answers the `status` query itself. Temporal's own record of the execution is read as
well when the job cannot say how it ended: a workflow terminated or timed out from outside never
runs its own ending, so its last answer stays non-terminal forever. While a prompt is followed,
the same record (the workflow's description) carries the follow activity's latest heartbeat,
whose step is laid over the job's answer (`starter.progress`): the job itself hears of progress
only on milestones. It also shows an activity of the job that no worker has started, which the
job cannot know: laid over its answer as `worker_wait` (`starter.worker_wait`), with the task
queue read (at most every two seconds per queue) only while one waits.
"""

from __future__ import annotations

import asyncio
import functools
import random
import re
import time
import uuid
from collections import Counter
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Coroutine,
    Iterator,
    Sequence,
)
from contextlib import aclosing, contextmanager
from datetime import timedelta
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Self, TypeVar

import structlog
from pydantic import BaseModel, ConfigDict, SecretStr, ValidationError
from temporalio.client import (
    Client,
    RPCTimeoutOrCancelledError,
    WorkflowExecution,
    WorkflowExecutionDescription,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.common import (
    SearchAttributeIndexedValueType,
    SearchAttributeKey,
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from configuration.settings import ClientSettings
from starter import errors
from starter.batches import BatchMethods, BatchSubmitted, queued_in_batch
from starter.budgets import BudgetCheck, budget_exceeded, every_usage, tenant_usage
from starter.connection import (
    connect_failure_gist,
    connect_target,
    connect_temporal,
    dialled_by_default,
)
from starter.execution import bare_status, ended_from_outside
from starter.live import LiveRelay, Pushed
from starter.pending_query import PendingQuery
from starter.pollers import activity_queue, live_pollers, workflow_pollers
from starter.progress import (
    FOLLOW_STATES,
    carried_forward,
    follow_heartbeats,
    follow_just_ended,
    heartbeat_status,
    overlaid,
)
from starter.queues import (
    RoomCheck,
    drain_pool,
    operator_name,
    pool_queue,
    release_slot,
    with_queue_position,
)
from starter.requests import check_segment_overrides, request_sha256
from starter.staging import stage_inputs
from starter.worker_wait import WAIT_STATES, QueueReader, with_worker_wait
from workflows.activity_io import FollowHeartbeat
from workflows.admission import PoolQueueView
from workflows.batches import BatchRequest, BatchResults, BatchStatus
from workflows.budgets import BudgetUsage
from workflows.contracts import (
    Artifact,
    CancelRequest,
    EventsQuery,
    JobEvents,
    JobRequest,
    JobState,
    JobStatus,
    OutputSpec,
    Progress,
    ReconnectPolicy,
    ResumeRequest,
    validate_job_id,
)
from workflows.errors import StorageConfigError, StorageError
from workflows.job_input import JobInput
from workflows.shared import (
    DEFAULT_TASK_QUEUE,
    DEFAULT_TENANT,
    POOL_KEY,
    PROGRESS_KEY,
    QUERY_EVENTS,
    QUERY_STATUS,
    SA_TENANT,
    SIGNAL_CANCEL_REASON,
    SIGNAL_CLIENT_SEEN,
    STATE_KEY,
    TENANT_LABEL,
    UPDATE_ATTACH,
    UPDATE_ENDED,
    UPDATE_RESUME,
    WORKFLOW_TYPE,
    reconnect_delay,
)

if TYPE_CHECKING:
    from activities.storage import ArtifactStore
    from configuration.settings import S3Settings

TENANT_KEY = SearchAttributeKey.for_keyword(SA_TENANT)

# Every search attribute a job is started with or sets, by the type name `temporal operator
# search-attribute create --type` and `tcld` take: what a namespace must have registered.
_TYPE_NAMES = {
    SearchAttributeIndexedValueType.KEYWORD: "Keyword",
    SearchAttributeIndexedValueType.INT: "Int",
}
SEARCH_ATTRIBUTES: dict[str, str] = {
    key.name: _TYPE_NAMES[key.indexed_value_type]
    for key in (STATE_KEY, PROGRESS_KEY, POOL_KEY, TENANT_KEY)
}
# How the server says a search attribute is not registered on the namespace.
_NO_MAPPING = re.compile(r"no mapping defined for search attribute (\w+)")

# Memo key holding the sha256 of the submitted request: a second submit under the same ID is
# compared against it without reading (and decoding) the job's history.
MEMO_REQUEST_SHA256 = "request_sha256"
# Memo key, true when the job has a webhook: its workflow may stay open after the job ended, so
# `wait` asks the job itself (the `ended` update); every other job's end is its workflow's.
MEMO_WEBHOOK = "webhook"
# Temporal's default `limit.blobSize.error`: a start whose input is bigger is rejected.
MAX_REQUEST_BYTES = 2 * 1024 * 1024
# Query failures that mean "nobody answered", as opposed to "no such job".
_UNANSWERED_CODES = frozenset(
    {RPCStatusCode.CANCELLED, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.FAILED_PRECONDITION}
)
# RPC failures that mean the server did not answer, as opposed to answering with an error.
_UNREACHABLE_CODES = frozenset(
    {RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED}
)


def _job_missing(exc: RPCError) -> bool:
    """NOT_FOUND names the job, unless it is the namespace that is missing."""
    return exc.status == RPCStatusCode.NOT_FOUND and not errors.is_namespace_missing(
        exc.status.name, exc.message
    )


def _unanswered(job_id: str, exc: RPCError) -> RPCError:
    """A query's failure that says no worker answered, for the caller to fall back on Temporal's
    record; a job that does not exist raises `JobNotFound`, any other failure itself."""
    if _job_missing(exc):
        raise errors.JobNotFound(job_id) from exc
    if exc.status not in _UNANSWERED_CODES:
        raise exc
    return exc


P = ParamSpec("P")
R = TypeVar("R")

log = structlog.get_logger("durable_comfy.client")


class SubmitOutcome(BaseModel):
    """What `JobClient.start` did: started a new job, or found one under that ID."""

    model_config = ConfigDict(extra="forbid")

    job_id: str
    # True: the ID was in use by a job with the same request; nothing new was started and
    # `status` is that job's real status (perhaps already ended).
    existed: bool
    status: JobStatus


def _client_errors(
    method: Callable[Concatenate[JobClient, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[JobClient, P], Coroutine[Any, Any, R]]:
    """A public method raises `ClientError`s only: the SDK's and the bucket's errors become
    them at the boundary (internal code keeps reading the SDK's status codes)."""

    @functools.wraps(method)
    async def translated(self: JobClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.translated_errors():
            return await method(self, *args, **kwargs)

    return translated


class JobClient(BatchMethods):
    """Async client for durable-comfy jobs.

    `JobClient.connect()` reads the same settings as the CLI: Temporal's (TEMPORAL_ADDRESS, a
    profile, ...), the task queue and query timeout (`configuration.settings.ClientSettings`) and,
    when DURABLE_COMFY_BUCKET is set, the artifact bucket's (`S3Settings`), whose store it opens:
    `result` then adds presigned download URLs, `download` fetches the files, and `start` stages
    inputs too large for a request to S3. Without a bucket you still get `s3://` URIs, and such
    inputs are refused. Close the client (`async with`, or `close()`) to close that store.

    Every error a method raises is a `starter.errors.ClientError`.
    """

    def __init__(
        self,
        client: Client,
        *,
        task_queue: str = DEFAULT_TASK_QUEUE,
        store: ArtifactStore | None = None,
        query_timeout_s: float = 10.0,
        live_progress_key: SecretStr | None = None,
        default_pool: str | None = None,
    ) -> None:
        self.temporal = client
        self.task_queue = task_queue
        # The workers' default pool, for the queue's room check of a request that names none.
        self.default_pool = default_pool
        self._rooms = RoomCheck(client, task_queue)
        self._budgets = BudgetCheck(client)
        self.store = store
        self.query_timeout = timedelta(seconds=query_timeout_s)
        self.max_request_bytes = MAX_REQUEST_BYTES
        # A store `connect` opened from the environment is the client's to close.
        self._owned_store: ArtifactStore | None = None
        # Task queues read for jobs whose activity waits for a worker (cached per queue).
        self.queues = QueueReader(lambda task_queue: activity_queue(self.temporal, task_queue))
        # With the workers' key, `watch` also takes the steps they push (starter/live.py).
        self.live = (
            LiveRelay(live_progress_key, self._pushing_workers)
            if live_progress_key is not None
            else None
        )

    @classmethod
    async def connect(
        cls,
        address: str | None = None,
        namespace: str | None = None,
        *,
        task_queue: str | None = None,
        query_timeout_s: float | None = None,
        store: ArtifactStore | None = None,
        s3: S3Settings | None = None,
        s3_from_environment: bool = True,
        live_progress_key: SecretStr | None = None,
    ) -> JobClient:
        """Connect to Temporal, with the CLI's settings for whatever is not given here.

        `address` and `namespace`: else TEMPORAL_ADDRESS / TEMPORAL_NAMESPACE, else the
        `temporal.toml` profile (TEMPORAL_CONFIG_FILE + TEMPORAL_PROFILE), else 127.0.0.1:7233.
        `task_queue` and `query_timeout_s`: else DURABLE_COMFY_TASK_QUEUE and
        DURABLE_COMFY_QUERY_TIMEOUT_S. The artifact bucket: `store` (an open
        `activities.storage.ArtifactStore` you close yourself), else one opened from `s3`, else
        from the environment when DURABLE_COMFY_BUCKET is set (`s3_from_environment=False`: no
        bucket). `live_progress_key`: else DURABLE_COMFY_LIVE_PROGRESS_KEY (none: `watch` only
        polls). Raises `TemporalUnreachable` when nothing answers, `SettingsError` or
        `StorageNotConfigured` for a bad variable, naming it.
        """
        try:
            settings = ClientSettings()
        except ValidationError as exc:
            raise errors.SettingsError(f"invalid client settings: {_problems(exc)}") from None
        try:
            temporal = await connect_temporal(address, namespace)
        except RuntimeError as exc:  # how the SDK reports a refused or failed connection
            target, tls = connect_target(address)
            raise errors.TemporalUnreachable(
                target,
                connect_failure_gist(exc),
                tls=tls,
                by_default=dialled_by_default(address),
            ) from exc
        client = cls(
            temporal,
            task_queue=task_queue or settings.task_queue,
            store=store,
            query_timeout_s=query_timeout_s or settings.query_timeout_s,
            live_progress_key=live_progress_key or settings.live_progress_key,
            default_pool=settings.default_pool,
        )
        if store is None and (s3 is not None or s3_from_environment):
            with client.translated_errors():
                await client._open_store(s3)
        return client

    async def _open_store(self, s3: S3Settings | None) -> None:
        # Imported here: aioboto3 is loaded only by a client that has a bucket.
        from activities.storage import ArtifactStore
        from configuration.settings import S3Settings

        settings = s3 or S3Settings.from_env_if_configured()
        if settings is None:
            return
        store = ArtifactStore(settings)
        self.store = self._owned_store = await store.__aenter__()

    async def close(self) -> None:
        """Close the bucket's client if `connect` opened it, and the connections to workers
        that push steps (Temporal's needs no closing)."""
        if self.live is not None:
            await self.live.close()
        store, self._owned_store = self._owned_store, None
        if store is not None:
            if self.store is store:
                self.store = None
            await store.__aexit__(None, None, None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @contextmanager
    def translated_errors(self) -> Iterator[None]:
        """The SDK's and the bucket's errors as `ClientError`s, with what they mean here."""
        try:
            yield
        except RPCError as exc:
            if exc.status in _UNREACHABLE_CODES:
                raise errors.TemporalUnreachable(self._target(), exc.message) from exc
            if errors.is_namespace_missing(exc.status.name, exc.message):
                raise errors.NamespaceMissing(self.temporal.namespace, self._target()) from exc
            if exc.status == RPCStatusCode.INVALID_ARGUMENT and (
                missing := _NO_MAPPING.search(exc.message)
            ):
                namespace = self.temporal.namespace
                raise errors.SearchAttributesMissing(
                    namespace, [missing.group(1)], SEARCH_ATTRIBUTES
                ) from exc
            raise errors.TemporalRefused(exc.status.name, exc.message) from exc
        except RPCTimeoutOrCancelledError as exc:
            raise errors.TemporalUnreachable(
                self._target(), str(exc) or "no answer in time"
            ) from exc
        except StorageConfigError as exc:
            raise errors.StorageNotConfigured(str(exc)) from exc
        except StorageError as exc:
            raise errors.StorageFailed(str(exc), retryable=exc.retryable) from exc

    def _target(self) -> str:
        return self.temporal.service_client.config.target_host

    def handle(self, job_id: str) -> WorkflowHandle[object, JobStatus]:
        return self.temporal.get_workflow_handle(checked_job_id(job_id), result_type=JobStatus)

    # -- starting ----------------------------------------------------------------------------

    @_client_errors
    async def submit(
        self, request: JobRequest, *, job_id: str | None = None, detached: bool = True
    ) -> JobStatus:
        """`start`, returning only the job's status (new, or the existing job's real one).

        Detached by default, like `durable-comfy submit`: the job runs to its end whether or
        not anyone watches. `detached=False` is what `submit --watch` does (below)."""
        return (await self.start(request, job_id=job_id, detached=detached)).status

    @_client_errors
    async def start(
        self, request: JobRequest, *, job_id: str | None = None, detached: bool = True
    ) -> SubmitOutcome:
        """Start a job, or find the one already started under `job_id` with this request.

        `job_id` is an idempotency key: the same request under the same ID starts nothing and
        returns `existed=True` with the job's real status; a different request under it raises
        `JobConflict`. Requests compare by content (`request_sha256`), not by how the job is
        followed: `detached` is not part of the comparison.

        An inline input over `MAX_INLINE_INPUT_BYTES` is uploaded to S3 first and sent by
        reference (`starter.staging`); that needs `store`, and raises `InputNeedsStaging`
        without it.

        A detached job (the default) runs to its end whoever is listening: a script may
        submit and exit. An attached one (`detached=False`, as `durable-comfy submit --watch`)
        expects to hear from a client: `watch` keeps it alive, and after
        `policy.abandon_after_s` without contact it is abandoned and its GPU work is stopped.
        With the workers' live-progress key, an attached start first subscribes to the job's
        pushed steps (waiting at most 1 s), for the `watch` that follows (`LiveRelay.hold`).
        """
        job_id = checked_job_id(job_id or f"job-{uuid.uuid4().hex[:16]}")
        check_segment_overrides(request.graph, request.segments)
        # Before the fingerprint: the job holds (and a resubmission compares) the staged form,
        # whose keys are content hashes, so the same file gives the same request every time.
        request = await stage_inputs(request, self.store)
        fingerprint = request_sha256(request)
        if detached:
            policy = request.policy.model_copy(update={"abandon_after_s": None})
            request = request.model_copy(update={"policy": policy})
        await self._check_size(request)
        await self._refuse_when_full(request, job_id)
        await self._refuse_over_budget(request, job_id)
        if self.live is not None:
            self.live.list_soon()  # for the watch that usually follows
        try:
            if self.live is not None and not detached:
                # An attached job is watched next (`submit --watch`): subscribed from before it
                # exists, that watch sees a short job's steps even if it ends before start returns.
                await self.live.hold(job_id)
            return await self._start_new(request, job_id, fingerprint)
        except BaseException:
            if self.live is not None:
                self.live.release(job_id)
            raise

    async def _refuse_when_full(self, request: JobRequest, job_id: str) -> None:
        """`QueueFull` when the job's pool's queue has no room for its tenant: checked here, at
        submission, where the caller can still try later; a job already started under `job_id`
        is found as always (an idempotent resubmission is never refused)."""
        pool = request.pool or self.default_pool
        if pool is None:
            return
        tenant = request.labels.get(TENANT_LABEL) or DEFAULT_TENANT
        room = await self._rooms.join(pool, tenant)
        if not room.full:
            return
        try:
            await self.handle(job_id).describe()
            return
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
        raise errors.QueueFull(pool, tenant, room.reason, room.retry_after_s)

    async def _refuse_over_budget(self, request: JobRequest, job_id: str) -> None:
        """`BudgetExceeded` when the job's tenant has spent its daily budget and its settings
        say `over_budget: refuse` (with `wait`, the job is started and waits PENDING until the
        reset); a job already started under `job_id` is found as always."""
        tenant = request.labels.get(TENANT_LABEL) or DEFAULT_TENANT
        usage = await self._budgets.refusal(tenant)
        if usage is None or await self._exists(job_id):
            return
        raise budget_exceeded(usage)

    async def _exists(self, job_id: str) -> bool:
        try:
            await self.handle(job_id).describe()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            return False
        return True

    @_client_errors
    async def tenant_usage(self, tenant: str) -> BudgetUsage | None:
        """The tenant's spend today as its budget ledger has it (None: it has no ledger: no
        budget, or no job of it checked yet)."""
        return await tenant_usage(self.temporal, tenant)

    @_client_errors
    async def every_usage(self) -> list[BudgetUsage]:
        """Every tenant's spend today, of every ledger that runs (`durable-comfy tenants`)."""
        return await every_usage(self.temporal)

    async def _start_new(self, request: JobRequest, job_id: str, fingerprint: str) -> SubmitOutcome:
        """Start the workflow of a checked request, or compare it with the job under its ID."""
        # The job's first state, as the workflow would upsert it: set here, it costs no event.
        pairs: list[SearchAttributePair[Any]] = [
            SearchAttributePair(STATE_KEY, JobState.QUEUED.value),
            SearchAttributePair(PROGRESS_KEY, 0),
        ]
        if tenant := request.labels.get("tenant"):
            pairs.append(SearchAttributePair(TENANT_KEY, tenant))
        try:
            await self.temporal.start_workflow(
                WORKFLOW_TYPE,
                JobInput(request=request),
                id=job_id,
                task_queue=self.task_queue,
                # FAIL (not USE_EXISTING) so that an existing job is reported, and compared.
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                search_attributes=TypedSearchAttributes(pairs),
                memo={
                    MEMO_REQUEST_SHA256: fingerprint,
                    **({MEMO_WEBHOOK: True} if request.webhook is not None else {}),
                },
                # Shown once, at the top of the job's page in the Temporal UI.
                static_summary=request_summary(request),
                static_details=request_details(request),
            )
        except WorkflowAlreadyStartedError:
            return await self._existing(job_id, fingerprint)
        except RPCError as exc:
            if exc.status == RPCStatusCode.INVALID_ARGUMENT and "size exceeds" in exc.message:
                # The server's limit may be lower than ours: its word is final.
                raise errors.RequestTooLarge(await self._request_size(request), None) from exc
            raise
        status = JobStatus(
            job_id=job_id,
            state=JobState.QUEUED,
            progress=Progress(segments=request.segment_count),
            detached=request.policy.detached,
            abandon_after_s=request.policy.abandon_after_s,
        )
        return SubmitOutcome(job_id=job_id, existed=False, status=status)

    async def _pushing_workers(self) -> list[str]:
        """Where the workers polling this client's task queue push live progress."""
        pollers = live_pollers(await workflow_pollers(self.temporal, self.task_queue))
        return [poller.live for poller in pollers if poller.live is not None]

    async def _request_size(self, request: JobRequest) -> int:
        payloads = await self.temporal.data_converter.encode([request])
        return sum(payload.ByteSize() for payload in payloads)

    async def _check_size(self, request: JobRequest) -> None:
        size = await self._request_size(request)
        if size > self.max_request_bytes:
            raise errors.RequestTooLarge(size, self.max_request_bytes)

    async def _existing(self, job_id: str, fingerprint: str) -> SubmitOutcome:
        description = await self.handle(job_id).describe()
        stored = await description.memo_value(MEMO_REQUEST_SHA256, None)
        if stored is None:
            # Started by something other than JobClient (the Temporal UI, an older client).
            log.warning("job_request_not_comparable", job_id=job_id)
        elif stored != fingerprint:
            raise errors.JobConflict(job_id, str(stored), fingerprint)
        status = await self.status(job_id)
        return SubmitOutcome(job_id=job_id, existed=True, status=status)

    # -- batches (starter/batches.py) ----------------------------------------------------------

    @_client_errors
    async def submit_batch(
        self,
        batch: BatchRequest | Sequence[JobRequest],
        *,
        batch_id: str | None = None,
        detached: bool = True,
    ) -> BatchSubmitted:
        """Start a batch: many ordinary jobs, one ID to follow, cancel and collect them by.

        `batch`: the jobs' requests, or a `BatchRequest` (`request` with `count`: seeds varied;
        with `overrides`: one per job; and the batch's `webhook`, fired once at its end). Every
        job is checked first, and the queue's room for all of them: a batch that cannot start
        whole starts nothing (`InvalidBatch`, `QueueFull`, `RequestTooLarge`). `batch_id` is an
        idempotency key as a job's ID is: the same batch again starts only the jobs missing
        from it (`existed=True`), another under it raises `BatchConflict`. Its jobs are
        `<batch_id>-0001`...; each is an ordinary job (its own status, its tenant's fair share).
        """
        return await self._submit_batch(batch, batch_id=batch_id, detached=detached)

    @_client_errors
    async def batch_status(self, batch_id: str, *, jobs: bool = False) -> BatchStatus:
        """Counts by state, progress, cost and artifacts, and its jobs: one query of the batch
        and, while jobs run, a count of them per state (from Temporal's visibility store).
        `jobs=True` also gives each unfinished job's state and percent (one list call: ten
        times the server's work at 1,000 jobs), and progress counts them partly done.
        An ended batch is read from its record. `BatchNotFound`."""
        return await self._batch_status(batch_id, jobs=jobs)

    @_client_errors
    async def cancel_batch(
        self, batch_id: str, reason: str = "batch cancelled by a client"
    ) -> BatchStatus:
        """Stop every unfinished job of the batch (each confirmed as one cancelled job is);
        answers at once, CANCELLING until every job has ended. A batch that ended stays as it
        is."""
        return await self._cancel_batch(batch_id, reason)

    @_client_errors
    async def batch_results(self, batch_id: str, *, presign: bool = True) -> BatchResults:
        """Every ended job's end: state, error, cost and artifacts (with presigned URLs when
        the client has the bucket and `presign`)."""
        results = await self._batch_results(batch_id)
        if not presign or self.store is None:
            return results
        ends = []
        for end in results.ends:
            artifacts = [await self._presigned(artifact) for artifact in end.artifacts]
            ends.append(end.model_copy(update={"artifacts": artifacts}))
        return results.model_copy(update={"ends": ends})

    async def watch_batch(
        self, batch_id: str, *, interval_s: float = 1.0
    ) -> AsyncIterator[BatchStatus]:
        """The batch's status each time it changes, until it has ended."""
        with self.translated_errors():
            async for status in self._watch_batch(batch_id, interval_s):
                yield status

    @_client_errors
    async def wait_batch(self, batch_id: str, *, interval_s: float = 1.0) -> BatchStatus:
        """The batch's status once every job has ended."""
        async for status in self._watch_batch(batch_id, interval_s):
            if status.terminal:
                return status
        return await self._batch_status(batch_id)

    # -- reading ------------------------------------------------------------------------------

    @_client_errors
    async def status(self, job_id: str) -> JobStatus:
        """The job's status, from the job itself, corrected by Temporal's record when the
        workflow was ended from outside (TERMINATED, TIMED_OUT), and with the follow activity's
        latest step laid over it while a prompt is followed (two calls: the query, and the
        describe that serves both; the query once more when the follow ended in between). A
        job its batch has yet to start is QUEUED."""
        try:
            status = await self._query(job_id)
        except errors.JobNotFound:
            if await self._queued_in_batch(job_id) is None:
                raise
            return queued_in_batch(job_id)
        if status.terminal:
            return status
        description = await self._describe(job_id)
        if follow_just_ended(status, description):
            # The step the follow's heartbeat showed left the record with it: asked again, the
            # job answers with the checkpoint it recovered, never a step behind the one shown.
            status = await self._query(job_id)
            if status.terminal:
                return status
        return await self._described(job_id, status, description)

    @_client_errors
    async def events(self, job_id: str, since: int = 0) -> JobEvents:
        """The job's journal after `since` (a `seq` the caller saw) and its status now.

        What a follower that was away replays: every state change, stored output and tenth of
        progress since, each once, in order (`JobEvent.seq`). The status is the job's own
        answer, without `status`'s corrections (use that for the latest step); entries older
        than `first_seq` are no longer held (the status still says what is true).
        """
        handle = self.handle(job_id)
        try:
            events: JobEvents = await handle.query(
                QUERY_EVENTS,
                EventsQuery(since=since),
                result_type=JobEvents,
                rpc_timeout=self.query_timeout,
            )
            return events
        except RPCError as exc:
            try:
                failure: Exception = _unanswered(job_id, exc)
            except errors.JobNotFound:
                if await self._queued_in_batch(job_id) is None:
                    raise
                return JobEvents(status=queued_in_batch(job_id))
        except WorkflowQueryFailedError as exc:
            failure = exc
        # No worker answered: the status as Temporal alone gives it, with no journal.
        return JobEvents(status=await self._without_worker(job_id, failure))

    @_client_errors
    async def journal(self, job_id: str, since: int = 0) -> JobEvents:
        """`events`, with the status corrected as `status` corrects it (ended from outside, the
        follow's latest step laid over it): the journal and the status a follower shows with
        it come from one answer, so every entry up to the status's `seq` is in the list."""
        events = await self.events(job_id, since)
        if events.status.terminal:
            return events
        try:
            description = await self._describe(job_id)
        except errors.JobNotFound:
            if await self._queued_in_batch(job_id) is None:
                raise
            return events  # its batch has yet to start it
        described = await self._described(job_id, events.status, description)
        return events.model_copy(update={"status": described})

    @_client_errors
    async def pool_queue(self, pool: str) -> PoolQueueView:
        """The queue of a bounded pool: who holds its slots, who waits, in the order they
        will start. `NoPoolQueue` when none runs (an unbounded pool, or no job asked yet)."""
        return await pool_queue(
            self.temporal, self.task_queue, pool, rpc_timeout=self.query_timeout
        )

    @_client_errors
    async def release_slot(self, pool: str, job_id: str) -> bool:
        """Settle a slot held by a job whose teardown was never confirmed, once you know its
        prompt no longer runs (or take a job out of line). False: the queue had no such job."""
        return await release_slot(self.temporal, self.task_queue, pool, job_id)

    @_client_errors
    async def drain_pool(
        self, pool: str, server: str | None = None, *, by: str | None = None
    ) -> PoolQueueView:
        """No new job for `server` of `pool` (a URL of its `urls`), or for the whole pool
        (`server` None), until `undrain_pool`; jobs running there finish. `by` (default: the
        OS user) is shown in `pool_queue`'s view. Returns the queue as it is then.
        `NoPoolQueue` when none runs, `UnknownServer` for a server the queue does not have."""
        return await drain_pool(
            self.temporal,
            self.task_queue,
            pool,
            server=server,
            drain=True,
            by=by or operator_name(),
            rpc_timeout=self.query_timeout,
        )

    @_client_errors
    async def undrain_pool(
        self, pool: str, server: str | None = None, *, by: str | None = None
    ) -> PoolQueueView:
        """`drain_pool` undone: `server` (or the whole pool) is given new jobs again (a server
        its health check finds unhealthy only once healthy again)."""
        return await drain_pool(
            self.temporal,
            self.task_queue,
            pool,
            server=server,
            drain=False,
            by=by or operator_name(),
            rpc_timeout=self.query_timeout,
        )

    @_client_errors
    async def tenant_of(self, job_id: str) -> str | None:
        """The job's `Tenant` search attribute (None: started without one); a job its batch
        has yet to start, its batch's. `JobNotFound`."""
        try:
            description = await self._describe(job_id)
        except errors.JobNotFound:
            tenant = await self._queued_in_batch(job_id)
            if tenant is None:
                raise
            return tenant
        return description.typed_search_attributes.get(TENANT_KEY)

    @_client_errors
    async def recorded_status(self, job_id: str) -> JobStatus:
        """The status as Temporal's record alone gives it (state and progress from the search
        attributes, the times), asking no worker: for when none answers. A job activity that no
        worker has started shows as `worker_wait`."""
        description = await self._describe(job_id)
        status = bare_status(job_id, description)
        if status.terminal:
            return status
        return await with_worker_wait(status, description, self.queues)

    @_client_errors
    async def presign_ttl(self, job_id: str) -> int:
        """How long the job's request asked its links to live (`output.presign_ttl_s`)."""
        return await self._presign_ttl(job_id)

    @_client_errors
    async def presigned(self, artifact: Artifact, ttl_s: int) -> Artifact:
        """`artifact` with a fresh presigned `url` (unchanged when no bucket is configured)."""
        if self.store is None:
            return artifact
        return await self._presigned(artifact, ttl_s)

    @_client_errors
    async def list_page(
        self, query: str, *, page_size: int, page_token: bytes | None = None
    ) -> tuple[list[WorkflowExecution], bytes | None]:
        """One page of the executions a visibility `query` matches, newest first, and the
        token of the next page (None: that was the last)."""
        pages = self.temporal.list_workflows(
            query, page_size=page_size, next_page_token=page_token, rpc_timeout=self.query_timeout
        )
        await pages.fetch_next_page()
        return list(pages.current_page or []), pages.next_page_token or None

    async def _described(
        self, job_id: str, status: JobStatus, description: WorkflowExecutionDescription
    ) -> JobStatus:
        """`status` as Temporal's record corrects it: ended from outside, or further along by
        the follow activity's heartbeat, or with an activity waiting for a worker."""
        ended = ended_from_outside(job_id, description, status)
        if ended is not None:
            return ended
        beats = await follow_heartbeats(description) if status.state in FOLLOW_STATES else []
        status = await with_queue_position(self.temporal, self.task_queue, status)
        return await with_worker_wait(overlaid(status, beats), description, self.queues)

    async def _recorded(
        self, job_id: str, description: WorkflowExecutionDescription, known: JobStatus | None
    ) -> JobStatus:
        """The status Temporal's record alone gives a job that may follow a prompt: its state
        and percent, the follow heartbeat's submission, step and outputs, a worker wait.

        `known`: the job's last status this client had (submit's answer, say): its seq, and
        whether the job is attached, which the record does not hold (so an interrupted
        `submit --watch` still says when the job will be abandoned)."""
        kept = (
            {"seq": known.seq, "detached": known.detached, "abandon_after_s": known.abandon_after_s}
            if known is not None
            else {}
        )
        status = bare_status(job_id, description).model_copy(update=kept)
        ended = ended_from_outside(job_id, description, status)
        if ended is not None:
            return ended
        status = heartbeat_status(status, await follow_heartbeats(description))
        return await with_worker_wait(status, description, self.queues)

    async def _query(self, job_id: str) -> JobStatus:
        handle = self.handle(job_id)
        try:
            status: JobStatus = await handle.query(
                QUERY_STATUS, result_type=JobStatus, rpc_timeout=self.query_timeout
            )
            return status
        except RPCError as exc:
            failure: Exception = _unanswered(job_id, exc)
            if exc.status != RPCStatusCode.FAILED_PRECONDITION:
                failure = TimeoutError(
                    f"no answer to its status query in {self.query_timeout.total_seconds():g} s"
                )
        except WorkflowQueryFailedError as exc:
            failure = exc
        return await self._without_worker(job_id, failure)

    async def _without_worker(self, job_id: str, failure: Exception) -> JobStatus:
        """The status as Temporal alone can give it, when no worker answered the query."""
        description = await self._describe(job_id)
        ended = ended_from_outside(job_id, description, None)
        if ended is not None:
            return ended
        recorded = await self._recorded_end(job_id, description)
        if recorded is not None:
            return recorded
        if description.status == WorkflowExecutionStatus.CANCELED:
            return bare_status(job_id, description)
        raise errors.JobUnanswered(job_id, description.task_queue, _short(failure)) from failure

    async def _recorded_end(
        self, job_id: str, description: WorkflowExecutionDescription
    ) -> JobStatus | None:
        """The final status a closed job left in its record (its result, or its failure's
        details), None for one that runs or left none. One read of the history's close event,
        where a query of a closed workflow has a worker replay its whole history."""
        if description.status == WorkflowExecutionStatus.COMPLETED:
            status: JobStatus = await self.handle(job_id).result()
            return status
        if description.status == WorkflowExecutionStatus.FAILED:
            try:
                await self.handle(job_id).result()
            except WorkflowFailureError as exc:
                if isinstance(exc.cause, ApplicationError) and exc.cause.details:
                    return JobStatus.model_validate(exc.cause.details[0])
        return None

    async def _describe(self, job_id: str) -> WorkflowExecutionDescription:
        try:
            return await self.handle(job_id).describe()
        except RPCError as exc:
            if _job_missing(exc):
                raise errors.JobNotFound(job_id) from exc
            raise

    async def _ended_status(self, job_id: str) -> JobStatus | None:
        """The final status when the job has ended, None while it runs (or raise not found)."""
        description = await self._describe(job_id)
        if description.status == WorkflowExecutionStatus.RUNNING:
            return None
        recorded = await self._recorded_end(job_id, description)
        if recorded is not None:
            return recorded
        try:
            return await self.status(job_id)
        except errors.JobUnanswered:
            return bare_status(job_id, description)

    async def _not_found_or_ended(
        self, job_id: str, exc: RPCError, action: str
    ) -> errors.JobAlreadyEnded:
        """Temporal says NOT_FOUND both for an unknown ID and for a workflow that has closed."""
        ended = await self._ended_status(job_id)
        if ended is None:
            raise exc
        return errors.JobAlreadyEnded(job_id, ended, action)

    # -- acting on a job ----------------------------------------------------------------------

    @_client_errors
    async def client_seen(self, job_id: str) -> None:
        await self._client_seen(job_id)

    @_client_errors
    async def attach(self, job_id: str) -> JobStatus:
        """Tell the job a client is (back) and get its status in one round trip."""
        return await self._attach(job_id)

    # The watch's own calls: the SDK's errors, which its reconnect loop retries (the public
    # methods above turn them into `ClientError`s, which would end the watch at the first).
    async def _client_seen(self, job_id: str) -> None:
        await self.handle(job_id).signal(SIGNAL_CLIENT_SEEN)

    async def _attach(self, job_id: str) -> JobStatus:
        status: JobStatus = await self.handle(job_id).execute_update(
            UPDATE_ATTACH, result_type=JobStatus, rpc_timeout=self.query_timeout
        )
        return status

    @_client_errors
    async def cancel(self, job_id: str, reason: str = "cancelled by a client") -> JobStatus:
        """Stop the job: its prompt is interrupted, finished artifacts are kept, CANCELLED.

        The reason is recorded first (`cancel_reason` signal), then Temporal's own cancel is
        requested, so the workflow also ends Canceled in Temporal. Returns the status the job
        had when the cancel was sent; `JobAlreadyEnded` (with the final status) when there is
        nothing left to cancel. Works without a worker: the job stops when one picks it up.
        A job its batch has yet to start is cancelled once started (within seconds).
        """
        try:
            current = await self.status(job_id)
        except errors.JobUnanswered:
            current = None
        action = "nothing to cancel"
        if current is not None and current.terminal:
            raise errors.JobAlreadyEnded(job_id, current, action)
        handle = self.handle(job_id)
        try:
            await handle.signal(SIGNAL_CANCEL_REASON, CancelRequest(reason=reason))
            await handle.cancel()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            if current is not None and await self._queued_in_batch(job_id) is not None:
                await self._until_started(job_id)
                return await self.cancel(job_id, reason)
            raise await self._not_found_or_ended(job_id, exc, action) from exc
        return current or JobStatus(job_id=job_id)

    @_client_errors
    async def resume(self, job_id: str, *, resubmit: bool = False) -> JobStatus:
        """Answer a job waiting in NEEDS_DECISION: re-attach to its prompt, or (resubmit=True)
        run the prompt again from step 0, on the GPU again (paid again).

        Only a job in NEEDS_DECISION takes it (its `decision` says why it waits and what each
        way out costs): a running, stopping or cancelled job refuses, as does a plain resume of
        a prompt the backend lost, with `ResumeRefused` and the job's reason. It does not
        restart a job that was cancelled or failed: submit the request again for that (under a
        new job ID). Answers with the job's status once it has acted on the decision; a job
        that has ended raises `JobAlreadyEnded`.
        """
        handle = self.handle(job_id)
        try:
            status: JobStatus = await handle.execute_update(
                UPDATE_RESUME, ResumeRequest(resubmit=resubmit), result_type=JobStatus
            )
            return status
        except WorkflowUpdateFailedError as exc:
            cause = exc.cause
            reason = cause.message if isinstance(cause, ApplicationError) else str(cause or exc)
            raise errors.ResumeRefused(job_id, reason) from exc
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            raise await self._not_found_or_ended(job_id, exc, "nothing to resume") from exc

    # -- following ----------------------------------------------------------------------------

    async def watch(
        self,
        job_id: str,
        *,
        poll_interval_s: float = 0.5,
        keepalive_s: float | None = None,
        reconnect: ReconnectPolicy | None = None,
        describe_after_s: float = 5.0,
        push_gap_s: float = 0.0,
        since: JobStatus | None = None,
        record_first: bool = True,
    ) -> AsyncIterator[JobStatus]:
        """Yield the job's status whenever it changes, the last one terminal (`_watch`)."""
        updates = self._watch(
            job_id,
            poll_interval_s=poll_interval_s,
            keepalive_s=keepalive_s,
            reconnect=reconnect,
            describe_after_s=describe_after_s,
            push_gap_s=push_gap_s,
            since=since,
            record_first=record_first,
        )
        async with aclosing(updates):
            with self.translated_errors():
                async for status in updates:
                    yield status

    async def _watch(
        self,
        job_id: str,
        *,
        poll_interval_s: float,
        keepalive_s: float | None,
        reconnect: ReconnectPolicy | None,
        describe_after_s: float,
        push_gap_s: float,
        since: JobStatus | None = None,
        record_first: bool = True,
    ) -> AsyncGenerator[JobStatus, None]:
        """Yield the job's status whenever it changes (its `seq`, the step it got to, or its
        `worker_wait`), the last one terminal.

        Polls the `status` query and, for attached jobs, sends `client_seen` about four times
        per abandonment horizon so the job knows someone is still listening. While a prompt is
        followed (SUBMITTING, WAITING, RUNNING), or an activity of the job may wait for a worker
        (PREPARING, STOPPING too), each poll reads the workflow's description instead: its
        follow activity's heartbeat gives the step (`starter.progress`), a scheduled activity no
        worker has started gives `worker_wait` (`starter.worker_wait`), and the
        query is asked again only when the history has grown since the last answer (the job's
        status changes only in workflow tasks, which write events), so one call per poll
        suffices between milestones; and it is asked in the background, so a worker too busy to
        answer at once does not hold up the heartbeat's steps (the last answer is shown with
        them meanwhile). Otherwise, while the answer stays the same for
        `describe_after_s`, Temporal's record is read too (at most that often), so a workflow
        terminated from outside ends the watch as TERMINATED. Transport errors are retried with
        the same bounded, jittered backoff the workflow uses; past the horizon without an answer
        `ContactLost` is raised, while the job runs on server-side.

        With the workers' live-progress key (`self.live`), while the job's prompt is followed by
        a worker that pushes its steps (`JobStatus.live_progress`), the watch also subscribes
        there and, between polls, hands out each pushed step laid over the last status polled
        (at most one every `push_gap_s`, the latest winning); the polls go on as the record.
        Until a status names that worker, it subscribes on every pushing worker of the task
        queue (`LiveRelay.workers`). `since`: the status the caller already has (what `submit`
        or `start` answered), not handed out again: steps pushed before the job's first answer
        are laid over it (a short job on a busy server may run to its end before that answer).

        `record_first`: when the job's first answer has not come within half a poll interval (a
        worker following a thousand jobs answers in seconds), the statuses meanwhile are read
        from Temporal's record alone (`_recorded`: the state and percent search attributes, the
        follow's heartbeat, a worker wait), so the heartbeat's and the pushed steps show at once.
        Such a status carries the `seq` of `since` (else 0) and only what the record holds (the
        outputs of the current segment, not the earlier ones); the job's answer follows. False
        (the gateway, whose journal cursor starts at the first status's `seq`): the first
        status is the job's own answer.
        """
        policy = reconnect or ReconnectPolicy()
        last_shown: tuple[object, ...] | None = None
        last_status = since if since is not None and since.job_id == job_id else None
        last_seq = -1
        last_seen = float("-inf")
        changed_at = time.monotonic()
        described_at: float | None = None  # None: not yet, so the first answer is checked
        # The last answer to the query, and the history (run, length) it was read after.
        answered: JobStatus | None = None
        answered_at: tuple[str | None, int] | None = None
        failures = 0
        lost_since: float | None = None
        query: PendingQuery[JobStatus, tuple[str | None, int]] = PendingQuery(
            lambda: self._query(job_id)
        )
        push: Pushed | None = None
        if self.live is not None:
            # The subscription an attached start made before the job existed, if any; on the
            # task queue's pushing workers until a status names the job's own.
            push = self.live.take(job_id) or Pushed(self.live, job_id)
            push.subscribe_early()

        async def poll_once() -> JobStatus | None:
            """One poll of the job (its status, with the heartbeat's step laid over it); None
            after a failure, once its backoff has passed."""
            nonlocal answered, answered_at, described_at, last_seen, changed_at, last_seq
            nonlocal failures, lost_since
            try:
                if failures:
                    # Back after a gap: one update both records contact and reads the state.
                    query.cancel()
                    status = answered = await self._attach_or_final(job_id)
                    answered_at = None
                    last_seen = time.monotonic()
                elif answered is None or answered.state in WAIT_STATES:
                    # The first poll, or an activity runs or waits (a prompt is followed, say).
                    # Described first: an answer read after it is at least as recent as the
                    # history it counts.
                    description = await self._describe(job_id)
                    history = (description.run_id, description.history_length)
                    ended = await self._recorded_end(job_id, description)
                    if ended is not None:
                        # The job has ended: its record holds the final status, read without
                        # a worker (a query of a closed workflow replays its whole history).
                        query.cancel()
                        answered, answered_at = ended, history
                    else:
                        if answered is None or history != answered_at:
                            query.ask(history)
                        # A busy worker answers late: meanwhile the last answer is shown with
                        # the heartbeat's newer step; before the first one, what the record
                        # says (or, without `record_first`, nothing: the answer is awaited).
                        late = answered is not None or record_first
                        got = await query.answer(poll_interval_s / 2 if late else None)
                        if got is not None:
                            answered, answered_at = got
                    described_at = time.monotonic()
                    if answered is None:
                        status = await self._recorded(job_id, description, last_status)
                    else:
                        status = await self._described(job_id, answered, description)
                else:
                    query.cancel()
                    status = answered = await self._query(job_id)
                    answered_at = None
                now = time.monotonic()
                if status.seq != last_seq:
                    changed_at = now
                last_seq = status.seq
                quiet_s = now - max(changed_at, described_at or changed_at)
                if not status.terminal and (described_at is None or quiet_s >= describe_after_s):
                    described_at = now
                    status = await self._described(job_id, status, await self._describe(job_id))
                interval = keepalive_s if keepalive_s is not None else _keepalive_interval(status)
                # Whether the job is detached is the job's to say: no contact before its answer.
                if (
                    answered is not None
                    and not status.terminal
                    and not status.detached
                    and now - last_seen >= interval
                ):
                    await self._client_seen(job_id)
                    last_seen = time.monotonic()
            except (
                RPCError,
                RPCTimeoutOrCancelledError,
                RuntimeError,
                WorkflowUpdateFailedError,
                errors.JobUnanswered,
            ) as exc:
                if _being_cancelled():
                    # A cancel (Ctrl-C) that landed in an update call, which the SDK turns
                    # into an RPC error: it ends the watch, it is no failure to retry.
                    raise asyncio.CancelledError() from exc
                lost_since = lost_since if lost_since is not None else time.monotonic()
                if time.monotonic() - lost_since > policy.horizon_s:
                    raise errors.ContactLost(job_id, failures, exc) from exc
                delay = reconnect_delay(
                    failures, policy.base_delay_s, policy.max_delay_s, random.random()
                )
                failures += 1
                await asyncio.sleep(delay)
                return None
            failures, lost_since = 0, None
            return status

        async def pushed(
            next_beat: Callable[[], Coroutine[Any, Any, FollowHeartbeat | None]],
        ) -> AsyncIterator[JobStatus]:
            """Each beat `next_beat` brings, up to its first None, laid over the last status:
            handed out when it shows something new, one every `push_gap_s` at most."""
            nonlocal last_status, last_shown
            while (beat := await next_beat()) is not None:
                moved = _pushed(beat, last_status, last_shown)
                if moved is not None:
                    last_status, last_shown = moved, _shown(moved)
                    yield moved
                    await asyncio.sleep(push_gap_s)

        try:
            while True:
                # A poll can take long on a loaded server: the steps pushed meanwhile go out.
                polling = asyncio.ensure_future(poll_once())
                try:
                    if push is not None:
                        async for moved in pushed(functools.partial(push.next_or, polling)):
                            yield moved
                    polled = await polling
                finally:
                    if polling.done():
                        # Read, so an error of a poll nobody awaited (the watch was closed
                        # while it ran) is not reported as never retrieved.
                        _ = polling.cancelled() or polling.exception()
                    else:
                        polling.cancel()
                if polled is None:
                    continue
                status = polled
                if push is not None and push.beat is not None:
                    status = overlaid(status, [push.beat])
                status = _not_behind(status, last_status)
                last_status = status
                shown = _shown(status)
                if shown != last_shown or status.terminal:
                    last_shown = shown
                    yield status
                if status.terminal:
                    return
                if push is None:
                    await asyncio.sleep(poll_interval_s)
                    continue
                push.follow_own(status.live_progress if status.state in FOLLOW_STATES else None)
                # Until the next poll: each step the worker pushes, laid over the last status.
                deadline = time.monotonic() + poll_interval_s
                async for moved in pushed(functools.partial(push.next_before, deadline)):
                    yield moved
        finally:
            query.cancel()
            if push is not None:
                push.close()

    async def _attach_or_final(self, job_id: str) -> JobStatus:
        try:
            return await self._attach(job_id)
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            ended = await self._ended_status(job_id)
            if ended is None:
                raise
            return ended

    @_client_errors
    async def wait(self, job_id: str) -> JobStatus:
        """Wait for the job to end; return its final status whatever the outcome.

        The job's result is its final status, and so are the details of the error a FAILED job
        ends with: read from there, without asking a worker to replay the closed workflow. Only
        an ending that carries no status (a cancel through Temporal, a workflow terminated or
        timed out from outside) is asked with a status query. A job with a webhook (started
        by this client: its memo says so) may have ended while its workflow still delivers the
        last events: it answers at once, through the `ended` update (`status.webhook.pending`
        says what is still on its way). Other jobs are not asked: an update is a workflow task
        and two history events, which the workflow's result makes unnecessary.
        """
        handle = self.temporal.get_workflow_handle(checked_job_id(job_id))
        try:
            final = await self._final(handle)
        except RPCError as exc:
            if not _job_missing(exc):
                raise
            # A job its batch has yet to start is waited for from its start.
            await self._until_started(job_id)
            final = await self._final(handle)
        if final is not None and final.job_id == job_id:
            return final
        return await self.status(job_id)

    async def _final(self, handle: WorkflowHandle[Any, Any]) -> JobStatus | None:
        """The job's final status as its result (or its failure's details) carries it."""
        try:
            if await self._has_webhook(handle):
                return _final_status(await self._ended_or_result(handle))
            return _final_status(await handle.result())
        except WorkflowFailureError as exc:
            cause = exc.cause
            details = cause.details if isinstance(cause, ApplicationError) else ()
            return _final_status(details[0] if details else None)

    @staticmethod
    async def _has_webhook(handle: WorkflowHandle[Any, Any]) -> bool:
        description = await handle.describe()
        return bool(await description.memo_value(MEMO_WEBHOOK, False))

    async def _ended_or_result(self, handle: WorkflowHandle[Any, Any]) -> object:
        """The workflow's result, or sooner its terminal status from the `ended` update: a job
        that has ended may still be delivering its last webhooks, which a client waiting for
        the job's end does not wait for. The result alone when the update is not answered (the
        workflow has closed, or runs on a worker that predates the update)."""
        result = asyncio.create_task(handle.result())
        try:
            while True:
                ended = asyncio.create_task(self._ended(handle))
                await asyncio.wait({result, ended}, return_when=asyncio.FIRST_COMPLETED)
                if result.done():
                    ended.cancel()
                    return result.result()
                status = ended.result()
                if status is None:
                    return await result
                if status.terminal:
                    return status
                # The run continues as new: ask the next one (once it has started).
                await asyncio.sleep(0.2)
        finally:
            result.cancel()

    async def _ended(self, handle: WorkflowHandle[Any, Any]) -> JobStatus | None:
        try:
            status: JobStatus = await handle.execute_update(UPDATE_ENDED, result_type=JobStatus)
        except (RPCError, RPCTimeoutOrCancelledError, WorkflowUpdateFailedError):
            return None
        return status

    @_client_errors
    async def result(self, job_id: str, *, presign: bool = True) -> JobStatus:
        """The final status, with presigned URLs for the artifacts when S3 access is set up."""
        status = await self.wait(job_id)
        if presign and self.store is not None:
            ttl_s = await self._presign_ttl(job_id)
            status.artifacts = [await self._presigned(a, ttl_s) for a in status.artifacts]
        return status

    async def _presign_ttl(self, job_id: str) -> int:
        """The link lifetime the job's request asked for (`output.presign_ttl_s`).

        Read from the run's start event (its argument holds the request), so a client that
        did not submit the job still honours it.
        """
        default = OutputSpec().presign_ttl_s
        try:
            async for event in self.handle(job_id).fetch_history_events():
                payloads = event.workflow_execution_started_event_attributes.input.payloads
                if not payloads:
                    return default
                converter = self.temporal.data_converter
                [job_input] = await converter.decode(list(payloads[:1]), [JobInput])
                return int(job_input.request.output.presign_ttl_s)
        except (RPCError, ValueError, TypeError):
            return default
        return default

    async def _presigned(self, artifact: Artifact, ttl_s: int = 3600) -> Artifact:
        assert self.store is not None
        bucket = artifact.uri.removeprefix("s3://").split("/", 1)[0]
        url = await self.store.presign_get(artifact.key, ttl_s, bucket=bucket)
        return artifact.model_copy(update={"url": url})

    def require_store(self) -> ArtifactStore:
        if self.store is None:
            raise errors.StorageNotConfigured(
                "downloading needs the artifact bucket: set DURABLE_COMFY_BUCKET (and "
                "DURABLE_COMFY_S3_ENDPOINT off AWS) with credentials from AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY or any source botocore reads (the local stack writes its "
                "own to its env file)"
            )
        return self.store

    @_client_errors
    async def download(self, status: JobStatus, directory: Path) -> list[Path]:
        """Download every artifact, each one checked against its sha256."""
        store = self.require_store()
        paths: list[Path] = []
        for artifact in status.artifacts:
            bucket = artifact.uri.removeprefix("s3://").split("/", 1)[0]
            dest = directory / _relative_download_path(artifact.key, directory)
            dest.parent.mkdir(parents=True, exist_ok=True)
            paths.append(
                await store.download(
                    artifact.key, dest, expected_sha256=artifact.sha256, bucket=bucket
                )
            )
        return paths


def _relative_download_path(key: str, directory: Path) -> PurePosixPath:
    """Where under the download directory an artifact goes: its key, which must stay there.

    Keys are built inside the job's folder, but a status is only data (a query answer, a
    result): a second guard costs nothing.
    """
    path = PurePosixPath(key)
    if path.is_absolute() or any(p == ".." for p in path.parts) or any(c in key for c in "\\\0"):
        raise errors.UnsafeArtifactKey(
            f"artifact key {key[:200]!r} would be written outside {directory}: not downloaded"
        )
    return path


def checked_job_id(job_id: str) -> str:
    try:
        return validate_job_id(job_id)
    except ValueError as exc:
        raise errors.InvalidJobId(str(exc)) from None


def _final_status(value: object) -> JobStatus | None:
    """A final `JobStatus` as a job ends with it (its result, its error's first detail)."""
    if value is None:
        return None
    try:
        status = JobStatus.model_validate(value)
    except ValidationError:
        return None
    return status if status.terminal else None


_LIFTED = (JobState.WAITING, JobState.RUNNING)


def _pushed(
    beat: FollowHeartbeat, last: JobStatus | None, shown: tuple[object, ...] | None
) -> JobStatus | None:
    """`last` with a pushed beat laid over it, when that shows something new."""
    if last is None:
        return None
    moved = _not_behind(overlaid(last, [beat]), last)
    return moved if _shown(moved) != shown else None


def _not_behind(status: JobStatus, last: JobStatus | None) -> JobStatus:
    """Never backwards while the job's own status stays the same (its `seq`), and never to an
    earlier step of the same submission after it: what a heartbeat
    showed (a step, WAITING or RUNNING before the job heard) stays shown when the next poll
    finds no heartbeat to lay over it (the follow attempt just failed, and the job has not
    yet recovered its checkpoint)."""
    if last is None or status.terminal:
        return status
    if status.seq != last.seq:
        # A newer status of the same submission, written before the job heard of the step a
        # heartbeat or a push showed (an attempt failed in its quiet start): the step stays.
        return carried_forward(status, last)
    now, then = status.checkpoint, last.checkpoint
    if (
        now is None
        or then is None
        or (now.prompt_id, now.client_id)
        != (
            then.prompt_id,
            then.client_id,
        )
    ):
        return status
    behind = last.progress.step > status.progress.step
    unlifted = status.state == JobState.SUBMITTING and last.state in _LIFTED
    if not (behind or unlifted):
        return status
    return status.model_copy(
        update={
            "state": last.state if unlifted else status.state,
            "progress": last.progress if behind else status.progress,
            "checkpoint": last.checkpoint if behind else status.checkpoint,
            "updated_at": max(filter(None, (status.updated_at, last.updated_at)), default=None),
        }
    )


def _being_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _shown(status: JobStatus) -> tuple[object, ...]:
    """What `watch` compares: the job's own changes, the progress a heartbeat moves, an
    activity waiting for a worker (appearing, changing, gone), where the job's steps are
    pushed from (a gateway subscribes there), and a PENDING job's place as its queue has it."""
    progress = status.progress
    admission = status.admission
    return (
        None if admission is None else (admission.position, admission.waiting, admission.eta_s),
        status.seq,
        status.state,
        progress.step,
        progress.total_steps,
        progress.fraction,
        progress.queue_position,
        status.worker_wait,
        status.live_progress,
    )


def _problems(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())


def _short(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def _keepalive_interval(status: JobStatus) -> float:
    """About a quarter of the abandonment horizon, so one lost signal never abandons a job."""
    if status.abandon_after_s is None:
        return 30.0
    return max(0.1, status.abandon_after_s / 4)


def request_summary(request: JobRequest) -> str:
    """One line for the Temporal UI: what runs where."""
    segments = max(1, len(request.segments))
    pool = request.pool or "the default pool"
    return f"{len(request.graph)}-node ComfyUI graph on {pool}, {segments} segment(s)" + (
        f", {len(request.inputs)} input file(s)" if request.inputs else ""
    )


def request_details(request: JobRequest) -> str:
    """The graph's node classes and the policy that matters to an operator, in Markdown."""
    classes = Counter(str(node.get("class_type", "?")) for node in request.graph.values())
    policy = request.policy
    lines = [
        "**nodes**: " + ", ".join(f"{name} x{count}" for name, count in sorted(classes.items())),
        f"**execution timeout**: {policy.execution_timeout_s:.0f} s; "
        f"**reconnect horizon**: {policy.reconnect.horizon_s:.0f} s; "
        f"**teardown horizon**: {policy.teardown_horizon_s:.0f} s",
        f"**attached**: abandoned after {policy.abandon_after_s:.0f} s without a client"
        if policy.abandon_after_s is not None
        else "**detached**: runs to its end whoever is listening",
    ]
    if request.labels:
        lines.append("**labels**: " + ", ".join(f"{k}={v}" for k, v in request.labels.items()))
    return "  \n".join(lines)
