"""The RunPod backend's follow and stop against a scripted RunPod (httpx.MockTransport) and an
in-memory bucket, inside `ActivityEnvironment`: no server. What each test guards is named in it:
submitting once, finding a job by its claim after a lost answer, following a claim's holder,
refusing outputs outside the job's folder, stopping and reading the cost back."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import json
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.live_progress import LiveProgress
from activities.runpod.backend import RunPodBackend
from activities.runpod.client import MAX_RUN_BYTES, RunPodClient
from activities.runpod.retry import RetryPolicy
from activities.storage import DatedBytes, StoredObject
from configuration.pools import PoolConfig
from configuration.settings import S3Settings
from protocol.runpod.contract import (
    ArtifactRecord,
    Claim,
    ClaimOutcome,
    FenceRecord,
    OutputFile,
    PromptEnd,
    S3Target,
    StopRecord,
    claim_key,
    delivery_key,
)
from workflows.activity_io import (
    FollowHeartbeat,
    FollowInput,
    OffloadInput,
    PreparedJob,
    PrepareInput,
    StopInput,
)
from workflows.contracts import Checkpoint, OutputSpec, S3Input
from workflows.errors import ObjectMissing
from workflows.failures import resubmit_cannot_run_twice
from workflows.shared import ErrorType

BUCKET = "artifacts"
PROMPT = "7d7c6a1e-51b1-4a49-9d4c-5b1d3c6e2a10"
JOB_ID = "job-1"
RUNPOD_JOB = "c80ffee4-f315-4e25-a146-0f3d98cf024b-u1"
HOLDER = "0ddba11a-0000-4000-8000-000000000000-u1"
GRAPH = {"1": {"class_type": "SaveImage", "inputs": {"filename_prefix": "t"}}}
PNG = b"\x89PNG fake image bytes"


class MemoryStore:
    """What the RunPod backend uses of `ArtifactStore`, over a dict."""

    def __init__(self) -> None:
        self.settings = S3Settings(bucket=BUCKET)
        self.objects: dict[tuple[str, str], tuple[bytes, str]] = {}
        # When each object was written (a test may age one, as the S3 server's clock would).
        self.modified: dict[tuple[str, str], datetime] = {}

    def put(self, key: str, data: bytes, *, sha256: str | None = None) -> None:
        self.objects[(BUCKET, key)] = (data, sha256 or hashlib.sha256(data).hexdigest())
        self.modified[(BUCKET, key)] = datetime.now(UTC)

    async def read_bytes(self, key: str, *, limit: int, bucket: str | None = None) -> bytes:
        return (await self.read_dated(key, limit=limit, bucket=bucket)).data

    async def read_dated(self, key: str, *, limit: int, bucket: str | None = None) -> DatedBytes:
        found = self.objects.get((bucket or BUCKET, key))
        if found is None:
            raise ObjectMissing(f"s3://{bucket}/{key} does not exist")
        return DatedBytes(data=found[0], last_modified=self.modified.get((bucket or BUCKET, key)))

    async def head(self, key: str, *, bucket: str | None = None) -> StoredObject | None:
        found = self.objects.get((bucket or BUCKET, key))
        if found is None:
            return None
        return StoredObject(
            bucket=bucket or BUCKET,
            key=key,
            uri=f"s3://{bucket or BUCKET}/{key}",
            size=len(found[0]),
            sha256=found[1],
            content_type="image/png",
        )

    async def upload_stream(
        self,
        key: str,
        chunks: AsyncIterable[bytes],
        *,
        content_type: str,
        bucket: str | None = None,
        metadata: Any = None,
    ) -> StoredObject:
        data = b"".join([chunk async for chunk in chunks])
        self.put(key, data)
        head = await self.head(key, bucket=bucket)
        assert head is not None
        return head

    async def put_small(
        self, key: str, data: bytes, *, content_type: str, bucket: str | None = None
    ) -> None:
        self.objects[(bucket or BUCKET, key)] = (data, "")
        self.modified[(bucket or BUCKET, key)] = datetime.now(UTC)

    async def list_keys(self, prefix: str, *, bucket: str | None = None) -> list[str]:
        return sorted(
            k for b, k in self.objects if b == (bucket or BUCKET) and k.startswith(prefix)
        )

    async def delete(self, key: str, *, bucket: str | None = None) -> None:
        self.objects.pop((bucket or BUCKET, key), None)


@dataclass
class ScriptedRunPod:
    """RunPod's answers, in order, per route; what was asked, in order."""

    statuses: list[dict[str, Any]] = field(default_factory=list)
    run_answer: Callable[[], httpx.Response] | None = None
    requests: list[tuple[str, str]] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def handle(self, request: httpx.Request) -> httpx.Response:
        route = request.url.path.split("/")[3]
        self.requests.append((request.method, route))
        if route == "run":
            self.bodies.append(json.loads(request.content))
            if self.run_answer is not None:
                return self.run_answer()
            return httpx.Response(200, json={"id": RUNPOD_JOB, "status": "IN_QUEUE"})
        if route == "cancel":
            return httpx.Response(200, json={"id": RUNPOD_JOB, "status": "CANCELLED"})
        answer = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        return httpx.Response(200, json=answer)


def record(key: str, data: bytes = PNG) -> dict[str, Any]:
    return {
        "filename": "t_00001_.png",
        "type": "s3_url",
        "data": f"s3://{BUCKET}/{key}",
        "bucket": BUCKET,
        "key": key,
        "node_id": "1",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "content_type": "image/png",
    }


OUR_KEY = f"jobs/{JOB_ID}/0/1/t_00001_.png"


def progress(
    step: int,
    seq: int,
    artifacts: list[dict[str, Any]] | None = None,
    *,
    total: int = 10,
    node: str | None = None,
) -> dict[str, Any]:
    return {
        "kind": "durable_comfy.progress",
        "submission": PROMPT,
        "prompt_id": PROMPT,
        "stage": "running",
        "seq": seq,
        "step": step,
        "total_steps": total,
        "node": node,
        "artifacts": artifacts or [],
        "at": datetime.now(UTC).isoformat(),
    }


def completed(images: list[dict[str, Any]], job: str = RUNPOD_JOB) -> dict[str, Any]:
    output = {"images": images, "submission": PROMPT, "prompt_id": PROMPT}
    return {
        "id": job,
        "status": "COMPLETED",
        "delayTime": 1500,
        "executionTime": 4200,
        "workerId": "w1",
        "output": output,
    }


def backend(
    runpod: ScriptedRunPod,
    store: MemoryStore,
    *,
    claims: bool = True,
    transport: httpx.AsyncBaseTransport | None = None,
    **pool_fields: Any,
) -> RunPodBackend:
    pool = PoolConfig(
        kind="runpod", endpoint_id="ep1", claims=claims, usd_per_second=0.001, **pool_fields
    )
    http = httpx.AsyncClient(transport=transport or httpx.MockTransport(runpod.handle))
    client = RunPodClient.for_pool(
        pool, SecretStr("k"), http, retry=RetryPolicy(attempts=1), sleep=_no_sleep
    )
    return RunPodBackend({"cloud": pool}, {"cloud": client}, store, poll_s=0.0)  # type: ignore[arg-type]


async def _no_sleep(_seconds: float) -> None:
    return None


def follow_input(*, submit: bool = True, checkpoint: Checkpoint | None = None) -> FollowInput:
    return FollowInput(
        job_id=JOB_ID,
        pool="cloud",
        prompt_id=PROMPT,
        client_id="dc-client",
        run_tag="tag",
        output=OutputSpec(),
        progress_interval_s=0.0,
        checkpoint=checkpoint,
        graph=GRAPH if submit else None,
        execution_timeout_s=60,
    )


def env(heartbeats: list[Any], details: list[Any] | None = None) -> ActivityEnvironment:
    environment = ActivityEnvironment()
    environment.on_heartbeat = lambda *d: heartbeats.append(d[0])
    environment.info = dataclasses.replace(environment.info, heartbeat_details=details or [])
    return environment


async def test_submits_once_follows_progress_and_keeps_verified_outputs() -> None:
    store = MemoryStore()
    store.put(OUR_KEY, PNG)
    runpod = ScriptedRunPod(
        statuses=[
            {"id": RUNPOD_JOB, "status": "IN_QUEUE"},
            {"id": RUNPOD_JOB, "status": "IN_PROGRESS", "output": progress(4, 1)},
            {
                "id": RUNPOD_JOB,
                "status": "IN_PROGRESS",
                "output": progress(10, 2, [record(OUR_KEY)]),
            },
            completed([record(OUR_KEY)]),
        ]
    )
    heartbeats: list[Any] = []
    result = await env(heartbeats).run(backend(runpod, store).follow, follow_input())
    assert [r for r in runpod.requests if r[1] == "run"] == [("POST", "run")]
    body = runpod.bodies[0]
    assert body["input"]["durable_comfy"]["submission"] == PROMPT
    assert body["input"]["durable_comfy"]["output"] == {"bucket": BUCKET, "prefix": "jobs"}
    assert body["policy"]["executionTimeout"] == 60_000
    assert [a.key for a in result.artifacts] == [OUR_KEY]
    assert result.checkpoint.provider_job_id == RUNPOD_JOB and result.checkpoint.step == 10
    assert result.cost is not None
    assert (result.cost.queue_s, result.cost.execution_s) == (1.5, 4.2)
    assert result.cost.usd_estimate == pytest.approx((4.2 + 5.0) * 0.001)
    # The job id is heartbeated before the first poll: a replacement polls, never re-submits.
    first = FollowHeartbeat.model_validate(heartbeats[1])
    assert first.checkpoint.provider_job_id == RUNPOD_JOB


async def test_the_claim_lease_is_the_pools_or_a_minute() -> None:
    leases = []
    for lease in (None, 20.0):
        store, runpod = MemoryStore(), ScriptedRunPod(statuses=[completed([record(OUR_KEY)])])
        store.put(OUR_KEY, PNG)
        await env([]).run(backend(runpod, store, claim_lease_s=lease).follow, follow_input())
        leases.append(runpod.bodies[0]["input"]["durable_comfy"]["lease_s"])
    assert leases == [60.0, 20.0]


async def test_a_retry_follows_the_job_it_knows_without_submitting() -> None:
    store = MemoryStore()
    store.put(OUR_KEY, PNG)
    runpod = ScriptedRunPod(statuses=[completed([record(OUR_KEY)])])
    known = Checkpoint(job_id=JOB_ID, prompt_id=PROMPT, provider_job_id=RUNPOD_JOB)
    await env([]).run(backend(runpod, store).follow, follow_input(checkpoint=known))
    assert ("POST", "run") not in runpod.requests


async def test_a_lost_run_answer_is_safe_to_resend_with_claims_but_asks_without() -> None:
    def lost() -> httpx.Response:
        raise httpx.ReadTimeout("answer lost")

    store = MemoryStore()
    heartbeats: list[Any] = []
    runpod = ScriptedRunPod(statuses=[completed([])], run_answer=lost)
    with pytest.raises(ApplicationError) as retried:
        await env(heartbeats).run(backend(runpod, store).follow, follow_input())
    assert retried.value.type == ErrorType.BACKEND_UNAVAILABLE and not retried.value.non_retryable
    sent = FollowHeartbeat.model_validate(heartbeats[0]).checkpoint
    assert sent.submit_sent_at is not None, "word of the /run in flight"
    assert retried.value.details, "and the workflow gets it with the failure"

    runpod = ScriptedRunPod(statuses=[completed([])], run_answer=lost)
    with pytest.raises(ApplicationError) as ambiguous:
        await env([]).run(backend(runpod, store, claims=False).follow, follow_input())
    assert ambiguous.value.type == ErrorType.SUBMISSION_AMBIGUOUS and ambiguous.value.non_retryable

    # The next attempt of a claims-less pool (a worker died waiting for the answer), told by
    # the workflow's checkpoint, does not send it again.
    runpod = ScriptedRunPod(statuses=[completed([])])
    unanswered = Checkpoint(job_id=JOB_ID, prompt_id=PROMPT, submit_sent_at=datetime.now(UTC))
    with pytest.raises(ApplicationError) as asked:
        await env([]).run(
            backend(runpod, store, claims=False).follow, follow_input(checkpoint=unanswered)
        )
    assert asked.value.type == ErrorType.SUBMISSION_AMBIGUOUS
    assert runpod.requests == []


async def test_a_refused_run_leaves_no_word_of_a_submission_in_flight() -> None:
    """A `/run` refused outright (here a 400; a 429 past the client's budget alike) created no
    job: the next attempt of a claims-less pool sends it again instead of waiting for a
    decision on a job that cannot exist (found by `make soak`)."""
    store = MemoryStore()
    heartbeats: list[Any] = []
    runpod = ScriptedRunPod(
        statuses=[completed([])], run_answer=lambda: httpx.Response(400, json={"error": "no"})
    )
    with pytest.raises(ApplicationError) as refused:
        await env(heartbeats).run(backend(runpod, store, claims=False).follow, follow_input())
    assert refused.value.type != ErrorType.SUBMISSION_AMBIGUOUS
    last = FollowHeartbeat.model_validate(heartbeats[-1]).checkpoint
    assert last.submit_sent_at is None, last


async def test_the_claim_finds_the_job_whose_answer_was_lost() -> None:
    store = MemoryStore()
    store.put(OUR_KEY, PNG)
    claim = Claim(
        submission=PROMPT,
        job_id=JOB_ID,
        prompt_id=PROMPT,
        holder=HOLDER,
        lease_until=datetime.now(UTC) + timedelta(minutes=1),
        renewed_at=datetime.now(UTC),
    )
    key = claim_key(S3Target(bucket=BUCKET), JOB_ID, PROMPT)
    store.put(key, claim.model_dump_json().encode())
    runpod = ScriptedRunPod(statuses=[completed([record(OUR_KEY)], job=HOLDER)])
    result = await env([]).run(backend(runpod, store).follow, follow_input())
    assert ("POST", "run") not in runpod.requests
    assert result.checkpoint.provider_job_id == HOLDER


async def test_a_delivery_that_found_the_claim_taken_follows_the_holder() -> None:
    store = MemoryStore()
    store.put(OUR_KEY, PNG)
    elsewhere: dict[str, Any] = {
        "id": RUNPOD_JOB,
        "status": "COMPLETED",
        "output": {
            "status": "claimed_elsewhere",
            "claim_holder": HOLDER,
            "submission": PROMPT,
            "prompt_id": PROMPT,
        },
    }
    elsewhere |= {"delayTime": 800, "executionTime": 350}
    runpod = ScriptedRunPod(statuses=[elsewhere, completed([record(OUR_KEY)], job=HOLDER)])
    result = await env([]).run(backend(runpod, store).follow, follow_input())
    assert result.checkpoint.provider_job_id == HOLDER
    assert [a.key for a in result.artifacts] == [OUR_KEY]
    # Both billed: the holder that ran it, and the delivery that found it claimed.
    assert result.cost is not None and result.cost.provider_job_id == HOLDER
    [other] = result.other_costs
    assert (other.provider_job_id, other.execution_s) == (RUNPOD_JOB, 0.35)


async def test_a_replayed_outcome_reports_what_the_job_that_ran_it_cost() -> None:
    """Our `/run` answer was lost, the job ran anyway and recorded its outcome; the resubmission
    replays it. The lost job billed for the run: its cost is read once it has ended."""
    store = MemoryStore()
    store.put(OUR_KEY, PNG)
    replayed = completed([record(OUR_KEY)])
    replayed["output"] |= {"replayed": True, "claim_holder": HOLDER}
    holder_running = {"id": HOLDER, "status": "IN_PROGRESS"}
    runpod = ScriptedRunPod(
        statuses=[replayed, holder_running, completed([record(OUR_KEY)], job=HOLDER)]
    )
    result = await env([]).run(backend(runpod, store).follow, follow_input())
    assert result.cost is not None and result.cost.provider_job_id == RUNPOD_JOB
    [other] = result.other_costs
    assert (other.provider_job_id, other.execution_s) == (HOLDER, 4.2)


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("jobs/other-job/0/1/x.png", "another job's folder"),
        ("elsewhere/x.png", "outside the prefix"),
    ],
)
async def test_outputs_outside_the_jobs_folder_are_refused(key: str, why: str) -> None:
    store = MemoryStore()
    store.put(key, PNG)
    runpod = ScriptedRunPod(statuses=[completed([record(key)])])
    with pytest.raises(ApplicationError) as refused:
        await env([]).run(backend(runpod, store).follow, follow_input())
    assert refused.value.type == ErrorType.OUTPUT_MISSING, why
    assert "outside this job's folder" in refused.value.message


async def test_an_output_whose_bytes_differ_from_the_record_is_not_kept() -> None:
    store = MemoryStore()
    store.put(OUR_KEY, b"something else")
    runpod = ScriptedRunPod(statuses=[completed([record(OUR_KEY)])])
    with pytest.raises(ApplicationError) as failed:
        await env([]).run(backend(runpod, store).follow, follow_input())
    assert failed.value.type == ErrorType.STORAGE_ERROR and not failed.value.non_retryable


async def test_a_job_that_expires_in_the_queue_is_a_queue_timeout() -> None:
    store = MemoryStore()

    class Gone(ScriptedRunPod):
        def handle(self, request: httpx.Request) -> httpx.Response:
            if "/status/" in request.url.path and self.requests:
                self.requests.append(("GET", "status"))
                return httpx.Response(404, json={"error": "job not found"})
            return super().handle(request)

    runpod = Gone(statuses=[{"id": RUNPOD_JOB, "status": "IN_QUEUE"}])
    known = Checkpoint(job_id=JOB_ID, prompt_id=PROMPT, provider_job_id=RUNPOD_JOB)
    with pytest.raises(ApplicationError) as expired:
        await env([]).run(backend(runpod, store).follow, follow_input(checkpoint=known))
    assert expired.value.type == ErrorType.QUEUE_TIMEOUT


def stop_input(provider_job_id: str | None = RUNPOD_JOB) -> StopInput:
    return StopInput(
        job_id=JOB_ID,
        pool="cloud",
        prompt_id=PROMPT,
        reason="after cancel",
        provider_job_id=provider_job_id,
    )


async def test_stop_cancels_a_running_job_and_waits_for_its_worker() -> None:
    store = MemoryStore()
    claim = Claim(
        submission=PROMPT,
        job_id=JOB_ID,
        prompt_id=PROMPT,
        holder=RUNPOD_JOB,
        lease_until=datetime.now(UTC) + timedelta(minutes=1),
        renewed_at=datetime.now(UTC),
    )
    key = claim_key(S3Target(bucket=BUCKET), JOB_ID, PROMPT)
    store.put(key, claim.model_dump_json().encode())
    cancelled = {"id": RUNPOD_JOB, "status": "CANCELLED", "executionTime": 3000}
    runpod = ScriptedRunPod(statuses=[{"id": RUNPOD_JOB, "status": "IN_PROGRESS"}, cancelled])
    first = await env([]).run(backend(runpod, store).stop, stop_input())
    assert ("POST", "cancel") in runpod.requests
    assert (first.position, first.action) == ("running", "interrupt_sent"), "its GPU is not free"

    now = datetime.now(UTC)
    stop = StopRecord(
        prompt="interrupted",
        started_at=now - timedelta(seconds=4),
        at=now,
        node="3",
        node_type="KSampler",
        worker_id="w1",
    )
    finished = claim.model_copy(
        update={"outcome": ClaimOutcome(state="cancelled", at=now, stop=stop)}
    )
    store.put(key, finished.model_dump_json().encode())
    runpod = ScriptedRunPod(statuses=[cancelled])
    second = await env([]).run(backend(runpod, store).stop, stop_input())
    assert (second.position, second.ended, second.confirmed) == ("gone", "interrupted", True)
    assert (second.node, second.node_type) == ("3", "KSampler")
    assert ("POST", "cancel") not in runpod.requests, "an ended job is not cancelled again"
    assert second.cost is not None and second.cost.execution_s == 3.0
    # The worker billed while the handler stopped the prompt after RunPod's cancel.
    assert second.cost.billed_after_end_s == pytest.approx(5.0 + 4.0)
    assert not second.cost.lower_bound


async def test_stop_without_a_known_job_reports_nothing_on_the_backend() -> None:
    runpod = ScriptedRunPod(statuses=[{"id": RUNPOD_JOB, "status": "IN_QUEUE"}])
    check = await env([]).run(backend(runpod, MemoryStore()).stop, stop_input(None))
    assert (check.position, check.ended) == ("gone", "unknown")
    assert runpod.requests == []


# -- a dead claim holder, re-deliveries, a ttl before the first poll -----------------------------


def put_claim(store: MemoryStore, *, lease_left_s: float, holder: str = HOLDER) -> Claim:
    """A claim without an outcome whose lease ends `lease_left_s` from now (negative: ended)."""
    now = datetime.now(UTC)
    claim = Claim(
        submission=PROMPT,
        job_id=JOB_ID,
        prompt_id=PROMPT,
        holder=holder,
        lease_until=now + timedelta(seconds=lease_left_s),
        renewed_at=now + timedelta(seconds=lease_left_s - 60),
    )
    key = claim_key(S3Target(bucket=BUCKET), JOB_ID, PROMPT)
    store.put(key, claim.model_dump_json().encode())
    # Written when it was last renewed, by the S3 server's clock (what its age is judged by).
    store.modified[(BUCKET, key)] = claim.renewed_at
    return claim


def write_claim(store: MemoryStore, claim: Claim) -> None:
    """`claim` as the holder last wrote it, at its `renewed_at` by the S3 server's clock."""
    key = claim_key(S3Target(bucket=BUCKET), JOB_ID, PROMPT)
    store.put(key, claim.model_dump_json().encode())
    store.modified[(BUCKET, key)] = claim.renewed_at


def holder_ended(status: str = "TIMED_OUT") -> dict[str, Any]:
    """The dead holder's RunPod job, as `/status` tells it: read once for what it billed."""
    return {"id": HOLDER, "status": status, "workerId": "w0", "executionTime": 9000}


async def test_a_claim_left_by_a_dead_holder_is_submitted_again_not_followed() -> None:
    """A resubmission after a worker crash finds the crashed holder's claim, lease run out and
    no outcome: following that job would find it dead again (and ask a person); the submission
    goes out once more and the new delivery takes the claim over."""
    store = MemoryStore()
    store.put(OUR_KEY, PNG)
    put_claim(store, lease_left_s=-30)
    runpod = ScriptedRunPod(statuses=[holder_ended(), completed([record(OUR_KEY)])])
    result = await env([]).run(backend(runpod, store, fence_after_s=1).follow, follow_input())
    # The dead holder's job is read once, for what it billed, then the submission goes out.
    assert runpod.requests[:2] == [("GET", "status"), ("POST", "run")]
    assert result.checkpoint.provider_job_id == RUNPOD_JOB
    [dead] = result.other_costs
    assert (dead.provider_job_id, dead.outcome, dead.execution_s) == (HOLDER, "fenced", 9.0)


async def test_a_delivery_refused_for_a_dead_holders_claim_is_sent_again() -> None:
    """The handler judges a lease by the S3 server's whole seconds and may refuse a takeover
    the orchestrator thought due (`claimed_elsewhere`, naming the dead holder): the attempt
    submits again instead of following the dead job."""
    store = MemoryStore()
    store.put(OUR_KEY, PNG)
    put_claim(store, lease_left_s=-30)
    elsewhere = {
        "id": RUNPOD_JOB,
        "status": "COMPLETED",
        "output": {"status": "claimed_elsewhere", "claim_holder": HOLDER, "submission": PROMPT},
    }
    runpod = ScriptedRunPod(statuses=[holder_ended(), elsewhere, completed([record(OUR_KEY)])])
    result = await env([]).run(backend(runpod, store, fence_after_s=1).follow, follow_input())
    assert [r for r in runpod.requests if r[1] == "run"] == [("POST", "run")] * 2
    assert result.checkpoint.provider_job_id == RUNPOD_JOB


async def test_a_live_holder_is_still_followed_after_a_refused_delivery() -> None:
    store = MemoryStore()
    store.put(OUR_KEY, PNG)
    elsewhere = {
        "id": RUNPOD_JOB,
        "status": "COMPLETED",
        "output": {"status": "claimed_elsewhere", "claim_holder": HOLDER, "submission": PROMPT},
    }

    def claimed_meanwhile() -> httpx.Response:
        # Another delivery (whose /run answer was lost) claims it while ours is sent.
        put_claim(store, lease_left_s=30)
        return httpx.Response(200, json={"id": RUNPOD_JOB, "status": "IN_QUEUE"})

    runpod = ScriptedRunPod(
        statuses=[elsewhere, completed([record(OUR_KEY)], job=HOLDER)],
        run_answer=claimed_meanwhile,
    )
    result = await env([]).run(backend(runpod, store).follow, follow_input())
    assert [r for r in runpod.requests if r[1] == "run"] == [("POST", "run")]
    assert result.checkpoint.provider_job_id == HOLDER


async def test_a_crashed_holder_is_resubmitted_only_once_it_is_fenced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its lease ran out, and the pool's `fence_after_s` past it (by the S3 server's clock,
    a second of resolution and the takeover margin more): only then may another delivery run
    the submission, since a silent holder's prompt may run on until its watchdog fences it."""
    from activities.runpod import follow as runpod_follow

    monkeypatch.setattr(runpod_follow, "TAKEOVER_MARGIN_S", 0.3)
    store = MemoryStore()
    put_claim(store, lease_left_s=0.2, holder=RUNPOD_JOB)
    crashed = {
        "id": RUNPOD_JOB,
        "status": "TIMED_OUT",
        "workerId": "w1",
        "executionTime": 4000,
    }
    runpod = ScriptedRunPod(statuses=[crashed])
    known = Checkpoint(job_id=JOB_ID, prompt_id=PROMPT, provider_job_id=RUNPOD_JOB)
    began = datetime.now(UTC)
    with pytest.raises(ApplicationError) as lost:
        follow = backend(runpod, store, fence_after_s=1).follow
        await env([]).run(follow, follow_input(checkpoint=known))
    assert lost.value.type == ErrorType.PROMPT_LOST, "submitted again by the workflow"
    # With claims it cannot run twice: the workflow resubmits without asking a person.
    assert resubmit_cannot_run_twice(lost.value)
    assert (datetime.now(UTC) - began).total_seconds() >= 0.2 + 1 + 1 + 0.3 - 0.05
    # The crashed job was paid for: its cost goes to the workflow with the failure.
    details = lost.value.details[0]
    assert details["cost"]["provider_job_id"] == RUNPOD_JOB
    assert details["cost"]["execution_s"] == 4.0
    assert details["cost"]["outcome"] == "crashed"


async def test_a_redelivered_jobs_progress_is_read_from_its_new_workers_first_update() -> None:
    """Each delivery numbers its updates from 0: after a re-delivery to another worker, its
    updates are not ignored for being below the dead worker's."""
    store = MemoryStore()
    store.put(OUR_KEY, PNG)

    def running(worker: str, step: int, seq: int) -> dict[str, Any]:
        return {
            "id": RUNPOD_JOB,
            "status": "IN_PROGRESS",
            "workerId": worker,
            "output": progress(step, seq),
        }

    runpod = ScriptedRunPod(
        statuses=[
            running("w1", 7, 12),
            {"id": RUNPOD_JOB, "status": "IN_QUEUE"},
            running("w2", 2, 1),
            completed([record(OUR_KEY)]),
        ]
    )
    heartbeats: list[Any] = []
    known = Checkpoint(job_id=JOB_ID, prompt_id=PROMPT, provider_job_id=RUNPOD_JOB)
    await env(heartbeats).run(backend(runpod, store).follow, follow_input(checkpoint=known))
    steps = [FollowHeartbeat.model_validate(h).checkpoint.step for h in heartbeats]
    assert 7 in steps and steps.index(2, steps.index(7)) > steps.index(7), steps


async def test_a_job_whose_ttl_ends_before_the_first_poll_expired_in_the_queue() -> None:
    """`/run` answered IN_QUEUE: a 404 at the first poll is the ttl running out in the queue
    (QueueTimeout), not a job RunPod lost (which would be submitted again)."""
    store = MemoryStore()

    class Gone(ScriptedRunPod):
        def handle(self, request: httpx.Request) -> httpx.Response:
            if "/status/" in request.url.path:
                self.requests.append(("GET", "status"))
                return httpx.Response(404, json={"error": "job not found"})
            return super().handle(request)

    runpod = Gone()
    with pytest.raises(ApplicationError) as expired:
        await env([]).run(backend(runpod, store).follow, follow_input())
    assert expired.value.type == ErrorType.QUEUE_TIMEOUT


async def test_an_attempt_heartbeats_while_a_runpod_call_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client may wait out a 429 burst for longer than the heartbeat timeout: the attempt
    keeps heartbeating meanwhile, or Temporal would start its replacement beside it (which, on
    the 429 burst of tests/stack/test_runpod_e2e.py, sent a second /run for the same submission)."""
    from activities.runpod import follow as runpod_follow

    monkeypatch.setattr(runpod_follow, "KEEPALIVE_S", 0.05)
    store = MemoryStore()
    store.put(OUR_KEY, PNG)
    runpod = ScriptedRunPod(statuses=[completed([record(OUR_KEY)])])

    async def slow_run(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/run"):
            await asyncio.sleep(0.5)
        return runpod.handle(request)

    heartbeats: list[Any] = []
    await env(heartbeats).run(
        backend(runpod, store, transport=httpx.MockTransport(slow_run)).follow, follow_input()
    )
    points = [FollowHeartbeat.model_validate(h).checkpoint for h in heartbeats]
    waiting = [p for p in points if p.submit_sent_at is not None and p.provider_job_id is None]
    assert len(waiting) >= 4, "heartbeats while /run was waiting for its answer"


async def test_a_delivery_that_dies_before_it_claims_is_cancelled_and_sent_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker killed while its handler was still reading the claim (through an S3 outage,
    say) leaves no claim and no lease: its silence is the sign (found by `make soak`, where
    such a job stayed IN_PROGRESS until its execution timeout). A handler that keeps
    reporting "claiming" is alive, however long its claim takes."""
    monkeypatch.setattr("activities.runpod.follow.CLAIM_LEASE_S", 0.0)
    monkeypatch.setattr("activities.runpod.follow.TAKEOVER_MARGIN_S", 0.3)
    store = MemoryStore()
    silent = {"id": RUNPOD_JOB, "status": "IN_PROGRESS", "workerId": "w-1"}
    runpod = ScriptedRunPod(statuses=[silent])
    known = Checkpoint(job_id=JOB_ID, prompt_id=PROMPT, provider_job_id=RUNPOD_JOB)
    with pytest.raises(ApplicationError) as lost:
        # Bounded: without the check the attempt would poll the dead job for ever.
        await asyncio.wait_for(
            env([]).run(backend(runpod, store).follow, follow_input(checkpoint=known)), 10
        )
    assert lost.value.type == ErrorType.PROMPT_LOST, lost.value
    assert "neither claimed" in lost.value.message and "w-1" in lost.value.message
    assert ("POST", "cancel") in runpod.requests

    claiming = [
        {**silent, "output": {**progress(0, seq), "stage": "claiming"}} for seq in range(1, 40)
    ]
    store.put(OUR_KEY, PNG)
    runpod = ScriptedRunPod(statuses=[*claiming, completed([record(OUR_KEY)])])
    result = await env([]).run(backend(runpod, store).follow, follow_input(checkpoint=known))
    assert ("POST", "cancel") not in runpod.requests and result.artifacts


async def test_a_job_left_in_progress_by_a_dead_worker_is_cancelled_and_sent_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RunPod may keep a dead worker's job IN_PROGRESS until its execution timeout; the claim's
    lease, no longer renewed, says nobody runs it."""
    monkeypatch.setattr("activities.runpod.follow.CLAIM_LEASE_S", 0.0)
    store = MemoryStore()
    stale = Claim(
        submission=PROMPT,
        job_id=JOB_ID,
        prompt_id=PROMPT,
        holder=RUNPOD_JOB,
        lease_until=datetime.now(UTC) - timedelta(minutes=1),
        renewed_at=datetime.now(UTC) - timedelta(minutes=2),
    )
    write_claim(store, stale)
    runpod = ScriptedRunPod(statuses=[{"id": RUNPOD_JOB, "status": "IN_PROGRESS"}])
    known = Checkpoint(job_id=JOB_ID, prompt_id=PROMPT, provider_job_id=RUNPOD_JOB)
    with pytest.raises(ApplicationError) as lost:
        await env([]).run(backend(runpod, store).follow, follow_input(checkpoint=known))
    assert lost.value.type == ErrorType.PROMPT_LOST and lost.value.non_retryable
    assert resubmit_cannot_run_twice(lost.value)
    assert "stopped renewing the claim" in lost.value.message
    assert ("POST", "cancel") in runpod.requests, "the dead job stops costing its time"
    cost = lost.value.details[0]["cost"]
    assert cost["outcome"] == "fenced" and cost["lower_bound"], "not final when given up"

    # A holder still renewing is left alone.
    live = stale.model_copy(
        update={
            "lease_until": datetime.now(UTC) + timedelta(minutes=1),
            "renewed_at": datetime.now(UTC),
        }
    )
    write_claim(store, live)
    runpod = ScriptedRunPod(
        statuses=[{"id": RUNPOD_JOB, "status": "IN_PROGRESS"}, completed([record(OUR_KEY)])]
    )
    store.put(OUR_KEY, PNG)
    result = await env([]).run(backend(runpod, store).follow, follow_input(checkpoint=known))
    assert ("POST", "cancel") not in runpod.requests and result.artifacts


def silent_holder(seconds_lapsed: float, **fields: Any) -> Claim:
    """Our RunPod job's claim, no longer renewed: its 60 s lease ran out that long ago."""
    now = datetime.now(UTC)
    return Claim(
        submission=PROMPT,
        job_id=JOB_ID,
        prompt_id=PROMPT,
        holder=RUNPOD_JOB,
        worker_id="w1",
        lease_until=now - timedelta(seconds=seconds_lapsed),
        renewed_at=now - timedelta(seconds=seconds_lapsed + 60),
        **fields,
    )


IN_PROGRESS = {"id": RUNPOD_JOB, "status": "IN_PROGRESS", "workerId": "w1", "executionTime": 7000}
KNOWN = Checkpoint(job_id=JOB_ID, prompt_id=PROMPT, provider_job_id=RUNPOD_JOB)


async def test_a_silent_holder_is_left_running_until_it_is_fenced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its lease ran out, but not yet by `fence_after_s`: its prompt may still run (a frozen
    handler, a worker cut off from S3), so it is neither cancelled nor run again; when it
    answers after all, its result is the job's."""
    monkeypatch.setattr("activities.runpod.follow.CLAIM_LEASE_S", 0.0)
    store = MemoryStore()
    store.put(OUR_KEY, PNG)
    write_claim(store, silent_holder(5))
    runpod = ScriptedRunPod(statuses=[IN_PROGRESS] * 5 + [completed([record(OUR_KEY)])])
    follow = backend(runpod, store, fence_after_s=600).follow
    result = await env([]).run(follow, follow_input(checkpoint=KNOWN))
    assert ("POST", "cancel") not in runpod.requests and ("POST", "run") not in runpod.requests
    assert result.artifacts and result.cost is not None and result.cost.outcome == "completed"


async def test_a_holder_that_recorded_its_fence_is_given_up_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("activities.runpod.follow.CLAIM_LEASE_S", 0.0)
    store = MemoryStore()
    fence = FenceRecord(action="interrupted", at=datetime.now(UTC), worker_id="w1")
    write_claim(store, silent_holder(0.5, fenced=fence))
    runpod = ScriptedRunPod(statuses=[IN_PROGRESS])
    with pytest.raises(ApplicationError) as lost:
        follow = backend(runpod, store, fence_after_s=600).follow
        await env([]).run(follow, follow_input(checkpoint=KNOWN))
    assert lost.value.type == ErrorType.PROMPT_LOST and resubmit_cannot_run_twice(lost.value)
    assert ("POST", "cancel") in runpod.requests
    assert lost.value.details[0]["cost"]["outcome"] == "fenced"


def done_claim(*keys: str, stored: int | None = None) -> Claim:
    """A silent holder's claim whose prompt succeeded with an output per key, the first
    `stored` of them (all by default) stored."""
    outputs = [
        OutputFile(node_id=str(n), filename=f"t_{n}.png", subfolder="dc_run")
        for n in range(len(keys))
    ]
    records = [
        ArtifactRecord.model_validate(
            record(key) | {"node_id": str(n), "filename": f"t_{n}.png", "subfolder": "dc_run"}
        )
        for n, key in enumerate(keys)
    ]
    end = PromptEnd(outcome="success", at=datetime.now(UTC), outputs=outputs)
    kept = records if stored is None else records[:stored]
    return silent_holder(90, prompt_end=end, stored=kept)


async def test_a_fenced_holder_whose_work_was_done_completes_the_job_without_a_rerun(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its prompt succeeded and every output is in the bucket (the claim says so, the bucket
    confirms size and sha256): the GPU does not run the graph again."""
    monkeypatch.setattr("activities.runpod.follow.CLAIM_LEASE_S", 0.0)
    store = MemoryStore()
    keys = [f"jobs/{JOB_ID}/0/{n}/t_{n}.png" for n in range(2)]
    for key in keys:
        store.put(key, PNG)
    write_claim(store, done_claim(*keys))
    runpod = ScriptedRunPod(statuses=[IN_PROGRESS])
    follow = backend(runpod, store, fence_after_s=1).follow
    result = await env([]).run(follow, follow_input(checkpoint=KNOWN))
    assert ("POST", "run") not in runpod.requests, "nothing submitted again"
    assert sorted(a.key for a in result.artifacts) == keys
    assert result.cost is not None and result.cost.provider_job_id == RUNPOD_JOB
    assert result.cost.outcome == "fenced"


async def test_a_fenced_holder_with_an_output_missing_is_submitted_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("activities.runpod.follow.CLAIM_LEASE_S", 0.0)
    store = MemoryStore()
    keys = [f"jobs/{JOB_ID}/0/{n}/t_{n}.png" for n in range(2)]
    store.put(keys[0], PNG)
    write_claim(store, done_claim(*keys, stored=1))
    runpod = ScriptedRunPod(statuses=[IN_PROGRESS])
    with pytest.raises(ApplicationError) as lost:
        follow = backend(runpod, store, fence_after_s=1).follow
        await env([]).run(follow, follow_input(checkpoint=KNOWN))
    assert lost.value.type == ErrorType.PROMPT_LOST, "the new delivery runs what is missing"


async def test_an_output_stored_but_not_yet_recorded_in_the_claim_is_found_at_its_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The holder stored its second output and was lost before its claim said so: the object
    at the output's key (whole, with the sha256 our upload writes) completes the job."""
    monkeypatch.setattr("activities.runpod.follow.CLAIM_LEASE_S", 0.0)
    store = MemoryStore()
    keys = [f"jobs/{JOB_ID}/0/{n}/t_{n}.png" for n in range(2)]
    for key in keys:
        store.put(key, PNG)
    write_claim(store, done_claim(*keys, stored=1))
    runpod = ScriptedRunPod(statuses=[IN_PROGRESS])
    follow = backend(runpod, store, fence_after_s=1).follow
    result = await env([]).run(follow, follow_input(checkpoint=KNOWN))
    assert ("POST", "run") not in runpod.requests, "nothing submitted again"
    assert sorted(a.key for a in result.artifacts) == keys
    assert {a.node_id for a in result.artifacts} == {"0", "1"}


async def test_a_worker_lost_after_it_recorded_its_outcome_completes_the_job() -> None:
    """RunPod times the job out (the worker is gone), but the claim says the run completed
    and names its outputs: they are the result, nothing is submitted again."""
    store = MemoryStore()
    store.put(OUR_KEY, PNG)
    outcome = ClaimOutcome(
        state="completed",
        images=[ArtifactRecord.model_validate(record(OUR_KEY))],
        at=datetime.now(UTC),
    )
    write_claim(store, silent_holder(0, outcome=outcome))
    lost = {"id": RUNPOD_JOB, "status": "TIMED_OUT", "workerId": "w1", "executionTime": 6000}
    runpod = ScriptedRunPod(statuses=[lost])
    result = await env([]).run(backend(runpod, store).follow, follow_input(checkpoint=KNOWN))
    assert [a.key for a in result.artifacts] == [OUR_KEY]
    assert ("POST", "run") not in runpod.requests
    assert result.cost is not None and result.cost.outcome == "completed"


async def test_a_worker_lost_between_recording_its_outcome_and_returning_it_completes_the_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RunPod keeps the job IN_PROGRESS (the `stuck` crash), but the claim recorded the run
    completed longer ago than a lease and `fence_after_s`: the claim's records are the result,
    the RunPod job is cancelled and costed, nothing is submitted again."""
    monkeypatch.setattr("activities.runpod.follow.CLAIM_LEASE_S", 0.0)
    store = MemoryStore()
    store.put(OUR_KEY, PNG)
    images = [ArtifactRecord.model_validate(record(OUR_KEY))]
    outcome = ClaimOutcome(state="completed", images=images, at=datetime.now(UTC))
    write_claim(store, silent_holder(30, outcome=outcome))
    runpod = ScriptedRunPod(statuses=[IN_PROGRESS])
    follow = backend(runpod, store, fence_after_s=1).follow
    result = await asyncio.wait_for(env([]).run(follow, follow_input(checkpoint=KNOWN)), 30)
    assert [a.key for a in result.artifacts] == [OUR_KEY]
    assert ("POST", "run") not in runpod.requests and ("POST", "cancel") in runpod.requests
    assert result.cost is not None and result.cost.provider_job_id == RUNPOD_JOB
    assert result.cost.outcome == "completed"


async def test_a_just_recorded_outcome_is_left_to_the_handlers_own_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The outcome was written a moment ago: the handler's answer is on its way, so the job is
    neither cancelled nor given up."""
    monkeypatch.setattr("activities.runpod.follow.CLAIM_LEASE_S", 0.0)
    store = MemoryStore()
    store.put(OUR_KEY, PNG)
    images = [ArtifactRecord.model_validate(record(OUR_KEY))]
    claim = silent_holder(
        -60, outcome=ClaimOutcome(state="completed", images=images, at=datetime.now(UTC))
    )
    write_claim(store, claim)
    runpod = ScriptedRunPod(statuses=[IN_PROGRESS] * 3 + [completed([record(OUR_KEY)])])
    follow = backend(runpod, store, fence_after_s=1).follow
    result = await asyncio.wait_for(env([]).run(follow, follow_input(checkpoint=KNOWN)), 30)
    assert ("POST", "cancel") not in runpod.requests
    assert result.cost is not None and result.cost.outcome == "completed"


async def test_a_delivery_whose_run_answer_was_lost_is_in_the_cost_by_its_marker() -> None:
    """A `/run` whose answer was lost made a RunPod job the follow never heard of; it found the
    claim held and ended, billing a little. Its marker in the deliveries folder puts it in the
    cost beside the job that ran the graph."""
    store = MemoryStore()
    store.put(OUR_KEY, PNG)
    target = S3Target(bucket=BUCKET)
    for job_id in (RUNPOD_JOB, "lost-answer-job"):
        store.put(delivery_key(target, JOB_ID, PROMPT, job_id), b"")
    unseen = {
        "id": "lost-answer-job",
        "status": "COMPLETED",
        "workerId": "w2",
        "executionTime": 300,
    }
    runpod = ScriptedRunPod(statuses=[completed([record(OUR_KEY)]), unseen])
    result = await env([]).run(backend(runpod, store).follow, follow_input(checkpoint=KNOWN))
    [other] = result.other_costs
    assert other.provider_job_id == "lost-answer-job" and other.outcome == "ran_nothing"
    assert other.execution_s == pytest.approx(0.3)
    assert ("POST", "cancel") not in runpod.requests, "an ended job is only read"


# -- input files ----------------------------------------------------------------------------------

LOAD_GRAPH = {
    "1": {"class_type": "LoadImage", "inputs": {"image": "big.png"}},
    "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "t"}},
}


async def prepared_with(
    store: MemoryStore, runpod: ScriptedRunPod, *, claims: bool, size: int
) -> PreparedJob:
    """Prepare a job whose LoadImage reads a `size`-byte file the client put in S3."""
    store.put("uploads/big.png", b"\x89PNG" + bytes(size - 4))
    req = PrepareInput(
        job_id=JOB_ID,
        pool="cloud",
        graph=LOAD_GRAPH,
        inputs={"big.png": S3Input(uri=f"s3://{BUCKET}/uploads/big.png")},
    )
    return await ActivityEnvironment().run(
        backend(runpod, store, claims=claims).prepare, req, "cloud"
    )


async def test_inputs_past_the_run_limit_travel_by_reference_to_our_handler() -> None:
    """12 MB of input is more than `/run` takes: it is staged in the job's folder and the
    submission names it with its size and sha256, for the handler to fetch and check."""
    store, runpod = MemoryStore(), ScriptedRunPod(statuses=[completed([record(OUR_KEY)])])
    store.put(OUR_KEY, PNG)
    size = 12 * 1000 * 1000
    prepared = await prepared_with(store, runpod, claims=True, size=size)
    key = f"jobs/{JOB_ID}/_inputs/big.png"
    assert prepared.staged_inputs == {"big.png": key}
    assert store.objects[(BUCKET, key)][0] == store.objects[(BUCKET, "uploads/big.png")][0]
    req = follow_input().model_copy(
        update={"graph": LOAD_GRAPH, "staged_inputs": prepared.staged_inputs}
    )
    await env([]).run(backend(runpod, store).follow, req)
    [body] = runpod.bodies
    assert len(json.dumps(body)) < 100_000, "the file itself did not travel"
    assert body["input"]["images"] == []
    [ref] = body["input"]["durable_comfy"]["inputs"]
    data = store.objects[(BUCKET, key)][0]
    assert ref == {
        "name": "big.png",
        "key": key,
        "size": size,
        "sha256": hashlib.sha256(data).hexdigest(),
    }


async def test_a_stock_endpoint_gets_input_files_inline_within_the_run_limit() -> None:
    store, runpod = MemoryStore(), ScriptedRunPod(statuses=[completed([record(OUR_KEY)])])
    store.put(OUR_KEY, PNG)
    prepared = await prepared_with(store, runpod, claims=False, size=1000)
    req = follow_input().model_copy(
        update={"graph": LOAD_GRAPH, "staged_inputs": prepared.staged_inputs}
    )
    await env([]).run(backend(runpod, store, claims=False).follow, req)
    [body] = runpod.bodies
    [image] = body["input"]["images"]
    assert image["name"] == "big.png"
    assert base64.b64decode(image["image"]) == store.objects[(BUCKET, "uploads/big.png")][0]
    assert body["input"]["durable_comfy"]["inputs"] == []


async def test_a_stock_endpoint_refuses_inputs_too_large_for_the_run_body_before_submitting() -> (
    None
):
    store, runpod = MemoryStore(), ScriptedRunPod()
    with pytest.raises(ApplicationError) as caught:
        await prepared_with(store, runpod, claims=False, size=MAX_RUN_BYTES)
    assert caught.value.type == ErrorType.INVALID_REQUEST and caught.value.non_retryable
    assert "claims: true" in caught.value.message and "10 MB" in caught.value.message
    assert runpod.requests == []


async def test_a_staged_input_gone_before_the_submission_is_a_missing_input() -> None:
    store, runpod = MemoryStore(), ScriptedRunPod()
    req = follow_input().model_copy(
        update={"graph": LOAD_GRAPH, "staged_inputs": {"big.png": f"jobs/{JOB_ID}/_inputs/x"}}
    )
    with pytest.raises(ApplicationError) as caught:
        await env([]).run(backend(runpod, store).follow, req)
    assert caught.value.type == ErrorType.MISSING_INPUT
    assert runpod.requests == []


class RecordingStore(MemoryStore):
    """The in-memory bucket, keeping every call as (operation, bucket, key)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, str]] = []

    async def read_bytes(self, key: str, *, limit: int, bucket: str | None = None) -> bytes:
        self.calls.append(("read", bucket or BUCKET, key))
        return await super().read_bytes(key, limit=limit, bucket=bucket)

    async def head(self, key: str, *, bucket: str | None = None) -> StoredObject | None:
        self.calls.append(("head", bucket or BUCKET, key))
        return await super().head(key, bucket=bucket)

    async def upload_stream(
        self,
        key: str,
        chunks: AsyncIterable[bytes],
        *,
        content_type: str,
        bucket: str | None = None,
        metadata: Any = None,
    ) -> StoredObject:
        self.calls.append(("upload", bucket or BUCKET, key))
        return await super().upload_stream(key, chunks, content_type=content_type, bucket=bucket)


async def test_after_a_failure_only_the_claims_records_inside_the_jobs_folder_are_looked_at() -> (
    None
):
    """The claim's records come from a worker: one naming another job's folder, or a key our
    handler could not have built, is neither kept nor even asked about (no HEAD)."""
    store = RecordingStore()
    hostile = [f"jobs/{JOB_ID}/../other-job/0/1/x.png", "jobs/other-job/0/1/x.png"]
    for key in [OUR_KEY, *hostile]:
        store.put(key, PNG)
    claim = put_claim(store, lease_left_s=-30)
    outcome = ClaimOutcome(
        state="failed",
        images=[ArtifactRecord.model_validate(record(k)) for k in [OUR_KEY, *hostile]],
        at=datetime.now(UTC),
    )
    store.put(
        claim_key(S3Target(bucket=BUCKET), JOB_ID, PROMPT),
        claim.model_copy(update={"outcome": outcome}).model_dump_json().encode(),
    )
    req = OffloadInput(
        job_id=JOB_ID,
        pool="cloud",
        prompt_id=PROMPT,
        run_tag="t",
        output=OutputSpec(),
        partial=True,
    )
    result = await env([]).run(backend(ScriptedRunPod(statuses=[]), store).offload, req)
    assert [a.key for a in result.artifacts] == [OUR_KEY]
    assert [key for op, _bucket, key in store.calls if op == "head"] == [OUR_KEY]


class RecordedLive(LiveProgress):
    """Live progress with one subscriber that reads every beat as it is announced."""

    def __init__(self) -> None:
        super().__init__("ws://10.0.0.5:7441/v1/live")
        self.steps: list[int] = []

    def moved(self, job_id: str) -> None:
        build = self._builders.get(job_id)
        if build is not None:
            self.steps.append(build().checkpoint.step)


async def test_a_pushing_worker_pushes_each_polled_step_and_names_its_address() -> None:
    store = MemoryStore()
    store.put(OUR_KEY, PNG)
    runpod = ScriptedRunPod(
        statuses=[
            {"id": RUNPOD_JOB, "status": "IN_PROGRESS", "output": progress(4, 1)},
            {"id": RUNPOD_JOB, "status": "IN_PROGRESS", "output": progress(7, 2)},
            completed([record(OUR_KEY)]),
        ]
    )
    live = RecordedLive()
    pushing = backend(runpod, store)
    pushing._live = live
    heartbeats: list[Any] = []
    await env(heartbeats).run(pushing.follow, follow_input())
    assert {4, 7} <= set(live.steps), live.steps
    assert {FollowHeartbeat.model_validate(h).live for h in heartbeats} == {live.url}
    assert live._builders == {}, "an attempt that ended is no longer followed"
