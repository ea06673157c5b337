"""At-most-once execution per submission token: the claim object in S3 (contract.Claim).

The protocol, with only S3 conditional writes (no lock service):

- create: `PutObject If-None-Match: *` of the Claim at `claim_key(...)`; exactly one creator
  gets 200, the others 412 (or 409 on AWS under a race) and read who won;
- renew: `PutObject If-Match: <etag of our last write>` every lease_s/3; a 412 means someone
  took the claim over after our lease ran out, so we no longer hold it;
- take over: a claim without an outcome whose lease ran out more than the job's
  `fence_after_s` ago, or whose holder recorded that it fenced itself (`fenced`), is replaced
  with `If-Match: <etag read>`; of several takers exactly one wins. A holder that cannot renew
  stops its prompt before its lease ends (endpoint/fencing.py), and the worker's watchdog does
  it when the holder is frozen (endpoint/watchdog.py), both well within `fence_after_s` of the
  lease's end: so a takeover never runs the graph beside a holder that is alive but silent. The
  taker keeps what the claim says is done (`prompt_end`, `stored`: endpoint/takeover.py);
- finish: the holder writes the outcome (`If-Match` again); a claim with an outcome is never
  written again by anyone, so its artifact records are final.

Expiry is judged by the S3 server's clock, not the worker's: the claim's age is the response's
`Date` minus the object's `Last-Modified`, and its lease length is `lease_until - renewed_at`
(both stamped by the holder, so only their difference matters). Two workers with skewed clocks
therefore agree on who may take over.

Every call rides out a storage outage (`endpoint.s3`: retried with backoff for BUCKET_RETRY_S),
except a renewal, which the lease retries on its own schedule. A conditional write whose answer
was lost is retried and then fails with 412 against our own write; `_write` reads the object
back and accepts it when it is exactly the claim we wrote. A 412 is otherwise an answer: someone
else wrote the claim.
"""

from __future__ import annotations

import email.utils
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from endpoint.errors import ClaimConflict, ClaimError
from endpoint.s3 import S3, S3_FAILURES, Patience, error_code
from protocol.runpod.contract import MAX_EARLIER_HOLDERS, Claim, ClaimOutcome, EarlierHolder
from protocol.s3_answers import is_conflict, is_missing

# Date and Last-Modified have a resolution of one second.
CLOCK_RESOLUTION_S = 1.0
# Reads and conditional writes before `acquire` gives up on a claim that keeps changing.
ACQUIRE_ROUNDS = 5


@dataclass(frozen=True)
class StoredClaim:
    """A claim as stored, with the ETag to write it conditionally."""

    claim: Claim
    etag: str
    # Seconds since the object was last written, by the S3 server's clock (0 for our writes).
    age_s: float = 0.0
    # Our writes: time.monotonic() when the write was sent (its first try). The lease it gives
    # starts on the S3 server when the write lands, which is later: a lease reckoned from here
    # ends no later than the server's.
    sent_at: float | None = None

    @property
    def lease_s(self) -> float:
        return max(0.0, (self.claim.lease_until - self.claim.renewed_at).total_seconds())

    @property
    def expired(self) -> bool:
        return self.claim.outcome is None and self.age_s > self.lease_s + CLOCK_RESOLUTION_S

    @property
    def expires_in_s(self) -> float:
        return max(0.0, self.lease_s + CLOCK_RESOLUTION_S - self.age_s)

    def takeable(self, fence_after_s: float) -> bool:
        """Another delivery may take the claim over: no outcome, and its holder fenced itself
        (said so in the claim), or its lease ran out more than `fence_after_s` ago, by when the
        holder is surely fenced (its prompt stopped, or its worker gone)."""
        if self.claim.outcome is not None:
            return False
        lapsed = self.age_s > self.lease_s + CLOCK_RESOLUTION_S + fence_after_s
        return self.claim.fenced is not None or lapsed

    def takeable_in_s(self, fence_after_s: float) -> float:
        """How long until `takeable` holds, as far as time can tell (0: now)."""
        if self.claim.fenced is not None:
            return 0.0
        return max(0.0, self.lease_s + CLOCK_RESOLUTION_S + fence_after_s - self.age_s)


@dataclass(frozen=True)
class Acquired:
    held: StoredClaim
    # The claim we replaced: an expired lease, or our own job's earlier handler on this worker.
    took_over: Claim | None = None


@dataclass(frozen=True)
class HeldElsewhere:
    current: StoredClaim


@dataclass(frozen=True)
class Finished:
    current: StoredClaim


Decision = Acquired | HeldElsewhere | Finished


def fresh_claim(template: Claim, lease_s: float, *, now: datetime | None = None) -> Claim:
    """`template` with a lease of `lease_s` from now."""
    now = now or datetime.now(UTC)
    return template.model_copy(
        update={"renewed_at": now, "lease_until": now + timedelta(seconds=lease_s)}
    )


class ClaimStore:
    """Reads and conditionally writes claim objects in one bucket."""

    def __init__(self, s3: S3, bucket: str) -> None:
        self._s3 = s3
        self.bucket = bucket

    async def read(self, key: str) -> StoredClaim | None:
        def get() -> tuple[dict[str, Any], bytes]:
            # The body is read in the same try: a read cut midway is a failed try like any other.
            resp = self._s3.client.get_object(Bucket=self.bucket, Key=key)
            return resp, resp["Body"].read()

        try:
            resp, body = await self._s3.attempt(get, "get_object")
        except ClientError as exc:
            if is_missing(exc):
                return None
            raise ClaimError(f"reading s3://{self.bucket}/{key}: {error_code(exc)}") from exc
        except BotoCoreError as exc:
            raise ClaimError(f"reading s3://{self.bucket}/{key}: {exc}") from exc
        try:
            claim = Claim.model_validate_json(body)
        except ValueError as exc:
            # Never overwrite what we cannot read: it may be a newer handler's claim.
            raise ClaimError(f"s3://{self.bucket}/{key} is not a claim: {exc}") from exc
        return StoredClaim(claim, str(resp["ETag"]), _age_s(resp))

    async def create(self, key: str, claim: Claim) -> StoredClaim:
        """Write a new claim; ClaimConflict when one exists already."""
        return await self._write(key, claim, None, IfNoneMatch="*")

    async def replace(
        self, key: str, claim: Claim, etag: str, *, patience: Patience | None = None
    ) -> StoredClaim:
        """Overwrite the claim last seen with `etag`; ClaimConflict when it changed since."""
        return await self._write(key, claim, patience, IfMatch=etag)

    async def acquire(
        self, key: str, template: Claim, lease_s: float, *, fence_after_s: float
    ) -> Decision:
        """Claim the submission for `template.holder`, unless someone else lawfully holds it.

        A claim is ours to take over when it is `takeable(fence_after_s)` (its holder fenced,
        or its lease ran out that long ago), or when it is held by the same RunPod job on the
        same worker: the platform runs one handler per worker, so that holder is this job's
        earlier handler process, which died (a restarted handler re-attaches). A takeover keeps
        what the claim says is done when its prompt succeeded (`prompt_end`, `stored`), so a
        delivery after this one knows it too.
        """
        for _ in range(ACQUIRE_ROUNDS):
            current = await self.read(key)
            if current is None:
                try:
                    return Acquired(await self.create(key, fresh_claim(template, lease_s)))
                except ClaimConflict:
                    continue  # someone created it meanwhile: read who
            if current.claim.outcome is not None:
                return Finished(current)
            if not (current.takeable(fence_after_s) or _same_handler(current.claim, template)):
                return HeldElsewhere(current)
            taken = fresh_claim(_taken_over(template, current.claim), lease_s)
            try:
                held = await self.replace(key, taken, current.etag)
            except ClaimConflict:
                continue  # renewed, finished or taken by another meanwhile
            return Acquired(held, took_over=current.claim)
        raise ClaimError(f"s3://{self.bucket}/{key} kept changing while being claimed")

    async def mark_delivery(self, key: str, body: bytes, *, patience: Patience) -> bool:
        """Leave the delivery's marker (`contract.delivery_key`; a small JSON body: an empty
        PUT left SeaweedFS's answer on the pooled connection, read as the next call's). Only
        the job's cost needs it, so a failure is not the job's: False, and the run goes on."""
        try:
            await self._put_json(key, body, patience)
        except S3_FAILURES:
            return False
        return True

    async def renew(self, key: str, held: StoredClaim, lease_s: float) -> StoredClaim:
        """Extend our lease; ClaimConflict when the claim is no longer ours."""
        return await self.replace(key, fresh_claim(held.claim, lease_s), held.etag)

    async def finish(
        self,
        key: str,
        held: StoredClaim,
        outcome: ClaimOutcome,
        *,
        patience: Patience | None = None,
    ) -> StoredClaim:
        """Record the outcome; from then on nobody writes this claim again."""
        now = datetime.now(UTC)
        done = held.claim.model_copy(
            update={"outcome": outcome, "renewed_at": now, "lease_until": now}
        )
        return await self.replace(key, done, held.etag, patience=patience)

    @property
    def retry_s(self) -> float:
        """How long one call rides out a storage outage unless told (BUCKET_RETRY_S)."""
        return self._s3.retry_s

    async def _put_json(
        self, key: str, body: bytes, patience: Patience | None, **condition: str
    ) -> dict[str, Any]:
        answer: dict[str, Any] = await self._s3.call(
            "put_object",
            patience=patience,
            Bucket=self.bucket,
            Key=key,
            Body=body,
            ContentType="application/json",
            **condition,
        )
        return answer

    async def _write(
        self, key: str, claim: Claim, patience: Patience | None, **condition: str
    ) -> StoredClaim:
        body = claim.model_dump_json().encode()
        sent_at = time.monotonic()
        try:
            resp = await self._put_json(key, body, patience, **condition)
        except S3_FAILURES as exc:
            if not is_conflict(exc):
                raise ClaimError(f"writing s3://{self.bucket}/{key}: {error_code(exc)}") from exc
            # A request whose answer was lost is tried again: the 412 may be against our own
            # first try. It is ours exactly when the stored claim is the one we wrote.
            current = await self.read(key)
            if current is not None and current.claim == claim:
                return StoredClaim(claim, current.etag, sent_at=sent_at)
            raise ClaimConflict(f"s3://{self.bucket}/{key} changed: {error_code(exc)}") from exc
        return StoredClaim(claim, str(resp["ETag"]), sent_at=sent_at)


def _taken_over(template: Claim, previous: Claim) -> Claim:
    """The claim a taker writes: its own, one takeover more, the holders before it (what a
    redelivered RunPod job billed on an earlier worker is read from them), and what the
    previous holders finished when their prompt succeeded (a failed or cut-short prompt is run
    again whole, so nothing of it is kept). A restarted handler of the same delivery
    (`_same_handler`) is no new holder: its claim keeps the time it was taken."""
    update: dict[str, Any] = {"takeovers": previous.takeovers + 1}
    if _same_handler(previous, template):
        update |= {"claimed_at": previous.claimed_at or template.claimed_at}
        update |= {"earlier": previous.earlier}
    else:
        holder = EarlierHolder.model_validate(previous, from_attributes=True)
        update |= {"earlier": [*previous.earlier, holder][-MAX_EARLIER_HOLDERS:]}
    ended = previous.prompt_end
    if ended is not None and ended.outcome == "success":
        update |= {"prompt_end": ended, "stored": previous.stored}
    return template.model_copy(update=update)


def _same_handler(current: Claim, template: Claim) -> bool:
    return current.holder == template.holder and current.worker_id == template.worker_id


def _age_s(resp: dict[str, Any]) -> float:
    """Now minus Last-Modified, both by the S3 server's clock (the local one as a fallback)."""
    modified = resp.get("LastModified")
    if not isinstance(modified, datetime):
        return 0.0
    headers = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    now = datetime.now(UTC)
    if isinstance(headers.get("date"), str):
        try:
            now = email.utils.parsedate_to_datetime(headers["date"])
        except (TypeError, ValueError):
            pass
    return max(0.0, (now - modified).total_seconds())
