"""The holder's own fence: its claim could not be renewed in time, so it stops working for the
submission before its lease ends, and says so in the claim once it can.

A handler cut off from S3 cannot tell a storage outage from a network cut that only it sees;
the orchestrator cannot tell it from a dead handler. Once the lease has run out by the job's
`fence_after_s` (or the claim records a fence) another delivery may run the submission, so a
holder that could not renew must by then have stopped its prompt for good. `Lease` sets
`fence_due` at the lease's end less a margin, reckoned from when its last successful write was
sent (endpoint/lease.py); then `SelfFence.fence`:

1. stops storing outputs (the job's folder is no longer surely ours) and ends the run;
2. stops the prompt as a platform stop does (endpoint/stopping.py: dequeue if queued,
   prompt-scoped interrupt if running, until `/queue` no longer holds it), for what is left of
   the lease; still running at the lease's end, its ComfyUI is killed and the worker replaced,
   as at a stop horizon;
3. tells the watchdog that nothing is left to stop (endpoint/fence_file.py);
4. writes the `FenceRecord` into the claim, through an outage, until the lease has run out by
   `fence_after_s` (then anyone may take the claim over anyway). A conflict means another
   delivery took the claim over: fine.

It never records an outcome: the submission is not finished. The job answers `PromptLost`
(`fenced_error`), which the orchestrator resubmits once the claim may be taken over; a delivery
that takes it over keeps what the claim says is done (endpoint/takeover.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from endpoint.execution import Execution
from endpoint.lease import Lease
from endpoint.settings import EndpointSettings
from endpoint.stopping import WorkerReplacer, stop_prompt
from protocol.comfyui.client import ComfyClient
from protocol.runpod.contract import EndpointError, FenceAction, FenceRecord, PromptFate

# Once the worker is being replaced, how long the run's own clean-up (aborting uploads) may
# keep the fence.
REPLACED_CLEANUP_S = 10.0
# The error type a fenced delivery answers with: the orchestrator's "a worker lost the prompt,
# submit it again" (after the fence: activities/runpod/follow.py).
FENCED_ERROR_TYPE = "PromptLost"
FENCED_DETAIL = "fenced"


@dataclass(frozen=True)
class Fenced:
    record: FenceRecord
    # The claim holds the record.
    recorded: bool
    since_renewal_s: float


class SelfFence:
    def __init__(
        self,
        client: ComfyClient,
        settings: EndpointSettings,
        *,
        replace_worker: WorkerReplacer | None,
        log: Any,
    ) -> None:
        self.client = client
        self.settings = settings
        self.replace_worker = replace_worker
        self.log = log

    async def fence(self, execution: Execution, work: asyncio.Task[Any], lease: Lease) -> Fenced:
        """Stop `execution` (its `work`) before `lease` ends, then record the fence. Run it as a
        task of its own that further cancels do not abort (`stopping.wait_out`)."""
        since = time.monotonic()
        since_renewal_s = lease.lease_s - (lease.ends_at - since)
        ended_before = execution.prompt_over
        subject = execution.stop_subject()
        execution.cancel_outputs()
        work.cancel()
        self.log.warning(
            "fence_started",
            since_renewal_s=round(since_renewal_s, 1),
            lease_ends_in_s=round(lease.ends_at - since, 1),
            prompt_over=ended_before,
        )
        stop = await stop_prompt(
            self.client,
            subject,
            # Interrupts are cooperative: what the lease leaves, then the worker goes.
            horizon_s=max(0.0, lease.ends_at - since),
            since=since,
            started_at=datetime.now(UTC),
            worker_id=self.settings.worker_id,
            comfy_pid=self.settings.comfy_pid,
        )
        action = fence_action(stop.prompt, ended_before=ended_before)
        if action == "still_running":
            self.log.warning(
                "worker_replaced",
                reason="fenced",
                prompt_id=subject.prompt_id,
                worker_id=self.settings.worker_id,
                node=stop.node,
                detail=stop.detail,
            )
            if self.replace_worker is None:
                self.log.error("worker_not_replaced", reason="no replace_worker given")
            else:
                self.replace_worker()
            await asyncio.wait({work}, timeout=REPLACED_CLEANUP_S)
        else:
            await asyncio.gather(work, return_exceptions=True)
        # Nothing of the submission runs here any more (or its ComfyUI is gone).
        lease.let_go()
        record = FenceRecord(
            action=action,
            at=datetime.now(UTC),
            worker_id=self.settings.worker_id,
            detail=(
                f"no claim renewal succeeded for {since_renewal_s:.0f} s of a "
                f"{lease.lease_s:.0f} s lease: {stop.detail}"
            ),
        )
        self.log.warning("fenced", action=action, detail=record.detail)
        recorded = await lease.record_fence(record)
        return Fenced(record, recorded, since_renewal_s)


def fence_action(fate: PromptFate, *, ended_before: bool) -> FenceAction:
    """What the fence did, from what the stop found (`ended_before`: the prompt had ended
    before the fence began)."""
    if ended_before:
        return "ended"
    actions: dict[PromptFate, FenceAction] = {
        "never_submitted": "never_submitted",
        "dequeued": "dequeued",
        "interrupted": "interrupted",
        "finished": "ended",
        "failed": "ended",
        # Neither queued nor running, and no record of how it ended: stopped all the same.
        "gone": "ended",
        "still_running": "still_running",
    }
    return actions[fate]


def fenced_error(fenced: Fenced) -> EndpointError:
    """The job's answer after it fenced itself: the submission is not finished."""
    return EndpointError(
        error=(
            f"this delivery fenced itself: it could not renew its claim for "
            f"{fenced.since_renewal_s:.0f} s, so it stopped its prompt before the lease ran out "
            f"({fenced.record.action}); the submission is not finished"
        ),
        error_type=FENCED_ERROR_TYPE,
        details=[f"{FENCED_DETAIL}: {fenced.record.action}"],
    )
