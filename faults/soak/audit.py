"""The final audit: every promise the system makes under faults, checked against the evidence.

Pure: no I/O, no clock. Each `Check` is a promise (`ok` True or False) or a figure shown for the
record (`ok` None). The soak fails when any promise does.

The job mix holds no job meant to fail, so every FAILED job breaks a promise; the check says for
each whether its life overlapped an injected fault (and which), which is where to look first.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, Field

from faults.soak.evidence import (
    Evidence,
    FaultRecord,
    JobEvidence,
    PromptRun,
    ProviderRun,
    QueueSnapshot,
    WorkerBill,
)

# A RunPod worker that stops for these reasons takes its ComfyUI down with it: a prompt it held
# did not outlive it (a crash is an injected fault; a refresh is the handler replacing a worker
# whose prompt would not stop; an execution timeout is the platform's own kill; a watchdog kills
# a handler that froze or lost S3, once it has interrupted its prompt).
EXCUSED_STOPS = frozenset({"crash", "refresh", "execution_timeout", "watchdog"})
# A worker may bill this much beyond the idle timeout (the simulator's own stop takes a moment).
IDLE_TOLERANCE_S = 1.0
# WorkflowTaskFailed with this cause is the server making the worker see new events (a signal
# arrived while the task completed): not a failure of the workflow's code.
BENIGN_TASK_FAILURES = frozenset({"WORKFLOW_TASK_FAILED_CAUSE_UNHANDLED_COMMAND"})
# Per RunPod delivery, what the ledger may bill beyond a job's `cost` reading of it: the
# simulator's clock ticks every 50 ms and RunPod reports whole milliseconds. A RunPod job the
# cost does not list at all gets none.
COST_SLACK_S = 1.0
# A fault's effects outlast it (a crashed worker's claim lease runs a minute, retries back off):
# a job counts as hit by a fault that was in effect during its life or ended this shortly before.
AFTERMATH_S = 60.0


class Check(BaseModel):
    name: str
    label: str
    ok: bool | None  # None: a figure, not a promise
    figure: str
    details: list[str] = Field(default_factory=list)
    value: Any = None  # machine-readable, for the JSON line


class Audit(BaseModel):
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(check.ok is not False for check in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [check for check in self.checks if check.ok is False]

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1


def _counts(items: Iterable[str]) -> str:
    counted = Counter(items)
    return ", ".join(f"{k} {v}" for k, v in sorted(counted.items(), key=lambda kv: (-kv[1], kv[0])))


def overlapping_faults(
    faults: list[FaultRecord], start: float, end: float | None
) -> list[FaultRecord]:
    """The faults whose window [fired_at or started_at, ended_at + AFTERMATH_S] overlaps the
    job's life [start, end] (an open end: still going)."""
    found = []
    for fault in faults:
        if fault.error is not None or fault.fired is False:
            continue
        fault_start = fault.fired_at if fault.fired_at is not None else fault.started_at
        fault_end = fault.ended_at + AFTERMATH_S if fault.ended_at is not None else float("inf")
        job_end = end if end is not None else float("inf")
        if fault_start <= job_end and fault_end >= start:
            found.append(fault)
    return found


def _jobs_check(ev: Evidence) -> Check:
    by_pool = Counter(job.pool for job in ev.jobs)
    figure = f"{len(ev.jobs)} ({_counts(j.pool for j in ev.jobs)})" if ev.jobs else "0"
    details = [f"could not be started: {job_id}" for job_id in ev.submit_failures]
    return Check(
        name="jobs",
        label="jobs submitted",
        # A job the soak could not start is a soak that did not test what it says.
        ok=False if ev.submit_failures else None,
        figure=figure + (f"; {len(ev.submit_failures)} never started" if details else ""),
        details=details,
        value={
            "total": len(ev.jobs),
            "by_pool": dict(by_pool),
            "cancel_planned": sum(j.cancel_planned for j in ev.jobs),
            "never_started": list(ev.submit_failures),
        },
    )


def _end_states(ev: Evidence) -> Check:
    states = Counter(job.state or "UNKNOWN" for job in ev.jobs)
    return Check(
        name="end_states",
        label="jobs by end state",
        ok=None,
        figure=_counts(job.state or "UNKNOWN" for job in ev.jobs) or "none",
        value=dict(states),
    )


def _not_ended(ev: Evidence) -> Check:
    left = [job for job in ev.jobs if not job.ended]
    return Check(
        name="not_ended",
        label="jobs not ended",
        ok=not left,
        figure=str(len(left)),
        details=[f"{job.job_id} ({job.pool}): still {job.state or 'unanswered'}" for job in left],
        value=[job.job_id for job in left],
    )


def _fault_names(faults: list[FaultRecord]) -> str:
    return ", ".join(f.name for f in faults) if faults else "no fault at the time"


def _failed(ev: Evidence) -> Check:
    failed = [job for job in ev.jobs if job.state == "FAILED"]
    rows: list[dict[str, Any]] = []
    details: list[str] = []
    during = 0
    for job in failed:
        faults = overlapping_faults(ev.faults, job.submitted_at, job.ended_at)
        during += bool(faults)
        message = (job.error_message or "").replace("\n", " ")[:160]
        details.append(
            f"{job.job_id} ({job.pool}) {job.error_type}: {message} [{_fault_names(faults)}]"
        )
        rows.append(
            {
                "job_id": job.job_id,
                "pool": job.pool,
                "error_type": job.error_type,
                "message": message,
                "faults": [f.name for f in faults],
            }
        )
    types = _counts(job.error_type or "?" for job in failed)
    figure = f"{len(failed)}" + (f" ({types}; {during} during a fault)" if failed else "")
    return Check(
        name="failed",
        label="FAILED jobs",
        ok=not failed,
        figure=figure,
        details=details,
        value={
            "count": len(failed),
            "by_type": dict(Counter(job.error_type or "?" for job in failed)),
            "during_fault": during,
            "jobs": rows,
        },
    )


def expected_states(job: JobEvidence) -> frozenset[str]:
    """A job not cancelled completes; a cancelled one ends CANCELLED, or COMPLETED when it
    finished before the cancel landed."""
    return frozenset({"CANCELLED", "COMPLETED"}) if job.cancel_planned else frozenset({"COMPLETED"})


def _unexpected(ev: Evidence) -> Check:
    odd = [
        job
        for job in ev.jobs
        if job.ended and job.state != "FAILED" and job.state not in expected_states(job)
    ]
    return Check(
        name="unexpected_end",
        label="unexpected end states",
        ok=not odd,
        figure=str(len(odd)),
        details=[
            f"{job.job_id} ({job.pool}) ended {job.state}"
            f"{' (a cancel was planned)' if job.cancel_planned else ' (no cancel was sent)'}"
            for job in odd
        ],
        value={job.job_id: job.state for job in odd},
    )


def complete_runs(run: PromptRun) -> int:
    """Complete executions of one prompt id on one simulator. Its latest run counts when it
    succeeded; earlier runs of the same id on the same simulator count too, whatever became of
    them (nothing should ever queue a prompt id twice)."""
    earlier = max(0, run.executions - 1)
    return earlier + (1 if run.outcome == "success" else 0)


def _job_key(run: PromptRun) -> str:
    return run.job_id or f"(unattributed) {run.sim} {run.prompt_id}"


def _per_submission(ev: Evidence) -> list[dict[str, Any]]:
    """Each submission's graph (its prompt id) ran to its end at most once, across every
    ComfyUI: a worker frozen or cut off from S3 whose ComfyUI ran on, then another delivery
    running it again, is a duplicate even when the job's total stays within its segments."""
    by_submission: dict[tuple[str, str], list[PromptRun]] = defaultdict(list)
    for run in ev.prompt_runs:
        by_submission[(_job_key(run), run.prompt_id)].append(run)
    rows = []
    for (job_id, prompt_id), runs in sorted(by_submission.items()):
        complete = sum(complete_runs(run) for run in runs)
        if complete > 1:
            rows.append(
                {
                    "job_id": job_id,
                    "submission": prompt_id,
                    "source": "comfy counters",
                    "runs": complete,
                    "where": [f"{r.sim}:{r.prompt_id}" for r in runs if complete_runs(r)],
                }
            )
    return rows


def _duplicates(ev: Evidence) -> Check:
    segments = {job.job_id: job.segments for job in ev.jobs}
    rows = _per_submission(ev)
    flagged = {row["job_id"] for row in rows}
    by_job: dict[str, list[PromptRun]] = defaultdict(list)
    for run in ev.prompt_runs:
        by_job[_job_key(run)].append(run)
    for job_id, runs in sorted(by_job.items()):
        complete = sum(complete_runs(run) for run in runs)
        if complete > segments.get(job_id, 1) and job_id not in flagged:
            rows.append(
                {
                    "job_id": job_id,
                    "source": "comfy counters",
                    "runs": complete,
                    "where": [f"{r.sim}:{r.prompt_id}" for r in runs if complete_runs(r)],
                }
            )
    by_job_ledger: dict[str, list[str]] = defaultdict(list)
    for provider in ev.provider_runs:
        if provider.ran_graph:
            key = provider.job_id or f"(unattributed) {provider.pool} {provider.submission}"
            by_job_ledger[key].append(provider.runpod_job_id)
    for job_id, ran in sorted(by_job_ledger.items()):
        if len(ran) > segments.get(job_id, 1):
            rows.append({"job_id": job_id, "source": "ledger", "runs": len(ran), "where": ran})
    partial = sum(
        run.executions - complete_runs(run) for run in ev.prompt_runs if run.outcome != "success"
    )
    comfy = sum(1 for r in rows if r["source"] == "comfy counters")
    ledger = len(rows) - comfy
    return Check(
        name="duplicates",
        label="duplicate GPU executions",
        ok=not rows,
        figure=f"{len(rows)} (comfy counters {comfy}, ledger {ledger}; {partial} run(s) cut short)",
        details=[
            f"{r['job_id']}"
            + (f" submission {r['submission']}" if "submission" in r else "")
            + f": {r['runs']} complete runs by {r['source']} ({', '.join(r['where'])})"
            for r in rows
        ],
        value={
            "count": len(rows),
            "comfy": comfy,
            "ledger": ledger,
            "per_submission": len(flagged),
            "cut_short": partial,
            "jobs": rows,
        },
    )


def _left_in(snapshot: QueueSnapshot) -> list[str]:
    if snapshot.when in EXCUSED_STOPS:
        return []
    return [f"{p} running" for p in snapshot.running] + [f"{p} queued" for p in snapshot.pending]


def _left_running(ev: Evidence) -> Check:
    details = [
        f"RunPod job {p.runpod_job_id} ({p.pool}, submission {p.submission}) {p.status}"
        for p in ev.provider_runs
        if p.status in ("IN_QUEUE", "IN_PROGRESS") and p.gone is None
    ]
    provider = len(details)
    for snapshot in ev.queues:
        when = (
            "at the end" if snapshot.when == "end" else f"when its worker stopped ({snapshot.when})"
        )
        details += [
            f"prompt {what} on {snapshot.pool}/{snapshot.sim} {when}" for what in _left_in(snapshot)
        ]
    prompts = len(details) - provider
    return Check(
        name="left_running",
        label="provider jobs / prompts left running",
        ok=not details,
        figure=f"{provider} / {prompts}",
        details=details,
        value={"provider_jobs": provider, "prompts": prompts, "items": details},
    )


def _idle_billing(ev: Evidence) -> Check:
    over = [
        bill
        for bill in ev.worker_bills
        if bill.billed_after_last_job_s is not None
        and bill.billed_after_last_job_s > bill.idle_timeout_s + IDLE_TOLERANCE_S
    ]
    return Check(
        name="idle_billing",
        label="workers billed past their idle timeout",
        ok=not over,
        figure=f"{len(over)} of {len(ev.worker_bills)}",
        details=[
            f"{b.pool}/{b.worker_id}: {b.billed_after_last_job_s:.1f} s after its last job "
            f"(idle timeout {b.idle_timeout_s:g} s; {'still alive' if b.alive else b.stop_reason})"
            for b in over
        ],
        value={
            "count": len(over),
            "workers": len(ev.worker_bills),
            "over": [b.worker_id for b in over],
        },
    )


def _provider_jobs(ev: Evidence) -> dict[str, str | None]:
    return {p.runpod_job_id: p.job_id for p in ev.provider_runs}


def _still_billing(ev: Evidence) -> Check:
    """Once the ledgers settled, no worker is billed any more: one the platform never stopped
    and that never exited (a handler frozen with nobody to kill it) bills on."""
    left = [bill for bill in ev.worker_bills if bill.billing]
    whose = _provider_jobs(ev)

    def jobs(bill: WorkerBill) -> str:
        named = [f"{j} ({whose.get(j) or '?'})" for j in bill.jobs]
        return ", ".join(named) or "none"

    return Check(
        name="still_billing",
        label="workers still billing at the end",
        ok=not left,
        figure=f"{len(left)} of {len(ev.worker_bills)}",
        details=[f"{b.pool}/{b.worker_id}: still billed; its RunPod jobs: {jobs(b)}" for b in left],
        value={
            "count": len(left),
            "workers": [b.worker_id for b in left],
            "jobs": sorted({whose.get(j) or j for b in left for j in b.jobs}),
        },
    )


def _short(run: ProviderRun, claimed: dict[str | None, float]) -> bool:
    """The job's cost claims less than the ledger billed for this RunPod job: beyond the slack
    when it lists it, by anything at all when it does not (a delivery missing from the cost)."""
    if run.runpod_job_id not in claimed:
        return run.billed_s > 0
    slack = COST_SLACK_S * max(1, len(run.delivery_outcomes))
    return claimed[run.runpod_job_id] + slack < run.billed_s


def _cost_covers_bill(ev: Evidence) -> Check:
    """Per job on a RunPod pool: its `JobStatus.cost` claims at least what the ledger billed
    for each of its RunPod jobs (every delivery, a frozen or cut-off one too)."""
    rows: list[dict[str, Any]] = []
    judged = 0
    for job in ev.jobs:
        runs = [p for p in ev.provider_runs if p.job_id == job.job_id]
        if job.pool_kind != "runpod" or not runs:
            continue
        judged += 1
        claimed: dict[str | None, float] = defaultdict(float)
        for cost in job.costs:
            claimed[cost.provider_job_id] += cost.billed_s
        short = [(run, claimed.get(run.runpod_job_id, 0.0)) for run in runs if _short(run, claimed)]
        if short:
            rows.append(
                {
                    "job_id": job.job_id,
                    "pool": job.pool,
                    "cost_s": round(sum(c.billed_s for c in job.costs), 3),
                    "billed_s": round(sum(r.billed_s for r in runs), 3),
                    "short": [
                        {
                            "runpod_job_id": run.runpod_job_id,
                            "cost_s": round(cost_s, 3),
                            "billed_s": round(run.billed_s, 3),
                            "in_cost": run.runpod_job_id in claimed,
                        }
                        for run, cost_s in short
                    ],
                }
            )
    return Check(
        name="cost_covers_bill",
        label="job cost below the RunPod bill",
        ok=not rows,
        figure=f"{len(rows)} of {judged}",
        details=[
            f"{r['job_id']} ({r['pool']}): cost {r['cost_s']:.1f} s, ledger {r['billed_s']:.1f} s; "
            + ", ".join(
                f"{s['runpod_job_id']} {s['cost_s']:.1f} < {s['billed_s']:.1f} s"
                + ("" if s["in_cost"] else " (not in its cost)")
                for s in r["short"]
            )
            for r in rows
        ],
        value={"count": len(rows), "judged": judged, "jobs": rows},
    )


def _artifacts(ev: Evidence) -> Check:
    checks = [(job, a) for job in ev.jobs for a in job.artifacts]
    bad = [(job, a) for job, a in checks if not a.verified]
    downloaded = sum(a.downloaded for _, a in checks)
    return Check(
        name="artifacts",
        label="artifacts verified in S3",
        ok=not bad,
        figure=f"{len(checks) - len(bad)}/{len(checks)} (size + sha256 by HEAD; "
        f"{downloaded} downloaded and hashed)",
        details=[
            f"{job.job_id}: s3://{a.bucket}/{a.key}: {a.problem or 'not verified'}"
            for job, a in bad
        ],
        value={
            "total": len(checks),
            "verified": len(checks) - len(bad),
            "downloaded": downloaded,
            "bad": [f"s3://{a.bucket}/{a.key}" for _, a in bad],
        },
    )


def _outputs_missing(ev: Evidence) -> Check:
    short = [
        job
        for job in ev.jobs
        if job.state == "COMPLETED" and len(job.artifacts) < job.expected_outputs
    ]
    return Check(
        name="outputs_missing",
        label="completed jobs missing outputs",
        ok=not short,
        figure=str(len(short)),
        details=[
            f"{j.job_id} ({j.pool}): {len(j.artifacts)} of {j.expected_outputs} outputs"
            for j in short
        ],
        value=[job.job_id for job in short],
    )


def _multipart(ev: Evidence) -> Check:
    return Check(
        name="multipart",
        label="open multipart uploads",
        ok=not ev.multipart_uploads,
        figure=str(len(ev.multipart_uploads)),
        details=list(ev.multipart_uploads),
        value=list(ev.multipart_uploads),
    )


def _benign(cause: str) -> bool:
    return cause.split(":")[0] in BENIGN_TASK_FAILURES


def _task_failures(ev: Evidence) -> Check:
    real = [(job, cause) for job in ev.jobs for cause in job.task_failures if not _benign(cause)]
    benign = sum(1 for job in ev.jobs for cause in job.task_failures if _benign(cause))
    return Check(
        name="task_failures",
        label="workflow task failures",
        ok=not real,
        figure=f"{len(real)}" + (f" (and {benign} unhandled-command retries)" if benign else ""),
        details=[f"{job.job_id}: {cause}" for job, cause in real],
        value={
            "count": len(real),
            "benign": benign,
            "by_cause": dict(Counter(cause.split(":")[0] for _, cause in real)),
        },
    )


def _faults(ev: Evidence) -> Check:
    injected = [f for f in ev.faults if f.error is None]
    unfired = [f for f in injected if f.fired is False]
    errors = [f for f in ev.faults if f.error is not None]
    figure = str(len(injected))
    if unfired or errors:
        figure += f" ({len(unfired)} did not happen, {len(errors)} failed to inject)"
    details = [f"by kind: {_counts(f.kind for f in injected)}"] if injected else []
    details += [f"{f.name} on {f.target}: injection failed: {f.error}" for f in errors]
    details += [f"{f.name} on {f.target}: did not happen: {f.detail}" for f in unfired]
    return Check(
        name="faults",
        label="faults injected",
        ok=None,
        figure=figure,
        details=details,
        value={
            "injected": len(injected),
            "by_kind": dict(Counter(f.kind for f in injected)),
            "did_not_happen": len(unfired),
            "injection_errors": len(errors),
            "faults": [f.model_dump(mode="json") for f in ev.faults],
        },
    )


def _teardowns(ev: Evidence) -> Check:
    stopped = [job for job in ev.jobs if job.state == "CANCELLED"]
    return Check(
        name="teardowns",
        label="teardown of cancelled jobs",
        ok=None,
        figure=_counts(job.teardown_state or "?" for job in stopped) or "none cancelled",
        value=dict(Counter(job.teardown_state or "?" for job in stopped)),
    )


def _cleanup(ev: Evidence) -> Check:
    return Check(
        name="cleanup",
        label="processes left after the soak stopped",
        ok=not ev.leftover_processes,
        figure=str(len(ev.leftover_processes)),
        details=[f"pid {pid}" for pid in ev.leftover_processes],
        value=list(ev.leftover_processes),
    )


def _collection(ev: Evidence) -> Check:
    return Check(
        name="collection",
        label="evidence the audit could not read",
        ok=not ev.collection_errors,
        figure=str(len(ev.collection_errors)),
        details=list(ev.collection_errors),
        value=list(ev.collection_errors),
    )


def audit(evidence: Evidence) -> Audit:
    return Audit(
        checks=[
            _jobs_check(evidence),
            _end_states(evidence),
            _not_ended(evidence),
            _failed(evidence),
            _unexpected(evidence),
            _duplicates(evidence),
            _left_running(evidence),
            _idle_billing(evidence),
            _still_billing(evidence),
            _cost_covers_bill(evidence),
            _artifacts(evidence),
            _outputs_missing(evidence),
            _multipart(evidence),
            _task_failures(evidence),
            _teardowns(evidence),
            _faults(evidence),
            _collection(evidence),
            _cleanup(evidence),
        ]
    )
