"""What one stop check of a RunPod job saw: RunPod's state and, with claims, the handler's own
word in the claim, read into a `StopCheck` (pure: the backend does the calls).

RunPod's CANCELLED says only that the platform stopped counting. The prompt runs on the
worker's ComfyUI until something stops it:

- our handler (claims) keeps stopping it, renewing its lease, and records what it saw in the
  claim's outcome (`StopRecord`); until then the job is "running" whatever RunPod says, and a
  lease that ran out is never read as the prompt's end. A prompt the handler gave up on is
  "stuck" (its worker replaced): the teardown fails at once, naming worker and prompt;
- a stock worker-comfyui handler never hears of the cancel (runpod 1.7.x has no job-stop) and
  never calls `/interrupt`: the cancel is all that was done ("cancel_sent"), and the prompt's
  end is unknown (`confirmed=False`: the teardown says UNCONFIRMED).

A job that ended by itself (COMPLETED, FAILED) before the cancel reached it ended as its
handler's answer says; a graph ComfyUI refused was never queued.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from activities.runpod.cost import job_cost
from activities.runpod.models import RunPodJob, RunPodState
from activities.runpod.outcome import Failed, read_job
from configuration.pools import PoolConfig
from protocol.runpod.contract import Claim, PromptFate, StopRecord
from workflows.activity_io import StopCheck
from workflows.contracts import JobCost
from workflows.shared import ErrorType

StopAction = Literal["none", "dequeued", "interrupt_sent", "cancel_sent"]
Ended = Literal["success", "interrupted", "error", "unknown", "never_queued"]
_ENDED: dict[RunPodState, Ended] = {
    RunPodState.COMPLETED: "success",
    RunPodState.FAILED: "error",
    RunPodState.TIMED_OUT: "error",
}
_FATE: dict[PromptFate, Ended] = {
    "never_submitted": "unknown",
    "dequeued": "unknown",
    "interrupted": "interrupted",
    "finished": "success",
    "failed": "error",
    "gone": "unknown",
}
_OUTCOME: dict[str, Ended] = {"completed": "success", "failed": "error"}


def stop_verdict(
    job: RunPodJob,
    pool: PoolConfig,
    claim: Claim | None,
    action: StopAction,
    prompt_id: str,
    now: datetime | None = None,
) -> StopCheck:
    """Where the prompt of RunPod job `job` is, after this check did `action`. `claim`: the
    submission's claim (claims pools), whoever holds it."""
    now = now or datetime.now(UTC)
    state = job.state
    if state is None or not state.terminal:
        where: Literal["pending", "running"] = (
            "pending" if state is RunPodState.IN_QUEUE else "running"
        )
        return StopCheck(at=now, position=where, action=action, worker_id=job.worker_id)
    if not pool.claims:
        return _stock(job, pool, action, now)
    if claim is None or claim.holder != job.id:
        # This job never held the submission (cancelled before its handler claimed it, or
        # refused before): RunPod's word is all there is.
        return _ended_alone(job, pool, action, now, claim)
    outcome = claim.outcome
    if outcome is None:
        if state in (RunPodState.COMPLETED, RunPodState.FAILED):
            # The handler's own answer reached RunPod, so it had returned: only recording the
            # outcome failed (a storage outage). Its answer says how the prompt ended.
            return _ended_alone(job, pool, action, now, claim)
        given_up = _runpod_gave_up_on(job, claim)
        if given_up and claim.lease_until <= now:
            # Two witnesses that the worker is gone: RunPod gave up on it (below) and its
            # handler stopped renewing the claim. A worker is one container: its ComfyUI, and
            # the prompt, went with it.
            lost = claim.worker_id or job.worker_id or "?"
            return StopCheck(
                at=now,
                position="gone",
                action=action,
                ended="unknown",
                worker_id=lost,
                message=(
                    f"RunPod gave up on worker {lost} (job {job.id} {given_up}) and its handler "
                    f"stopped renewing the claim at {claim.lease_until:%H:%M:%S} UTC: prompt "
                    f"{prompt_id} went with its worker"
                ),
                cost=job_cost(job, pool, claim=claim),
            )
        return StopCheck(
            at=now,
            position="running",
            action=action,
            worker_id=claim.worker_id or job.worker_id,
            message=_still_stopping(job, claim, prompt_id, now),
        )
    worker = claim.worker_id or job.worker_id
    if outcome.stop is not None:
        return _stopped(job, pool, outcome.stop, action, worker, prompt_id, now, claim)
    if outcome.state == "cancelled":
        return _fate_unknown(
            now,
            action,
            worker,
            f"the handler recorded RunPod job {job.id} cancelled without saying what became "
            f"of prompt {prompt_id} on worker {worker or '?'} (a handler from before stop "
            "records)",
            job_cost(job, pool, claim=claim),
        )
    rejected = outcome.error_type == ErrorType.PROMPT_REJECTED
    return StopCheck(
        at=now,
        position="gone",
        action=action,
        ended="never_queued" if rejected else _OUTCOME.get(outcome.state, "unknown"),
        worker_id=worker,
        message=f"RunPod job {job.id}: {job.status}, the handler recorded it {outcome.state}"
        + (f": {outcome.error[:300]}" if outcome.error else ""),
        cost=job_cost(job, pool, claim=claim),
    )


def _runpod_gave_up_on(job: RunPodJob, claim: Claim) -> str | None:
    """How RunPod showed it had given up on the claim holder's worker, if it did: it timed the
    job out because the worker stopped reporting (not at its limit), or it took the job off
    that worker (a re-delivery after a worker loss, then cancelled while queued again)."""
    read = read_job(job)
    if isinstance(read, Failed) and read.error_type == ErrorType.PROMPT_LOST:
        return "TIMED_OUT"
    moved = job.worker_id is not None or not job.execution_time_ms  # (no worker, no run: requeued)
    if claim.worker_id and job.worker_id != claim.worker_id and moved:
        return f"{job.status} off that worker"
    return None


def _still_stopping(job: RunPodJob, claim: Claim, prompt_id: str, now: datetime) -> str:
    where = f"RunPod job {job.id} is {job.status}"
    worker = f"worker {claim.worker_id or job.worker_id or '?'}"
    since = claim.stopping_since
    stopping = f" (stopping since {since:%H:%M:%S} UTC)" if since is not None else ""
    if claim.lease_until <= now:
        return (
            f"{where}, but its handler on {worker} stopped renewing its claim at "
            f"{claim.lease_until:%H:%M:%S} UTC{stopping} and nothing confirms that prompt "
            f"{prompt_id} stopped"
        )
    if since is not None:
        return f"{where}; its handler on {worker} is stopping prompt {prompt_id}{stopping}"
    return f"{where}; its handler on {worker} has not yet recorded that prompt {prompt_id} stopped"


def _stopped(
    job: RunPodJob,
    pool: PoolConfig,
    stop: StopRecord,
    action: StopAction,
    worker: str | None,
    prompt_id: str,
    now: datetime,
    claim: Claim,
) -> StopCheck:
    """The handler's verdict on the prompt (`StopRecord`)."""
    worker = stop.worker_id or worker
    cost = job_cost(job, pool, stop, claim=claim)
    said = f": {stop.detail}" if stop.detail else ""
    if stop.prompt == "still_running" or stop.worker_replaced:
        replaced = (
            "the handler replaced the worker"
            if stop.worker_replaced
            else "the worker was not replaced, so later jobs on it may queue behind the prompt"
        )
        running = "was still running" if stop.prompt == "still_running" else f"was {stop.prompt}"
        return StopCheck(
            at=now,
            position="stuck",
            action=action,
            worker_id=worker,
            worker_replaced=stop.worker_replaced,
            node=stop.node,
            node_type=stop.node_type,
            message=(
                f"prompt {prompt_id} {running} on RunPod worker {worker or '?'} after the "
                f"handler's stop horizon; {replaced}{said}"
            ),
            cost=cost,
        )
    return StopCheck(
        at=now,
        position="gone",
        action="dequeued" if stop.prompt == "dequeued" else action,
        ended=_FATE[stop.prompt],
        worker_id=worker,
        node=stop.node,
        node_type=stop.node_type,
        message=f"the handler on worker {worker or '?'} saw prompt {prompt_id} {stop.prompt}{said}",
        cost=cost,
    )


def _stock(job: RunPodJob, pool: PoolConfig, action: StopAction, now: datetime) -> StopCheck:
    """A stock handler: RunPod's state and nothing more."""
    if job.state is RunPodState.CANCELLED and job.worker_id:
        return _fate_unknown(
            now,
            action,
            job.worker_id,
            f"RunPod job {job.id} was cancelled; a stock worker-comfyui handler cannot stop "
            f"its prompt, which may run to its end on worker {job.worker_id} and bill until "
            "then",
            job_cost(job, pool),
        )
    return _ended_alone(job, pool, action, now)


def _fate_unknown(
    now: datetime, action: StopAction, worker: str | None, message: str, cost: JobCost
) -> StopCheck:
    """A cancelled job whose handler never said what became of its prompt: it may still run on
    `worker`, so the teardown says UNCONFIRMED."""
    return StopCheck(
        at=now,
        position="gone",
        action=action,
        ended="unknown",
        confirmed=False,
        worker_id=worker,
        message=message,
        cost=cost,
    )


def _ended_alone(
    job: RunPodJob, pool: PoolConfig, action: StopAction, now: datetime, claim: Claim | None = None
) -> StopCheck:
    """A job that ended on RunPod's word alone: as its handler answered, or cancelled before
    any handler ran it."""
    read = read_job(job)
    rejected = isinstance(read, Failed) and read.error_type == ErrorType.PROMPT_REJECTED
    ended: Ended = "unknown" if job.state is None else _ENDED.get(job.state, "unknown")
    if rejected:
        ended = "never_queued"  # ComfyUI refused the graph: it never ran
    return StopCheck(
        at=now,
        position="gone",
        action=action,
        ended=ended,
        worker_id=job.worker_id,
        message=read.message if isinstance(read, Failed) else f"RunPod job {job.id}: {job.status}",
        cost=job_cost(job, pool, claim=claim),
    )
