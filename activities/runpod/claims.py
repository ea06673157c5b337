"""Reading a submission's claim (written by our handler) from the orchestrator's side.

The claim says which RunPod job holds a submission and, once it is over, how it ended and what
it stored. The orchestrator reads it to find a job whose `/run` answer was lost, to know when a
crashed holder's lease has run out (only then may a new delivery run the graph), and to confirm
that a stopped job's GPU is really done with the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from pydantic import ValidationError

from activities.storage import ArtifactStore
from protocol.runpod.contract import Claim, S3Target, claim_key, server_age_s
from workflows.contracts import OutputSpec
from workflows.errors import ObjectMissing

# A claim is a small JSON document: anything bigger is not one of ours.
MAX_CLAIM_BYTES = 1024 * 1024
# `Date` and `Last-Modified` have a resolution of one second (endpoint/claims.py reads them so).
CLOCK_RESOLUTION_S = 1.0


def claim_target(output: OutputSpec, default_bucket: str) -> S3Target:
    return S3Target(bucket=output.bucket or default_bucket, prefix=output.prefix)


async def read_claim(
    store: ArtifactStore, target: S3Target, job_id: str, submission: str
) -> Claim | None:
    """The claim, or None when nobody has claimed the submission (or it is unreadable)."""
    aged = await read_aged_claim(store, target, job_id, submission)
    return None if aged is None else aged.claim


@dataclass(frozen=True)
class AgedClaim:
    """A claim with its age by the S3 server's clock (`server_age_s`), as the handler judges
    a lease: two machines' clocks need not agree."""

    claim: Claim
    age_s: float

    @property
    def lease_s(self) -> float:
        return max(0.0, (self.claim.lease_until - self.claim.renewed_at).total_seconds())

    def lapsed_by(self, seconds: float) -> bool:
        """No outcome, and the lease ran out more than `seconds` ago (by the server's
        whole-second clock: a second more, as the handler allows)."""
        return self.claim.outcome is None and self.written_before_lease_and(seconds)

    def written_before_lease_and(self, seconds: float) -> bool:
        """The claim was last written more than its lease and `seconds` ago (a second more
        for the server's clock), whatever it says."""
        return self.age_s > self.lease_s + CLOCK_RESOLUTION_S + seconds

    def lapses_in_s(self, seconds: float) -> float:
        """How long until `lapsed_by(seconds)` holds (0: it does)."""
        return max(0.0, self.lease_s + CLOCK_RESOLUTION_S + seconds - self.age_s)


async def read_aged_claim(
    store: ArtifactStore, target: S3Target, job_id: str, submission: str
) -> AgedClaim | None:
    """`read_claim`, with its age."""
    key = claim_key(target, job_id, submission)
    try:
        read = await store.read_dated(key, limit=MAX_CLAIM_BYTES, bucket=target.bucket)
    except ObjectMissing:
        return None
    try:
        claim = Claim.model_validate_json(read.data)
    except ValidationError:
        return None
    return AgedClaim(claim, server_age_s(read.last_modified, read.server_date))


def lease_running(claim: Claim, now: datetime | None = None) -> bool:
    """The holder may still be running the prompt: no outcome, and its lease has not run out."""
    return claim.outcome is None and claim.lease_until > (now or datetime.now(UTC))
