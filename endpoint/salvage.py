"""The watchdog's salvage: a prompt that finished while its handler was frozen has its outputs
stored and recorded in the claim, so that the orchestrator completes the job from the claim
instead of running the whole graph again on another worker.

A frozen handler records nothing: not the prompt's end, not its outputs. A short prompt may
finish meanwhile; its outputs stay in ComfyUI's output folder, listed in its `/history` entry.
Once the watchdog (endpoint/watchdog.py) has seen the prompt gone from `/queue` and killed the
handler (which therefore writes nothing any more), `salvage`

1. reads the prompt's history entry: only one that `completed` with `success` goes on;
2. reads the claim: only one still held by this handler goes on (`holder` and `worker_id` as
   the fence file says, no outcome, no fence): a claim taken over is the taker's, and so are
   its keys;
3. stores every output file (`type: output`: previews are not outputs) through the handler's
   own `OutputCollector` and `S3Sink`, at the key the handler uses
   (`artifact_key(prefix, job_id, segment, node_id, filename)`) with the same metadata
   (sha256, verified after the upload, and the content type); an output in another run's
   folder, or with a name that could leave the output folder, is refused as the handler
   refuses it, and then nothing is recorded;
4. reads the claim again and, still held by this handler, writes it with `If-Match` on that
   read: `prompt_end` (success, the files), `stored` (the records, as the handler builds them)
   and a `FenceRecord(action="ended")`. The fence is what lets the orchestrator give the holder
   up at once (`claim.fenced`): a write without it would move Last-Modified and read as a
   renewal. A 412 means someone took the claim over meanwhile: it is theirs, and is left alone.

The deadline. Nobody takes the claim over, and the orchestrator submits nothing again, before
the lease has run out by `fence_after_s` (endpoint/claims.py, activities/runpod/follow.py). So
everything ends by then less SALVAGE_MARGIN_S, reckoned on the local wall clock from the fence
file's `lease_end` (as the watchdog reckons `fence_by`): each ComfyUI and S3 call is cut off at
the deadline, every S3 socket wait is capped by what was left of it at the start, and past it
the claim is not written. The claim write, once sent before the deadline, is let finish: it is
guarded by If-Match.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any, Literal

import boto3
import httpx
from botocore.config import Config

from endpoint.claims import ClaimStore, StoredClaim
from endpoint.errors import ClaimConflict, ClaimError
from endpoint.fence_file import ClaimPlace, FenceState
from endpoint.outputs import OutputCollector, S3Sink
from endpoint.s3 import S3, Patience
from endpoint.settings import BucketSettings
from endpoint.takeover import recorded_end
from protocol.comfyui.client import ComfyClient
from protocol.comfyui.follower import PromptEnd as FollowedEnd
from protocol.comfyui.history import history_when_written, outputs_of
from protocol.errors import ComfyError, HistoryMissing
from protocol.keys import artifact_key
from protocol.runpod.contract import ArtifactRecord, Claim, FenceRecord, OutputFile, PromptEnd

# The salvage ends this long before anyone may take the claim over (the lease's end plus
# `fence_after_s`): room for the wall clock's reading of it, and for a write in flight.
SALVAGE_MARGIN_S = 3.0
# ComfyUI takes the prompt off /queue and writes its history entry in one step; a moment more,
# in case a ComfyUI does not.
HISTORY_WAIT_S = 1.0
# Each S3 socket wait (connect, read) at most this long, and no longer than the deadline is away.
S3_TIMEOUT_S = 30.0
COMFY_TIMEOUT_S = 60.0
FENCE_DETAIL = "watchdog: prompt had ended; outputs stored"

SalvageResult = Literal[
    "recorded",  # outputs stored, the claim written
    "no_place",  # the fence file does not say where the claim is (an older handler's)
    "not_finished",  # the prompt did not end with success (or ComfyUI did not say)
    "not_ours",  # the claim is not this handler's any more (taken over, finished, fenced)
    "taken_over",  # the claim changed between its read and our write (412)
    "failed",  # an output or the claim could not be stored, or an output was refused
    "deadline",  # not done by the deadline: the claim is not written
]


def salvage_by(state: FenceState) -> float | None:
    """Epoch seconds by which the salvage must be done (None: the file does not say)."""
    lease_end = state.lease_end if state.lease_end is not None else state.fence_by
    if lease_end is None or state.fence_after_s is None:
        return None
    return lease_end + state.fence_after_s - SALVAGE_MARGIN_S


def succeeded(entry: dict[str, Any]) -> bool:
    """The history entry says the prompt ran to its end with success."""
    status = entry.get("status")
    return (
        isinstance(status, dict)
        and status.get("status_str") == "success"
        and status.get("completed") is True
    )


async def salvage(
    state: FenceState, comfy_url: str, bucket: BucketSettings, log: Any
) -> SalvageResult:
    """Store the outputs of the prompt the fence file names, if it succeeded, and record them
    and a fence in the claim, if it is still this handler's, all by `salvage_by(state)`. Call
    only once the prompt is gone from ComfyUI's queue and the handler is dead."""
    by = salvage_by(state)
    if state.claim is None or state.prompt_id is None or by is None:
        log.info(
            "watchdog_salvage_skipped", reason="the fence file does not say where the claim is"
        )
        return "no_place"
    deadline = time.monotonic() + (by - time.time())
    left = deadline - time.monotonic()
    if left <= 0:
        log.warning("watchdog_salvage_gave_up", reason="past its deadline", late_s=round(-left, 1))
        return "deadline"
    salvaging = Salvage(state.claim, state.prompt_id, comfy_url, bounded_s3(bucket, left), log)
    return await salvaging.run(deadline)


class Salvage:
    """One salvage of one prompt's outputs into one claim."""

    def __init__(self, place: ClaimPlace, prompt_id: str, comfy_url: str, s3: S3, log: Any) -> None:
        self.place = place
        self.prompt_id = prompt_id
        self.comfy_url = comfy_url
        self.s3 = s3
        self.store = ClaimStore(s3, place.claim_bucket)
        self.log = log.bind(claim_key=place.claim_key, holder=place.holder)

    async def run(self, deadline: float) -> SalvageResult:
        started = time.monotonic()
        try:
            async with asyncio.timeout(deadline - time.monotonic()):
                prepared = await self._prepare(deadline)
        except TimeoutError:
            self.log.warning(
                "watchdog_salvage_gave_up",
                reason="not done by its deadline: the claim is not written",
                spent_s=round(time.monotonic() - started, 1),
            )
            return "deadline"
        if isinstance(prepared, str):
            return prepared
        current, end, records = prepared
        return await self.record(current, end, records, deadline)

    async def _prepare(
        self, deadline: float
    ) -> SalvageResult | tuple[StoredClaim, PromptEnd, list[ArtifactRecord]]:
        """Steps 1 to 3, and the read of step 4: the claim to write over, and what to write."""
        timeout = httpx.Timeout(COMFY_TIMEOUT_S, connect=5.0)
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as http:
            client = ComfyClient(self.comfy_url, http)
            try:
                entry = await history_when_written(client, self.prompt_id, wait_s=HISTORY_WAIT_S)
            except (HistoryMissing, ComfyError, ValueError) as exc:
                self.log.info("watchdog_salvage_skipped", reason="no history entry", error=str(exc))
                return "not_finished"
            if not succeeded(entry):
                self.log.info(
                    "watchdog_salvage_skipped",
                    reason="the prompt did not succeed",
                    status=entry.get("status"),
                )
                return "not_finished"
            if await self._ours() is None:
                return "not_ours"
            records = await self._store(client, entry, deadline)
            if records is None:
                return "failed"
        # Read again: the write goes over the claim as it is now, If-Match on this read.
        current = await self._ours()
        if current is None:
            return "not_ours"
        end = recorded_end(FollowedEnd(outcome="success", entry=entry), _kept(current.claim, entry))
        return current, end, records

    async def _ours(self) -> StoredClaim | None:
        """The claim, when it is still this handler's to write; None (logged) when not."""
        try:
            current = await self.store.read(self.place.claim_key)
        except ClaimError as exc:
            self.log.warning(
                "watchdog_salvage_gave_up", reason="the claim is unreadable", error=str(exc)
            )
            return None
        why = _not_ours(current, self.place, self.prompt_id)
        if why is not None:
            self.log.info("watchdog_salvage_skipped", reason=why)
            return None
        return current

    async def _store(
        self, client: ComfyClient, entry: dict[str, Any], deadline: float
    ) -> list[ArtifactRecord] | None:
        """Every output file the entry lists, stored as the handler stores it; None (logged)
        when one could not be, or was refused."""
        place = self.place

        def key_for(node_id: str, filename: str) -> str:
            return artifact_key(place.output_prefix, place.job_id, place.segment, node_id, filename)

        retry_s = max(0.0, deadline - time.monotonic())
        sink = S3Sink(self.s3, place.output_bucket, key_for, retry_s=retry_s)
        collector = OutputCollector(client, sink, _ignore, run_tag=place.run_tag)
        try:
            collector.add(outputs_of(entry))
            if collector.failure() is None:
                await collector.drain()
        finally:
            # Cut off at the deadline, or refused: the uploads still in flight end here.
            await collector.cancel()
        problem = collector.failure()
        if problem is not None:
            self.log.warning(
                "watchdog_salvage_gave_up",
                reason="an output could not be stored",
                error=f"{type(problem).__name__}: {problem}",
            )
            return None
        return collector.records()

    async def record(
        self,
        current: StoredClaim,
        end: PromptEnd,
        records: list[ArtifactRecord],
        deadline: float,
    ) -> SalvageResult:
        """Step 4's write: the prompt's end, the records and the fence, If-Match `current`."""
        now = datetime.now(UTC)
        fence = FenceRecord(
            action="ended", at=now, worker_id=self.place.worker_id, detail=FENCE_DETAIL
        )
        keys = {record.key for record in records}
        stored = [kept for kept in current.claim.stored if kept.key not in keys] + records
        # No lease left, as a fencing handler writes it: a fenced claim may be taken over at once.
        claim = current.claim.model_copy(
            update={
                "prompt_end": end,
                "stored": stored,
                "fenced": fence,
                "renewed_at": now,
                "lease_until": now,
            }
        )
        if time.monotonic() >= deadline:
            self.log.warning(
                "watchdog_salvage_gave_up",
                reason="not done by its deadline: the claim is not written",
            )
            return "deadline"
        try:
            await self.store.replace(
                self.place.claim_key, claim, current.etag, patience=Until(deadline)
            )
        except ClaimConflict:
            self.log.info(
                "watchdog_salvage_not_recorded", reason="the claim was taken over meanwhile"
            )
            return "taken_over"
        except ClaimError as exc:
            self.log.warning("watchdog_salvage_not_recorded", error=str(exc))
            return "failed"
        self.log.warning(
            "watchdog_salvaged",
            prompt_id=self.prompt_id,
            outputs=len(end.outputs),
            stored=[record.key for record in records],
        )
        return "recorded"


class Until(Patience):
    """Retries through an outage until a fixed time.monotonic(), not for a budget from the
    first failure."""

    def __init__(self, deadline: float) -> None:
        super().__init__(max(0.0, deadline - time.monotonic()))
        self._deadline = deadline


def bounded_s3(settings: BucketSettings, left_s: float) -> S3:
    """The handler's S3 client, whose retries and every socket wait end within `left_s`: a
    call cut off at the deadline leaves no request to land much later from its thread."""
    s3 = S3(settings, retry_s=left_s)
    wait_s = max(1.0, min(S3_TIMEOUT_S, left_s))
    s3.client = boto3.session.Session().client(
        "s3",
        endpoint_url=settings.endpoint_url,
        region_name=settings.region,
        aws_access_key_id=settings.access_key_id.get_secret_value(),
        aws_secret_access_key=settings.secret_access_key.get_secret_value(),
        config=s3.client.meta.config.merge(Config(connect_timeout=wait_s, read_timeout=wait_s)),
    )
    return s3


def _not_ours(current: StoredClaim | None, place: ClaimPlace, prompt_id: str) -> str | None:
    """Why the claim is not this handler's to write (None: it is)."""
    if current is None:
        return "the claim is gone"
    claim = current.claim
    if claim.holder != place.holder or (place.worker_id and claim.worker_id != place.worker_id):
        return f"the claim is held by {claim.holder} on {claim.worker_id or '-'}"
    if claim.outcome is not None:
        return "the claim is finished"
    if claim.fenced is not None:
        return "the claim records a fence"
    if claim.prompt_id != prompt_id:
        return "the claim is another prompt's"
    return None


def _kept(claim: Claim, entry: dict[str, Any]) -> list[OutputFile]:
    """The files an earlier successful prompt of the claim listed of nodes this prompt did not
    run (a takeover left them out, their outputs stored): listed again, before this prompt's,
    as the handler lists them."""
    ended = claim.prompt_end
    if ended is None or ended.outcome != "success":
        return []
    ran = set(outputs_of(entry))
    return [output for output in ended.outputs if output.node_id not in ran]


def _ignore(_record: ArtifactRecord) -> None:
    pass
