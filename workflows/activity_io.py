"""Inputs and results of the activities, one model in and one model out for each."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationError

from workflows.admission import Admission, PoolBound
from workflows.budgets import BudgetHold
from workflows.contracts import (
    Artifact,
    Checkpoint,
    InputRef,
    JobCost,
    JobEvent,
    JobRequest,
    OutputSpec,
    StrictModel,
    WebhookEventName,
    WebhookSpec,
)
from workflows.graph import sampler_steps
from workflows.shared import TENANT_LABEL


def _unnamed(name: Any) -> Any:
    return None if name == "" else name


# A pool, or its kind, that may not be named yet: None until the job hears which pool took it
# (the worker's default; each activity resolves it before anything reads it,
# activities/backend.py). "" is how earlier versions wrote that (a continued run's carry, an
# activity an older workflow scheduled): read as None, so "" means nothing past here.
MaybeNamed = Annotated[str | None, BeforeValidator(_unnamed)]


def _routed(pool: str | None) -> str:
    if pool is None:
        raise ValueError("an activity's input reached its backend without a pool")
    return pool


class PrepareInput(StrictModel):
    job_id: str
    pool: str | None
    graph: dict[str, Any]
    inputs: dict[str, InputRef] = Field(default_factory=dict)
    segments: list[dict[str, Any]] = Field(default_factory=list)
    # Where the job stores things (backends that stage inputs beside its artifacts).
    output: OutputSpec = Field(default_factory=OutputSpec)
    # Checked before any GPU time: a URL the worker must not POST to, or a tenant without a
    # signing secret, refuses the job here.
    webhook: WebhookSpec | None = None
    # The request's `tenant` label (None: a job of no tenant's, its webhook signed as the
    # default tenant's). A tenant's `s3://` inputs must be in its own area.
    tenant: str | None = None
    # The request's priority: its tenant's `max_priority` may forbid it.
    priority: int = 3
    # When the job was accepted: on a bounded pool the check asks the pool's queue for a slot
    # at once, in the job's place (its order within its tenant).
    accepted_at: datetime | None = None
    # A job of a group (its `pool` names one) leaving this pool of it before it started there
    # (it turned unhealthy): the check picks another that takes work, else this one again.
    leaving: str | None = None
    # The request's start deadline (left of it, for a job checked again): a group's pool whose
    # estimated start is later is passed.
    start_by_s: float | None = None

    @classmethod
    def of(
        cls, request: JobRequest, job_id: str, accepted_at: datetime | None = None
    ) -> PrepareInput:
        """The check of `request`, by its prepare or by its first follow."""
        return cls(
            job_id=job_id,
            pool=request.pool,
            graph=request.graph,
            inputs=request.inputs,
            segments=request.segments,
            output=request.output,
            webhook=request.webhook,
            # The label as the request has it: a job without one is not a tenant's
            # (activities/inputs.py confines a tenant's s3:// inputs to its own area).
            tenant=request.labels.get(TENANT_LABEL),
            priority=request.priority,
            accepted_at=accepted_at,
            start_by_s=request.policy.start_by_s,
        )


class PreparedJob(StrictModel):
    """The graph as it will be submitted, checked against the backend's node registry (by a
    prepare, which names its pool and kind; None: by the job's first follow, not yet)."""

    pool: MaybeNamed
    kind: MaybeNamed
    graph: dict[str, Any]
    sampler_steps: dict[str, int] = Field(default_factory=dict)
    nodes_total: int = 0
    output_nodes: list[str] = Field(default_factory=list)
    # Input files staged in the job's bucket folder for backends that fetch them with the
    # submission (RunPod): the name a load node uses -> its object key.
    staged_inputs: dict[str, str] = Field(default_factory=dict)
    # Set when the pool is bounded (`max_running`): the job waits for a slot first. `slot_asked`:
    # the check has asked the pool's queue already (the job need not); `admission`: the queue's
    # answer to it (the grant, or a place in line; None: it comes by signal).
    bound: PoolBound | None = None
    slot_asked: bool = False
    admission: Admission | None = None
    # The job's tenant has a daily budget: the tenant, whose ledger the job tells its spend at
    # its end (workflows/budgets.py). `held`: its spend today has reached a limit, so the job
    # may not start before the reset (nothing was asked of the pool's queue).
    budget: str | None = None
    held: BudgetHold | None = None
    # The request named a group: this (`pool`) is the pool of it the check picked.
    group: str | None = None

    @classmethod
    def unchecked(cls, request: JobRequest) -> PreparedJob:
        """A request that stages no input file, as its first follow will check it: the graph
        is its own, its pool the request's (None: the worker's default, named by the check)."""
        return cls(
            pool=request.pool,
            kind=None,
            graph=request.graph,
            sampler_steps=sampler_steps(request.graph),
            nodes_total=len(request.graph),
        )


class FollowInput(StrictModel):
    job_id: str
    pool: MaybeNamed
    prompt_id: str
    client_id: str
    segment: int = 0
    segments: int = 1
    run_tag: str
    sampler_steps: dict[str, int] = Field(default_factory=dict)
    nodes_total: int = 0
    output: OutputSpec
    progress_interval_s: float = 2.0
    # Where an earlier attempt got to; a retry of the same activity prefers its own heartbeat.
    checkpoint: Checkpoint | None = None
    # Artifacts of this segment stored by an earlier attempt: never uploaded twice.
    stored: list[Artifact] = Field(default_factory=list)
    # Submit this graph first, unless the backend already knows the prompt. The socket opens
    # before the submission, so no event of the prompt is missed.
    graph: dict[str, Any] | None = None
    # No earlier attempt can have submitted `prompt_id` (the first follow of it in this run):
    # the backend is not asked whether it holds the prompt before the POST, a round trip less.
    first_post: bool = False
    # For backends that take them with the submission (RunPod's executionTimeout and ttl).
    execution_timeout_s: float | None = None
    queue_timeout_s: float | None = None
    # PreparedJob.staged_inputs, for backends that send input files with the submission.
    staged_inputs: dict[str, str] = Field(default_factory=dict)
    # The job's teardown horizon, for backends whose worker stops the prompt itself (our RunPod
    # handler keeps at it a little less long, so the teardown still reads its verdict).
    teardown_horizon_s: float | None = None
    # The request's own check, left to the follow when it stages no input file (there is then
    # nothing to prepare but the check, and `graph` is the request's graph as it is): done
    # before anything is submitted, and a refusal fails the attempt before any POST
    # (`workflows.failures.refused_before_submission`). Set until the workflow hears which
    # pool took the job.
    prepare: PrepareInput | None = None
    # The job holds a slot of its pool's queue: a bounded pool's check (`prepare`) goes on to
    # submit. Without one it returns `needs_slot` before anything reaches the pool.
    slot_held: bool = False
    # Set by the follow itself (never by the workflow) when its own check was granted the slot
    # at once: its progress reports carry it, so the workflow knows it holds the slot.
    slot_bound: PoolBound | None = None
    # How long a check told a place in line may wait for its grant itself, watching the queue,
    # before it returns `needs_slot` (the job then waits by signal); 0: it returns at once. The
    # attempt's start-to-close timeout has this much more than the execution timeout.
    slot_wait_s: float = 0.0
    # On a pool of many servers: the one its queue granted the job (a checkpoint's own
    # `server`, where an attempt sent the prompt, comes first).
    server: str | None = None

    @property
    def named_pool(self) -> str:
        """The pool, as the activity named it before its backend reads it."""
        return _routed(self.pool)


class FollowResult(StrictModel):
    """A prompt that ended successfully, every output of it stored in the job's folder and
    verified (size, sha256) by the follow itself: the workflow schedules no offload for it."""

    prompt_id: str
    # needs_slot: the check (`FollowInput.prepare`) passed on a bounded pool and nothing was
    # submitted: the job asks for a slot (`bound`), then follows again. held: the check found
    # the tenant over its daily budget (`held`) and nothing was submitted: the job waits until
    # the reset, then is checked again.
    outcome: Literal["success", "needs_slot", "held"]
    artifacts: list[Artifact] = Field(default_factory=list)
    checkpoint: Checkpoint
    # What the provider job that produced the result cost; and other provider jobs of the same
    # submission that billed (a delivery that found it claimed, a job whose `/run` answer was
    # lost but which ran it).
    cost: JobCost | None = None
    other_costs: list[JobCost] = Field(default_factory=list)
    # The worker that followed it (`pid@host`): a prompt that ended within the attempt's quiet
    # start sent no progress report to say so.
    worker_id: str | None = None
    # The pool the request was checked against (`FollowInput.prepare`) and its kind; None
    # when the workflow named the pool itself.
    pool: str | None = None
    kind: str | None = None
    bound: PoolBound | None = None
    slot_asked: bool = False
    admission: Admission | None = None
    # The follow gave the job's slot back itself (its last prompt ended): the job need not.
    slot_released: bool = False
    # From the check (`FollowInput.prepare`): the tenant whose daily budget counts the job, and
    # with `held`, until when it may not start.
    budget: str | None = None
    held: BudgetHold | None = None
    # From the check: the request named a group, and `pool` is the pool of it picked.
    group: str | None = None


class FollowHeartbeat(StrictModel):
    """Where a follow attempt got to: the one detail of its heartbeats and of its retryable
    failures, so the next attempt (or the workflow) resumes from it."""

    checkpoint: Checkpoint
    # Artifacts of this segment stored so far: never uploaded twice.
    artifacts: list[Artifact] = Field(default_factory=list)
    # Where the backend says the prompt is (None: not yet known), and its place in the queue
    # (1 = next): clients read them from here before the workflow hears of them (it hears of a
    # stage change only once the attempt has run past its quiet start).
    stage: Literal["queued", "running"] | None = None
    queue_position: int | None = None
    # Where the worker following the prompt pushes its steps as they happen (a gateway
    # subscribes there: activities/live_progress.py); None when that worker serves no push.
    live: str | None = None

    @classmethod
    def from_details(cls, details: Sequence[Any] | None) -> FollowHeartbeat | None:
        """The heartbeat in a details sequence (`heartbeat_details`, `ApplicationError.details`,
        `last_heartbeat_details`); None when there is none or it cannot be read."""
        if not details or not isinstance(details, Sequence) or isinstance(details, str | bytes):
            return None
        first = details[0]
        if isinstance(first, cls):
            return first
        if len(details) != 1 or not isinstance(first, Mapping):
            return None
        try:
            return cls.model_validate(first)
        except ValidationError:
            return None


class OffloadInput(StrictModel):
    job_id: str
    pool: MaybeNamed
    prompt_id: str
    segment: int = 0
    run_tag: str
    output: OutputSpec
    stored: list[Artifact] = Field(default_factory=list)
    # Compensation after a failure or cancel: keep whatever finished, never fail for the rest.
    partial: bool = False
    # On a pool of many servers: the one that ran the prompt (None: not known; each is asked).
    server: str | None = None

    @property
    def named_pool(self) -> str:
        """The pool, as the activity named it before its backend reads it."""
        return _routed(self.pool)


class OffloadResult(StrictModel):
    artifacts: list[Artifact]


class StopInput(StrictModel):
    """One check of a stop: where is the prompt, and what does it take to stop it now."""

    job_id: str
    pool: MaybeNamed
    prompt_id: str
    reason: str
    free_memory: bool = False
    # False when the backend never acknowledged the prompt: "no record" then means never queued.
    submitted: bool = True
    # The last check before the teardown horizon: a prompt still there marks the pool busy.
    final: bool = False
    # The backend's own job id for the prompt, when the workflow has heard it (RunPod's).
    provider_job_id: str | None = None
    output: OutputSpec = Field(default_factory=OutputSpec)
    # On a pool of many servers: the one the prompt was sent to (None: not known; each is
    # asked, and one that cannot be makes the check "unreachable").
    server: str | None = None

    @property
    def named_pool(self) -> str:
        """The pool, as the activity named it before its backend reads it."""
        return _routed(self.pool)


class StopCheck(StrictModel):
    """What one check saw and did."""

    at: datetime
    # "unreachable": the backend could not be asked (`message` says why); ask again later.
    # "stuck": the backend could not stop the prompt and says so for good (our RunPod handler
    # gave up at its stop horizon and replaced its worker): the teardown fails now.
    position: Literal["pending", "running", "gone", "unreachable", "stuck"]
    # "cancel_sent": the provider's job was cancelled; its worker is not known to stop the
    # prompt (a stock worker-comfyui endpoint).
    action: Literal["none", "dequeued", "interrupt_sent", "cancel_sent"] = "none"
    # Once gone: how the backend's own record says the prompt ended ("unknown": no record;
    # "never_queued": the backend refused the prompt, so it never ran).
    ended: Literal["success", "interrupted", "error", "unknown", "never_queued"] | None = None
    # False once gone from a backend that cannot tell whether the prompt really stopped.
    confirmed: bool = True
    # The backend's worker that held the prompt, where it says (a RunPod worker id).
    worker_id: str | None = None
    # With "stuck": the worker was replaced, so nothing runs behind the prompt.
    worker_replaced: bool = False
    node: str | None = None
    node_type: str | None = None
    message: str = ""
    freed_memory: bool = False
    # Once gone from a per-second-billed backend: what the provider job cost, and what the
    # job's other provider jobs cost (RunPod jobs whose `/run` answer was lost, read once).
    cost: JobCost | None = None
    other_costs: list[JobCost] = Field(default_factory=list)
    # The pool checked and its kind, when the job named none: a job stopped before its
    # follow, which checked the request, said which pool took it.
    pool: str | None = None
    kind: str | None = None
    # The pool is bounded: a job that has not heard of a slot may hold one all the same (its
    # follow's own check was granted it and went on to submit, and the job was stopped before
    # a report or a result said so). The job gives it back (or holds it unsettled) at its end.
    slot: PoolBound | None = None


class WebhookDeliveryInput(StrictModel):
    """One attempt to POST one journal entry to the job's webhook. Names the tenant whose
    secret signs it; the secret itself stays on the worker."""

    job_id: str
    tenant: str
    url: str
    webhook_id: str
    event: WebhookEventName
    # The job's journal entry; None for a batch's end, whose summary is `batch`.
    entry: JobEvent | None = None
    attempt: int = 1
    # A batch's end (workflows/job_batch.py): its summary, sent as `batch.<event>`.
    batch: dict[str, Any] | None = None


class WebhookAttempt(StrictModel):
    """How one attempt went. `retry`: try again later; `gone`: the receiver answered 410 and
    wants no more; `refused`: the worker will not send to that URL or cannot sign for the tenant
    (nothing more is sent)."""

    outcome: Literal["delivered", "retry", "gone", "refused"]
    status_code: int | None = None
    error: str | None = None
    at: datetime
