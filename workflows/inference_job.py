"""The `InferenceJob` workflow: one ComfyUI job, from request to confirmed artifacts.

prepare → for each segment: submit → follow (progress, artifacts streamed to S3) → offload
(reconcile against history, verify) → tear down → COMPLETED. Any failure: tear down, FAILED.
The job's state lives here; clients read it with the `status` query.
"""

from __future__ import annotations

from datetime import timedelta

from pydantic import ValidationError
from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows.activity_io import (
        FollowInput,
        FollowResult,
        OffloadInput,
        OffloadResult,
        PreparedJob,
        PrepareInput,
        SubmitInput,
        SubmitResult,
        TeardownInput,
        TeardownResult,
    )
    from workflows.contracts import (
        Artifact,
        BackendInfo,
        Checkpoint,
        JobError,
        JobRequest,
        JobState,
        JobStatus,
        Progress,
        ProgressReport,
        Teardown,
    )
    from workflows.graph import apply_overrides, with_unique_save_prefixes
    from workflows.shared import (
        QUERY_STATUS,
        SA_JOB_POOL,
        SA_JOB_PROGRESS,
        SA_JOB_STATE,
        SIGNAL_CLIENT_SEEN,
        SIGNAL_PROGRESS,
        UPDATE_ATTACH,
        WORKFLOW_TYPE,
        ErrorType,
    )

STATE_KEY = SearchAttributeKey.for_keyword(SA_JOB_STATE)
PROGRESS_KEY = SearchAttributeKey.for_int(SA_JOB_PROGRESS)
POOL_KEY = SearchAttributeKey.for_keyword(SA_JOB_POOL)

QUICK_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=10,
)


@workflow.defn(name=WORKFLOW_TYPE, failure_exception_types=[ValidationError])
class InferenceJob:
    @workflow.init
    def __init__(self, request: JobRequest) -> None:
        now = workflow.now()
        self._request = request
        self._status = JobStatus(
            job_id=workflow.info().workflow_id,
            state=JobState.QUEUED,
            progress=Progress(segments=max(1, len(request.segments))),
            detached=request.policy.detached,
            created_at=now,
            updated_at=now,
            last_client_contact_at=now,
        )
        # Progress from an earlier attempt's socket must not overwrite the current one's.
        self._client_id: str | None = None
        self._last_coarse_progress = -1

    # -- messages ---------------------------------------------------------------------------

    @workflow.query(name=QUERY_STATUS)
    def status(self) -> JobStatus:
        return self._status

    @workflow.signal(name=SIGNAL_PROGRESS)
    def progress(self, report: ProgressReport) -> None:
        if report.attempt_client_id != self._client_id or self._status.terminal:
            return
        self._apply_progress(report)

    @workflow.signal(name=SIGNAL_CLIENT_SEEN)
    def client_seen(self) -> None:
        self._status.last_client_contact_at = workflow.now()

    @workflow.update(name=UPDATE_ATTACH)
    def attach(self) -> JobStatus:
        self._status.last_client_contact_at = workflow.now()
        self._touch()
        return self._status

    # -- the process ------------------------------------------------------------------------

    @workflow.run
    async def run(self, request: JobRequest) -> JobStatus:
        prompt_id: str | None = None
        pool = request.pool or ""
        try:
            self._set_state(JobState.PREPARING)
            prepared = await self._prepare(request)
            pool = prepared.pool
            segments = request.segments or [{}]
            for segment, overrides in enumerate(segments):
                prompt_id = str(workflow.uuid4())
                await self._run_segment(request, prepared, segment, overrides, prompt_id)
            self._status.teardown = await self._teardown(pool, prompt_id, "completed")
            self._set_state(JobState.COMPLETED)
        except (ActivityError, ApplicationError) as err:
            self._status.error = job_error(err)
            if pool:
                self._status.teardown = await self._teardown(pool, prompt_id, "failed")
            else:
                self._status.teardown = Teardown(
                    state="SKIPPED", at=workflow.now(), detail="nothing was submitted"
                )
            self._set_state(JobState.FAILED)
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._status.state == JobState.FAILED and self._status.error is not None:
            # The Temporal UI shows the job as failed, with the typed reason.
            raise ApplicationError(
                self._status.error.message,
                self._status,
                type=self._status.error.type,
                non_retryable=True,
            )
        return self._status

    async def _prepare(self, request: JobRequest) -> PreparedJob:
        prepared: PreparedJob = await workflow.execute_activity(
            "prepare_prompt",
            PrepareInput(
                job_id=self._status.job_id,
                pool=request.pool,
                graph=request.graph,
                inputs=request.inputs,
                segments=request.segments,
            ),
            result_type=PreparedJob,
            start_to_close_timeout=timedelta(minutes=2),
            retry_policy=QUICK_RETRY,
        )
        self._status.backend = BackendInfo(pool=prepared.pool, kind=prepared.kind)
        workflow.upsert_search_attributes([POOL_KEY.value_set(prepared.pool)])
        return prepared

    async def _run_segment(
        self,
        request: JobRequest,
        prepared: PreparedJob,
        segment: int,
        overrides: dict[str, dict[str, object]],
        prompt_id: str,
    ) -> None:
        job_id = self._status.job_id
        run_tag = f"dc_{safe_tag(job_id)}_{segment}_{prompt_id[:8]}"
        graph = with_unique_save_prefixes(apply_overrides(prepared.graph, overrides), run_tag)
        client_id = f"dc-{workflow.uuid4()}"
        self._client_id = client_id
        self._status.checkpoint = Checkpoint(
            job_id=job_id,
            segment=segment,
            prompt_id=prompt_id,
            client_id=client_id,
            total_steps=sum(prepared.sampler_steps.values()),
            updated_at=workflow.now(),
        )
        self._status.progress = Progress(
            segment=segment,
            segments=max(1, len(request.segments)),
            total_steps=sum(prepared.sampler_steps.values()) or prepared.nodes_total,
            unit="steps" if prepared.sampler_steps else "nodes",
        )
        self._set_state(JobState.SUBMITTING)
        await workflow.execute_activity(
            "submit_prompt",
            SubmitInput(
                job_id=job_id,
                pool=prepared.pool,
                prompt_id=prompt_id,
                client_id=client_id,
                segment=segment,
                graph=graph,
            ),
            result_type=SubmitResult,
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=QUICK_RETRY,
        )
        if self._status.backend is not None:
            self._status.backend.provider_job_id = prompt_id
        self._set_state(JobState.RUNNING)
        stored = [a for a in self._status.artifacts if a.segment == segment]
        followed: FollowResult = await workflow.execute_activity(
            "follow_prompt",
            FollowInput(
                job_id=job_id,
                pool=prepared.pool,
                prompt_id=prompt_id,
                client_id=client_id,
                segment=segment,
                segments=max(1, len(request.segments)),
                run_tag=run_tag,
                sampler_steps=prepared.sampler_steps,
                nodes_total=prepared.nodes_total,
                output=request.output,
                progress_interval_s=request.policy.progress_interval_s,
                stored=stored,
            ),
            result_type=FollowResult,
            start_to_close_timeout=timedelta(seconds=request.policy.execution_timeout_s),
            heartbeat_timeout=timedelta(seconds=request.policy.heartbeat_timeout_s),
            retry_policy=RetryPolicy(
                initial_interval=timedelta(seconds=request.policy.reconnect.base_delay_s),
                maximum_interval=timedelta(seconds=request.policy.reconnect.max_delay_s),
                backoff_coefficient=2.0,
            ),
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )
        self._merge_artifacts(followed.artifacts)
        self._status.checkpoint = followed.checkpoint
        self._set_state(JobState.UPLOADING)
        offloaded: OffloadResult = await workflow.execute_activity(
            "offload_outputs",
            OffloadInput(
                job_id=job_id,
                pool=prepared.pool,
                prompt_id=prompt_id,
                segment=segment,
                run_tag=run_tag,
                output=request.output,
                stored=[a for a in self._status.artifacts if a.segment == segment],
            ),
            result_type=OffloadResult,
            start_to_close_timeout=timedelta(minutes=30),
            heartbeat_timeout=timedelta(minutes=2),
            retry_policy=QUICK_RETRY,
        )
        self._merge_artifacts(offloaded.artifacts)
        if not any(a.segment == segment for a in self._status.artifacts):
            raise ApplicationError(
                f"segment {segment} finished without any saved output (add a SaveImage node?)",
                type=ErrorType.OUTPUT_MISSING,
                non_retryable=True,
            )
        self._status.progress.step = self._status.progress.total_steps
        self._status.progress.fraction = (segment + 1) / max(1, len(request.segments))
        self._touch()

    async def _teardown(self, pool: str, prompt_id: str | None, reason: str) -> Teardown:
        try:
            result: TeardownResult = await workflow.execute_activity(
                "teardown_prompt",
                TeardownInput(
                    job_id=self._status.job_id, pool=pool, prompt_id=prompt_id, reason=reason
                ),
                result_type=TeardownResult,
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=QUICK_RETRY,
            )
        except ActivityError as err:
            return Teardown(state="FAILED", at=workflow.now(), detail=str(err.cause or err))
        return result.teardown

    # -- state bookkeeping ------------------------------------------------------------------

    def _apply_progress(self, report: ProgressReport) -> None:
        progress = self._status.progress
        progress.step = report.step
        progress.total_steps = report.total_steps or progress.total_steps
        if progress.total_steps:
            within = min(1.0, report.step / progress.total_steps)
            progress.fraction = (progress.segment + within) / max(1, progress.segments)
        if report.checkpoint is not None:
            self._status.checkpoint = report.checkpoint
        if report.artifact is not None:
            self._merge_artifacts([report.artifact])
        if self._status.backend is not None and report.worker_id:
            self._status.backend.worker_id = report.worker_id
        self._touch()
        self._upsert_progress()

    def _merge_artifacts(self, artifacts: list[Artifact]) -> None:
        known = {a.key for a in self._status.artifacts}
        for artifact in artifacts:
            if artifact.key not in known:
                self._status.artifacts.append(artifact)
                known.add(artifact.key)

    def _touch(self) -> None:
        self._status.seq += 1
        self._status.updated_at = workflow.now()

    def _set_state(self, state: JobState) -> None:
        self._status.state = state
        self._touch()
        workflow.upsert_search_attributes(
            [STATE_KEY.value_set(state.value), PROGRESS_KEY.value_set(self._coarse_progress())]
        )
        workflow.set_current_details(self._details())

    def _coarse_progress(self) -> int:
        return int(self._status.progress.fraction * 10) * 10

    def _upsert_progress(self) -> None:
        # Only whole tens: a search-attribute upsert costs history events.
        coarse = self._coarse_progress()
        if coarse != self._last_coarse_progress:
            self._last_coarse_progress = coarse
            workflow.upsert_search_attributes([PROGRESS_KEY.value_set(coarse)])

    def _details(self) -> str:
        status = self._status
        lines = [f"**{status.state.value}** — {int(status.progress.fraction * 100)} %"]
        if status.backend:
            lines.append(f"pool `{status.backend.pool}`")
        if status.error:
            lines.append(f"error `{status.error.type}`: {status.error.message}")
        if status.artifacts:
            lines.append(f"{len(status.artifacts)} artifact(s) stored")
        return "  \n".join(lines)


def job_error(err: ActivityError | ApplicationError) -> JobError:
    cause = err.cause if isinstance(err, ActivityError) else err
    if isinstance(cause, ApplicationError):
        return JobError(
            type=cause.type or ErrorType.EXECUTION_ERROR,
            message=cause.message,
            retryable=not cause.non_retryable,
        )
    return JobError(type=ErrorType.TIMEOUT, message=str(cause or err), retryable=True)


def safe_tag(job_id: str) -> str:
    """The job ID as a file-name component on the backend (no ':' on every filesystem)."""
    cleaned = "".join(c if c.isalnum() or c in "-_" else "_" for c in job_id)
    return cleaned[:48]
