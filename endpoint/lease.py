"""Keeping a held claim alive while the job runs, and finishing it once.

Renewal runs every lease_s/3 in its own task; a failed renewal (S3 unreachable) is retried
sooner, and the lease only ends for real when someone else's conditional write wins, which they
can do only after our lease expired. Then `lost` is set and the job must stop: the new holder
runs the graph.

The renewal task is never cancelled mid-write: a PutObject in a worker thread would land anyway
and leave us holding a stale ETag. `stop()` asks the loop to end and waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from typing import Self

import structlog

from endpoint.claims import ClaimConflict, ClaimError, ClaimStore, StoredClaim
from endpoint.contract import ClaimOutcome

log = structlog.get_logger(__name__)

# After a failed renewal, the next try comes this soon (capped by the normal interval).
RENEW_RETRY_S = 1.0
# How long `finish` keeps trying to record the outcome through S3 errors.
FINISH_TRIES = 5


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
        self._task: asyncio.Task[None] | None = None
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

    async def finish(self, outcome: ClaimOutcome) -> StoredClaim:
        """Stop renewing and record the outcome. ClaimConflict when the claim is not ours."""
        await self.stop()
        if self.lost.is_set():
            raise ClaimConflict(f"{self.key}: the claim was taken over")
        for attempt in range(1, FINISH_TRIES + 1):
            try:
                self.held = await self.store.finish(self.key, self.held, outcome)
            except ClaimError as exc:
                self._log.warning("claim_finish_failed", attempt=attempt, error=str(exc))
                if attempt == FINISH_TRIES:
                    raise
                await asyncio.sleep(RENEW_RETRY_S * attempt)
                continue
            self._log.info("claim_finished", state=outcome.state, images=len(outcome.images))
            return self.held
        raise AssertionError("unreachable")

    async def _renew_forever(self) -> None:
        interval = self.lease_s / 3
        wait = interval
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=wait)
                return
            try:
                self.held = await self.store.renew(self.key, self.held, self.lease_s)
                wait = interval
            except ClaimConflict:
                await self._note_lost()
                return
            except ClaimError as exc:
                # Keep trying: until our lease runs out nobody else may take the claim, and a
                # later renewal with our ETag still succeeds if nobody did.
                self._log.warning("claim_renew_failed", error=str(exc))
                wait = min(interval, RENEW_RETRY_S)

    async def _note_lost(self) -> None:
        try:
            self.lost_to = await self.store.read(self.key)
        except ClaimError as exc:
            self._log.warning("claim_lost_unreadable", error=str(exc))
        holder = self.lost_to.claim.holder if self.lost_to is not None else None
        self._log.warning("claim_lost", new_holder=holder)
        self.lost.set()
