"""Batches: one request for many jobs, and what a batch's workflow (`JobBatch`) knows of them.

A batch is many ordinary jobs (each its own workflow, ID, status and history, counted in its
tenant's fair share like any other) and one small workflow that holds their IDs and hears each
job's end (`BatchJobEnd`, signalled by the job itself: workflows/inference_job.py). Its status
is one query: counts by state, cost and artifacts, without asking a thousand jobs.

A `BatchRequest` names its jobs one of three ways: whole `requests`; one `request` and `count`
(the graph's seeds varied: job i adds i to every literal `seed` and `noise_seed`); or one
`request` and `overrides` (`{node_id: {input: value}}` per job), which keeps a batch of a big
graph small enough for one HTTP body.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows import shared
    from workflows.contracts import (
        Artifact,
        JobError,
        JobRequest,
        JobStatus,
        ReadModel,
        ReadState,
        StrictModel,
        WebhookSpec,
    )
    from workflows.graph import apply_overrides, iter_nodes

# A batch's jobs are named in its workflow's input and told apart in its history by their end
# signals: a thousand keeps both well inside Temporal's limits (2 MiB a payload, a few thousand
# events), and a bigger run is several batches.
MAX_BATCH_JOBS: Final = 1000
# The inputs `count` varies: every sampler's and noise node's seed in ComfyUI's core nodes.
SEED_INPUTS: Final = frozenset({"seed", "noise_seed"})
# ComfyUI's seeds are unsigned 64-bit.
SEED_LIMIT: Final = 2**64

BATCH_ID_PATTERN: Final = r"^[A-Za-z0-9_.:-]{1,190}$"


class BatchState(StrEnum):
    # Its jobs run (or wait): not every one has ended.
    RUNNING = "RUNNING"
    # Cancelled: every unfinished job was told to stop, and not every one has ended yet.
    CANCELLING = "CANCELLING"
    # Every job ended (how each did: `counts`).
    COMPLETED = "COMPLETED"
    # Cancelled, and every job ended.
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (BatchState.COMPLETED, BatchState.CANCELLED)


class BatchRequest(StrictModel):
    """What a client asks for: the jobs (one of the three forms), and the batch's webhook,
    which fires once, at the batch's end, with its summary (a job's own `webhook` still fires
    for that job)."""

    requests: list[JobRequest] | None = Field(None, min_length=1, max_length=MAX_BATCH_JOBS)
    request: JobRequest | None = None
    count: int | None = Field(None, ge=1, le=MAX_BATCH_JOBS, strict=True)
    overrides: list[dict[str, dict[str, Any]]] | None = Field(
        None, min_length=1, max_length=MAX_BATCH_JOBS
    )
    webhook: WebhookSpec | None = None

    @model_validator(mode="after")
    def _one_form(self) -> BatchRequest:
        if self.requests is not None:
            if self.request is not None or self.count is not None or self.overrides is not None:
                raise ValueError(
                    "send either `requests` (each job whole) or `request` with `count` or "
                    "`overrides`, not both"
                )
            return self
        if self.request is None:
            raise ValueError(
                "a batch needs its jobs: `requests` (a list of job requests), or `request` "
                "with `count` (seeds varied) or `overrides` (one per job)"
            )
        if (self.count is None) == (self.overrides is None):
            raise ValueError("with `request`, send exactly one of `count` and `overrides`")
        if self.count is not None and not seed_inputs(self.request.graph):
            raise ValueError(
                "`count` varies the graph's seeds, and this graph has no literal `seed` or "
                "`noise_seed` input: send `overrides` (one per job) or `requests`"
            )
        return self

    def expanded(self) -> list[JobRequest]:
        """Every job's request, in order (GraphFormatError: an override names no node)."""
        if self.requests is not None:
            return list(self.requests)
        assert self.request is not None
        template = self.request
        if self.count is not None:
            return [_seeded(template, index) for index in range(self.count)]
        assert self.overrides is not None
        return [
            template.model_copy(update={"graph": apply_overrides(template.graph, values)})
            for values in self.overrides
        ]


def seed_inputs(graph: Mapping[str, Any]) -> list[tuple[str, str, int]]:
    """(node, input, value) of every literal integer seed of the graph."""
    return [
        (node_id, name, value)
        for node_id, _cls, inputs in iter_nodes(graph)
        for name, value in inputs.items()
        if name in SEED_INPUTS and isinstance(value, int) and not isinstance(value, bool)
    ]


def _seeded(template: JobRequest, index: int) -> JobRequest:
    if index == 0:
        return template
    overrides: dict[str, dict[str, Any]] = {}
    for node_id, name, value in seed_inputs(template.graph):
        overrides.setdefault(node_id, {})[name] = (value + index) % SEED_LIMIT
    return template.model_copy(update={"graph": apply_overrides(template.graph, overrides)})


def batch_job_id(batch_id: str, index: int) -> str:
    """The ID of a batch's job: the batch's, and its place (0001 is the first)."""
    return f"{batch_id}-{index + 1:04d}"


class BatchJobs(BaseModel):
    """A batch's jobs in short, for its workflow to start: the first job's request as the
    client checked it (staged, labelled) and, per job, the graph inputs in which it differs
    from that one. A batch by `count` or `overrides`, or of `requests` that differ only in
    input values (prompts, seeds, files), fits in a few bytes a job."""

    model_config = ConfigDict(extra="ignore")

    template: JobRequest
    # Per job, in order: {node_id: {input: value}} where its graph differs ({} for the first).
    inputs: list[dict[str, dict[str, Any]]]
    # Each job runs detached (its fingerprint is the request's before this was applied).
    detached: bool = True

    def request(self, index: int) -> JobRequest:
        """Job `index`'s request, whole (its fingerprint's form: not yet detached)."""
        values = self.inputs[index]
        if not values:
            return self.template
        graph = apply_overrides(self.template.graph, values)
        return self.template.model_copy(update={"graph": graph})


def compact_jobs(requests: Sequence[JobRequest], *, detached: bool) -> BatchJobs | None:
    """The jobs as one request and each one's differing inputs; None when they differ in more
    than input values (another node, an input one lacks, another pool or policy)."""
    template = requests[0]
    rest = template.model_dump(mode="json", exclude={"graph"})
    inputs: list[dict[str, dict[str, Any]]] = []
    for request in requests:
        if request is not template and request.model_dump(mode="json", exclude={"graph"}) != rest:
            return None
        differing = _differing_inputs(template.graph, request.graph)
        if differing is None:
            return None
        inputs.append(differing)
    jobs = BatchJobs(template=template, inputs=inputs, detached=detached)
    return jobs


def _differing_inputs(
    base: Mapping[str, Any], graph: Mapping[str, Any]
) -> dict[str, dict[str, Any]] | None:
    if base.keys() != graph.keys():
        return None
    differing: dict[str, dict[str, Any]] = {}
    for node_id, node in graph.items():
        base_node = base[node_id]
        if not isinstance(node, Mapping) or not isinstance(base_node, Mapping):
            return None
        if {k: v for k, v in node.items() if k != "inputs"} != {
            k: v for k, v in base_node.items() if k != "inputs"
        }:
            return None
        values, base_values = node.get("inputs", {}), base_node.get("inputs", {})
        if not isinstance(values, Mapping) or not isinstance(base_values, Mapping):
            return None
        if values.keys() != base_values.keys():
            return None
        changed = {
            name: value
            for name, value in values.items()
            # By type too: 1 and True (or 1.0) are equal in Python, not in the graph's JSON.
            if value != base_values[name] or type(value) is not type(base_values[name])
        }
        if changed:
            differing[node_id] = changed
    return differing


class BatchInput(BaseModel):
    """`JobBatch`'s argument: the IDs of its jobs, its tenant, and its webhook; with `jobs`,
    the batch's workflow starts its jobs itself (each with the `batch` label), so a client's
    submission ends once the batch is recorded; without, the client starts them."""

    model_config = ConfigDict(extra="ignore")

    batch_id: str
    tenant: str = shared.DEFAULT_TENANT
    job_ids: list[str]
    webhook: WebhookSpec | None = None
    created_at: datetime | None = None
    jobs: BatchJobs | None = None


class BatchJobEnd(ReadModel):
    """A job's end, as it tells its batch (once, when it is terminal)."""

    job_id: str
    state: ReadState
    error: JobError | None = None
    # The GPU-seconds it held a GPU (`JobStatus.gpu_s`), and its dollars where its pool gives
    # a price (`JobStatus.usd`).
    gpu_s: float = 0.0
    usd: float | None = None
    artifacts: list[Artifact] = Field(default_factory=list)
    ended_at: datetime | None = None
    # Where the batch heard it from: the job itself, or the batch's own look at a job that
    # ended without saying (terminated from outside, never started).
    source: Literal["job", "found"] = "job"

    @classmethod
    def of(cls, status: JobStatus, at: datetime) -> BatchJobEnd:
        # The job's own figures: what its tenant's budget counts (docs/queue.md, "Budgets").
        return cls(
            job_id=status.job_id,
            state=status.state,
            error=status.error,
            gpu_s=status.gpu_s,
            usd=status.usd,
            artifacts=status.artifacts,
            ended_at=at,
        )


class BatchCancel(StrictModel):
    reason: str = Field("batch cancelled", max_length=500)


class BatchCost(ReadModel):
    # The GPU-seconds its ended jobs held a GPU (each job's `gpu_s`).
    gpu_s: float = 0.0
    # Their dollars, over the ended jobs whose pool gives its price (None: none does).
    usd: float | None = None


class BatchJob(ReadModel):
    """One job of the batch as its status lists it."""

    job_id: str
    # None: neither ended nor seen running yet (not started, or its end is on its way).
    state: ReadState | None = None
    # 0..100, for a job that has not ended (as its `JobProgress` search attribute says).
    percent: int | None = None
    error: JobError | None = None
    artifacts: int = 0


class BatchStatus(ReadModel):
    """What every client sees of a batch: one query of its workflow, with the live states of
    its unfinished jobs laid over it by the client (Temporal's visibility store)."""

    batch_id: str
    state: BatchState | str = BatchState.RUNNING
    tenant: str = shared.DEFAULT_TENANT
    total: int = 0
    ended: int = 0
    # Jobs by state (ended jobs by how they ended; the others by what they show now).
    counts: dict[str, int] = Field(default_factory=dict)
    # 0..1: ended jobs count whole, the others by their own progress.
    progress: float = 0.0
    cost: BatchCost = Field(default_factory=BatchCost)
    artifacts: int = 0
    jobs: list[BatchJob] = Field(default_factory=list)
    cancel_reason: str | None = None
    # The batch's webhook, once it fired (or gave up): its outcome.
    webhook: str | None = None
    created_at: datetime | None = None
    ended_at: datetime | None = None
    # Increases with every change the batch's workflow records (a stream's cursor).
    seq: int = 0

    @property
    def terminal(self) -> bool:
        return self.state in (BatchState.COMPLETED, BatchState.CANCELLED)


class BatchResults(ReadModel):
    """Every ended job's end, artifacts included (the `results` query)."""

    batch_id: str
    state: BatchState | str = BatchState.RUNNING
    ends: list[BatchJobEnd] = Field(default_factory=list)


def batch_of(labels: Mapping[str, str]) -> str | None:
    """The batch a job belongs to, by its label (set by the client that started it)."""
    return labels.get(shared.BATCH_LABEL) or None


async def tell_batch(labels: Mapping[str, str], status: JobStatus) -> None:
    """A batch's job's end, to its batch (a job of no batch tells no one); a batch that is gone
    is not the job's concern (its own look finds jobs that ended unheard)."""
    batch_id = batch_of(labels)
    if batch_id is None:
        return
    end = BatchJobEnd.of(status, workflow.now())
    try:
        await workflow.get_external_workflow_handle(batch_id).signal(
            shared.SIGNAL_BATCH_JOB_ENDED, end
        )
    except Exception:
        workflow.logger.warning("batch_not_told", extra={"batch_id": batch_id})
