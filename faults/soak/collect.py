"""After the drain: read back everything the audit needs, from where it is recorded.

- each job's final `JobStatus` (the driver has it) and its history in Temporal (every
  WorkflowTaskFailed event, across continue-as-new runs);
- each artifact in S3: HEAD (size and the `sha256` metadata), then a download hashed locally;
- the bucket's open multipart uploads (ListMultipartUploads);
- the `comfyui` pool's simulator: /sim/stats (prompts queued and executed per prompt id),
  /history (whose each prompt was: its extra_data tag) and /queue;
- each RunPod simulator's ledger (GET /sim/ledger: every RunPod job, its deliveries and every
  worker's bill), each completed job's output (/status: was it answered from a claim?), and
  each worker's ComfyUI counters and queue, as left when the worker went (comfy_factory) or
  asked now if it is still up.

Nothing here judges: a read that fails is a `collection_errors` entry, which the audit fails.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog
from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause
from temporalio.client import Client

from activities.storage import ArtifactStore
from devstack.runpod_sim import Ledger
from faults.soak.comfy_factory import snapshot
from faults.soak.driver import JobRecord
from faults.soak.endpoints import IDLE_TIMEOUT_S, RunpodEndpoint
from faults.soak.evidence import (
    ArtifactCheck,
    CostReading,
    Evidence,
    JobEvidence,
    PromptRun,
    ProviderRun,
    QueueSnapshot,
    WorkerBill,
)
from faults.soak.stack import COMFY_POOL, SoakStack
from workflows.contracts import Artifact, JobStatus

log = structlog.get_logger("soak.collect")

# After the last job: RunPod jobs end and every worker stops within its idle timeout.
SETTLE_S = IDLE_TIMEOUT_S + 45.0
QUEUE_IDLE_S = 20.0
MAX_RUNS = 50  # continue-as-new runs followed back per job
BUSY = ("IN_QUEUE", "IN_PROGRESS")
FINAL_FILE_WAIT_S = 15.0


# -- jobs ------------------------------------------------------------------------------------------


def job_evidence(record: JobRecord) -> JobEvidence:
    plan, status = record.plan, record.final or record.last
    evidence = JobEvidence(
        job_id=plan.job_id,
        pool=plan.pool.name,
        pool_kind=plan.pool.kind,
        claims=plan.pool.claims,
        graph_kind=plan.kind,
        expected_outputs=plan.outputs,
        cancel_planned=plan.cancel_after_s is not None,
        cancel_sent_at=record.cancel_sent_at,
        submitted_at=record.submitted_at,
        ended=record.final is not None and record.final.terminal,
        ended_at=record.ended_at,
    )
    if status is not None:
        evidence.state = status.state.value
        evidence.error_type = status.error.type if status.error else None
        evidence.error_message = status.error.message if status.error else None
        evidence.teardown_state = status.teardown.state
        if status.checkpoint is not None and status.checkpoint.prompt_id:
            evidence.submissions = [status.checkpoint.prompt_id]
        evidence.provider_job_ids = [c.provider_job_id for c in status.cost if c.provider_job_id]
        evidence.costs = [
            CostReading(
                provider_job_id=c.provider_job_id, billed_s=c.billed_s, lower_bound=c.lower_bound
            )
            for c in status.cost
        ]
    return evidence


def _split_uri(artifact: Artifact, default_bucket: str) -> tuple[str, str]:
    rest = artifact.uri.removeprefix("s3://")
    bucket, _, key = rest.partition("/")
    return (bucket or default_bucket), (key or artifact.key)


async def check_artifact(store: ArtifactStore, artifact: Artifact, scratch: Path) -> ArtifactCheck:
    bucket, key = _split_uri(artifact, store.settings.bucket)
    check = ArtifactCheck(
        bucket=bucket, key=key, size=artifact.size, sha256=artifact.sha256, head_ok=False
    )
    stored = await store.head(key, bucket=bucket)
    if stored is None:
        check.problem = "not in S3"
        return check
    if stored.size != artifact.size or stored.sha256 != artifact.sha256:
        check.problem = (
            f"S3 holds {stored.size} bytes / sha256 {stored.sha256 or '(none)'}, the status says "
            f"{artifact.size} / {artifact.sha256}"
        )
        return check
    check.head_ok = True
    target = scratch / f"{abs(hash(key))}.bin"
    check.downloaded = True
    try:
        await store.download(key, target, expected_sha256=artifact.sha256, bucket=bucket)
    except Exception as exc:
        check.download_ok = False
        check.problem = f"download: {type(exc).__name__}: {exc}"
        return check
    check.download_ok = target.stat().st_size == artifact.size
    if not check.download_ok:
        check.problem = f"downloaded {target.stat().st_size} bytes, expected {artifact.size}"
    target.unlink(missing_ok=True)
    return check


async def task_failures(temporal: Client, job_id: str) -> list[str]:
    """`CAUSE: message` of every WorkflowTaskFailed event in the job's runs, newest run first."""
    found: list[str] = []
    run_id: str | None = None
    for _ in range(MAX_RUNS):
        handle = temporal.get_workflow_handle(job_id, run_id=run_id)
        previous: str | None = None
        async for event in handle.fetch_history_events():
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
                attrs = event.workflow_execution_started_event_attributes
                previous = attrs.continued_execution_run_id or None
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
                attrs_f = event.workflow_task_failed_event_attributes
                cause = WorkflowTaskFailedCause.Name(attrs_f.cause)
                found.append(f"{cause}: {attrs_f.failure.message[:200]}")
        if previous is None:
            break
        run_id = previous
    return found


# -- ComfyUI simulators ------------------------------------------------------------------------


def prompt_runs(pool: str, sim: str, snap: dict[str, Any]) -> list[PromptRun]:
    stats = snap.get("stats") or {}
    queued: dict[str, int] = stats.get("prompts") or {}
    executions: dict[str, int] = stats.get("executions") or {}
    executed: dict[str, str] = stats.get("executed") or {}
    tags: dict[str, dict[str, Any]] = snap.get("tags") or {}
    runs = []
    for prompt_id in sorted(set(queued) | set(executions)):
        tag = tags.get(prompt_id, {})
        mine = tag.get("durable_comfy") or tag.get("durable_comfy_runpod") or {}
        runs.append(
            PromptRun(
                pool=pool,
                sim=sim,
                prompt_id=prompt_id,
                job_id=mine.get("job_id"),
                runpod_job_id=(tag.get("durable_comfy_runpod") or {}).get("runpod_job_id"),
                queued=int(queued.get(prompt_id, 0)),
                executions=int(executions.get(prompt_id, 0)),
                outcome=executed.get(prompt_id)
                if prompt_id not in snap.get("running", [])
                else None,
            )
        )
    return runs


def queue_snapshot(pool: str, sim: str, snap: dict[str, Any], when: str) -> QueueSnapshot:
    return QueueSnapshot(
        pool=pool,
        sim=sim,
        running=list(snap.get("running") or []),
        pending=list(snap.get("pending") or []),
        when=when,
    )


async def _idle_snapshot(url: str) -> dict[str, Any]:
    """The simulator's snapshot once its queue is empty, or after QUEUE_IDLE_S (a prompt being
    interrupted takes a moment to go)."""
    deadline = time.monotonic() + QUEUE_IDLE_S
    while True:
        snap = await snapshot(url)
        if (not snap["running"] and not snap["pending"]) or time.monotonic() > deadline:
            return snap
        await asyncio.sleep(0.5)


# -- RunPod endpoints --------------------------------------------------------------------------

Interval = tuple[float, float, str]  # epoch start, epoch end, RunPod job id


def delivery_intervals(ledger: Ledger) -> dict[str, list[Interval]]:
    """worker id -> when it held each RunPod job (epoch seconds; an open end: still held)."""

    def epoch(t: float) -> float:
        return ledger.started_at_unix + t / ledger.clock_speed

    held: dict[str, list[Interval]] = {}
    for job in ledger.jobs:
        for d in job.deliveries:
            end = epoch(d.ended_at) if d.ended_at is not None else float("inf")
            held.setdefault(d.worker_id, []).append((epoch(d.taken_at), end, job.id))
    return held


def attribute_by_time(
    runs: list[PromptRun], snap: dict[str, Any], held: list[Interval], slack_s: float = 1.0
) -> None:
    """A prompt without our tag (a stock handler's) belongs to the RunPod job its worker held
    when the prompt started: a worker runs one job at a time."""
    started: dict[str, float] = (snap.get("stats") or {}).get("started_at") or {}
    for run in runs:
        at = started.get(run.prompt_id)
        if run.runpod_job_id is not None or at is None:
            continue
        # The job whose delivery holds the start; only failing that the nearest within the
        # slack (the clocks differ a little). Jobs follow each other within milliseconds on a
        # busy worker: the first interval within the slack may be the one before.
        inside = [job for start, end, job in held if start <= at <= end]
        if inside:
            run.runpod_job_id = inside[0]
            continue
        near = [
            (min(abs(at - start), abs(at - end)), job)
            for start, end, job in held
            if start - slack_s <= at <= end + slack_s
        ]
        if near:
            run.runpod_job_id = min(near)[1]


async def settle(endpoint: RunpodEndpoint) -> Ledger:
    """The ledger once no job is queued or running and every worker has stopped (or after
    SETTLE_S: whatever is still there is for the audit to see)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        ledger = await endpoint.ledger()
        busy = [j for j in ledger.jobs if j.status in BUSY and j.gone is None]
        alive = [w for w in ledger.workers if w.exited_at is None]
        if (not busy and not alive) or time.monotonic() > deadline:
            return ledger
        await asyncio.sleep(1.0)


async def _final_snapshot(endpoint: RunpodEndpoint, worker_id: str) -> dict[str, Any] | None:
    """What a stopped worker's ComfyUI held; the ledger may say the worker is gone a moment
    before the file is written (the ComfyUI is asked first, then stopped)."""
    deadline = time.monotonic() + FINAL_FILE_WAIT_S
    while True:
        snap = endpoint.final_snapshot(worker_id)
        if snap is not None or endpoint.worker_comfy(worker_id) is None:
            return snap
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.2)


async def _ran_graph(endpoint: RunpodEndpoint, job: Any) -> bool:
    if not any(d.outcome == "completed" for d in job.deliveries):
        return False
    if not endpoint.spec.claims:
        return True  # no claims: every completed delivery ran the graph
    output = await endpoint.job_output(job.id)
    if not isinstance(output, dict):
        return False
    return output.get("status") != "claimed_elsewhere" and not output.get("replayed")


class Collector:
    def __init__(self, stack: SoakStack, records: list[JobRecord]) -> None:
        self.stack = stack
        self.records = records
        self.errors: list[str] = []

    def _failed(self, what: str, exc: BaseException) -> None:
        self.errors.append(f"{what}: {type(exc).__name__}: {exc}")
        log.error("collection_failed", what=what, error=str(exc))

    async def collect(self, evidence: Evidence) -> None:
        started = [r for r in self.records if r.started]
        evidence.submit_failures = [r.job_id for r in self.records if not r.started]
        evidence.jobs = [job_evidence(r) for r in started]
        ledgers = await self._ledgers()
        await self._jobs(evidence, started)
        await self._pool_sim(evidence)
        for pool, (endpoint, ledger) in ledgers.items():
            await self._endpoint(evidence, pool, endpoint, ledger)
        self._attribute(evidence)
        await self._multipart(evidence)
        evidence.collection_errors = self.errors

    async def _ledgers(self) -> dict[str, tuple[RunpodEndpoint, Ledger]]:
        settled = {}
        for pool, endpoint in self.stack.endpoints.items():
            try:
                settled[pool] = (endpoint, await settle(endpoint))
            except Exception as exc:
                self._failed(f"ledger of {pool}", exc)
        return settled

    async def _jobs(self, evidence: Evidence, started: list[JobRecord]) -> None:
        finals: dict[str, JobStatus] = {r.job_id: r.final for r in started if r.final is not None}
        temporal = await self.stack.temporal_client()
        with tempfile.TemporaryDirectory(prefix="soak-artifacts-") as scratch:
            async with self.stack.store() as store:
                for job in evidence.jobs:
                    final = finals.get(job.job_id)
                    for artifact in final.artifacts if final is not None else []:
                        try:
                            job.artifacts.append(
                                await check_artifact(store, artifact, Path(scratch))
                            )
                        except Exception as exc:
                            self._failed(f"artifact {artifact.key} of {job.job_id}", exc)
                    try:
                        job.task_failures = await task_failures(temporal, job.job_id)
                    except Exception as exc:
                        self._failed(f"history of {job.job_id}", exc)

    async def _pool_sim(self, evidence: Evidence) -> None:
        try:
            snap = await _idle_snapshot(self.stack.comfy_url)
        except Exception as exc:
            self._failed("the comfyui pool's simulator", exc)
            return
        evidence.prompt_runs += prompt_runs(COMFY_POOL, "pool", snap)
        evidence.queues.append(queue_snapshot(COMFY_POOL, "pool", snap, "end"))

    async def _endpoint(
        self, evidence: Evidence, pool: str, endpoint: RunpodEndpoint, ledger: Ledger
    ) -> None:
        for job in ledger.jobs:
            try:
                ran = await _ran_graph(endpoint, job)
            except Exception as exc:
                self._failed(f"output of RunPod job {job.id} ({pool})", exc)
                ran = False
            evidence.provider_runs.append(
                ProviderRun(
                    pool=pool,
                    runpod_job_id=job.id,
                    submission=job.submission,
                    status=job.status,
                    gone=job.gone,
                    delivery_outcomes=[d.outcome for d in job.deliveries],
                    ran_graph=ran,
                    billed_s=job.billed_s,
                )
            )
        held = delivery_intervals(ledger)
        for worker in ledger.workers:
            alive = worker.exited_at is None
            evidence.worker_bills.append(
                WorkerBill(
                    pool=pool,
                    worker_id=worker.id,
                    billed_after_last_job_s=worker.billed_after_last_job_s,
                    idle_timeout_s=ledger.idle_timeout_s,
                    stop_reason=worker.stop_reason,
                    alive=alive,
                    billing=alive and worker.stop_requested_at is None,
                    jobs=list(worker.jobs),
                )
            )
            snap = await _final_snapshot(endpoint, worker.id) if not alive else None
            when = worker.stop_reason or "stopped"
            if alive or snap is None:
                comfy = endpoint.worker_comfy(worker.id)
                if comfy is None:
                    continue  # it never got a ComfyUI (stopped while starting)
                when = "end"
                try:
                    snap = await snapshot(comfy.url)
                except Exception as exc:
                    self._failed(f"ComfyUI of {pool}/{worker.id}", exc)
                    continue
            if "error" in snap:
                self.errors.append(f"ComfyUI of {pool}/{worker.id} at its stop: {snap['error']}")
                continue
            runs = prompt_runs(pool, worker.id, snap)
            attribute_by_time(runs, snap, held.get(worker.id, []))
            evidence.prompt_runs += runs
            evidence.queues.append(queue_snapshot(pool, worker.id, snap, when))

    def _attribute(self, evidence: Evidence) -> None:
        """Name each RunPod job's and each prompt's job where its own tag does not."""
        by_provider = {pid: job.job_id for job in evidence.jobs for pid in job.provider_job_ids}
        by_submission = {s: job.job_id for job in evidence.jobs for s in job.submissions}
        for provider in evidence.provider_runs:
            provider.job_id = by_provider.get(provider.runpod_job_id) or by_submission.get(
                provider.submission or ""
            )
        provider_jobs = {p.runpod_job_id: p.job_id for p in evidence.provider_runs}
        for run in evidence.prompt_runs:
            if run.job_id is None and run.runpod_job_id is not None:
                run.job_id = provider_jobs.get(run.runpod_job_id)

    async def _multipart(self, evidence: Evidence) -> None:
        try:
            async with self.stack.store() as store:
                evidence.multipart_uploads = await store.list_multipart_uploads("")
        except Exception as exc:
            self._failed("multipart uploads", exc)


async def collect(stack: SoakStack, records: list[JobRecord], evidence: Evidence) -> None:
    await Collector(stack, records).collect(evidence)
