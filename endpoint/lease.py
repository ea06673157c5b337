"""Keeping a held claim alive while the job runs, and finishing it once.

Renewal runs every lease_s/3 in its own task; a failed renewal (S3 unreachable) is retried
sooner, for as long as it takes, and the lease only ends for real when someone else's conditional
write wins, which they can do only after our lease expired. Then `lost` is set and the job must
stop: the new holder runs the graph. A renewal whose answer was lost may have landed: the next
one's 412 is then against our own write, recognised by reading the claim back.

The renewal task is never cancelled mid-write: a PutObject in a worker thread would land anyway
and leave us holding a stale ETag. `stop()` asks the loop to end and waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime
from types import TracebackType
from typing import Self

import structlog

from activities.runpod.contract import Claim, ClaimOutcome
from endpoint.claims import ClaimConflict, ClaimError, ClaimStore, StoredClaim, fresh_claim
from endpoint.s3 import Patience

log = structlog.get_logger(__name__)

# After a failed renewal, the next try comes this soon (capped by the normal interval).
RENEW_RETRY_S = 1.0


class Lease:
    """`async with Lease(...) as lease:` renews `held` until `finish` or the end of the block."""

    def __init__(self, store: ClaimStore, key: str, held: StoredClaim, lease_s: float) -> None:
        self.store = store
        self.key = key
        self.held = held
        self.lease_s = lease_s
        self.lost = asyncio.Event()
        # Who holds the claim once `lost` is set (None if it could not be read).
        self.lost_to: StoredClaim | None = None
        self._stop = asyncio.Event()
        self._renew_now = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping_since: datetime | None = None
        # A renewal that failed without an answer: it may have landed all the same.
        self._unanswered: Claim | None = None
        self._log = log.bind(key=key, holder=held.claim.holder)

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._renew_forever(), name=f"lease {self.key}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def stop(self) -> None:
        """End renewal after any write in flight; the claim keeps its current lease."""
        self._stop.set()
        task, self._task = self._task, None
        if task is None:
            return
        try:
            # Shielded: cancelling the job must not abandon a write in flight.
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise  # we are being cancelled, not the renewal task

    def mark_stopping(self, at: datetime) -> None:
        """Say in the claim that the platform stopped the job and its prompt is being stopped:
        written with the next renewal, which comes now, and kept in every later write."""
        self._stopping_since = at
        self._renew_now.set()

    def _ours(self) -> Claim:
        """The claim as we hold it, with what we have to say since our last write."""
        claim = self.held.claim
        if self._stopping_since is not None and claim.stopping_since is None:
            claim = claim.model_copy(update={"stopping_since": self._stopping_since})
        return claim

    async def finish(self, outcome: ClaimOutcome) -> StoredClaim:
        """Stop renewing and record the outcome (through an outage, for the bucket's retry
        budget). ClaimConflict when the claim is not ours."""
        await self.stop()
        if self.lost.is_set():
            raise ClaimConflict(f"{self.key}: the claim was taken over")
        try:
            try:
                self.held = await self.store.finish(self.key, self._held_now(), outcome)
            except ClaimConflict:
                if not await self._adopt_unanswered():
                    raise
                self.held = await self.store.finish(self.key, self._held_now(), outcome)
        except ClaimError as exc:
            self._log.warning("claim_finish_failed", state=outcome.state, error=str(exc))
            raise
        self._log.info("claim_finished", state=outcome.state, images=len(outcome.images))
        return self.held

    async def _renew_forever(self) -> None:
        interval = self.lease_s / 3
        wait = interval
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake(), timeout=wait)
            if self._stop.is_set():
                return
            self._renew_now.clear()
            attempt = fresh_claim(self._ours(), self.lease_s)
            try:
                # One try: this loop is the retry, sooner than the lease runs out.
                self.held = await self.store.replace(
                    self.key, attempt, self.held.etag, patience=Patience(0.0)
                )
                self._unanswered = None
                wait = interval
            except ClaimConflict:
                if await self._adopt_unanswered():
                    wait = 0.0
                    continue
                await self._note_lost()
                return
            except ClaimError as exc:
                # Keep trying: until our lease runs out nobody else may take the claim, and a
                # later renewal with our ETag still succeeds if nobody did.
                self._log.warning("claim_renew_failed", error=str(exc))
                self._unanswered = attempt
                wait = min(interval, RENEW_RETRY_S)

    async def _wake(self) -> None:
        """Return when renewal must end or must happen now."""
        stop = asyncio.ensure_future(self._stop.wait())
        now = asyncio.ensure_future(self._renew_now.wait())
        try:
            await asyncio.wait({stop, now}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            now.cancel()

    def _held_now(self) -> StoredClaim:
        return StoredClaim(self._ours(), self.held.etag)

    async def _adopt_unanswered(self) -> bool:
        """After a 412: True when the stored claim is a renewal of ours whose answer was lost
        (we hold it, with its ETag); False when someone else wrote it."""
        unanswered, self._unanswered = self._unanswered, None
        if unanswered is None:
            return False
        try:
            current = await self.store.read(self.key)
        except ClaimError:
            return False
        if current is None or current.claim != unanswered:
            return False
        self._log.info("claim_renewal_landed_unanswered")
        self.held = StoredClaim(current.claim, current.etag)
        return True

    async def _note_lost(self) -> None:
        try:
            self.lost_to = await self.store.read(self.key)
        except ClaimError as exc:
            self._log.warning("claim_lost_unreadable", error=str(exc))
        holder = self.lost_to.claim.holder if self.lost_to is not None else None
        self._log.warning("claim_lost", new_holder=holder)
        self.lost.set()
