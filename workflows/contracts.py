"""The data contracts every layer exchanges (docs/architecture.md), as pydantic v2 models.

They travel through Temporal with `temporalio.contrib.pydantic.pydantic_data_converter`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from enum import StrEnum
from types import MappingProxyType
from typing import Annotated, Any, Final, Literal, NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    PrivateAttr,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    computed_field,
    field_validator,
    model_validator,
)
from pydantic_core import core_schema

from workflows.admission import (
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    MIN_PRIORITY,
    Admission,
    PoolBound,
)
from workflows.graph import check_graph, check_input_files, check_segment_files
from workflows.request_checks import (
    check_input_names,
    check_labels,
    check_policy,
    check_segments,
)
from workflows.shared import JOB_ID_PATTERN


class StrictModel(BaseModel):
    """Base of every request: an unknown field is an error, never silently dropped (a typo in
    a request must not pass as a default)."""

    model_config = ConfigDict(extra="forbid")


class ReadModel(BaseModel):
    """Base of what a worker writes and any client reads (the status, its journal, webhook
    payloads, activity results): a field from a newer version is ignored, so a client, CLI,
    gateway or page one version behind the worker that wrote it still reads it during a
    rolling upgrade (docs/upgrading.md). States and kinds are open too (`ReadState`)."""

    model_config = ConfigDict(extra="ignore")


class JobState(StrEnum):
    QUEUED = "QUEUED"
    PREPARING = "PREPARING"
    # Checked, and waiting in our own queue for a slot of its bounded pool (`max_running`):
    # nothing is at the provider yet; `admission` says where it stands.
    PENDING = "PENDING"
    SUBMITTING = "SUBMITTING"
    # Accepted by the backend, waiting behind other prompts (progress.queue_position says where).
    WAITING = "WAITING"
    RUNNING = "RUNNING"
    RECONNECTING = "RECONNECTING"
    UPLOADING = "UPLOADING"
    # A stop was decided (cancel, abandonment, deadline, failure): waiting for the backend to
    # confirm the prompt is gone; `teardown` says what was done and seen so far.
    STOPPING = "STOPPING"
    NEEDS_DECISION = "NEEDS_DECISION"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    ABANDONED = "ABANDONED"
    # Its prompt had not begun to run on a GPU by `policy.start_by_s` after acceptance: what it
    # had submitted was withdrawn, nothing ran and nothing was billed.
    EXPIRED = "EXPIRED"
    # Never set by the job itself: clients report these from Temporal's own record when the
    # workflow was ended from outside (`temporal workflow terminate`, a run timeout), which
    # skips the job's teardown.
    TERMINATED = "TERMINATED"
    TIMED_OUT = "TIMED_OUT"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


WebhookEventName = Literal[
    "completed",
    "failed",
    "cancelled",
    "abandoned",
    "expired",
    "needs_decision",
    "output_stored",
    "progress",
]


class Ending(NamedTuple):
    """What a terminal state means beyond its name."""

    # The webhook event that tells of it; None: no webhook can (the job never sets the state:
    # clients read it from Temporal's own record of a workflow ended from outside).
    webhook_event: WebhookEventName | None
    # What a stop after it is called (the teardown's detail and the Temporal UI's label).
    stop_label: str


# The terminal states, once: `TERMINAL_STATES`, the default webhook events, the webhook's state
# events, the teardown's labels and the browser page (`GET /v1/config`) derive from this.
ENDINGS: Final[Mapping[JobState, Ending]] = MappingProxyType(
    {
        JobState.COMPLETED: Ending("completed", "after completion"),
        JobState.FAILED: Ending("failed", "after failure"),
        JobState.CANCELLED: Ending("cancelled", "after cancel"),
        JobState.ABANDONED: Ending("abandoned", "after abandonment"),
        JobState.EXPIRED: Ending("expired", "after expiry"),
        JobState.TERMINATED: Ending(None, "after terminated"),
        JobState.TIMED_OUT: Ending(None, "after timed_out"),
    }
)
TERMINAL_STATES: Final = frozenset(ENDINGS)


class UnknownState(str):
    """A state a newer worker wrote that this version does not know (`ReadState`): shown by its
    name. Whether it is terminal is the status's own word (`JobStatus.terminal`, written by the
    worker), never this version's guess."""

    @property
    def value(self) -> str:
        return str(self)

    @property
    def name(self) -> str:
        return str(self)

    @property
    def terminal(self) -> bool:
        return False

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: type[Any], handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(cls, core_schema.str_schema())


# A state as a reader takes it: one of this version's `JobState`s, else by its name.
ReadState = Annotated[JobState | UnknownState, Field(union_mode="left_to_right")]


def known_state(state: JobState | UnknownState) -> JobState:
    """`state` as the workflow holds it: always one of its own version's (a job is pinned to
    its version, so its carry was written by the same code)."""
    if isinstance(state, JobState):
        return state
    raise ValueError(f"state {state!r} is not one of this version's")


# Numbers in policies are strict: `true` or "30" is refused, never read as 1 or 30 seconds.
class ReconnectPolicy(StrictModel):
    base_delay_s: float = Field(1.0, gt=0, strict=True)
    max_delay_s: float = Field(30.0, gt=0, strict=True)
    horizon_s: float = Field(300.0, gt=0, strict=True)

    @model_validator(mode="after")
    def _max_not_below_base(self) -> ReconnectPolicy:
        if self.max_delay_s < self.base_delay_s:
            raise ValueError("reconnect.max_delay_s must be >= reconnect.base_delay_s")
        return self


class JobPolicy(StrictModel):
    # The cap on the job's run on the GPU (also sent to RunPod); its clock starts when the job
    # leaves PENDING: time in our queue never counts.
    execution_timeout_s: float = Field(1800.0, gt=0, strict=True)
    # Counted from acceptance: a job whose prompt has not begun to run on a GPU by then (still
    # PENDING, or queued at the provider) has what it submitted withdrawn and ends EXPIRED.
    start_by_s: float | None = Field(None, gt=0, strict=True)
    # Replaced by `start_by_s`; still honoured for a request that sends it: a prompt that waits
    # in the backend's queue longer than this fails the job (QueueTimeout).
    queue_timeout_s: float | None = Field(None, gt=0, strict=True)
    heartbeat_timeout_s: float = Field(20.0, gt=0, strict=True)
    reconnect: ReconnectPolicy = Field(default_factory=ReconnectPolicy)
    # Unset means "the reconnect horizon"; an explicit null makes a detached job.
    abandon_after_s: float | None = Field(default=300.0, gt=0, strict=True)
    progress_interval_s: float = Field(2.0, gt=0, strict=True)
    on_ambiguous_submit: Literal["pause", "fail", "resubmit"] = "pause"
    # How long a stop keeps confirming that the prompt left the backend's queue. ComfyUI
    # interrupts cooperatively: a node without a progress hook runs to its end first.
    teardown_horizon_s: float = Field(900.0, gt=0, strict=True)
    # Continue-as-new at a segment boundary once history passes half of this many events.
    history_budget_events: int = Field(2000, ge=10, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _abandon_defaults_to_horizon(cls, data: Any) -> Any:
        # Resolved here, once, so the value survives serialisation: after a JSON round trip an
        # explicit null must still mean "detached", and a default must still mean "horizon".
        if isinstance(data, dict) and "abandon_after_s" not in data:
            reconnect = data.get("reconnect")
            horizon = 300.0
            if isinstance(reconnect, dict):
                horizon = reconnect.get("horizon_s", horizon)
            elif isinstance(reconnect, ReconnectPolicy):
                horizon = reconnect.horizon_s
            data = {**data, "abandon_after_s": horizon}
        return data

    @property
    def detached(self) -> bool:
        return self.abandon_after_s is None


class InlineInput(StrictModel):
    kind: Literal["inline"] = "inline"
    filename: str = Field(min_length=1, max_length=255)
    data_b64: str = Field(description="File bytes, base64. Keep small: it is stored in history.")


class S3Input(StrictModel):
    kind: Literal["s3"] = "s3"
    uri: str = Field(pattern=r"^s3://[^/]+/.+")


class UrlInput(StrictModel):
    kind: Literal["url"] = "url"
    url: str = Field(pattern=r"^https://")


InputRef = Annotated[InlineInput | S3Input | UrlInput, Field(discriminator="kind")]

# Inline inputs live in workflow history, whose payloads are capped at 2 MiB.
MAX_INLINE_INPUT_BYTES = 1024 * 1024
# What may stay inline in one request, all inputs together (the client stages the rest): with
# the graph it must fit in the workflow's start payload (2 MiB), and base64 grows bytes by a third.
MAX_INLINE_TOTAL_BYTES = MAX_INLINE_INPUT_BYTES


class OutputSpec(StrictModel):
    bucket: str | None = None
    prefix: str = Field("jobs", max_length=200)
    presign_ttl_s: int = Field(3600, gt=0, le=7 * 24 * 3600)


# A webhook's events when the request names none: how the job ended, and a call for a person.
DEFAULT_WEBHOOK_EVENTS: tuple[WebhookEventName, ...] = (
    *(ending.webhook_event for ending in ENDINGS.values() if ending.webhook_event is not None),
    "needs_decision",
)


class WebhookSpec(StrictModel):
    """Where the job POSTs its events (docs/http-api.md, *Webhooks*): signed with the tenant's
    secret, which the worker holds; the request never carries it."""

    url: str = Field(pattern=r"^https?://", max_length=2000)
    events: list[WebhookEventName] = Field(
        default_factory=lambda: list(DEFAULT_WEBHOOK_EVENTS), min_length=1
    )
    # How long one event is retried before it is given up (a receiver down for a day still
    # gets it); never part of the job's own run time.
    retry_horizon_s: float = Field(24 * 3600.0, gt=0, le=7 * 24 * 3600, strict=True)


class JobRequest(StrictModel):
    """What a client asks for. Names a pool and perhaps a webhook URL, never a credential."""

    graph: dict[str, Any]
    # Validated when absent too: `_declared_inputs` checks the graph's load nodes against it.
    inputs: dict[str, InputRef] = Field(default_factory=dict, validate_default=True)
    segments: list[dict[str, Any]] = Field(default_factory=list)
    pool: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    output: OutputSpec = Field(default_factory=OutputSpec)
    policy: JobPolicy = Field(default_factory=JobPolicy)
    labels: dict[str, str] = Field(default_factory=dict)
    webhook: WebhookSpec | None = None
    # 1 (first) to 5 (last): on a bounded pool a better priority starts before any worse one
    # waiting; a tenant's `max_priority` may forbid the best ones.
    priority: int = Field(DEFAULT_PRIORITY, ge=MIN_PRIORITY, le=MAX_PRIORITY, strict=True)

    @property
    def segment_count(self) -> int:
        """How many times the graph runs: once per segment, once when there are none."""
        return max(1, len(self.segments))

    # Every check below raises a ValueError subclass that names the node or field
    # (workflows/graph.py, workflows/request_checks.py); pydantic reports it under the field,
    # with the error itself in the error's `ctx`.

    @field_validator("graph")
    @classmethod
    def _api_format(cls, graph: dict[str, Any]) -> dict[str, Any]:
        check_graph(graph)
        return graph

    @field_validator("inputs")
    @classmethod
    def _declared_inputs(cls, inputs: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """Load nodes may name declared inputs only (checked here: the graph comes first)."""
        check_input_names(inputs)
        graph = info.data.get("graph")
        if graph is not None:
            check_input_files(graph, inputs)
        return inputs

    @field_validator("segments")
    @classmethod
    def _bounded_segments(
        cls, segments: list[dict[str, Any]], info: ValidationInfo
    ) -> list[dict[str, Any]]:
        check_segments(segments)
        graph, inputs = info.data.get("graph"), info.data.get("inputs")
        if graph is not None and inputs is not None:
            check_segment_files(graph, segments, inputs)
        return segments

    @field_validator("labels")
    @classmethod
    def _bounded_labels(cls, labels: dict[str, str]) -> dict[str, str]:
        check_labels(labels)
        return labels

    @field_validator("policy")
    @classmethod
    def _bounded_policy(cls, policy: JobPolicy) -> JobPolicy:
        check_policy(policy)
        return policy


class Checkpoint(ReadModel):
    """The durable answer to "where do I resume": heartbeated on every progress event."""

    job_id: str
    segment: int = 0
    step: int = 0
    total_steps: int = 0
    provider_job_id: str | None = None
    prompt_id: str | None = None
    client_id: str | None = None
    nodes_done: list[str] = Field(default_factory=list)
    node_steps: dict[str, int] = Field(default_factory=dict)
    uploaded: list[str] = Field(default_factory=list)
    # When the backend was known to hold the prompt (accepted or found queued): from then on a
    # prompt it no longer knows is lost, never "not submitted yet".
    submitted_at: datetime | None = None
    # When a submission was sent whose answer may not have been heard (a RunPod `/run`): with
    # no `provider_job_id` beside it, whether the backend has the prompt is unknown.
    submit_sent_at: datetime | None = None
    updated_at: datetime | None = None
    # How long the prompt has run on its GPU so far, as its follows measured it on a comfyui
    # pool (each attempt on its worker's monotonic clock, from when it saw the prompt running to
    # its end; a follow that re-attaches adds its own): at least what it ran.
    ran_s: float = 0.0
    # The server of a pool of many (`urls`) the prompt was sent to: every later look at it
    # (re-attach, stop, offload) asks that server, never another.
    server: str | None = None


class Artifact(ReadModel):
    key: str
    uri: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    content_type: str
    node_id: str
    segment: int = 0
    url: str | None = Field(None, description="Presigned GET URL; filled by clients, never stored.")


class Progress(ReadModel):
    segment: int = 0
    segments: int = 1
    step: int = 0
    total_steps: int = 0
    fraction: float = Field(0.0, ge=0.0, le=1.0)
    unit: Literal["steps", "nodes"] = "steps"
    # While WAITING: 1 = next to run on the backend.
    queue_position: int | None = None
    # The node the backend is running, when known.
    node: str | None = None


class JobError(ReadModel):
    type: str
    message: str
    retryable: bool = False


class BackendInfo(ReadModel):
    pool: str
    kind: str = "comfyui"
    provider_job_id: str | None = None
    # The worker process following the job (`pid@host`, its Temporal identity).
    worker_id: str | None = None
    # On a pool of many ComfyUI servers: the one the job runs on (its queue's choice).
    server: str | None = None


StopAction = Literal[
    "never_queued",  # the backend never accepted the prompt
    "dequeued",  # removed from the backend's queue before it started
    "interrupt_sent",  # running: asked to stop (cooperative: lands at the next node/step)
    "interrupted",  # ended by the interrupt (at `node`)
    "finished",  # ended on its own: it had finished before the stop landed
    "failed",  # ended with an error of its own
    "gone",  # no longer queued, and the backend keeps no record of it (restarted?)
    "freed_memory",  # POST /free, after an out-of-memory failure
    "still_running",  # still on the backend when the teardown horizon ran out
    "check_failed",  # the backend could not be asked (the check is repeated)
    # The provider's job was cancelled, but its worker cannot be told to stop the prompt (a
    # stock worker-comfyui endpoint): whether the prompt stopped is unknown.
    "cancel_sent",
    # The prompt could not be stopped, so its worker was replaced (RunPod: our handler killed
    # its ComfyUI and ended the worker): no later job queues behind it.
    "worker_replaced",
]


class TeardownStep(ReadModel):
    """One thing teardown did or saw, in order."""

    at: datetime
    action: StopAction
    node: str | None = None
    detail: str = ""


class Teardown(ReadModel):
    """How the job made sure its prompt no longer runs, kept across retries and stops."""

    # CONFIRMED: the prompt is gone from the backend. FAILED: it was still there at the
    # teardown horizon, or could not be stopped (`detail` says where). UNCONFIRMED: everything
    # the backend allows was done, but it cannot tell whether the prompt stopped (a stock
    # worker-comfyui endpoint cannot stop one). SKIPPED: nothing was ever submitted.
    state: Literal["PENDING", "STOPPING", "CONFIRMED", "FAILED", "UNCONFIRMED", "SKIPPED"] = (
        "PENDING"
    )
    at: datetime | None = None
    detail: str = ""
    started_at: datetime | None = None
    checks: int = 0
    steps: list[TeardownStep] = Field(default_factory=list)


class Decision(ReadModel):
    """Why a NEEDS_DECISION job waits, and what each way out does."""

    reason: str
    # choice -> what it does and costs ("resume --resubmit": ..., "cancel": ...)
    options: dict[str, str] = Field(default_factory=dict)
    # Whether a plain resume (no resubmit) can re-attach to anything.
    reattach_possible: bool = False
    since: datetime | None = None


class Notice(ReadModel):
    """A message the job received but could not use as sent (what was dropped, and why)."""

    at: datetime
    message: str


MAX_NOTICES = 20


# What became of one provider job (a RunPod job: a delivery of a submission to a worker):
#   completed    it ran the prompt to its end (or its outcome, recorded, was used)
#   failed       it ended with an error of the prompt's or the handler's
#   crashed      its worker died (RunPod says so): the submission went to another
#   fenced       its worker fell silent (frozen, cut off from storage) and was fenced: its prompt
#                stopped and its worker taken down before anyone ran the submission again
#   cancelled    the job was stopped (cancel, abandonment, deadline)
#   ran_nothing  it found the submission claimed by another and ran nothing
DeliveryOutcome = Literal["completed", "failed", "crashed", "fenced", "cancelled", "ran_nothing"]


class JobCost(ReadModel):
    """What the job cost on a provider that bills by the second (RunPod): its own figures.

    `billed_after_end_s` is what a worker keeps billing once the job is over (its idle timeout)
    — part of the bill, not of the job's run time.
    """

    provider_job_id: str | None = None
    # What became of it (None: not said, as by a worker before 0.4.0).
    outcome: DeliveryOutcome | None = None
    queue_s: float = 0.0
    execution_s: float = 0.0
    billed_after_end_s: float = 0.0
    usd_per_second: float | None = None
    # True when the provider's figures are known to fall short of the bill: a stock worker
    # runs a cancelled prompt on to its end, and bills for it, after the provider stopped
    # counting. `note` says why; `billed_s` is then what is known, at least.
    lower_bound: bool = False
    note: str = ""

    @property
    def billed_s(self) -> float:
        return self.execution_s + self.billed_after_end_s

    @property
    def usd_estimate(self) -> float | None:
        if self.usd_per_second is None:
            return None
        return round(self.billed_s * self.usd_per_second, 6)


class Delivery(ReadModel):
    """One provider job (RunPod job) of the job, as `JobStatus.deliveries` lists them: built
    from `cost`, an entry per job."""

    provider_job_id: str
    outcome: DeliveryOutcome | None = None
    billed_s: float = 0.0
    # The figure is what is known so far, at least (`JobCost.note` says why).
    lower_bound: bool = False

    @classmethod
    def of(cls, cost: JobCost) -> Delivery:
        return cls(
            provider_job_id=cost.provider_job_id or "",
            outcome=cost.outcome,
            billed_s=round(cost.billed_s, 3),
            lower_bound=cost.lower_bound,
        )


WebhookDeliveryState = Literal["pending", "retrying", "delivered", "failed"]


class WebhookDelivery(ReadModel):
    """One event's delivery to the job's webhook, as far as it got."""

    # The same on every attempt (Standard Webhooks' `webhook-id`): a receiver deduplicates on it.
    webhook_id: str
    event: WebhookEventName
    seq: int  # the journal entry's seq
    state: WebhookDeliveryState = "pending"
    attempts: int = 0
    # The receiver's last answer, or why there was none (a timeout, a refused connection).
    last_status_code: int | None = None
    last_error: str | None = None
    at: datetime | None = None


# The status keeps the latest deliveries only; the counts cover them all.
MAX_WEBHOOK_DELIVERIES = 20


def shown_url(url: str) -> str:
    """A webhook URL as the status and the logs show it: without its query or fragment (a
    token)."""
    return url.split("#", 1)[0].split("?", 1)[0]


class WebhookStatus(ReadModel):
    """Where the job's events go and how their deliveries went (never the signing secret)."""

    url: str  # without its query string, which may carry a token
    events: list[WebhookEventName] = Field(default_factory=list)
    delivered: int = 0
    failed: int = 0
    # Subscribed events not yet delivered or given up (being tried, or waiting their turn).
    pending: int = 0
    # Why nothing more is sent (the URL was refused, the tenant has no secret).
    refused: str | None = None
    deliveries: list[WebhookDelivery] = Field(default_factory=list)


class WorkerWait(ReadModel):
    """One of the job's activities is scheduled but no worker has started it yet: every slot of
    the workers that poll its task queue is taken, or no worker polls it.

    Never set by the workflow: a client lays it over the job's answer from Temporal's record of
    the execution (its pending activities) and of the task queue (`starter.worker_wait`).
    """

    activity: str  # the activity type waiting (follow_prompt, prepare_prompt, stop_prompt, ...)
    since: datetime  # when it was scheduled
    # slots_busy: workers poll the task queue but every slot is taken; no_worker: no worker (of
    # the job's version) polls it; unknown: the task queue could not be read.
    reason: Literal["slots_busy", "no_worker", "unknown"]
    task_queue: str
    # Activity tasks waiting on the task queue, as the server counts them (approximate; every
    # job's, this one's included), when it says. Not the job's place: Temporal dispatches from
    # several partitions, not in one line.
    backlog: int | None = None


class JobStatus(ReadModel):
    """What every client sees, by query, poll or push."""

    job_id: str
    state: ReadState = JobState.QUEUED
    seq: int = 0
    progress: Progress = Field(default_factory=Progress)
    checkpoint: Checkpoint | None = None
    artifacts: list[Artifact] = Field(default_factory=list)
    error: JobError | None = None
    backend: BackendInfo | None = None
    reconnects: int = 0
    teardown: Teardown = Field(default_factory=Teardown)
    # Set while NEEDS_DECISION (and kept afterwards for the record).
    decision: Decision | None = None
    # The latest messages the job could not use as sent (at most MAX_NOTICES).
    notices: list[Notice] = Field(default_factory=list)
    # Per provider job (one per submission that reached a per-second-billed backend).
    cost: list[JobCost] = Field(default_factory=list)
    # Each provider job of the job (a RunPod job: one delivery of a submission to a worker),
    # what became of it and what it billed: one per entry of `cost`.
    deliveries: list[Delivery] = Field(default_factory=list)
    # The GPU-seconds the job held a GPU, over all its provider jobs and prompts: RunPod's
    # billed execution on a `runpod` pool, the prompts' execution as the follow measured it on
    # a `comfyui` pool. What its tenant's daily budget counts (docs/queue.md, "Budgets").
    gpu_s: float = 0.0
    # What it cost in dollars where its pool gives a price (`usd_per_second`; RunPod's bill,
    # the idle time billed after its end included). None: no price.
    usd: float | None = None
    # Set when the request has a webhook: each event's delivery.
    webhook: WebhookStatus | None = None
    detached: bool = False
    # The client-contact horizon: no contact for this long abandons the job (None: detached).
    abandon_after_s: float | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    last_client_contact_at: datetime | None = None
    # Set on a bounded pool: where the job stands in our queue (PENDING), or that it was
    # granted its slot; clients lay the queue's latest word over it.
    admission: Admission | None = None
    # Set by clients only (never by the workflow): one of the job's activities waits for a
    # worker slot (`WorkerWait`).
    worker_wait: WorkerWait | None = None
    # Set by clients only: where the worker following the job pushes its steps as they happen
    # (`FollowHeartbeat.live`), for a gateway to subscribe to; the HTTP API never shows it.
    live_progress: str | None = None
    # `terminal` as the writer said it, for a state this version does not know.
    _terminal_as_written: bool = PrivateAttr(default=False)

    @model_validator(mode="wrap")
    @classmethod
    def _read_terminal(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        status = handler(data)
        if isinstance(status, JobStatus) and isinstance(data, dict):
            status._terminal_as_written = data.get("terminal") is True
        return status

    @computed_field  # type: ignore[prop-decorator]
    @property
    def terminal(self) -> bool:
        """Whether the job has ended: written with every status, so that a reader that does not
        know the state (a newer worker's) still knows whether to wait for more."""
        if isinstance(self.state, JobState):
            return self.state.terminal
        return self._terminal_as_written


class JobEvent(ReadModel):
    """One entry of the job's journal: what a client following the job must not miss.

    `seq` is the status `seq` the change produced, so a client that saw seq N asks for the
    entries after N (`events` query, the gateway's `Last-Event-ID`) and gets each once, in order.
    """

    seq: int
    at: datetime
    # Open to a reader: a kind a newer worker journals is kept by its name.
    kind: Annotated[
        Literal["state", "output_stored", "progress"] | str, Field(union_mode="left_to_right")
    ]
    state: ReadState | None = None  # kind "state": the state entered
    error: JobError | None = None  # kind "state", a failed, cancelled or abandoned ending
    artifact: Artifact | None = None  # kind "output_stored"
    percent: int | None = None  # kind "progress": whole tens of the job's fraction


# The journal holds the latest entries only: older ones are still true in the status itself
# (its state, every artifact), and a bounded journal keeps the query and the carry small.
MAX_JOURNAL = 500


class JobEvents(ReadModel):
    """The `events` query's answer: the journal after `since`, and the status it leads to."""

    status: JobStatus
    events: list[JobEvent] = Field(default_factory=list)
    # The oldest seq the journal still holds: a client behind it missed entries (the status
    # still says everything that is true now).
    first_seq: int = 0


class EventsQuery(StrictModel):
    since: int = Field(0, ge=0)


class ProgressReport(StrictModel):
    """Sent by the monitoring activity as the `progress` signal, throttled by fraction."""

    # `step` counts nodes when the graph has no sampler.
    attempt_client_id: str
    stage: Literal["queued", "running", "uploading", "finished"] = "running"
    # With stage "queued": 1 = next to run on the backend.
    queue_position: int | None = None
    step: int = 0
    total_steps: int = 0
    node: str | None = None
    artifact: Artifact | None = None
    checkpoint: Checkpoint | None = None
    worker_id: str | None = None
    # From a follow that also checked the request (`FollowInput.prepare`): the pool that took
    # the job, and its kind.
    pool: str | None = None
    kind: str | None = None
    # From a follow whose own check was granted a slot of a bounded pool and went on to submit:
    # the job holds that slot (it gives it back, or holds it unsettled, at its end).
    slot: PoolBound | None = None
    # From a follow whose check was told a place in line and waits for its grant itself (with
    # `slot`): the job is PENDING at that place. A later report with `slot` and without it says
    # the follow was granted the slot.
    admission: Admission | None = None
    # From a follow whose check found the job's tenant has a daily budget, before it submits
    # anything: the tenant whose ledger the job tells its spend at its end (the report says
    # nothing of a prompt).
    budget: str | None = None


class CancelRequest(StrictModel):
    reason: str = Field("cancelled by a client", max_length=500)


class ResumeRequest(StrictModel):
    """Continue a NEEDS_DECISION job: re-attach to the prompt, or submit it again."""

    resubmit: bool = False


def validate_job_id(job_id: str) -> str:
    if not JOB_ID_PATTERN.match(job_id):
        raise ValueError(
            f"job id {job_id!r} is not valid: use 1-200 characters from A-Z a-z 0-9 _ . : -"
        )
    return job_id
