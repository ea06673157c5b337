"""Following one submission on a RunPod endpoint: submit it once, poll it to its end, keep what
it stored.

The submission token is the workflow's prompt id: the same on every attempt and on every
resubmission of the same prompt, so our handler's claim runs it at most once. RunPod's `/run`
has no idempotency key, so where the answer to `/run` is lost:

- with claims (our handler), the claim object says which RunPod job holds the submission; if
  none does yet, submitting again is safe (a second delivery of a claimed token runs nothing);
- without claims (a stock worker-comfyui endpoint), nobody can tell: `SubmissionAmbiguous`, and
  the job's `on_ambiguous_submit` decides.

Every poll heartbeats the checkpoint (with RunPod's job id as `provider_job_id`, and the step our
handler reported), so a worker that dies mid-job is replaced by one that polls the same RunPod
job instead of paying again, and clients read the step from the heartbeat; the workflow gets a
`progress` signal on milestones only (follow_common's `Milestones`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NoReturn, TypeVar

import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.errors import fatal, retryable
from activities.follow_common import (
    Milestones,
    Stage,
    restore_checkpoint,
    send_progress,
    with_resume_point,
    worker_identity,
)
from activities.live_progress import LiveProgress
from activities.runpod import submissions
from activities.runpod.artifacts import artifact_source, inline_bytes, record_keys, s3_location
from activities.runpod.claims import (
    AgedClaim,
    claim_target,
    lease_running,
    read_aged_claim,
    read_claim,
)
from activities.runpod.client import RunPodClient
from activities.runpod.cost import job_cost
from activities.runpod.deliveries import delivery_ids
from activities.runpod.failures import from_failure, from_runpod
from activities.runpod.models import RunPodJob, RunPodState, RunPolicy
from activities.runpod.nodes import published_target
from activities.runpod.outcome import (
    ClaimedElsewhere,
    Failed,
    Queued,
    Running,
    Succeeded,
    after_storage_failure,
    read_gone,
    read_job,
)
from activities.storage import ArtifactStore
from configuration.pools import PoolConfig
from protocol.keys import artifact_key, content_type_for, job_folder
from protocol.runpod.contract import (
    DEFAULT_FENCE_AFTER_S,
    DEFAULT_LEASE_S,
    DEFAULT_STOP_HORIZON_S,
    ArtifactRecord,
    Claim,
    EndpointInput,
    InputImage,
    Orchestration,
    OutputFile,
    StagedInput,
)
from workflows.activity_io import FollowHeartbeat, FollowInput, FollowResult
from workflows.contracts import Artifact, Checkpoint, DeliveryOutcome, JobCost, ProgressReport
from workflows.errors import (
    CompletedFromClaim,
    KeyCollision,
    RunPodError,
    RunPodJobGone,
    RunPodSubmissionAmbiguous,
    StorageError,
    UnusableArtifact,
)
from workflows.shared import AT_MOST_ONCE, ErrorType

log = structlog.get_logger(__name__)

# How often one follow asks `/status` while RunPod runs its job, start to start, unless the
# pool sets `status_poll_s`: under a second, so the step a client sees changes at least once a
# second (RunPod allows 2000 calls per 10 s per endpoint: 160 jobs followed at once at this
# pace). While the job is queued nothing moves but the pickup: read half as often.
POLL_S = 0.8
QUEUED_POLL_FACTOR = 2.0
# How often our handler sends the platform a progress update while the steps move, unless the
# pool sets `report_interval_s`: well inside POLL_S, so each `/status` read carries what the
# GPU did up to a quarter of a second before.
REPORT_S = 0.25
# A job's default limit when neither the pool nor the job sets one (RunPod's own default).
DEFAULT_EXECUTION_TIMEOUT_S = 600.0
# The claim lease our handler is asked to hold (and renew every third of it) while it runs a
# submission, unless the pool sets `claim_lease_s`: how long a crashed holder blocks a takeover.
CLAIM_LEASE_S = DEFAULT_LEASE_S
# How long a replayed delivery waits for the holder's RunPod job to end, to read what it cost.
HOLDER_END_WAIT_S = 15.0
# How long after a silent holder is certainly fenced (its lease out by the pool's
# `fence_after_s`, by the S3 server's clock) a new delivery is sent to take its claim over: the
# handler reads the same clock in whole seconds and adds a second of its own, so a takeover
# sent on the dot would often be refused.
TAKEOVER_MARGIN_S = 3.0
# Submissions one attempt sends after finding the claim held by a dead holder (each one a
# delivery that may find the lease not yet out by the S3 server's clock); then the workflow
# decides.
MAX_TAKEOVER_SUBMITS = 3
# Our handler stops a cancelled job's prompt for the job's teardown horizon less a margin (a
# tenth of it, at least STOP_MARGIN_MIN_S), so the workflow still reads its verdict in time.
STOP_MARGIN_SHARE = 0.1
STOP_MARGIN_MIN_S = 15.0
MIN_STOP_HORIZON_S = 5.0
# How often the attempt heartbeats while a RunPod call is under way (Temporal's SDK sends at
# most one heartbeat per 0.8 heartbeat timeouts, so this costs nothing).
KEEPALIVE_S = 1.0

T = TypeVar("T")


@dataclass(frozen=True)
class RunInputs:
    """A submission's input files: inline (`input.images`, what stock endpoints read) or staged
    in S3 by reference (`durable_comfy.inputs`, our handler's way past RunPod's 10 MB body)."""

    images: list[InputImage] = field(default_factory=list)
    staged: list[StagedInput] = field(default_factory=list)


class RunPodFollower:
    """One attempt at following one submission to its end."""

    def __init__(
        self,
        req: FollowInput,
        pool: PoolConfig,
        client: RunPodClient,
        store: ArtifactStore,
        inputs: RunInputs,
        *,
        poll_s: float = POLL_S,
        live: LiveProgress | None = None,
    ) -> None:
        self.req = req
        self.live = live or LiveProgress()
        self.pool = pool
        self.client = client
        self.store = store
        self.inputs = inputs
        self.poll_s = pool.status_poll_s if pool.status_poll_s is not None else poll_s
        self.report_s = pool.report_interval_s or REPORT_S
        self.lease_s = pool.claim_lease_s or CLAIM_LEASE_S
        self.fence_after_s = pool.fence_after_s or DEFAULT_FENCE_AFTER_S
        heartbeat = FollowHeartbeat.from_details(activity.info().heartbeat_details)
        self.checkpoint = restore_checkpoint(heartbeat, req)
        stored = list(req.stored) + (heartbeat.artifacts if heartbeat is not None else [])
        self.artifacts: dict[str, Artifact] = {a.key: a for a in stored}
        self.submission = req.prompt_id
        self.target = claim_target(req.output, store.settings.bucket)
        execution_s = (
            pool.execution_timeout_s or req.execution_timeout_s or DEFAULT_EXECUTION_TIMEOUT_S
        )
        self.policy = RunPolicy.for_job(execution_s, req.queue_timeout_s)
        self.last_state: RunPodState | None = None
        # The highest progress `seq` of the delivery reporting now (RunPod job, worker): each
        # delivery counts from 0, so a re-delivered job's progress is not compared with the
        # dead worker's.
        self.delivery: tuple[str, str | None] | None = None
        self.best_seq = -1
        # When this delivery last gave a sign of life (it started, or sent a new update).
        self.heard_at = time.monotonic()
        self.takeover_submits = 0
        # Other RunPod jobs of this submission that billed: a delivery that found it claimed,
        # and the holder whose `/run` answer was lost (its outcome replayed to ours).
        self.other_costs: dict[str, JobCost] = {}
        # Where the submission is on RunPod, as last reported: "queued" or "running".
        self.stage: Stage | None = None
        # Stored outputs the workflow has not been told of (their signal fell in the quiet start).
        self.untold: list[Artifact] = []
        self.queue_position: int | None = None
        self.told_position: int | None = None  # the place in the queue last signalled
        self.node: str | None = None
        self.milestones = Milestones(req.progress_interval_s)
        self.worker_id = worker_identity()
        self.next_lease_check = time.monotonic() + self.lease_s / 3
        # The silent holder already logged as waited for (once per holder).
        self.waiting_for_fence: str | None = None
        self.log = log.bind(job_id=req.job_id, prompt_id=req.prompt_id, segment=req.segment)

    # -- the attempt -------------------------------------------------------------------------

    async def run(self) -> FollowResult:
        with self.live.following(self.req.job_id, self._live_beat):
            return await self._run()

    async def _run(self) -> FollowResult:
        try:
            job_id = self.checkpoint.provider_job_id or await self._submit_or_find()
            return await self._follow(job_id)
        except CompletedFromClaim as done:
            assert isinstance(done.result, FollowResult)
            return done.result
        except RunPodError as exc:
            failure = from_runpod(exc, "following the RunPod job")
            error = with_resume_point(failure, self._resume_point)
            raise self._at_most_once(error) from None
        except ApplicationError as exc:
            raise self._at_most_once(with_resume_point(exc, self._resume_point)) from None

    def _at_most_once(self, error: ApplicationError) -> ApplicationError:
        """A lost prompt on a pool with claims says it cannot run twice: a new delivery takes
        the claim over or finds it finished, so the workflow submits it again without asking
        (`workflows.failures.resubmit_cannot_run_twice`)."""
        if error.type != ErrorType.PROMPT_LOST or not self.pool.claims:
            return error
        return ApplicationError(
            error.message,
            *error.details,
            {AT_MOST_ONCE: True},
            type=error.type,
            non_retryable=error.non_retryable,
            next_retry_delay=error.next_retry_delay,
        )

    async def _submit_or_find(self) -> str:
        """RunPod's job id for this submission: found by its claim, or a fresh `/run`.

        A claim names the job to follow while its holder runs (its lease is being renewed) or
        once it recorded an outcome. A claim with neither was left by a holder that died (a
        crashed worker): following that job would only find it dead again, so the submission is
        sent once more, after the lease has run out, and the new delivery takes the claim over.
        """
        if self.pool.claims:
            claim = await read_claim(self.store, self.target, self.req.job_id, self.submission)
            if claim is not None and (claim.outcome is not None or lease_running(claim)):
                self.log.info("runpod_found_by_claim", runpod_job_id=claim.holder)
                return self._known_as(claim.holder)
            if claim is not None:
                self.log.info("runpod_claim_holder_dead", runpod_job_id=claim.holder)
                aged = await self._wait_for_fence()
                if aged is not None and aged.claim.renewed_at > claim.renewed_at:
                    # Renewed meanwhile: the holder is alive after all.
                    return self._known_as(aged.claim.holder)
                if aged is not None and aged.claim.outcome is None:
                    if await self._gone_holder(aged.claim):
                        return self._known_as(aged.claim.holder)
        elif self.checkpoint.submit_sent_at is not None:
            raise fatal(
                ErrorType.SUBMISSION_AMBIGUOUS,
                f"an earlier attempt sent prompt {self.submission} to RunPod and never heard "
                "back; this endpoint keeps no claims, so whether a job exists is unknown",
            )
        if self.req.graph is None:
            raise fatal(
                ErrorType.PROMPT_LOST,
                f"no RunPod job is known for prompt {self.submission} and nothing to submit",
            )
        record = await self._alive_while(
            submissions.submitting(self.store, self.req, self.pool, self.target, self.policy)
        )
        # Recorded before sending: an attempt that dies waiting for the answer leaves word.
        sent = datetime.now(UTC)
        self.checkpoint = self.checkpoint.model_copy(update={"submit_sent_at": sent})
        self._heartbeat()
        try:
            job = await self._alive_while(
                self.client.run(self._run_input(self.req.graph), self.policy)
            )
        except RunPodSubmissionAmbiguous:
            if not self.pool.claims:
                raise
            # Safe to send again: a second delivery of a claimed submission runs nothing.
            self.log.warning("runpod_run_answer_lost_resubmitting")
            raise retryable(
                ErrorType.BACKEND_UNAVAILABLE,
                f"RunPod's answer to /run for prompt {self.submission} was lost; with claims, "
                "submitting again is safe",
            ) from None
        except RunPodError:
            # Any other failure of `/run` is a refusal (a 429 past the client's budget, a 4xx,
            # a connection never made): no job exists, so the next attempt may send it again.
            # Left set, the mark would make a stock endpoint's job wait for a decision.
            self.checkpoint = self.checkpoint.model_copy(update={"submit_sent_at": None})
            self._heartbeat()
            raise
        self.log.info("runpod_submitted", runpod_job_id=job.id)
        await self._alive_while(submissions.submitted(self.store, record, job.id))
        # What `/run` answered (IN_QUEUE) counts as seen: a job whose ttl runs out before the
        # first poll expired in the queue, it was not lost.
        self.last_state = job.state
        return self._known_as(job.id)

    def _known_as(self, job_id: str) -> str:
        self.checkpoint = self.checkpoint.model_copy(
            update={"provider_job_id": job_id, "submitted_at": datetime.now(UTC)}
        )
        self._heartbeat()
        return job_id

    def _run_input(self, graph: dict[str, Any]) -> EndpointInput:
        req = self.req
        return EndpointInput(
            workflow=graph,
            images=self.inputs.images,
            durable_comfy=Orchestration(
                job_id=req.job_id,
                submission=self.submission,
                segment=req.segment,
                prompt_id=req.prompt_id,
                client_id=req.client_id,
                run_tag=req.run_tag,
                output=self.target,
                sampler_steps=req.sampler_steps,
                nodes_total=req.nodes_total,
                # The handler's updates cost no workflow history (the follow's signals are
                # what `req.progress_interval_s` bounds): as often as a step should be seen.
                progress_interval_s=self.report_s,
                claims=bool(self.pool.claims),
                lease_s=self.lease_s,
                inputs=self.inputs.staged,
                stop_horizon_s=stop_horizon(req.teardown_horizon_s),
                nodes=published_target(self.pool, self.store.settings.bucket),
                fence_after_s=self.fence_after_s,
            ),
        )

    async def _follow(self, job_id: str) -> FollowResult:
        while True:
            asked_at = time.monotonic()
            job = await self._status(job_id)
            outcome = read_job(job, submission=self.submission, policy=self.policy)
            if isinstance(outcome, Queued):
                await self._report("queued")
            elif isinstance(outcome, Running):
                await self._running(outcome)
                await self._fail_if_holder_silent(job)
            elif isinstance(outcome, ClaimedElsewhere):
                self.other_costs[job.id] = self.cost_of(job, "ran_nothing")
                job_id = await self._holder(outcome)
                continue
            elif isinstance(outcome, Succeeded):
                return await self._succeeded(job, outcome)
            else:
                failed = await self._recovered(outcome)
                if not isinstance(failed, Failed):
                    return await self._succeeded(job, None, failed)
                await self._failed(failed, job)
            if activity.is_worker_shutdown():
                raise retryable(ErrorType.CONNECTION_LOST, "worker shutting down")
            self._heartbeat()
            # Start to start: a slow answer does not stretch the gap between two reads.
            pace = self.poll_s * (QUEUED_POLL_FACTOR if job.state is RunPodState.IN_QUEUE else 1.0)
            await asyncio.sleep(max(0.0, asked_at + pace - time.monotonic()))

    async def _status(self, job_id: str) -> RunPodJob:
        try:
            job = await self._alive_while(self.client.status(job_id))
        except RunPodJobGone:
            await self._failed(read_gone(job_id, self.last_state))
        self.last_state = job.state
        return job

    async def _holder(self, outcome: ClaimedElsewhere) -> str:
        """This delivery found the submission claimed: follow the job that holds it, unless
        the holder is dead (no outcome, lease out: its delivery came before the lease had run
        out by the S3 server's clock), in which case the submission goes out again."""
        claim = await read_claim(self.store, self.target, self.req.job_id, self.submission)
        holder = outcome.holder or (claim.holder if claim is not None else None)
        dead = (
            claim is not None
            and claim.holder == holder
            and claim.outcome is None
            and not lease_running(claim)
        )
        if dead and self.req.graph is not None and self.takeover_submits < MAX_TAKEOVER_SUBMITS:
            self.takeover_submits += 1
            self.log.info("runpod_claim_holder_dead", runpod_job_id=holder)
            self.last_state = None
            return await self._submit_or_find()  # which waits for the fence first
        if holder is None or holder == self.checkpoint.provider_job_id:
            raise retryable(
                ErrorType.BACKEND_UNAVAILABLE,
                f"RunPod job {outcome.job_id} found prompt {self.submission} claimed, but the "
                "claim names no other job yet",
            )
        self.log.info("runpod_following_claim_holder", runpod_job_id=holder)
        self.last_state = None
        return self._known_as(holder)

    async def _fail_if_holder_silent(self, job: RunPodJob) -> None:
        """RunPod may keep a job IN_PROGRESS after its worker died (until its execution
        timeout), or while its worker is alive but silent: its handler frozen, or cut off from
        S3, its ComfyUI running on. Our handler renews its claim's lease while it runs; a lease
        run out means the holder stopped renewing, not that its prompt stopped. So nothing is
        run again until the holder is fenced (docs/architecture.md, *Fencing*): the claim
        records that it fenced itself, or its lease has run out by the pool's `fence_after_s`
        (by the S3 server's clock), past which its handler and its worker's watchdog have
        stopped the prompt and taken the worker down. Then the job is cancelled, and completed
        from the claim when the holder's work was done, else submitted again."""
        if not self.pool.claims:
            return
        now = time.monotonic()
        if now < self.next_lease_check:
            return
        self.next_lease_check = now + self.lease_s / 3
        aged = await read_aged_claim(self.store, self.target, self.req.job_id, self.submission)
        if aged is None:
            await self._fail_if_silent_before_claiming(job)
            return
        claim = aged.claim
        if claim.holder != job.id:
            return
        if claim.outcome is not None:
            await self._complete_from_outcome(job, aged)
            return
        if claim.fenced is None and not aged.lapsed_by(self.fence_after_s + TAKEOVER_MARGIN_S):
            if aged.lapsed_by(0):
                left = aged.lapses_in_s(self.fence_after_s + TAKEOVER_MARGIN_S)
                self.next_lease_check = now + min(self.lease_s / 3, max(left, self.poll_s))
                if self.waiting_for_fence != job.id:
                    self.waiting_for_fence = job.id
                    self.log.warning(
                        "runpod_holder_silent",
                        runpod_job_id=job.id,
                        worker_id=job.worker_id,
                        lease_until=claim.lease_until,
                        fenced_in_s=round(left, 1),
                    )
            return
        recorded = claim.fenced.action if claim.fenced is not None else None
        cost = await self._give_up(
            job, "fenced", "runpod_holder_fenced", lease_until=claim.lease_until, recorded=recorded
        )
        await self._complete_from(claim, cost)
        raise _lost(
            f"RunPod job {job.id} is still IN_PROGRESS, but its worker stopped renewing the "
            f"claim at {claim.lease_until:%H:%M:%S} UTC and has been fenced since: submitting "
            "again",
            cost,
        )

    async def _complete_from_outcome(self, job: RunPodJob, aged: AgedClaim) -> None:
        """The holder recorded its outcome, yet RunPod still has its job IN_PROGRESS: the
        handler returns its result the moment the outcome is written, so once the claim is
        older than a lease and `fence_after_s`, the worker was lost in between (RunPod may keep
        the job for its whole execution timeout). A completed run is the job's result; any
        other outcome is answered by a new delivery, which replays it from the claim."""
        outcome = aged.claim.outcome
        if outcome is None or not aged.written_before_lease_and(
            self.fence_after_s + TAKEOVER_MARGIN_S
        ):
            return
        ended: DeliveryOutcome = "completed" if outcome.state == "completed" else "crashed"
        cost = await self._give_up(
            job, ended, "runpod_holder_lost_after_outcome", recorded=outcome.state
        )
        if outcome.state == "completed" and outcome.images:
            for record, key in self._unkept(list(outcome.images)):
                await self._keep(record, key, verifiable=True)
            raise await self._completed_by(job.id, cost)
        raise _lost(
            f"RunPod job {job.id} is still IN_PROGRESS, but its worker recorded the run "
            f"{outcome.state} {aged.age_s:.0f} s ago and never returned it: submitting again "
            "(the new delivery answers with the recorded outcome)",
            cost,
        )

    async def _fail_if_silent_before_claiming(self, job: RunPodJob) -> None:
        """No claim yet, so no lease to judge: our handler reports "claiming" at once and then
        every third of the lease until its claim is written (its S3 reads may ride out an outage
        for minutes meanwhile). A delivery silent for a lease died before it claimed anything:
        nothing ran, and the submission may go out again at once."""
        silent_s = time.monotonic() - self.heard_at
        if silent_s <= self.lease_s + TAKEOVER_MARGIN_S:
            return
        cost = await self._give_up(
            job, "crashed", "runpod_delivery_silent", silent_s=round(silent_s)
        )
        raise _lost(
            f"RunPod job {job.id} is IN_PROGRESS on worker {job.worker_id or '?'}, but its "
            f"handler has neither claimed prompt {self.submission} nor reported for "
            f"{silent_s:.0f} s: the worker is gone; submitting again",
            cost,
        )

    async def _gone_holder(self, claim: Claim) -> bool:
        """A holder that is gone for good (fenced, or dead): what its RunPod job billed joins
        the job's cost, and when its work was done the job completes from it. True when its
        job COMPLETED after all: cut off from S3 after its prompt succeeded, the holder handed
        its outputs over in its answer (endpoint/handover.py), which is to be followed."""
        if claim.holder not in self.other_costs:
            cost, job = await self._read_given_up(claim.holder, "fenced")
            if job is not None and job.state is RunPodState.COMPLETED:
                return True
            self.other_costs[claim.holder] = cost
        await self._complete_from(claim, self.other_costs[claim.holder])
        return False

    async def _give_up(
        self, job: RunPodJob, outcome: DeliveryOutcome, event: str, **seen: object
    ) -> JobCost:
        """Log why `job`'s delivery is given up (`event`, with what was `seen`); `_given_up`."""
        self.log.warning(event, runpod_job_id=job.id, worker_id=job.worker_id, **seen)
        return await self._given_up(job.id, outcome)

    async def _given_up(self, job_id: str, outcome: DeliveryOutcome) -> JobCost:
        """Cancel a RunPod job whose delivery is given up (a silent or dead worker: RunPod
        stops counting it) and read what it cost. Figures RunPod has not made final yet are a
        lower bound, and say so."""
        cost, _ = await self._read_given_up(job_id, outcome)
        return cost

    async def _read_given_up(
        self, job_id: str, outcome: DeliveryOutcome
    ) -> tuple[JobCost, RunPodJob | None]:
        """`_given_up`, and the job as it was last read (None: RunPod did not answer)."""
        job: RunPodJob | None = None
        try:
            job, _ = await self._alive_while(self.client.cancelled_unless_ended(job_id))
        except RunPodError as exc:
            self.log.warning("runpod_given_up_cost_unread", runpod_job_id=job_id, error=str(exc))
        if job is None:
            unread = JobCost(
                provider_job_id=job_id,
                outcome=outcome,
                usd_per_second=self.pool.usd_per_second,
                lower_bound=True,
                note="RunPod did not say what this job billed when it was given up",
            )
            return unread, None
        cost = await self._cost_read(job, outcome)
        if not cost.lower_bound and (job.state is None or not job.state.terminal):
            cost = cost.model_copy(
                update={
                    "lower_bound": True,
                    "note": "RunPod had not ended the job when it was given up: what it "
                    "counted so far",
                }
            )
        return cost, job

    async def _complete_from(self, claim: Claim, cost: JobCost) -> None:
        """When a gone holder's claim says its prompt succeeded, the job is done once every file
        it made is in the bucket: raise `CompletedFromClaim`. An output the claim lists as
        stored is verified (size, sha256); one the holder stored but died before recording is
        found at its key (kept already from a progress update, or an object whose sha256 our
        upload wrote: an upload completes whole or not at all). Anything missing: return, and
        the submission goes out again (a new delivery runs only what is missing)."""
        end = claim.prompt_end
        if end is None or end.outcome != "success" or not end.outputs:
            return
        stored = {(r.node_id, r.subfolder, r.filename): r for r in claim.stored}
        try:
            for record, key in self._unkept(list(stored.values())):
                await self._keep(record, key, verifiable=True)
            unrecorded = [
                o for o in end.outputs if (o.node_id, o.subfolder, o.filename) not in stored
            ]
            missing = [o for o in unrecorded if not await self._found_at_key(o)]
        except ApplicationError as exc:
            self.log.warning("runpod_claim_outputs_unverified", error=exc.message)
            return
        if missing:
            self.log.info(
                "runpod_claim_outputs_missing",
                runpod_job_id=claim.holder,
                missing=len(missing),
                outputs=len(end.outputs),
            )
            return
        self.log.info(
            "runpod_completed_from_claim", runpod_job_id=claim.holder, outputs=len(end.outputs)
        )
        raise await self._completed_by(claim.holder, cost)

    async def _completed_by(self, holder: str, cost: JobCost) -> CompletedFromClaim:
        """The job's result when a gone `holder` did its work (every output kept already)."""
        await self._cost_unseen_deliveries(holder)
        self._heartbeat()
        await submissions.ended(self.store, self.req.named_pool, self.req.job_id, self.submission)
        return CompletedFromClaim(
            FollowResult(
                prompt_id=self.req.prompt_id,
                outcome="success",
                artifacts=list(self.artifacts.values()),
                checkpoint=self._checkpoint(),
                cost=cost,
                other_costs=[c for c in self.other_costs.values() if c.provider_job_id != holder],
                worker_id=self.worker_id,
            )
        )

    async def _found_at_key(self, output: OutputFile) -> bool:
        """Whether `output` is in the bucket under the key its holder stores it at."""
        req = self.req
        # Our handler keys an output by its node and file name (its subfolder is the run's own
        # folder, `dc_...`, which the key's job and segment levels say already).
        key = artifact_key(
            req.output.prefix, req.job_id, req.segment, output.node_id, output.filename
        )
        if key in self.artifacts:
            return True
        head = await self.store.head(key, bucket=self.target.bucket)
        if head is None or not head.sha256:
            return False
        record = ArtifactRecord(
            filename=output.filename,
            subfolder=output.subfolder,
            type="s3_url",
            data=head.uri,
            node_id=output.node_id,
        )
        self._remember(record, head.uri, key, head.size, head.sha256, head.content_type)
        return True

    async def _running(self, outcome: Running) -> None:
        update = outcome.progress
        delivery = (outcome.job_id, outcome.worker_id)
        if delivery != self.delivery:
            self.delivery, self.best_seq = delivery, -1
            self.heard_at = time.monotonic()
        if update is not None and update.seq > self.best_seq:
            self.heard_at = time.monotonic()
        if update is None or update.seq < self.best_seq:
            await self._report("running")  # a stock worker says nothing more
            return
        self.best_seq = update.seq
        self.checkpoint = self.checkpoint.model_copy(
            update={
                "step": update.step,
                "total_steps": update.total_steps or self.checkpoint.total_steps,
                "node_steps": dict(update.node_steps),
                "nodes_done": list(update.nodes_done),
            }
        )
        self.node = update.node
        for record, key in self._unkept(update.artifacts):
            artifact = await self._keep(record, key, verifiable=True)
            self._heartbeat()
            await self._report("uploading", artifact=artifact, force=True)
        waiting = update.stage in ("queued", "claiming", "starting")
        await self._report("queued" if waiting else "running", position=update.queue_position)

    async def _succeeded(
        self, job: RunPodJob, outcome: Succeeded | None, claimed: Sequence[ArtifactRecord] = ()
    ) -> FollowResult:
        """The job's result, every output kept (verified) first. `outcome` None: `claimed` are
        the records of a completed claim (a StorageError of the handler it recovered from)."""
        stock = outcome is not None and outcome.stock
        for record, key in self._unkept(outcome.output.images if outcome else list(claimed)):
            await self._keep(record, key, verifiable=not stock)
        if not self.artifacts:
            raise fatal(
                ErrorType.OUTPUT_MISSING,
                f"RunPod job {job.id} completed without any stored output (add a SaveImage node?)",
            )
        holder = outcome.output.claim_holder if outcome is not None else None
        replayed = bool(outcome is not None and outcome.output.replayed and holder != job.id)
        if replayed and holder:
            await self._read_holder_cost(holder)
        await self._cost_unseen_deliveries(job.id)
        self._heartbeat()
        await submissions.ended(self.store, self.req.named_pool, self.req.job_id, self.submission)
        # No "finished" signal: the result tells the workflow the same, a round trip sooner.
        return FollowResult(
            prompt_id=self.req.prompt_id,
            outcome="success",
            artifacts=list(self.artifacts.values()),
            checkpoint=self._checkpoint(),
            cost=await self._cost_read(job, "ran_nothing" if replayed else "completed"),
            other_costs=[c for c in self.other_costs.values() if c.provider_job_id != job.id],
            worker_id=self.worker_id,
        )

    async def _cost_unseen_deliveries(self, current: str) -> None:
        """Every delivery of the submission leaves a marker as it claims
        (`contract.deliveries_folder`): a RunPod job this follow never heard of (its `/run`
        answer was lost, and another delivery held the claim) ran, billed a little, and is
        in the job's cost too. Each is read (cancelled first if it still runs: it cannot hold
        the claim) once; a folder that cannot be listed leaves the cost as it is, said so in
        the log."""
        if not self.pool.claims:
            return
        try:
            ids = await delivery_ids(self.store, self.target, self.req.job_id, self.submission)
        except StorageError as exc:
            self.log.warning("runpod_deliveries_unlisted", error=str(exc))
            return
        for runpod_job_id in ids:
            if runpod_job_id == current or runpod_job_id in self.other_costs:
                continue
            self.log.info("runpod_unseen_delivery", runpod_job_id=runpod_job_id)
            self.other_costs[runpod_job_id] = await self._given_up(runpod_job_id, "ran_nothing")

    async def _read_holder_cost(self, holder: str) -> None:
        """Our delivery replayed the outcome another RunPod job recorded (one whose `/run`
        answer was lost): that job ran the graph and billed for it. It records the outcome just
        before it returns, so its end is seconds away at most."""
        deadline = time.monotonic() + HOLDER_END_WAIT_S
        try:
            while True:
                job = await self._alive_while(self.client.status(holder))
                if job.state is not None and job.state.terminal:
                    self.other_costs[holder] = self.cost_of(job, "completed")
                    return
                if time.monotonic() > deadline:
                    break
                self._heartbeat()
                await asyncio.sleep(max(self.poll_s, 0.2))
        except RunPodError as exc:
            self.log.warning("runpod_holder_cost_unread", runpod_job_id=holder, error=str(exc))
            return
        self.log.warning("runpod_holder_cost_unread", runpod_job_id=holder, error="not ended")

    async def _failed(self, failed: Failed, job: RunPodJob | None = None) -> NoReturn:
        """Raise the failure, with what `job` (the failed RunPod job, when there is one to
        read) cost; a worker crash on a claimed submission first waits until the crashed
        holder's lease has run out, so the resubmission may take the claim over."""
        if job is None or (job.state is not None and job.state.terminal):  # gone, or ended
            await submissions.ended(
                self.store, self.req.named_pool, self.req.job_id, self.submission
            )
        try:
            unkept = self._unkept(failed.artifacts)
        except ApplicationError as exc:  # the failure is the answer: say why none is kept
            self.log.warning("runpod_partial_output_unusable", error=exc.message)
            unkept = []
        for record, key in unkept:
            try:
                await self._keep(record, key, verifiable=True)
            except ApplicationError as exc:  # what failed to verify is not kept
                self.log.warning("runpod_partial_output_unusable", error=exc.message)
        outcome: DeliveryOutcome = "crashed" if failed.resubmit else "failed"
        cost = await self._cost_read(job, outcome) if job is not None else None
        if failed.resubmit and self.pool.claims:
            aged = await self._wait_for_fence()
            if aged is not None and aged.claim.holder == failed.job_id and cost is not None:
                await self._complete_from(aged.claim, cost)
        raise from_failure(failed, cost)

    async def _recovered(self, failed: Failed) -> Failed | list[ArtifactRecord]:
        """A lost worker (`resubmit`) whose claim records the run completed did the work: its
        records are the result. A StorageError of our handler is final only once its claim
        says so: the claim is read again (the orchestrator's own S3 calls are retried by
        Temporal), and `after_storage_failure` decides: the claim's records (a success after
        all), a resubmission, or the failure as it is."""
        if self.pool.claims and failed.resubmit and failed.job_id:
            # A worker lost after it recorded its outcome: the work is done, nothing runs again.
            claim = await read_claim(self.store, self.target, self.req.job_id, self.submission)
            done = claim.outcome if claim is not None and claim.holder == failed.job_id else None
            if done is not None and done.state == "completed":
                self.log.warning("runpod_lost_worker_claim_completed", runpod_job_id=failed.job_id)
                return list(done.images)
            return failed
        if not (self.pool.claims and failed.error_type == ErrorType.STORAGE_ERROR):
            return failed
        claim = await read_claim(self.store, self.target, self.req.job_id, self.submission)
        verdict = after_storage_failure(failed, claim)
        if not isinstance(verdict, Failed):
            self.log.warning("runpod_storage_failure_claim_completed", runpod_job_id=failed.job_id)
        elif verdict.resubmit:
            self.log.warning("runpod_storage_failure_resubmitting", runpod_job_id=failed.job_id)
        return verdict

    async def _wait_for_fence(self) -> AgedClaim | None:
        """Until a new delivery may run the submission: the claim has an outcome or a fence
        record, or its holder's lease has run out by the pool's `fence_after_s` (by the S3
        server's clock; `TAKEOVER_MARGIN_S` more for the handler's stricter reading). A renewal
        meanwhile (the holder is alive after all) also ends the wait: the caller follows it.
        Returns the claim as last read (None: there is none)."""
        first: datetime | None = None
        while True:
            aged = await read_aged_claim(self.store, self.target, self.req.job_id, self.submission)
            if aged is None or aged.claim.outcome is not None or aged.claim.fenced is not None:
                return aged
            if first is not None and aged.claim.renewed_at > first:
                return aged
            first = first or aged.claim.renewed_at
            left = aged.lapses_in_s(self.fence_after_s + TAKEOVER_MARGIN_S)
            if left <= 0:
                return aged
            self._heartbeat()
            await asyncio.sleep(min(max(left, 0.1), self.poll_s * 5))

    # -- outputs -----------------------------------------------------------------------------

    def _unkept(self, records: list[ArtifactRecord]) -> list[tuple[ArtifactRecord, str]]:
        """Each of one answer's records not kept yet, with its key (`record_keys`: one per
        record, the same on every attempt). A key kept already is the same output again and is
        skipped, except an S3 record whose object changed since (a re-run stored it again),
        which is verified anew. Two outputs on one key fail the job rather than lose one."""
        req = self.req
        try:
            keys = record_keys(records, req.output.prefix, req.job_id, req.segment)
        except KeyCollision as exc:
            raise fatal(ErrorType.OUTPUT_MISSING, str(exc)) from None
        unkept: dict[str, ArtifactRecord] = {}
        for record, key in zip(records, keys, strict=True):
            kept = self.artifacts.get(key)
            changed = (
                kept is not None
                and record.type == "s3_url"
                and record.sha256 is not None
                and (record.size, record.sha256) != (kept.size, kept.sha256)
            )
            if (kept is None or changed) and key not in unkept:
                unkept[key] = record
        return [(record, key) for key, record in unkept.items()]

    async def _keep(self, record: ArtifactRecord, key: str, *, verifiable: bool) -> Artifact:
        """An output as a verified `Artifact` in our bucket, under this job's folder only."""
        try:
            source = artifact_source(record, verifiable=verifiable)
            if source == "s3":
                return await self._verified(record)
            if source == "inline":
                return await self._stored(record, key, inline_bytes(record))
        except UnusableArtifact as exc:
            raise fatal(ErrorType.OUTPUT_MISSING, str(exc)) from None
        # Without its query: a presigned URL's query (X-Amz-Credential, X-Amz-Signature) is a
        # credential, and this message lands in the job's history and status.
        where = record.data.split("?", 1)[0][:80]
        raise fatal(
            ErrorType.OUTPUT_MISSING,
            f"output {record.filename!r} is a URL ({where!r}); fetching outputs by URL "
            "is not supported yet: give the endpoint a bucket (BUCKET_ENDPOINT_URL)",
        )

    async def _verified(self, record: ArtifactRecord) -> Artifact:
        bucket, key = s3_location(record)
        folder = job_folder(self.req.output.prefix, self.req.job_id) + "/"
        if bucket != self.target.bucket or not key.startswith(folder):
            raise fatal(
                ErrorType.OUTPUT_MISSING,
                f"output {record.filename!r} points at s3://{bucket}/{key}, outside this job's "
                f"folder s3://{self.target.bucket}/{folder}: refused",
            )
        head = await self.store.head(key, bucket=bucket)
        if head is None or head.size != record.size or head.sha256 != record.sha256:
            raise retryable(
                ErrorType.STORAGE_ERROR,
                f"s3://{bucket}/{key} is not stored as the worker says (size {record.size}, "
                f"sha256 {(record.sha256 or '')[:12]}...)",
            )
        return self._remember(record, head.uri, key, head.size, head.sha256, head.content_type)

    async def _stored(self, record: ArtifactRecord, key: str, data: bytes) -> Artifact:
        stored = await self.store.upload_stream(
            key,
            one_chunk(data),
            content_type=content_type_for(record.filename),
            bucket=self.target.bucket,
        )
        return self._remember(
            record, stored.uri, key, stored.size, stored.sha256, stored.content_type
        )

    def _remember(
        self, record: ArtifactRecord, uri: str, key: str, size: int, sha256: str, content_type: str
    ) -> Artifact:
        artifact = Artifact(
            key=key,
            uri=uri,
            size=size,
            sha256=sha256,
            content_type=content_type,
            node_id=record.node_id or "output",
            segment=self.req.segment,
        )
        self.artifacts[key] = artifact
        self.log.info("artifact_kept", key=key, size=size)
        return artifact

    # -- reporting ---------------------------------------------------------------------------

    def cost_of(self, job: RunPodJob, outcome: DeliveryOutcome | None = None) -> JobCost:
        return job_cost(job, self.pool, outcome=outcome)

    async def _cost_read(self, job: RunPodJob, outcome: DeliveryOutcome | None) -> JobCost:
        """`cost_of`, with what the claim says the job's earlier deliveries held (a job RunPod
        delivered again after its worker was lost: its figures count the last delivery only).
        An unreadable claim leaves RunPod's figures as they are, said so in the log."""
        claim = None
        if self.pool.claims:
            try:
                claim = await read_claim(self.store, self.target, self.req.job_id, self.submission)
            except StorageError as exc:
                self.log.warning("runpod_cost_claim_unread", runpod_job_id=job.id, error=str(exc))
        return job_cost(job, self.pool, outcome=outcome, claim=claim)

    def _checkpoint(self) -> Checkpoint:
        return self.checkpoint.model_copy(
            update={"uploaded": sorted(self.artifacts), "updated_at": datetime.now(UTC)}
        )

    def _resume_point(self) -> FollowHeartbeat:
        return FollowHeartbeat(
            checkpoint=self._checkpoint(),
            artifacts=list(self.artifacts.values()),
            stage=self.stage,
            queue_position=self.queue_position if self.stage == "queued" else None,
            live=self.live.url,
        )

    def _live_beat(self) -> FollowHeartbeat:
        """What a live-progress subscriber is pushed (activities/live_progress.py): the
        heartbeat without its artifacts."""
        return FollowHeartbeat(
            checkpoint=self._checkpoint(),
            stage=self.stage,
            queue_position=self.queue_position if self.stage == "queued" else None,
        )

    def _heartbeat(self) -> None:
        # A gateway subscribed to the job's steps hears of them with the heartbeat, not at its
        # next poll of the job.
        self.live.moved(self.req.job_id)
        activity.heartbeat(self._resume_point().model_dump(mode="json"))

    async def _alive_while(self, call: Coroutine[Any, Any, T]) -> T:
        """`call`, heartbeating every `KEEPALIVE_S` while it lasts.

        The client waits out 429 / 5xx bursts by itself, up to its retry budget (10 s), which
        may be longer than the job's heartbeat timeout. Silent that long, this attempt would be
        timed out while it still runs, and the workflow's next attempt would poll, or send
        `/run`, beside it: two RunPod jobs for one submission.
        """
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=KEEPALIVE_S)
                if done:
                    return task.result()
                self._heartbeat()
        finally:
            if not task.done():
                task.cancel()

    async def _report(
        self,
        stage: Stage,
        *,
        position: int | None = None,
        artifact: Artifact | None = None,
        force: bool = False,
    ) -> None:
        """A `progress` signal, if this is a milestone (every poll's step is in the heartbeat).

        "uploading" only labels the report of an artifact (forced); the stage milestones follow
        is the submission's on RunPod. A new place in the queue is news the workflow's status
        carries: told no more often than a tenth."""
        if stage in ("queued", "running"):
            self.stage = stage
            self.queue_position = position if stage == "queued" else None
        where = "finished" if stage == "finished" else self.stage or stage
        checkpoint = self._checkpoint()
        news = self.queue_position != self.told_position
        if artifact is None and self.untold and self.milestones.quiet_left_s == 0:
            # Outputs stored during the quiet start: told now, each with its report.
            artifact, stage, force = self.untold.pop(0), "uploading", True
        if not self.milestones.due(
            where, checkpoint.step, checkpoint.total_steps, force=force, news=news
        ):
            if artifact is not None and self.milestones.held:
                self.untold.append(artifact)
            return
        self.told_position = self.queue_position
        report = ProgressReport(
            attempt_client_id=self.req.client_id,
            stage=stage,
            queue_position=self.queue_position if stage == "queued" else None,
            step=checkpoint.step,
            total_steps=checkpoint.total_steps,
            node=self.node,
            artifact=artifact,
            checkpoint=checkpoint,
            worker_id=self.worker_id,
            # The workflow left the check to this follow and learns the pool from it.
            pool=self.req.pool if self.req.prepare is not None else None,
            kind="runpod" if self.req.prepare is not None else None,
            slot=self.req.slot_bound,
        )
        await send_progress(self.req.job_id, report, self.log)


async def one_chunk(data: bytes) -> AsyncIterator[bytes]:
    yield data


def stop_horizon(teardown_horizon_s: float | None) -> float:
    """How long our handler keeps stopping a cancelled job's prompt (`Orchestration`): the
    job's teardown horizon less a margin in which the workflow reads the handler's verdict."""
    if teardown_horizon_s is None:
        return DEFAULT_STOP_HORIZON_S
    margin = max(STOP_MARGIN_MIN_S, STOP_MARGIN_SHARE * teardown_horizon_s)
    return max(MIN_STOP_HORIZON_S, teardown_horizon_s - margin)


def _lost(message: str, cost: JobCost) -> ApplicationError:
    """A delivery given up: the workflow submits the prompt again (`PROMPT_LOST`), and what the
    lost delivery billed joins the job's cost."""
    return fatal(ErrorType.PROMPT_LOST, message, cost=cost.model_dump(mode="json"))
