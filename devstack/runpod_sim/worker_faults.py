"""The faults done to a live worker rather than to the platform: freeze (SIGSTOP the handler's
process group) and partition (shut its S3 proxy), each undone after its time (thaw: SIGCONT;
heal: the proxy reopened) or with the worker. The platform fires them from a delivery's plan
(faults.py) and calls `tick` on its timer loop to undo them; each step is an event of the
worker's in the ledger.

The handler's group is the worker process's session: the handler and whatever it started in it
(the runpod SDK's ping process). The worker's ComfyUI and its watchdog each lead a session of
their own, so a freeze leaves them running, as a hung handler leaves its container's other
processes running.
"""

from __future__ import annotations

import os
import signal

import structlog

from .clock import SimClock
from .jobs import FaultPlan
from .workers import Worker

log = structlog.get_logger("runpod_sim.worker_faults")


def _signal_group(worker: Worker, sig: signal.Signals) -> bool:
    process = worker.process
    # Only while its leader lives: once it is reaped, its group id may come back to another.
    if process is None or process.returncode is not None:
        return False
    try:
        os.killpg(process.pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class WorkerFaults:
    def __init__(self, clock: SimClock) -> None:
        self.clock = clock

    def _until(self, plan: FaultPlan) -> float | None:
        return None if plan.lasts_s is None else self.clock.now() + plan.lasts_s

    def _lasting(self, plan: FaultPlan, undo: str) -> str:
        if plan.lasts_s is None:
            return "until the worker ends"
        return f"{undo} after {plan.lasts_s:g} s"

    def freeze(self, worker: Worker, job_id: str, plan: FaultPlan) -> bool:
        if not worker.alive or worker.frozen or not _signal_group(worker, signal.SIGSTOP):
            return False
        worker.frozen, worker.thaw_at = True, self._until(plan)
        if plan.outcome is not None:
            worker.death_outcome = plan.outcome
        worker.record("freeze", self.clock.now(), job_id, self._lasting(plan, "SIGCONT"))
        return True

    def thaw(self, worker: Worker) -> None:
        if not worker.frozen:
            return
        worker.frozen, worker.thaw_at = False, None
        if _signal_group(worker, signal.SIGCONT):
            worker.record("thaw", self.clock.now(), _current_job(worker))

    def partition(self, worker: Worker, job_id: str, plan: FaultPlan) -> bool:
        if not worker.alive or worker.partitioned:
            return False
        if worker.s3_proxy is None:
            worker.record("partition_skipped", self.clock.now(), job_id, "no S3 proxy")
            return False
        worker.s3_proxy.shut()
        worker.partitioned, worker.heal_at = True, self._until(plan)
        if plan.outcome is not None:
            worker.death_outcome = plan.outcome
        worker.record("partition", self.clock.now(), job_id, self._lasting(plan, "healed"))
        return True

    def heal(self, worker: Worker) -> None:
        if not worker.partitioned:
            return
        worker.partitioned, worker.heal_at = False, None
        if worker.s3_proxy is not None and worker.alive:
            worker.s3_proxy.reopen()
            worker.record("heal", self.clock.now(), _current_job(worker))

    def tick(self, workers: list[Worker]) -> None:
        """Undo what is due."""
        now = self.clock.now()
        for worker in workers:
            if worker.frozen and worker.thaw_at is not None and now >= worker.thaw_at:
                self.thaw(worker)
            if worker.partitioned and worker.heal_at is not None and now >= worker.heal_at:
                self.heal(worker)


def _current_job(worker: Worker) -> str | None:
    return next(iter(sorted(worker.jobs)), None)
