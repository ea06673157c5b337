"""Reading a submission's claim (written by our handler) from the orchestrator's side.

The claim says which RunPod job holds a submission and, once it is over, how it ended and what
it stored. The orchestrator reads it to find a job whose `/run` answer was lost, to know when a
crashed holder's lease has run out (only then may a new delivery run the graph), and to confirm
that a stopped job's GPU is really done with the prompt.
"""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import ValidationError

from activities.runpod.contract import Claim, S3Target, claim_key
from activities.storage import ArtifactStore
from activities.storage_errors import ObjectMissing
from workflows.contracts import OutputSpec

# A claim is a small JSON document: anything bigger is not one of ours.
MAX_CLAIM_BYTES = 1024 * 1024


def claim_target(output: OutputSpec, default_bucket: str) -> S3Target:
    return S3Target(bucket=output.bucket or default_bucket, prefix=output.prefix)


async def read_claim(
    store: ArtifactStore, target: S3Target, job_id: str, submission: str
) -> Claim | None:
    """The claim, or None when nobody has claimed the submission (or it is unreadable)."""
    key = claim_key(target, job_id, submission)
    try:
        data = await store.read_bytes(key, limit=MAX_CLAIM_BYTES, bucket=target.bucket)
    except ObjectMissing:
        return None
    try:
        return Claim.model_validate_json(data)
    except ValidationError:
        return None


def lease_running(claim: Claim, now: datetime | None = None) -> bool:
    """The holder may still be running the prompt: no outcome, and its lease has not run out."""
    return claim.outcome is None and claim.lease_until > (now or datetime.now(UTC))
