"""What a soak saw, as plain data: the audit (audit.py) reads only this, so it can be tested on
synthetic evidence without a stack, and a run's evidence can be kept as JSON (`--keep`).

Times are epoch seconds (time.time()) unless a field says otherwise.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class FaultRecord(BaseModel):
    """One injected fault: what, where, and the window in which it was in effect."""

    index: int
    kind: str
    target: str
    started_at: float
    # When the fault was over: the service answered again, or the armed fault was seen taken
    # (None: it never ended, e.g. an armed fault nobody took).
    ended_at: float | None = None
    # Did it actually happen? None for faults that happen by being done (kill, restart).
    fired: bool | None = None
    # When an armed fault was seen to happen (it was in effect from then on, not from arming).
    fired_at: float | None = None
    detail: str = ""
    error: str | None = None  # the injection itself failed (say why)

    @property
    def name(self) -> str:
        return f"{self.kind}#{self.index}"


class ArtifactCheck(BaseModel):
    """One artifact a job's final status lists, checked in S3."""

    bucket: str
    key: str
    size: int
    sha256: str
    head_ok: bool  # HEAD found it with that size and `sha256` metadata
    downloaded: bool = False
    download_ok: bool | None = None  # the downloaded bytes hash to `sha256`
    problem: str = ""

    @property
    def verified(self) -> bool:
        return self.head_ok and (not self.downloaded or self.download_ok is True)


class CostReading(BaseModel):
    """One entry of a job's `JobStatus.cost`: what the job says a RunPod job cost."""

    provider_job_id: str | None = None
    billed_s: float = 0.0  # execution plus the idle time billed after it
    lower_bound: bool = False


class JobEvidence(BaseModel):
    job_id: str
    pool: str
    pool_kind: str  # comfyui | runpod
    claims: bool = False
    graph_kind: str  # short | long | multi
    expected_outputs: int
    segments: int = 1
    cancel_planned: bool = False
    cancel_sent_at: float | None = None
    submitted_at: float
    # The job ended (a terminal state). A job waiting in NEEDS_DECISION has not ended.
    ended: bool = False
    ended_at: float | None = None
    state: str | None = None  # the last state seen (None: never answered)
    error_type: str | None = None
    error_message: str | None = None
    teardown_state: str | None = None
    artifacts: list[ArtifactCheck] = Field(default_factory=list)
    # Causes of WorkflowTaskFailed events in the job's history (every run of it).
    task_failures: list[str] = Field(default_factory=list)
    # The job's submission tokens (= prompt ids) and provider job ids, as its status lists them.
    submissions: list[str] = Field(default_factory=list)
    provider_job_ids: list[str] = Field(default_factory=list)
    costs: list[CostReading] = Field(default_factory=list)


class PromptRun(BaseModel):
    """One prompt id on one ComfyUI simulator, from its counters (/sim/stats) and history."""

    pool: str
    sim: str  # "pool" for a comfyui pool's simulator, else the RunPod worker id
    prompt_id: str
    job_id: str | None = None  # from the prompt's extra_data tag, or via the ledger
    runpod_job_id: str | None = None
    queued: int = 0  # POST /prompt accepted with this id
    executions: int = 0  # times it started executing
    outcome: str | None = None  # its latest run: success | error | interrupted | None (running)


class ProviderRun(BaseModel):
    """One RunPod job in an endpoint's ledger."""

    pool: str
    runpod_job_id: str
    submission: str | None
    status: str
    gone: str | None = None
    job_id: str | None = None
    delivery_outcomes: list[str | None] = Field(default_factory=list)
    # A delivery ran the graph to its end (completed, and not answered from another delivery's
    # claim or a recorded outcome).
    ran_graph: bool = False
    # What the ledger billed for it: every delivery's seconds, from taken to ended.
    billed_s: float = 0.0


class QueueSnapshot(BaseModel):
    """What a ComfyUI simulator held: at the end of the run, or when its RunPod worker stopped."""

    pool: str
    sim: str
    running: list[str] = Field(default_factory=list)
    pending: list[str] = Field(default_factory=list)
    # "end" (taken after the run), or the RunPod worker's stop reason (idle, crash, ...).
    when: str = "end"


class WorkerBill(BaseModel):
    pool: str
    worker_id: str
    billed_after_last_job_s: float | None
    idle_timeout_s: float
    stop_reason: str | None = None
    alive: bool = False
    # Still billed when the ledger was read at the end: neither stopped by the platform nor
    # exited (a frozen worker nobody killed, say).
    billing: bool = False
    jobs: list[str] = Field(default_factory=list)  # the RunPod jobs it took


class RunInfo(BaseModel):
    minutes: float
    fault_every_s: float
    seed: int
    jobs_per_minute: float
    pools: dict[str, str] = Field(default_factory=dict)  # pool -> kind (+ "claims: false")
    started_at: float = 0.0
    injection_ended_at: float = 0.0
    drained_at: float = 0.0
    work_dir: str = ""


class Evidence(BaseModel):
    run: RunInfo
    jobs: list[JobEvidence] = Field(default_factory=list)
    # Jobs the soak could not even start (Temporal down for longer than the submit budget).
    submit_failures: list[str] = Field(default_factory=list)
    faults: list[FaultRecord] = Field(default_factory=list)
    prompt_runs: list[PromptRun] = Field(default_factory=list)
    provider_runs: list[ProviderRun] = Field(default_factory=list)
    queues: list[QueueSnapshot] = Field(default_factory=list)
    worker_bills: list[WorkerBill] = Field(default_factory=list)
    multipart_uploads: list[str] = Field(default_factory=list)
    # Processes the soak started that were still alive after it stopped everything.
    leftover_processes: list[int] = Field(default_factory=list)
    # Whatever could not be read: the audit cannot vouch for what it did not see.
    collection_errors: list[str] = Field(default_factory=list)
