"""Keeping a held claim alive while the job runs, saying in it what is done, fencing when it can
no longer be renewed, and finishing it once.

Renewal runs every lease_s/3 in its own task; a failed renewal (S3 unreachable) is retried
sooner. Every write carries what the holder has to say since the last: `stopping_since`, the
prompt's end (`prompt_end`, written at once when the prompt ends, before the uploads it leaves
are done, however recent the last write) and each output stored (`stored`, written at once, at
most one write per WRITE_GAP_S): a delivery that takes the claim over after this one dies knows
what is done (endpoint/takeover.py), and so does the orchestrator. `caught_up` waits for the
write that carries what was said: progress updates wait for it, never running ahead of the claim.

The lease lasts `lease_s` from when the S3 server received our last successful write, which is
no earlier than when we sent it: reckoned on the local monotonic clock from the send, it ends
no later than on the server's. When no renewal has succeeded by `fence_at` (the lease's end by
that reckoning, less `fence_margin_s`), `fence_due` is set and renewal ends: the holder must
stop its prompt before the lease ends (endpoint/fencing.py), since from then on another
delivery may take the submission over (once the lease has run out by `fence_after_s`, or at
once when the claim records the fence: `record_fence`). The same deadline goes into the fence
file for the worker's watchdog (endpoint/fence_file.py), in case this process is the one that
froze.

When someone else's conditional write wins (they took over a lapsed claim) `lost` is set and the
job must stop: the new holder runs the graph. A renewal whose answer was lost may have landed:
the next one's 412 is then against our own write, recognised by reading the claim back.

The renewal task is never cancelled mid-write: a PutObject in a worker thread would land anyway
and leave us holding a stale ETag. `stop()` asks the loop to end and waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Self

import structlog

from endpoint.claims import ClaimStore, StoredClaim, fresh_claim
from endpoint.errors import ClaimConflict, ClaimError
from endpoint.fence_file import FenceFile, epoch_of
from endpoint.s3 import Patience
from protocol.runpod.contract import (
    DEFAULT_FENCE_AFTER_S,
    ArtifactRecord,
    Claim,
    ClaimOutcome,
    FenceRecord,
    PromptEnd,
)

log = structlog.get_logger(__name__)

# After a failed renewal, the next try comes this soon (capped by the normal interval).
RENEW_RETRY_S = 1.0
# News (the prompt's end, a stored output) is written at once, but at most once per this long:
# a job that stores a hundred files makes tens of claim writes, not a hundred.
WRITE_GAP_S = 1.0
# The holder fences this long before its lease would end unrenewed: a quarter of the lease, at
# most FENCE_MARGIN_MAX_S. It is the time the holder gives its prompt to stop before it kills
# its ComfyUI instead, so it must cover an interrupt landing at the next sampler step.
FENCE_MARGIN_FRACTION = 0.25
FENCE_MARGIN_MAX_S = 10.0


def fence_margin_s(lease_s: float) -> float:
    return min(lease_s * FENCE_MARGIN_FRACTION, FENCE_MARGIN_MAX_S)


@dataclass(frozen=True)
class _Waiting:
    """Someone in `Lease.caught_up`: for a write carrying the first `said` things said."""

    said: int
    answer: asyncio.Future[bool]
    one_try: bool


class Lease:
    """`async with Lease(...) as lease:` renews `held` until `finish`, the fence or the end of
    the block. `stored`: the records the claim keeps (by default, those it holds)."""

    def __init__(
        self,
        store: ClaimStore,
        key: str,
        held: StoredClaim,
        lease_s: float,
        *,
        fence_after_s: float = DEFAULT_FENCE_AFTER_S,
        fence_file: FenceFile | None = None,
        stored: list[ArtifactRecord] | None = None,
    ) -> None:
        self.store = store
        self.key = key
        self.held = held
        self.lease_s = lease_s
        self.fence_after_s = fence_after_s
        self.margin_s = fence_margin_s(lease_s)
        self.lost = asyncio.Event()
        # Who holds the claim once `lost` is set (None if it could not be read).
        self.lost_to: StoredClaim | None = None
        # No renewal succeeded in time: the holder must stop its work before `ends_at`.
        self.fence_due = asyncio.Event()
        # time.monotonic() when our last successful write was sent: the lease runs from there.
        self._sent_at = held.sent_at if held.sent_at is not None else time.monotonic()
        self._stop = asyncio.Event()
        self._renew_now = asyncio.Event()
        # News not to hold behind WRITE_GAP_S: the prompt's end, which turns a takeover of a
        # finished run from running it again into keeping what it made.
        self._write_at_once = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._last_try = float("-inf")
        self._stopping_since: datetime | None = None
        self._prompt_end: PromptEnd | None = held.claim.prompt_end
        self._stored: list[ArtifactRecord] = list(held.claim.stored if stored is None else stored)
        # A write that failed without an answer, and when it was sent: it may have landed.
        self._unanswered: tuple[Claim, float] | None = None
        self._fence_file = fence_file
        # How many things were said (`_said`) and how many of them the last successful
        # renewal carried; those waiting in `caught_up` for the claim to hold what was said.
        self._said = 0
        self._said_written = 0
        self._waiting: list[_Waiting] = []
        self._log = log.bind(key=key, holder=held.claim.holder)

    @property
    def ends_at(self) -> float:
        """time.monotonic() by which the lease has surely not ended on the S3 server."""
        return self._sent_at + self.lease_s

    @property
    def fence_at(self) -> float:
        """time.monotonic() at which the holder fences unless a renewal succeeds first."""
        return self.ends_at - self.margin_s

    async def __aenter__(self) -> Self:
        self._tell_watchdog(self.fence_at)
        self._tasks = [
            asyncio.create_task(self._renew_forever(), name=f"lease {self.key}"),
            asyncio.create_task(self._watch_fence(), name=f"fence {self.key}"),
        ]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await self.stop()
        finally:
            self.let_go()

    async def stop(self) -> None:
        """End renewal after any write in flight; the claim keeps its current lease."""
        self._stop.set()
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            try:
                # Shielded: cancelling the job must not abandon a write in flight.
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # we are being cancelled, not the renewal task

    def let_go(self) -> None:
        """Tell the watchdog that no prompt of this claim is left to stop (it ended, was
        stopped, or the claim is finished)."""
        if self._fence_file is not None:
            self._fence_file.released()

    # --- what the claim says ---------------------------------------------------------------

    def mark_stopping(self, at: datetime) -> None:
        """Say in the claim that the platform stopped the job and its prompt is being stopped:
        written with the next write, which comes now, and kept in every later write."""
        self._stopping_since = at
        self._said += 1
        self._renew_now.set()

    def prompt_ended(self, end: PromptEnd) -> None:
        """The prompt ended: written at once, even within WRITE_GAP_S of the last write (the
        uploads it leaves go on meanwhile)."""
        self._prompt_end = end
        self._said += 1
        self._renew_now.set()
        self._write_at_once.set()

    def output_stored(self, record: ArtifactRecord) -> None:
        """An output is stored and verified: written at once, with any others meanwhile."""
        if record.key is None or all(kept.key != record.key for kept in self._stored):
            self._stored.append(record)
            self._said += 1
            self._renew_now.set()

    async def caught_up(self, *, at_once: bool = False) -> bool:
        """Wait until a renewal carried everything said so far: True once the claim holds it;
        False when renewal ended first (finished, fenced or lost), after which what was said
        is in the claim only if the outcome or the fence carried it. `at_once`: written now,
        not WRITE_GAP_S after the last write, and False as soon as a write fails (an outage is
        not waited out here: the caller has the claim's finish for that)."""
        wanted = self._said
        if self._said_written >= wanted:
            return True
        if not self._tasks or self._stop.is_set() or self.fence_due.is_set():
            return False
        if at_once:
            self._write_at_once.set()
        waiting = _Waiting(wanted, asyncio.get_running_loop().create_future(), one_try=at_once)
        self._waiting.append(waiting)
        return await waiting.answer

    def _answer_waiting(self, *, renewal_over: bool = False, write_failed: bool = False) -> None:
        still: list[_Waiting] = []
        for waiting in self._waiting:
            if waiting.answer.done():
                continue
            if self._said_written >= waiting.said:
                waiting.answer.set_result(True)
            elif renewal_over or (write_failed and waiting.one_try):
                waiting.answer.set_result(False)
            else:
                still.append(waiting)
        self._waiting = still

    def _ours(self) -> Claim:
        """The claim as we hold it, with what we have to say since our last write."""
        claim = self.held.claim
        update: dict[str, object] = {"prompt_end": self._prompt_end, "stored": list(self._stored)}
        if self._stopping_since is not None and claim.stopping_since is None:
            update["stopping_since"] = self._stopping_since
        return claim.model_copy(update=update)

    def _held_now(self) -> StoredClaim:
        return StoredClaim(self._ours(), self.held.etag, sent_at=self._sent_at)

    # --- finishing and fencing ---------------------------------------------------------------

    async def finish(self, outcome: ClaimOutcome) -> StoredClaim:
        """Stop renewing and record the outcome (through an outage, for the bucket's retry
        budget, but never past the fence point: by then the worker's watchdog may end this
        process, and the job's answer must be out). ClaimConflict when the claim is not
        ours."""
        await self.stop()
        if self.lost.is_set():
            raise ClaimConflict(f"{self.key}: the claim was taken over")
        try:
            try:
                self.held = await self.store.finish(
                    self.key, self._held_now(), outcome, patience=self._finish_patience()
                )
            except ClaimConflict:
                if not await self._adopt_unanswered():
                    raise
                self.held = await self.store.finish(
                    self.key, self._held_now(), outcome, patience=self._finish_patience()
                )
        except ClaimError as exc:
            self._log.warning("claim_finish_failed", state=outcome.state, error=str(exc))
            raise
        self.let_go()
        self._log.info("claim_finished", state=outcome.state, images=len(outcome.images))
        return self.held

    def _finish_patience(self) -> Patience:
        left = self.fence_at - time.monotonic()
        return Patience(max(0.0, min(self.store.retry_s, left)))

    async def record_fence(self, record: FenceRecord) -> bool:
        """Write the fence into the claim (`If-Match` on our last write: it is still ours unless
        someone took it over, which is fine too), trying again through an outage until the
        lease has run out by `fence_after_s`, when anyone may take the claim over anyway. True
        when recorded. The claim keeps no lease: a fenced claim may be taken over at once."""
        until = self.ends_at + self.fence_after_s
        self._stop.set()
        if self._tasks:
            # A renewal in flight (a hung connection may hold one for a minute) must end first:
            # its answer decides the ETag we write with.
            await asyncio.wait(self._tasks, timeout=max(0.0, until - time.monotonic()))
            if not all(task.done() for task in self._tasks):
                self._log.warning("claim_fence_not_recorded", reason="a renewal still in flight")
                return False
            self._tasks = []
        while not self.lost.is_set():
            now = datetime.now(UTC)
            claim = self._ours().model_copy(
                update={"fenced": record, "renewed_at": now, "lease_until": now}
            )
            sent_at = time.monotonic()
            try:
                self.held = await self.store.replace(
                    self.key, claim, self.held.etag, patience=Patience(0.0)
                )
            except ClaimConflict:
                if not await self._adopt_unanswered():
                    self._log.info("claim_fence_not_recorded", reason="the claim was taken over")
                    return False
                if self.held.claim.fenced is None:
                    continue  # a renewal of ours had landed: write the fence over it
            except ClaimError as exc:
                self._unanswered = (claim, sent_at)
                if time.monotonic() + RENEW_RETRY_S >= until:
                    self._log.warning("claim_fence_not_recorded", error=str(exc))
                    return False
                await asyncio.sleep(RENEW_RETRY_S)
                continue
            self._log.info("claim_fence_recorded", action=record.action)
            return True
        return False

    # --- the renewal and the fence timer -------------------------------------------------------

    async def _renew_forever(self) -> None:
        try:
            await self._renew_until_over()
        finally:
            self._answer_waiting(renewal_over=True)

    async def _renew_until_over(self) -> None:
        interval = self.lease_s / 3
        next_due = time.monotonic() + interval
        while not (self._stop.is_set() or self.fence_due.is_set()):
            asked = self._renew_now.is_set()
            due = min(next_due, self._last_try + WRITE_GAP_S) if asked else next_due
            wait = due - time.monotonic()
            if wait > 0 and not self._write_at_once.is_set():
                await self._sleep(wait, woken_by_news=not asked)
                continue
            self._renew_now.clear()
            self._write_at_once.clear()
            said = self._said
            attempt = fresh_claim(self._ours(), self.lease_s)
            self._last_try = time.monotonic()
            try:
                # One try: this loop is the retry, sooner than the lease runs out.
                held = await self.store.replace(
                    self.key, attempt, self.held.etag, patience=Patience(0.0)
                )
            except ClaimConflict:
                if await self._adopt_unanswered():
                    next_due = time.monotonic()
                    continue
                await self._note_lost()
                return
            except ClaimError as exc:
                # Keep trying: until our lease runs out nobody else may take the claim, and a
                # later renewal with our ETag still succeeds if nobody did.
                self._log.warning("claim_renew_failed", error=str(exc))
                self._answer_waiting(write_failed=True)
                self._unanswered = (attempt, self._last_try)
                next_due = time.monotonic() + min(interval, RENEW_RETRY_S)
                continue
            self._unanswered = None
            self._renewed(held)
            self._said_written = said
            self._answer_waiting()
            next_due = time.monotonic() + interval

    async def _watch_fence(self) -> None:
        """Set `fence_due` at `fence_at` (which each successful write moves on)."""
        while not self._stop.is_set():
            left = self.fence_at - time.monotonic()
            if left <= 0:
                self._fence_now()
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=left)

    def _fence_now(self) -> None:
        self._log.warning(
            "claim_fence_due",
            since_renewal_s=round(time.monotonic() - self._sent_at, 1),
            lease_s=self.lease_s,
            lease_ends_in_s=round(self.ends_at - time.monotonic(), 1),
        )
        self.fence_due.set()
        # The holder stops its prompt by the lease's end: the watchdog waits until then.
        self._tell_watchdog(self.ends_at)

    async def _sleep(self, seconds: float, *, woken_by_news: bool) -> None:
        """Up to `seconds`, or until renewal must end (or, `woken_by_news`, write news)."""
        events = [self._stop, self.fence_due, self._write_at_once]
        events += [self._renew_now] if woken_by_news else []
        waits = [asyncio.ensure_future(event.wait()) for event in events]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()

    def _renewed(self, held: StoredClaim) -> None:
        self.held = held
        if held.sent_at is not None:
            self._sent_at = max(self._sent_at, held.sent_at)
        if not self.fence_due.is_set():
            self._tell_watchdog(self.fence_at)

    def _tell_watchdog(self, fence_by: float) -> None:
        if self._fence_file is None:
            return
        claim = self.held.claim
        self._fence_file.holding(
            submission=claim.submission,
            prompt_id=claim.prompt_id,
            lease_s=self.lease_s,
            fence_after_s=self.fence_after_s,
            fence_by=epoch_of(fence_by),
            # What the watchdog needs to salvage a prompt that finishes while we are frozen.
            lease_end=epoch_of(self.ends_at),
            holder=claim.holder,
            worker_id=claim.worker_id,
            claim_bucket=self.store.bucket,
            claim_key=self.key,
            job_id=claim.job_id,
            segment=claim.segment,
        )

    async def _adopt_unanswered(self) -> bool:
        """After a 412: True when the stored claim is a write of ours whose answer was lost
        (we hold it, with its ETag); False when someone else wrote it."""
        unanswered, self._unanswered = self._unanswered, None
        if unanswered is None:
            return False
        attempt, sent_at = unanswered
        try:
            current = await self.store.read(self.key)
        except ClaimError:
            return False
        if current is None or current.claim != attempt:
            return False
        self._log.info("claim_renewal_landed_unanswered")
        self._renewed(StoredClaim(current.claim, current.etag, sent_at=sent_at))
        return True

    async def _note_lost(self) -> None:
        try:
            self.lost_to = await self.store.read(self.key)
        except ClaimError as exc:
            self._log.warning("claim_lost_unreadable", error=str(exc))
        holder = self.lost_to.claim.holder if self.lost_to is not None else None
        self._log.warning("claim_lost", new_holder=holder)
        self._stop.set()  # nothing to fence for: the claim is someone else's
        self.lost.set()
