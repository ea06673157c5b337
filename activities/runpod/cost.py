"""What a RunPod job cost the job: RunPod's own figures for it, and what they leave out.

RunPod counts a job's `executionTime` from its start on a worker to its end. Two things are
billed beyond that, and both are read from what our handler writes in the submission's claim:

- a job cancelled on a worker ends for RunPod at the cancel, but the worker goes on until its
  handler has stopped the prompt (the claim's `StopRecord`);
- a job RunPod delivered again after its worker was lost counts only its last delivery; the
  earlier ones billed on their own workers. Each left its holder in the claim
  (`Claim.earlier`, or the claim itself while no later delivery took it over), and the time it
  held the claim, to its lease's end at most, is added: a holder cannot have run past its
  lease's end (it fences itself before, its watchdog by `fence_after_s` after), so the figure
  is at least what it billed, by its claim.
"""

from __future__ import annotations

from datetime import datetime

from activities.runpod.models import RunPodJob, RunPodState
from configuration.pools import PoolConfig
from protocol.runpod.contract import Claim, StopRecord
from workflows.contracts import DeliveryOutcome, JobCost

# What a worker keeps billing after its last job when the pool does not say (RunPod's default
# idle timeout).
DEFAULT_IDLE_TIMEOUT_S = 5.0


def job_cost(
    job: RunPodJob,
    pool: PoolConfig,
    stop: StopRecord | None = None,
    *,
    outcome: DeliveryOutcome | None = None,
    claim: Claim | None = None,
) -> JobCost:
    """What RunPod job `job` cost, from its own figures (a later `/status` with a larger
    executionTime is read as it comes); the idle time a worker bills after its last job is the
    pool's `idle_timeout_s` (RunPod's default 5 s when unset). `claim`: the submission's claim,
    when read: the job's earlier deliveries it names are added (`earlier_deliveries_s`).

    Never less than was billed: RunPod's executionTime of a job cancelled on a worker ends at
    the cancel, but the worker goes on. Our handler (claims) keeps stopping the prompt and
    records how long in the claim (`stop`, added to what the worker billed after the job);
    until it has, and on a stock endpoint, whose handler cannot stop its prompt and runs it to
    its end, the figure is a lower bound and says so."""
    finished = job.state is not None and job.state.terminal and job.execution_time_ms is not None
    idle = pool.idle_timeout_s
    after = (DEFAULT_IDLE_TIMEOUT_S if idle is None else idle) if finished else 0.0
    lower_bound, notes = False, []
    if stop is not None:
        stopping = max(0.0, (stop.at - stop.started_at).total_seconds())
        after += stopping
        notes.append(
            f"includes {stopping:.1f} s the handler spent stopping the prompt after RunPod's stop"
        )
    elif job.state is RunPodState.CANCELLED and job.worker_id:
        lower_bound = True
        notes.append(
            "RunPod stopped counting at the cancel; "
            + (
                "the handler has not yet recorded how long it took to stop the prompt"
                if pool.claims
                else f"a stock worker-comfyui handler cannot stop its prompt, which runs on "
                f"worker {job.worker_id}, billing, until it ends"
            )
        )
    earlier_s, workers = earlier_deliveries_s(job, claim)
    if workers:
        notes.append(
            f"includes at most {earlier_s:.1f} s of {len(workers)} earlier "
            f"deliver{'y' if len(workers) == 1 else 'ies'} of the job (worker "
            f"{', '.join(workers)}), which RunPod's figures leave out: from its claim to its "
            "lease's end"
        )
    if outcome is None and job.state is RunPodState.CANCELLED:
        outcome = "cancelled"
    return JobCost(
        provider_job_id=job.id,
        outcome=outcome,
        queue_s=(job.delay_time_ms or 0.0) / 1000,
        execution_s=(job.execution_time_ms or 0.0) / 1000 + earlier_s,
        billed_after_end_s=after,
        usd_per_second=pool.usd_per_second,
        lower_bound=lower_bound,
        note="; ".join(notes),
    )


def earlier_deliveries_s(job: RunPodJob, claim: Claim | None) -> tuple[float, list[str]]:
    """How long the earlier deliveries of RunPod job `job` (on workers it has left) held the
    submission's claim, each to its lease's end at most, and their workers. The claim's
    current holder is one of them when it is this job on a worker the job is no longer on, and
    recorded no outcome (a lost worker whose job RunPod delivered again, or queued again)."""
    if claim is None:
        return 0.0, []
    spans: list[tuple[str, datetime | None, datetime, datetime]] = [
        (e.worker_id, e.claimed_at, e.renewed_at, e.lease_until)
        for e in claim.earlier
        if e.holder == job.id and e.worker_id != job.worker_id
    ]
    if (
        claim.holder == job.id
        and claim.outcome is None
        and claim.worker_id
        and claim.worker_id != job.worker_id
    ):
        spans.append((claim.worker_id, claim.claimed_at, claim.renewed_at, claim.lease_until))
    total = 0.0
    for _, claimed_at, renewed_at, lease_until in spans:
        start = claimed_at or renewed_at  # a claim that never said when it was taken
        total += max(0.0, (lease_until - start).total_seconds())
    return total, [worker or "?" for worker, *_ in spans]
