"""One RunPod job, start to end: read the input, claim the submission, run the graph, return
the result. Everything the handler does, without the `runpod` SDK: `handler.py` passes the
job and the SDK's `progress_update`, tests pass a list's `append`.

Two kinds of input (contract.EndpointInput):
- stock (worker-comfyui 5.x clients): no `durable_comfy` block; answered as worker-comfyui does
  (`images: [{filename, type, data}]`, `errors`, `status: success_no_images`), base64 unless the
  endpoint has a bucket and `BUCKET_NAME`;
- orchestrated (`durable_comfy` block): the prompt and client IDs are the orchestrator's, progress
  updates carry the checkpoint, outputs go to the job's S3 folder as each node finishes, and with
  `claims` the submission token runs the graph at most once (claims.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, NoReturn

import httpx
import structlog

from endpoint.claims import Acquired, ClaimStore, Decision, Finished, HeldElsewhere, StoredClaim
from endpoint.errors import ClaimConflict, ClaimError, InputProblem
from endpoint.execution import Execution, ExecutionResult
from endpoint.failures import failure_of, failure_of_end
from endpoint.fence_file import FenceFile
from endpoint.fencing import SelfFence, fenced_error
from endpoint.handover import inline_outputs, succeeded
from endpoint.inputs import read_input
from endpoint.lease import Lease
from endpoint.nodes import PUBLISHER
from endpoint.outputs import Base64Sink, OutputSink, S3Sink
from endpoint.reporting import ProgressReporter, ProgressSink
from endpoint.s3 import S3, Patience
from endpoint.settings import EndpointSettings
from endpoint.staged_inputs import StagedInputs
from endpoint.stopping import WorkerReplacer, stop_prompt, wait_out
from endpoint.takeover import Left, recorded_end, what_is_left, with_kept
from protocol.comfyui.client import ComfyClient
from protocol.comfyui.follower import PromptEnd as FollowedEnd
from protocol.keys import artifact_key
from protocol.progress import ProgressTracker
from protocol.runpod.contract import (
    DEFAULT_STOP_HORIZON_S,
    ArtifactRecord,
    Claim,
    ClaimOutcome,
    EndpointError,
    EndpointInput,
    EndpointOutput,
    Orchestration,
    StopRecord,
    claim_key,
    delivery_key,
    inputs_folder,
)

log = structlog.get_logger(__name__)

# The tag in ComfyUI's extra_data: whose prompt this is (not the orchestrator's orphan-sweep tag,
# which this ComfyUI is not swept by).
PROMPT_TAG = "durable_comfy_runpod"
# How long a re-delivery of our own job waits for the earlier delivery's lease to run out.
WAIT_OUT_FACTOR = 2.0
# While claiming, a progress update at least this often (a fraction of the claim lease).
CLAIMING_REPORT_FACTOR = 1 / 3
# Once the worker is being replaced, how long the run's own clean-up (aborting uploads) may
# keep the process.
REPLACED_CLEANUP_S = 10.0


async def run_job(
    job: Mapping[str, Any],
    settings: EndpointSettings,
    progress: ProgressSink | None = None,
    *,
    replace_worker: WorkerReplacer | None = None,
) -> dict[str, Any]:
    """Run one RunPod job (`{"id", "input"}`) and return the handler's result.

    When the platform stops the job (our task is cancelled, maybe many times), the prompt is
    stopped until ComfyUI no longer holds it, and CancelledError is raised. `replace_worker`
    is called when a prompt outlives the job's stop horizon (handler.py passes
    `stopping.replace_this_worker`)."""
    job_id = str(job.get("id") or "")
    structlog.contextvars.bind_contextvars(runpod_job=job_id)
    try:
        try:
            request = read_input(job.get("input"))
        except InputProblem as exc:
            log.info("input_rejected", error=str(exc))
            return _dump(failure_of(exc))
        # Local ComfyUI only: a proxy from the environment must not get in between.
        timeout = httpx.Timeout(60.0, connect=5.0)
        # Every stop of the job ends inside this block: nothing runs on with a closed client.
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as http:
            client = ComfyClient(settings.comfy_url, http)
            s3 = None
            if settings.bucket is not None:
                s3 = S3(settings.bucket, retry_s=settings.bucket_retry_s)
            if request.durable_comfy is None:
                stock = StockJob(job_id, request, client, s3, settings)
                stock.replace_worker = replace_worker
                return await stock.run()
            orchestrated = OrchestratedJob(
                job_id, request, request.durable_comfy, client, s3, settings, progress
            )
            orchestrated.replace_worker = replace_worker
            return await orchestrated.run()
    finally:
        structlog.contextvars.unbind_contextvars("runpod_job")


class JobStop:
    """The stop of one run after the platform stopped its job: the prompt stopped until
    ComfyUI no longer holds it (or the horizon passed), the verdict in the claim when there is
    one, and the worker replaced when the prompt would not stop."""

    def __init__(
        self,
        client: ComfyClient,
        settings: EndpointSettings,
        *,
        horizon_s: float,
        replace_worker: WorkerReplacer | None,
        log: Any,
    ) -> None:
        """`log`: bound to the job (its IDs), as every line of the stop carries them."""
        self.client = client
        self.settings = settings
        self.horizon_s = horizon_s
        self.replace_worker = replace_worker
        self.log = log

    async def stopped(
        self,
        execution: Execution,
        work: asyncio.Task[Any],
        lease: Lease | None = None,
        *,
        since: tuple[float, datetime] | None = None,
    ) -> NoReturn:
        """Call from our task's `except CancelledError`: the whole stop runs as one task that
        further cancels of ours do not abort; then the job ends cancelled. `since`: when the
        first stop came (time.monotonic(), wall clock), if not now."""
        first = since or (time.monotonic(), datetime.now(UTC))
        stop = asyncio.create_task(self._run(execution, work, lease, first), name="stop the prompt")
        await wait_out(stop, "stopping the prompt")
        if not stop.cancelled() and (problem := stop.exception()) is not None:
            self.log.error("stop_failed", exc_info=problem)
        raise asyncio.CancelledError

    async def _run(
        self,
        execution: Execution,
        work: asyncio.Task[Any],
        lease: Lease | None,
        first: tuple[float, datetime],
    ) -> None:
        since, started_at = first
        self.log.info("job_stop_requested", horizon_s=self.horizon_s)
        if lease is not None:
            lease.mark_stopping(started_at)  # renewed meanwhile, as throughout the stop
        subject = execution.stop_subject()
        execution.cancel_outputs()
        work.cancel()
        stopping = asyncio.create_task(
            stop_prompt(
                self.client,
                subject,
                horizon_s=self.horizon_s,
                since=since,
                started_at=started_at,
                worker_id=self.settings.worker_id,
                comfy_pid=self.settings.comfy_pid,
            ),
            name="stop the prompt",
        )
        if lease is not None and await _fence_first(lease, stopping):
            # The claim could not be renewed meanwhile: the prompt must be gone by the lease's
            # end, whatever the stop horizon, and the claim records the fence, not an outcome.
            fence = SelfFence(
                self.client, self.settings, replace_worker=self.replace_worker, log=self.log
            )
            fenced = await fence.fence(execution, work, lease)
            if fenced.record.action != "still_running":
                # No outcome: its outputs stay for a later delivery (the worker's go with it).
                await execution.files.clear(stored_outputs=False)
            return
        record = await stopping
        replace = record.prompt == "still_running"
        record.worker_replaced = replace
        # No claim: nobody comes back for this run's outputs.
        recorded = True
        if lease is not None:
            # First the verdict, then the worker: the claim must say why the worker went.
            recorded = await self._record(lease, execution.records(), record)
        if not replace:
            await asyncio.gather(work, return_exceptions=True)
            # The prompt is gone and the uploads have ended: the run's files go (outputs only
            # once the claim says the run is over: until then a later delivery may need them).
            await execution.files.clear(stored_outputs=recorded)
            return
        # The files stay under a prompt that still runs; the worker goes, and they with it.
        self.log.warning(
            "worker_replaced",
            worker_id=self.settings.worker_id,
            node=record.node,
            node_type=record.node_type,
            detail=record.detail,
        )
        if self.replace_worker is None:
            self.log.error("worker_not_replaced", reason="no replace_worker given")
        else:
            self.replace_worker()
        await asyncio.wait({work}, timeout=REPLACED_CLEANUP_S)

    async def _record(self, lease: Lease, images: list[ArtifactRecord], record: StopRecord) -> bool:
        """Finish the claim as cancelled; True when it is recorded."""
        outcome = _outcome("cancelled", images=images, error="cancelled", stop=record)
        try:
            await lease.finish(outcome)
        except (ClaimConflict, ClaimError) as exc:
            self.log.warning("claim_outcome_not_recorded", state="cancelled", error=str(exc))
            return False
        return True


class StockJob:
    """worker-comfyui's contract, so one endpoint serves stock clients too."""

    def __init__(
        self,
        job_id: str,
        request: EndpointInput,
        client: ComfyClient,
        s3: S3 | None,
        settings: EndpointSettings,
    ) -> None:
        self.job_id = job_id
        self.request = request
        self.client = client
        self.s3 = s3
        self.settings = settings
        self.replace_worker: WorkerReplacer | None = None

    async def run(self) -> dict[str, Any]:
        prompt_id = str(uuid.uuid4())
        execution = Execution(
            self.client,
            self.settings,
            graph=self.request.workflow,
            images=self.request.images,
            prompt_id=prompt_id,
            client_id=str(uuid.uuid4()),
            extra_data=_extra_data(self.request, {"runpod_job_id": self.job_id}),
            sink=self._sink(),
            tracker=ProgressTracker({}, 0),
            reporter=None,  # worker-comfyui sends no progress
        )
        work = asyncio.create_task(execution.run(), name=f"run {prompt_id}")
        try:
            await asyncio.wait({work})
        except asyncio.CancelledError:
            stop = JobStop(
                self.client,
                self.settings,
                horizon_s=DEFAULT_STOP_HORIZON_S,
                replace_worker=self.replace_worker,
                log=log.bind(runpod_job_id=self.job_id, prompt_id=prompt_id),
            )
            await stop.stopped(execution, work)
        # A stock answer is final (nobody re-attaches to its prompt): the run's files go.
        await _clear_files(execution, stored_outputs=True)
        try:
            result = work.result()
        except Exception as exc:
            return _dump(failure_of(exc))
        failure = failure_of_end(result.end)
        if failure is None:
            return _stock_output(result.records, [])
        if result.records and not failure.refresh_worker:
            # worker-comfyui returns what was produced, with the error as a non-fatal one.
            return _stock_output(result.records, failure.details or [failure.error])
        failed = failure.model_copy(update={"error": "Job processing failed"})
        failed.details = failure.details or [failure.error]
        return _dump(failed)

    def _sink(self) -> OutputSink:
        bucket = self.settings.bucket
        if self.s3 is None or bucket is None or bucket.default_bucket is None:
            return Base64Sink()
        prefix, job_id = bucket.stock_prefix, self.job_id or "local"
        return S3Sink(
            self.s3,
            bucket.default_bucket,
            lambda node, filename: artifact_key(prefix, job_id, 0, node, filename),
            presign=True,
            retry_s=self.settings.bucket_retry_s,
        )


class OrchestratedJob:
    """A job with the orchestrator's `durable_comfy` block."""

    def __init__(
        self,
        job_id: str,
        request: EndpointInput,
        orchestration: Orchestration,
        client: ComfyClient,
        s3: S3 | None,
        settings: EndpointSettings,
        progress: ProgressSink | None,
    ) -> None:
        self.job_id = job_id
        self.request = request
        self.o = orchestration
        self.client = client
        self.s3 = s3
        self.settings = settings
        self.tracker = ProgressTracker(
            orchestration.sampler_steps,
            orchestration.nodes_total,
            min_interval_s=orchestration.progress_interval_s,
            # An update to the platform costs no workflow history (unlike the orchestrator's
            # signals, which the fraction rule bounds): every step may go, at the interval.
            min_fraction=0.0,
        )
        self.reporter = ProgressReporter(
            progress or _discard,
            self.tracker,
            submission=orchestration.submission,
            prompt_id=orchestration.prompt_id,
            worker_id=settings.worker_id,
        )
        self.log = log.bind(
            job_id=orchestration.job_id,
            submission=orchestration.submission,
            prompt_id=orchestration.prompt_id,
        )
        self.replace_worker: WorkerReplacer | None = None
        # Set when the platform stops the job while its claim is being taken.
        self._stopping = asyncio.Event()
        # The delivery marker's write: it runs on by itself (a reference keeps it alive).
        self._marking: asyncio.Task[None] | None = None

    async def run(self) -> dict[str, Any]:
        o = self.o
        if o.claims and self.s3 is None:
            return self._error(
                EndpointError(
                    error="this job asks for claims (at-most-once execution) but the endpoint "
                    "has no bucket: set BUCKET_ENDPOINT_URL, BUCKET_ACCESS_KEY_ID and "
                    "BUCKET_SECRET_ACCESS_KEY on the endpoint, or send claims: false",
                    error_type="BackendError",
                )
            )
        if o.inputs and self.s3 is None:
            return self._error(
                EndpointError(
                    error="this job's input files are staged in S3 but the endpoint has no "
                    "bucket: set BUCKET_ENDPOINT_URL, BUCKET_ACCESS_KEY_ID and "
                    "BUCKET_SECRET_ACCESS_KEY on the endpoint",
                    error_type="BackendError",
                )
            )
        if not o.claims:
            return await self._run_unclaimed()
        assert self.s3 is not None
        store = ClaimStore(self.s3, o.output.bucket)
        key = claim_key(o.output, o.job_id, o.submission)
        acquiring = asyncio.create_task(self._acquire(store, key), name="claim")
        # Beside the claim, not before it: through an outage the claim gets the whole budget.
        self._marking = asyncio.create_task(self._mark_delivery(store), name="delivery marker")
        # Until a claim is written (its reads may ride out a storage outage for minutes), the
        # platform's progress updates are the only sign that this handler lives.
        keepalive = asyncio.create_task(self._report_while_claiming(), name="claiming")
        try:
            decision = await asyncio.shield(acquiring)
        except ClaimError as exc:
            return self._error(failure_of(exc))
        except asyncio.CancelledError:
            await self._stopped_while_claiming(store, key, acquiring)
        finally:
            keepalive.cancel()
        if isinstance(decision, Finished):
            return self._replay(decision.current.claim)
        if isinstance(decision, HeldElsewhere):
            holder = decision.current.claim
            self.log.info("claimed_elsewhere", holder=holder.holder, worker=holder.worker_id)
            return self._output(
                EndpointOutput(
                    status="claimed_elsewhere",
                    claim_holder=holder.holder,
                    prompt_id=holder.prompt_id,
                )
            )
        left = what_is_left(decision.held.claim, self.request.workflow)
        if decision.took_over is not None:
            previous = decision.took_over
            self.log.info(
                "claim_taken_over",
                previous=previous.holder,
                worker=previous.worker_id,
                fenced=previous.fenced.action if previous.fenced is not None else None,
                prompt_end=previous.prompt_end.outcome if previous.prompt_end else None,
                stored=len(previous.stored),
                left_to_run="nothing" if left.done else "all" if not left.dropped else "some",
                dropped=list(left.dropped),
            )
        async with self._lease(store, key, decision.held, left.kept) as lease:
            if left.done and decision.took_over is not None:
                return await self._complete_from_claim(lease, left, decision.took_over)
            return await self._run_claimed(lease, left, took_over=decision.took_over is not None)

    def _lease(
        self, store: ClaimStore, key: str, held: StoredClaim, stored: list[ArtifactRecord] | None
    ) -> Lease:
        fence_file = self.settings.fence_file
        return Lease(
            store,
            key,
            held,
            self.o.lease_s,
            fence_after_s=self.o.fence_after_s,
            fence_file=(
                FenceFile(fence_file, output=self.o.output, run_tag=self.o.run_tag)
                if fence_file is not None
                else None
            ),
            stored=stored,
        )

    async def _mark_delivery(self, store: ClaimStore) -> None:
        """This delivery's marker (`contract.delivery_key`): how the orchestrator learns of a
        RunPod job whose `/run` answer it lost, to put what it billed in the job's cost."""
        marker = delivery_key(self.o.output, self.o.job_id, self.o.submission, self.job_id)
        body = json.dumps(
            {
                "runpod_job_id": self.job_id,
                "worker_id": self.settings.worker_id,
                "at": datetime.now(UTC).isoformat(),
            }
        ).encode()
        if not await store.mark_delivery(marker, body, patience=Patience(self.o.lease_s / 3)):
            self.log.warning("delivery_unmarked", key=marker)

    async def _report_while_claiming(self) -> None:
        """A "claiming" update now and every CLAIMING_REPORT_FACTOR of the lease: the
        orchestrator judges a delivery with neither a claim nor an update for a lease dead."""
        self.reporter.set_stage("claiming")
        while True:
            await asyncio.sleep(self.o.lease_s * CLAIMING_REPORT_FACTOR)
            self.reporter.keepalive()

    async def _acquire(self, store: ClaimStore, key: str) -> Decision:
        """Claim the token. A claim held by this same RunPod job on another worker is an
        earlier delivery the platform gave up on: wait until it may be taken over (its lease
        run out by `fence_after_s`: it may still be running somewhere until it fenced itself),
        then take over; if it keeps being renewed, it is alive."""
        template = Claim(
            submission=self.o.submission,
            job_id=self.o.job_id,
            segment=self.o.segment,
            prompt_id=self.o.prompt_id,
            holder=self.job_id,
            worker_id=self.settings.worker_id,
            lease_until=datetime.now(UTC),
            renewed_at=datetime.now(UTC),
            claimed_at=datetime.now(UTC),
        )
        fence_after_s = self.o.fence_after_s
        decision = await store.acquire(key, template, self.o.lease_s, fence_after_s=fence_after_s)
        give_up = (
            asyncio.get_running_loop().time() + WAIT_OUT_FACTOR * self.o.lease_s + fence_after_s
        )
        while (
            isinstance(decision, HeldElsewhere)
            and decision.current.claim.holder == self.job_id
            and asyncio.get_running_loop().time() < give_up
            and not self._stopping.is_set()
        ):
            takeable_in_s = decision.current.takeable_in_s(fence_after_s)
            self.log.info("claim_wait_out", takeable_in_s=round(takeable_in_s, 1))
            self.reporter.set_stage("claiming")
            wait = min(max(takeable_in_s, 0.5), 5.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), wait)
                break
            decision = await store.acquire(
                key, template, self.o.lease_s, fence_after_s=fence_after_s
            )
        return decision

    async def _stopped_while_claiming(
        self, store: ClaimStore, key: str, acquiring: asyncio.Task[Decision]
    ) -> NoReturn:
        """Stopped while the claim was being taken: a claim we took meanwhile is finished as
        cancelled, so no other delivery runs the submission. Its prompt was never sent, unless
        an earlier handler of this job left it on ComfyUI: the stop looks, and stops it."""
        since, started_at = time.monotonic(), datetime.now(UTC)
        self._stopping.set()
        await wait_out(acquiring, "claiming")
        if acquiring.cancelled() or acquiring.exception() is not None:
            raise asyncio.CancelledError
        decision = acquiring.result()
        if not isinstance(decision, Acquired):
            raise asyncio.CancelledError
        async with self._lease(store, key, decision.held, None) as lease:
            never_ran = asyncio.create_task(asyncio.sleep(0))
            stop = self._stop()
            await stop.stopped(self._execution(), never_ran, lease, since=(since, started_at))

    def _stop(self) -> JobStop:
        return JobStop(
            self.client,
            self.settings,
            horizon_s=self.o.stop_horizon_s,
            replace_worker=self.replace_worker,
            log=self.log,
        )

    async def _run_unclaimed(self) -> dict[str, Any]:
        execution = self._execution()
        work = asyncio.create_task(execution.run(), name=f"run {self.o.prompt_id}")
        try:
            await asyncio.wait({work})
        except asyncio.CancelledError:
            await self._stop().stopped(execution, work)
        # Without a claim no delivery re-attaches to the prompt: the run's files go.
        await _clear_files(execution, stored_outputs=True)
        try:
            result = work.result()
        except Exception as exc:
            return self._error(failure_of(exc), execution.records())
        failure, records = self._verdict(result)
        if failure is not None:
            return self._error(failure, records)
        return self._success(records)

    async def _run_claimed(self, lease: Lease, left: Left, *, took_over: bool) -> dict[str, Any]:
        execution = self._execution(left, lease, rerun_interrupted=took_over)
        work = asyncio.create_task(execution.run(), name=f"run {self.o.prompt_id}")
        lost = asyncio.create_task(lease.lost.wait(), name="claim lost")
        fence = asyncio.create_task(lease.fence_due.wait(), name="claim fence due")
        try:
            await asyncio.wait({work, lost, fence}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # The platform stopped the job (cancel, executionTimeout): stop the prompt, then
            # record the claim as cancelled so no other delivery runs it.
            lost.cancel()
            fence.cancel()
            await self._stop().stopped(execution, work, lease)
        finally:
            lost.cancel()
            fence.cancel()
        if not work.done():
            if lease.fence_due.is_set():
                return await self._fenced(execution, work, lease, left)
            return await self._lost(execution, work, lease)
        try:
            failure, records = self._verdict(work.result())
        except Exception as exc:
            failure, records = failure_of(exc), execution.records()
        records = with_kept(left.kept, records)
        if failure is None:
            outcome = _outcome("completed", images=records)
        else:
            outcome = _outcome(
                "failed", images=records, error=failure.error, error_type=failure.error_type
            )
        recorded = False
        try:
            recorded = await self._finish(lease, outcome)
        finally:
            # Outputs only once the claim holds the outcome: until then a later delivery of the
            # submission may re-attach to the prompt and store every output again from here.
            await _clear_files(execution, stored_outputs=recorded)
        if failure is None:
            return self._success(records)
        return self._error(failure, records, claim_recorded=recorded)

    async def _fenced(
        self, execution: Execution, work: asyncio.Task[ExecutionResult], lease: Lease, left: Left
    ) -> dict[str, Any]:
        """No renewal succeeded in time: stop everything before the lease ends, record the
        fence, and answer that the submission is not finished (endpoint/fencing.py). A prompt
        that had succeeded has its outputs handed over in the answer instead
        (endpoint/handover.py)."""
        if succeeded(execution):
            handed = await self._handed_over(execution, work, lease, left)
            if handed is not None:
                return handed
        fence = SelfFence(
            self.client, self.settings, replace_worker=self.replace_worker, log=self.log
        )
        fencing = asyncio.create_task(fence.fence(execution, work, lease), name="fence")
        cancelled = await wait_out(fencing, "fencing")
        fenced = fencing.result()
        if fenced.record.action != "still_running":
            # The outcome is not recorded: a later delivery may re-attach to the prompt here and
            # store its outputs from the folder (it stages its own inputs). A worker being
            # replaced keeps its files: they go with it.
            await _clear_files(execution, stored_outputs=False)
        if cancelled:
            raise asyncio.CancelledError
        return self._error(fenced_error(fenced), with_kept(left.kept, execution.records()))

    async def _handed_over(
        self, execution: Execution, work: asyncio.Task[ExecutionResult], lease: Lease, left: Left
    ) -> dict[str, Any] | None:
        """The prompt succeeded, but the claim cannot be written: the outputs in the answer
        (none stored any more to S3 from here), or None to fence as usual."""
        execution.cancel_outputs()
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        within_s = max(0.0, lease.ends_at - time.monotonic()) + self.o.fence_after_s / 2
        records = await inline_outputs(
            self.client, execution, run_tag=self.o.run_tag, within_s=within_s, log=self.log
        )
        if records is None:
            return None
        # Nothing of the submission runs here any more; the watchdog has nothing to stop.
        lease.let_go()
        # Kept on the worker: an answer RunPod loses leaves a later delivery here the files.
        await _clear_files(execution, stored_outputs=False)
        return self._success(with_kept(left.kept, records))

    async def _complete_from_claim(
        self, lease: Lease, left: Left, previous: Claim
    ) -> dict[str, Any]:
        """The claim taken over says the prompt succeeded and every output it listed is
        stored: nothing runs; the claim is finished with those records, and the answer is the
        one a replay would give."""
        recorded = await self._finish(lease, _outcome("completed", images=left.kept))
        self.log.info(
            "claim_completed_from_record",
            holder=previous.holder,
            images=len(left.kept),
            recorded=recorded,
        )
        self.tracker.complete()
        status = "success" if left.kept else "success_no_images"
        return self._output(
            EndpointOutput(
                images=left.kept,
                status=status,
                claim_holder=previous.holder,
                prompt_id=previous.prompt_id,
                replayed=True,
            )
        )

    async def _lost(
        self, execution: Execution, work: asyncio.Task[ExecutionResult], lease: Lease
    ) -> dict[str, Any]:
        """Our lease lapsed and another delivery took the submission over: it runs now, so
        ours stops its prompt (briefly: the new holder answers for the submission)."""
        subject = execution.stop_subject()
        execution.cancel_outputs()
        work.cancel()

        async def stop() -> None:
            await execution.stop_briefly(subject)
            await asyncio.gather(work, return_exceptions=True)

        stopping = asyncio.create_task(stop(), name="stop the prompt")
        cancelled = await wait_out(stopping, "stopping the prompt")
        # The new holder answers for the submission, and may re-attach to this prompt here (on
        # this worker, once it is free): it needs the outputs, not the inputs (it stages its own).
        await _clear_files(execution, stored_outputs=False)
        if cancelled:
            raise asyncio.CancelledError
        holder = lease.lost_to.claim if lease.lost_to is not None else None
        return self._output(
            EndpointOutput(
                status="claimed_elsewhere",
                claim_holder=holder.holder if holder else None,
                prompt_id=self.o.prompt_id,
                errors=["this delivery's claim lapsed and was taken over; it stopped"],
            )
        )

    async def _finish(self, lease: Lease, outcome: ClaimOutcome) -> bool:
        """Record the outcome in the claim; True when it is recorded. A failure to do so is
        logged, not raised: the job's own result stands (the orchestrator verifies its records
        in S3 either way), and `errors` in a result would make it read as a failed job."""
        task = asyncio.create_task(lease.finish(outcome), name="finish the claim")
        # A stop now must not leave the claim half-written: it waits, then ends the job.
        cancelled = await wait_out(task, "recording the outcome")
        recorded = not task.cancelled() and task.exception() is None
        if not recorded:
            problem = None if task.cancelled() else task.exception()
            if problem is not None and not isinstance(problem, ClaimConflict | ClaimError):
                raise problem
            self.log.warning("claim_outcome_not_recorded", state=outcome.state, error=str(problem))
        if cancelled:
            raise asyncio.CancelledError
        return recorded

    def _execution(
        self,
        left: Left | None = None,
        lease: Lease | None = None,
        *,
        rerun_interrupted: bool = False,
    ) -> Execution:
        """The run of the graph, or of what is `left` of it after a takeover; with a `lease`,
        the claim hears of the prompt's end and of each stored output."""
        on_prompt_end = on_stored = None
        if lease is not None:
            kept = left.kept_outputs if left is not None else []

            def on_prompt_end(end: FollowedEnd) -> None:
                lease.prompt_ended(recorded_end(end, kept))

            on_stored = lease.output_stored
        return Execution(
            self.client,
            self.settings,
            graph=left.graph if left is not None else self.request.workflow,
            images=self.request.images,
            prompt_id=self.o.prompt_id,
            client_id=self.o.client_id,
            extra_data=_extra_data(
                self.request,
                {
                    "job_id": self.o.job_id,
                    "segment": self.o.segment,
                    "submission": self.o.submission,
                    "runpod_job_id": self.job_id,
                },
            ),
            sink=self._sink(),
            tracker=self.tracker,
            reporter=self.reporter,
            staged=self._staged(),
            run_tag=self.o.run_tag,
            on_ready=self._publish_nodes,
            on_prompt_end=on_prompt_end,
            on_stored=on_stored,
            recorded=lease.caught_up if lease is not None else None,
            prior=left.kept if left is not None else None,
            rerun_interrupted=rerun_interrupted,
        )

    def _publish_nodes(self) -> None:
        """ComfyUI answers: its node registry goes where the job says, in the background."""
        if self.o.nodes is not None:
            PUBLISHER.publish(self.settings, self.o.nodes)

    def _staged(self) -> StagedInputs | None:
        if not self.o.inputs or self.s3 is None:
            return None
        folder = inputs_folder(self.o.output, self.o.job_id)
        return StagedInputs(self.s3, self.o.output.bucket, folder, self.o.inputs)

    def _sink(self) -> OutputSink:
        if self.s3 is None:
            # claims: false on an endpoint without a bucket: the orchestrator stores them.
            return Base64Sink()
        output, job_id, segment = self.o.output, self.o.job_id, self.o.segment
        return S3Sink(
            self.s3,
            output.bucket,
            lambda node, filename: artifact_key(output.prefix, job_id, segment, node, filename),
            retry_s=self.settings.bucket_retry_s,
        )

    def _verdict(
        self, result: ExecutionResult
    ) -> tuple[EndpointError | None, list[ArtifactRecord]]:
        failure = failure_of_end(result.end)
        if failure is None:
            self.tracker.complete()
        return failure, result.records

    def _success(self, records: list[ArtifactRecord]) -> dict[str, Any]:
        status = "success" if records else "success_no_images"
        return self._output(EndpointOutput(images=records, status=status))

    def _replay(self, claim: Claim) -> dict[str, Any]:
        """A delivery of a submission that already ran returns what the claim recorded."""
        outcome = claim.outcome
        assert outcome is not None
        self.log.info("claim_replayed", state=outcome.state, holder=claim.holder)
        common = {"claim_holder": claim.holder, "prompt_id": claim.prompt_id, "replayed": True}
        if outcome.state == "completed":
            status = "success" if outcome.images else "success_no_images"
            return self._output(EndpointOutput(images=outcome.images, status=status, **common))
        if outcome.state == "cancelled":
            error = (
                f"submission {claim.submission} was cancelled (RunPod job {claim.holder}) and "
                "will not run again: submit with a new submission token"
            )
            return self._error(
                EndpointError(error=error, error_type="Cancelled", **common),
                outcome.images,
                claim_recorded=True,
            )
        return self._error(
            EndpointError(
                error=outcome.error or "failed",
                error_type=outcome.error_type or "ExecutionError",
                **common,
            ),
            outcome.images,
            claim_recorded=True,
        )

    def _output(self, output: EndpointOutput) -> dict[str, Any]:
        output.submission = self.o.submission
        output.prompt_id = output.prompt_id or self.o.prompt_id
        if output.status != "claimed_elsewhere":
            output.claim_holder = output.claim_holder or (self.job_id if self.o.claims else None)
        return _dump(output)

    def _error(
        self,
        error: EndpointError,
        images: list[ArtifactRecord] | None = None,
        *,
        claim_recorded: bool = False,
    ) -> dict[str, Any]:
        error.submission = self.o.submission
        error.prompt_id = error.prompt_id or self.o.prompt_id
        error.images = images or error.images
        error.claim_recorded = claim_recorded
        self.log.info(
            "job_failed",
            error_type=error.error_type,
            error=error.error,
            claim_recorded=claim_recorded,
        )
        return _dump(error)


async def _fence_first(lease: Lease, work: asyncio.Task[Any]) -> bool:
    """Wait for `work` or the lease's fence, whichever comes first; True for the fence (then
    `work` is cancelled and has ended)."""
    fence = asyncio.ensure_future(lease.fence_due.wait())
    try:
        await asyncio.wait({work, fence}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        fence.cancel()
    if work.done():
        return False
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    return True


async def _clear_files(execution: Execution, *, stored_outputs: bool) -> None:
    """Remove the run's files from ComfyUI's folders (endpoint/job_files.py). A stop meanwhile
    lets it finish, then ends the job, as it does the claim's finish."""
    task = asyncio.create_task(
        execution.files.clear(stored_outputs=stored_outputs), name="remove the run's files"
    )
    if await wait_out(task, "removing the run's files"):
        raise asyncio.CancelledError


def _outcome(
    state: str,
    *,
    images: list[ArtifactRecord],
    error: str | None = None,
    error_type: str | None = None,
    stop: StopRecord | None = None,
) -> ClaimOutcome:
    return ClaimOutcome.model_validate(
        {
            "state": state,
            "images": images,
            "error": error,
            "error_type": error_type,
            "at": datetime.now(UTC),
            "stop": stop,
        }
    )


def _extra_data(request: EndpointInput, tag: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = {PROMPT_TAG: tag}
    # worker-comfyui's Comfy.org key for API nodes: per request, else the endpoint's.
    key = request.api_key_comfy_org or os.environ.get("COMFY_ORG_API_KEY")
    if key:
        extra["api_key_comfy_org"] = key
    return extra


def _stock_output(records: list[ArtifactRecord], errors: list[str]) -> dict[str, Any]:
    """worker-comfyui 5.x's shape: `images`, `errors` only when any, `status` only when empty."""
    images = [r.model_dump(mode="json", exclude_none=True) for r in records]
    result: dict[str, Any] = {"images": images}
    if errors:
        result["errors"] = errors
    if not records:
        result["status"] = "success_no_images"
    return result


def _dump(model: EndpointOutput | EndpointError) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_none=True)


def _discard(_update: Mapping[str, Any]) -> None:
    pass
