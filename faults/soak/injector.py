"""The soak's fault injector: every F seconds (jittered +-50%, seeded) one fault, drawn from a
shuffled deck of every kind (so a short run still meets each kind), on a target drawn at random.
Each fault is inject.py's, as the chaos tests and `make demo-chaos` inject it; what is the soak's
own is when, where, and the record of whether and when it happened.

Faults that are done by doing them (a kill -9 and restart) are over when the service answers
again. Faults that are armed on a simulator (socket cuts and stalls on a ComfyUI simulator,
RunPod 429/5xx bursts, dropped /run answers, RunPod worker crashes) are over when they were seen
to happen: the simulator's log line, its `taken` counters, the ledger's crashed workers. A
RunPod worker frozen (SIGSTOP of its handler's process group) or cut off from S3 (its S3 proxy
shut) is in effect from the ledger's `freeze` / `partition` event of the worker to its `thaw` /
`heal`, or to the worker's end (its watchdog killing it, or the platform stopping it). One never
taken by the end of the run is disarmed and recorded as such.

Each fault's window goes into the evidence, which the audit compares with each failed job's
life.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import httpx
import structlog

from devstack.runpod_sim import Ledger
from devstack.runpod_sim.ledger import LedgerWorker, LedgerWorkerEvent
from devstack.runpod_sim.settings import DeathOutcome
from faults.inject import ArmedRunpodFault, ComfyFaults, DidNotComeBack, crash_worker
from faults.soak.endpoints import RunpodEndpoint
from faults.soak.evidence import FaultRecord
from faults.soak.stack import RESTART_ATTEMPTS, SoakStack, SoakStackError

log = structlog.get_logger("soak.faults")

FaultKind = Literal[
    "worker_kill",
    "temporal_restart",
    "s3_restart",
    "comfy_socket_cut",
    "comfy_socket_stall",
    "runpod_429",
    "runpod_5xx",
    "drop_run_answer",
    "runpod_crash_timed_out",
    "runpod_crash_redeliver",
    "runpod_crash_stuck",
    "runpod_freeze",
    "runpod_freeze_thaw",
    "runpod_partition",
]
ALL_KINDS: tuple[FaultKind, ...] = get_args(FaultKind)
# A crash, a freeze or a partition is armed for the next delivery and fires `after_s` into it;
# a delivery that ended first took the plan with it. Past this long after being taken, it missed.
CRASH_MISS_S = 60.0
WATCH_S = 1.0
# Simulator seconds a thawed freeze or a healed partition lasts: from shorter than the claim's
# renewal to longer than its lease (60 s), so both the handler riding it out and its lease
# lapsing (the watchdog's turn) are met.
LASTS_S = (3.0, 90.0)
# What RunPod makes of each crash's job.
CRASH_OUTCOME: dict[str, DeathOutcome] = {
    "runpod_crash_timed_out": "timed_out",
    "runpod_crash_redeliver": "redeliver",
    "runpod_crash_stuck": "stuck",
}
# The simulator's fault (its own slot: one armed at a time per endpoint), the ledger event that
# says it happened and the one that ends it, per kind of delivery fault.
WORKER_FAULT = {
    "runpod_freeze": ("freeze", "thaw"),
    "runpod_freeze_thaw": ("freeze", "thaw"),
    "runpod_partition": ("partition", "heal"),
}


def delivery_slot(kind: str) -> str | None:
    """Which of the simulator's delivery faults `kind` arms (each one at a time)."""
    if kind.startswith("runpod_crash"):
        return "crash"
    return WORKER_FAULT[kind][0] if kind in WORKER_FAULT else None


@dataclass
class Pending:
    """An armed fault not seen to happen yet."""

    record: FaultRecord
    # Something took it (a prompt, a delivery, a request): it can no longer be disarmed.
    taken: Callable[[], Awaitable[bool]]
    check: Callable[[], Awaitable[bool]]  # True once over (it fills in the record)
    disarm: Callable[[], Awaitable[None]]
    # Why a fault that was taken never happened, asked at the end.
    why_not: Callable[[], Awaitable[str]] | None = None


@dataclass(frozen=True)
class ComfyTarget:
    name: str  # "comfyui" or "<pool>/<worker id>"
    url: str
    log_file: Path


class FaultInjector:
    """`run` injects until a deadline; `stop_injecting` disarms what nothing took; `close`,
    after the drain, settles what was taken (a crash planned for a delivery still running)."""

    def __init__(self, stack: SoakStack, rng: random.Random, every_s: float) -> None:
        self.stack = stack
        self.rng = rng
        self.every_s = every_s
        self.records: list[FaultRecord] = []
        self._deck: list[FaultKind] = []
        self._pending: list[Pending] = []
        self._watcher: asyncio.Task[None] | None = None
        self._http = httpx.AsyncClient(timeout=5, trust_env=False)

    # -- the loop -------------------------------------------------------------------------------

    async def run(self, until: float) -> None:
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch(), name="soak fault watcher")
        while True:
            pause = self.every_s * self.rng.uniform(0.5, 1.5)
            if time.time() + pause >= until:
                break
            await asyncio.sleep(pause)
            await self.inject_one()

    async def stop_injecting(self) -> None:
        """No new fault from now on: whatever is armed and untaken is disarmed."""
        await self._check_pending()
        still = []
        for pending in self._pending:
            try:
                taken = await pending.taken()
            except Exception:
                taken = False
            if taken:
                still.append(pending)
                continue
            with contextlib.suppress(Exception):
                await pending.disarm()
            pending.record.fired = False
            pending.record.detail += "; never taken (disarmed when the faults stopped)"
        self._pending = still

    async def close(self) -> None:
        """After the drain: the last look at what was taken; the rest did not happen."""
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        with contextlib.suppress(Exception):
            await self._check_pending()
        for pending in self._pending:
            record = pending.record
            if record.fired:
                record.ended_at = record.ended_at or time.time()
                continue
            why = "taken, but it never happened"
            if pending.why_not is not None:
                with contextlib.suppress(Exception):
                    why = await pending.why_not()
            record.fired = False
            record.detail += f"; {why}"
        self._pending.clear()
        await self._http.aclose()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            with contextlib.suppress(Exception):
                await self._check_pending()

    async def _check_pending(self) -> None:
        still = []
        for pending in self._pending:
            try:
                done = await pending.check()
            except Exception:
                done = False
            if not done:
                still.append(pending)
        self._pending = still

    def _draw(self) -> FaultKind:
        if not self._deck:
            self._deck = list(ALL_KINDS)
            self.rng.shuffle(self._deck)
        return self._deck.pop()

    async def inject_one(self) -> None:
        deferred: list[FaultKind] = []
        try:
            await self._inject_one(deferred)
        finally:
            # A kind with no target right now (a RunPod fault armed there already) is drawn
            # first next time, not dropped from the deck: a short run still meets each kind.
            for kind in reversed(deferred):
                if kind not in self._deck:
                    self._deck.append(kind)

    async def _inject_one(self, deferred: list[FaultKind]) -> None:
        for _ in range(len(ALL_KINDS) * 2):
            kind = self._draw()
            record = FaultRecord(
                index=len(self.records) + 1, kind=kind, target="", started_at=time.time()
            )
            try:
                applied = await self._apply(kind, record)
            except (SoakStackError, DidNotComeBack):
                raise  # the stack is broken: the soak cannot go on
            except Exception as exc:
                record.error = f"{type(exc).__name__}: {exc}"
                applied = True
            if applied:
                self.records.append(record)
                log.info(
                    "fault",
                    name=record.name,
                    target=record.target,
                    detail=record.detail,
                    error=record.error,
                )
                return
            deferred.append(kind)

    # -- the faults -----------------------------------------------------------------------------

    async def _apply(self, kind: FaultKind, record: FaultRecord) -> bool:
        """Inject `kind`, filling in `record`; False when it has no target right now."""
        if kind == "worker_kill":
            await self._worker_kill(record)
        elif kind == "temporal_restart":
            await self._restart(record, "temporal", down_s=self.rng.uniform(0.5, 3.0))
        elif kind == "s3_restart":
            await self._restart(record, "s3", down_s=self.rng.uniform(3.0, 20.0))
        elif kind in ("comfy_socket_cut", "comfy_socket_stall"):
            return await self._comfy(kind, record)
        else:
            return await self._runpod(kind, record)
        return True

    async def _worker_kill(self, record: FaultRecord) -> None:
        worker = self.rng.choice(self.stack.workers)
        record.target = f"{worker.name} (pid {worker.pid})"
        down_s = self.rng.uniform(0.5, 3.0)
        record.detail = f"kill -9, restarted after {down_s:.1f} s"
        await crash_worker(worker, down_s=down_s, attempts=RESTART_ATTEMPTS)
        record.ended_at = time.time()

    async def _restart(
        self, record: FaultRecord, service: Literal["temporal", "s3"], down_s: float
    ) -> None:
        record.target = service
        record.detail = f"kill -9, down {down_s:.1f} s, restarted on its data"
        await self.stack.restart_service(service, down_s=down_s)
        record.ended_at = time.time()
        record.detail += f" (back after {record.ended_at - record.started_at:.1f} s)"

    async def _comfy_targets(self) -> list[ComfyTarget]:
        paths = self.stack.paths
        targets = [ComfyTarget("comfyui", self.stack.comfy_url, paths.log_file("comfyui_sim"))]
        for endpoint in self.stack.endpoints.values():
            if "comfy_socket_cut" not in endpoint.spec.faults:
                continue
            try:
                ledger = await endpoint.ledger()
            except httpx.HTTPError:
                continue
            for worker in ledger.workers:
                comfy = endpoint.worker_comfy(worker.id)
                if worker.state in ("idle", "running") and comfy is not None:
                    log_file = endpoint.worker_dir(worker.id) / "comfy_sim.log"
                    name = f"{endpoint.spec.pool}/{worker.id}"
                    targets.append(ComfyTarget(name, comfy.url, log_file))
        return targets

    async def _comfy(self, kind: FaultKind, record: FaultRecord) -> bool:
        busy = {p.record.target for p in self._pending if p.record.kind == kind}
        targets = [t for t in await self._comfy_targets() if t.name not in busy]
        if not targets:
            return False
        target = self.rng.choice(targets)
        record.target = target.name
        faults = ComfyFaults(target.url, self._http, target.log_file)
        if kind == "comfy_socket_cut":
            events = self.rng.randint(3, 40)
            record.detail = f"the next prompt's socket is cut after {events} events"
            armed = await faults.cut_socket(after_events=events)
            lasts_s = 0.0
        else:
            stall_s = round(self.rng.uniform(3.0, 12.0), 1)
            after = self.rng.randint(1, 20)
            record.detail = f"the next prompt's events stall {stall_s} s after {after} events"
            armed = await faults.stall_socket(for_s=stall_s, after_events=after)
            lasts_s = stall_s

        async def check() -> bool:
            # A prompt that took it may end before reaching the event count: then it never fires.
            if not armed.fired():
                return False
            record.fired = True
            record.fired_at = time.time()
            record.ended_at = record.fired_at + lasts_s
            return True

        async def why_not() -> str:
            return "taken by a prompt that ended before it fired"

        self._pending.append(Pending(record, armed.taken, check, armed.disarm, why_not))
        return True

    async def _runpod(self, kind: FaultKind, record: FaultRecord) -> bool:
        endpoints = [e for e in self.stack.endpoints.values() if kind in e.spec.faults]
        if delivery_slot(kind) is not None:
            busy = await self._delivery_busy(kind)
            endpoints = [e for e in endpoints if e.spec.pool not in busy]
        if not endpoints:
            return False
        endpoint = self.rng.choice(endpoints)
        record.target = endpoint.spec.pool
        if kind.startswith("runpod_crash"):
            await self._crash(kind, record, endpoint)
            return True
        if kind in WORKER_FAULT:
            await self._worker_fault(kind, record, endpoint)
            return True
        armed: ArmedRunpodFault
        if kind == "runpod_429":
            count = self.rng.randint(5, 25)
            record.detail = f"the next {count} API requests answered 429"
            armed = await endpoint.faults.burst_429(count)
        elif kind == "runpod_5xx":
            count = self.rng.randint(3, 15)
            routes = endpoint.spec.burst_5xx_routes
            code = self.rng.choice([500, 502, 503])
            only = f" ({', '.join(routes)} only)" if routes else ""
            record.detail = f"the next {count} API requests{only} answered {code}"
            armed = await endpoint.faults.burst_5xx(count, status=code, routes=routes)
        else:
            record.detail = "the next /run creates its job, then drops the connection"
            armed = await endpoint.faults.drop_run_answer()

        async def check() -> bool:
            if not await armed.taken():
                return False
            if record.fired_at is None:
                record.fired, record.fired_at = True, time.time()
            if await armed.left() > 0:  # a burst still being answered
                return False
            record.ended_at = time.time()
            return True

        self._pending.append(Pending(record, armed.taken, check, armed.disarm))
        return True

    async def _crash(self, kind: FaultKind, record: FaultRecord, endpoint: RunpodEndpoint) -> None:
        outcome = CRASH_OUTCOME[kind]
        after_s = round(self.rng.uniform(1.0, 8.0), 1)
        record.detail = f"the next delivery's worker is kill -9ed {after_s} s in; job {outcome}"
        crashed_before = _crashed(await endpoint.ledger())
        armed = await endpoint.faults.crash(outcome, after_s=after_s)
        taken_at: list[float] = []

        async def check() -> bool:
            if not taken_at:
                if not await armed.taken():
                    return False
                taken_at.append(time.time())
            if _crashed(await endpoint.ledger()) > crashed_before:
                record.fired = True
                record.fired_at = record.ended_at = time.time()
                return True
            if time.time() - taken_at[0] > CRASH_MISS_S:
                record.fired = False
                record.detail += f"; {await why_not()}"
                return True
            return False

        async def why_not() -> str:
            return "its delivery ended before the kill"

        self._pending.append(Pending(record, armed.taken, check, armed.disarm, why_not))

    async def _delivery_busy(self, kind: FaultKind) -> set[str]:
        """Endpoints where `kind` cannot be armed now: one whose same fault is still pending
        (its slot, and the ledger events it reads, are its own until it is over), or one with
        another delivery fault armed and not taken yet (both would land on one delivery, and
        whatever broke could not be told apart)."""
        busy = set()
        for pending in self._pending:
            other = delivery_slot(pending.record.kind)
            if other is None:
                continue
            if other == delivery_slot(kind):
                busy.add(pending.record.target)
                continue
            with contextlib.suppress(Exception):
                if not await pending.taken():
                    busy.add(pending.record.target)
        return busy

    async def _worker_fault(
        self, kind: FaultKind, record: FaultRecord, endpoint: RunpodEndpoint
    ) -> None:
        """Freeze the next delivery's handler, or cut its worker off from S3, `after_s` into
        the delivery; thawed / healed after a while, or (a freeze without thaw) for as long as
        the worker lives: its watchdog's turn."""
        event, undo = WORKER_FAULT[kind]
        after_s = round(self.rng.uniform(1.0, 8.0), 1)
        lasts_s = None if kind == "runpod_freeze" else round(self.rng.uniform(*LASTS_S), 1)
        if event == "freeze":
            what = "the next delivery's handler is frozen (SIGSTOP)"
        else:
            what = "the next delivery's worker is cut off from S3"
        until = "until its worker ends" if lasts_s is None else f"for {lasts_s} s"
        record.detail = f"{what} {after_s} s in, {until}"
        seen_before = len(_events(await endpoint.ledger(), event))
        if event == "freeze":
            armed = await endpoint.faults.freeze(after_s=after_s, thaw_after_s=lasts_s)
        else:
            armed = await endpoint.faults.partition(after_s=after_s, heal_after_s=lasts_s)
        taken_at: list[float] = []

        async def check() -> bool:
            if not taken_at:
                if not await armed.taken():
                    return False
                taken_at.append(time.time())
            ledger = await endpoint.ledger()
            events = _events(ledger, event)
            if len(events) <= seen_before:
                if time.time() - taken_at[0] > CRASH_MISS_S:
                    record.fired = False
                    record.detail += f"; {await why_not()}"
                    return True
                return False
            worker, fired = events[seen_before]
            if record.fired_at is None:
                record.fired, record.fired_at = True, ledger.epoch(fired.at)
                record.detail += f"; {worker.id}, RunPod job {fired.job_id}"
            ended = [e.at for e in worker.events_of(undo) if e.at >= fired.at]
            if ended:
                record.ended_at = ledger.epoch(ended[0])
            elif worker.exited_at is not None:
                record.ended_at = ledger.epoch(worker.exited_at)
                record.detail += f"; ended with its worker ({worker.stop_reason})"
            return record.ended_at is not None

        async def why_not() -> str:
            return f"its delivery ended before the {event}"

        self._pending.append(Pending(record, armed.taken, check, armed.disarm, why_not))


def _events(ledger: Ledger, kind: str) -> list[tuple[LedgerWorker, LedgerWorkerEvent]]:
    """Every `kind` event of the ledger's workers, oldest first."""
    found = [(w, e) for w in ledger.workers for e in w.events if e.kind == kind]
    return sorted(found, key=lambda pair: pair[1].at)


def _crashed(ledger: Any) -> int:
    return sum(1 for worker in ledger.workers if worker.stop_reason == "crash")
