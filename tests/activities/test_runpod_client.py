"""The RunPod client and the outcome reader, against scripted answers (httpx.MockTransport).

Every status sequence the client must read, the error translation at the client's edge
(auth, 404, 429 with Retry-After, 5xx, transport errors, 413 and the 10 MB limit, an ambiguous
`/run`), the client's own bounded and really jittered waits, and the API key kept out of every
log line, repr and message. No server, no real sleeping: the waits go to a recording fake.
"""

from __future__ import annotations

import base64
import json
import random
import re
import statistics
from collections.abc import AsyncIterator, Callable, Iterator, MutableMapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
import structlog
from pydantic import SecretStr
from structlog.testing import capture_logs

import activities.runpod.client as client_module
from activities.runpod.artifacts import artifact_source, inline_bytes, s3_location
from activities.runpod.client import MAX_RUN_BYTES, RunPodClient, run_body
from activities.runpod.failures import from_failure, from_runpod
from activities.runpod.models import RunPodJob, RunPodState, RunPolicy
from activities.runpod.outcome import (
    ClaimedElsewhere,
    Failed,
    Queued,
    Running,
    Succeeded,
    read_gone,
    read_job,
)
from activities.runpod.retry import RetryPolicy, parse_retry_after
from configuration.pools import PoolConfig
from protocol.runpod.contract import (
    ArtifactRecord,
    EndpointInput,
    InputImage,
    Orchestration,
    ProgressUpdate,
    S3Target,
)
from workflows.errors import (
    RunPodAuthError,
    RunPodError,
    RunPodJobGone,
    RunPodPolicyError,
    RunPodRateLimited,
    RunPodRefused,
    RunPodRequestTooLarge,
    RunPodSubmissionAmbiguous,
    RunPodUnavailable,
    UnusableArtifact,
)
from workflows.shared import ErrorType

KEY = "rpa_K3Y_never_to_be_shown_0123456789abcdef"
ENDPOINT = "ep-test-1"
BASE = "https://api.runpod.test/v2"
JOB = "c80ffee4-f315-4e25-a146-0f3d98cf024b-u1"
OTHER_JOB = "0ddba11a-0000-4000-8000-000000000000-u1"
SUBMISSION = "job-1.seg-0.sub-0001"
SHA = "ab" * 32
GRAPH = {"9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0]}}}

Reply = httpx.Response | Callable[[httpx.Request], httpx.Response]


# --- a scripted RunPod ---------------------------------------------------------------------------


@dataclass
class FakeRunPod:
    """Answers per route (`"GET /status/ID"`), in order; the last one repeats."""

    script: dict[str, list[Reply]]
    requests: list[httpx.Request] = field(default_factory=list)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        route = f"{request.method} {request.url.path.removeprefix(f'/v2/{ENDPOINT}')}"
        replies = self.script.get(route)
        assert replies, f"unexpected request {route}"
        reply = replies.pop(0) if len(replies) > 1 else replies[0]
        return reply(request) if callable(reply) else reply

    def routes(self) -> list[str]:
        prefix = f"/v2/{ENDPOINT}"
        return [f"{r.method} {r.url.path.removeprefix(prefix)}" for r in self.requests]


@dataclass
class Harness:
    client: RunPodClient
    fake: FakeRunPod
    sleeps: list[float]


@asynccontextmanager
async def harness(
    script: dict[str, list[Reply]],
    *,
    rng: random.Random | None = None,
    retry: RetryPolicy | None = None,
    api_key_env: str = "RUNPOD_API_KEY",
) -> AsyncIterator[Harness]:
    fake = FakeRunPod(script)
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as http:
        client = RunPodClient(
            BASE,
            ENDPOINT,
            SecretStr(KEY),
            http,
            api_key_env=api_key_env,
            retry=retry,
            sleep=sleep,
            rng=rng or random.Random(7),
        )
        yield Harness(client, fake, sleeps)


def answer(status: str, job_id: str = JOB, **fields: Any) -> httpx.Response:
    return httpx.Response(200, json={"id": job_id, "status": status, **fields})


def raising(exc_type: type[httpx.TransportError], text: str = "boom") -> Reply:
    def reply(request: httpx.Request) -> httpx.Response:
        raise exc_type(text, request=request)

    return reply


def job_input(image_bytes: int = 0) -> EndpointInput:
    images = [InputImage(name="in.png", image="A" * image_bytes)] if image_bytes else []
    return EndpointInput(
        workflow=GRAPH,
        images=images,
        durable_comfy=Orchestration(
            job_id="job-1",
            submission=SUBMISSION,
            prompt_id="prompt-1",
            client_id="client-1",
            output=S3Target(bucket="artifacts"),
        ),
    )


POLICY = RunPolicy.for_job(execution_timeout_s=1800, queue_timeout_s=120)


def s3_record(**changes: Any) -> dict[str, Any]:
    record = {
        "filename": "out_00001_.png",
        "type": "s3_url",
        "data": "s3://artifacts/jobs/job-1/0/9/out_00001_.png",
        "bucket": "artifacts",
        "key": "jobs/job-1/0/9/out_00001_.png",
        "size": 1234,
        "sha256": SHA,
        "content_type": "image/png",
        "node_id": "9",
    }
    return {**record, **changes}


def progress(step: int, **changes: Any) -> dict[str, Any]:
    update = ProgressUpdate(
        submission=SUBMISSION,
        prompt_id="prompt-1",
        step=step,
        total_steps=20,
        node="3",
        at=datetime(2025, 1, 1, tzinfo=UTC),
    )
    return {**update.model_dump(mode="json"), **changes}


# --- submitting ----------------------------------------------------------------------------------


async def test_run_sends_input_and_policy_in_milliseconds_with_the_key_as_a_bearer() -> None:
    async with harness({"POST /run": [answer("IN_QUEUE")]}) as h:
        job = await h.client.run(job_input(), POLICY)
    assert (job.id, job.state) == (JOB, RunPodState.IN_QUEUE)
    [request] = h.fake.requests
    assert request.headers["Authorization"] == f"Bearer {KEY}"
    body = json.loads(request.content)
    assert body["policy"] == {"executionTimeout": 1_800_000, "ttl": 1_920_000}
    assert body["input"]["workflow"] == GRAPH
    assert body["input"]["durable_comfy"]["submission"] == SUBMISSION
    stock = run_body(EndpointInput(workflow=GRAPH), POLICY)
    assert "durable_comfy" not in json.loads(stock)["input"]


@pytest.mark.parametrize(
    ("execution_s", "queue_s", "expected"),
    [
        (1800, 120, (1_800_000, 1_920_000)),  # ttl counts from submission: queue + execution
        (5, 5, (5_000, 10_000)),  # both at their minimum
        (1800, None, (1_800_000, (24 * 3600 + 1800) * 1000)),  # RunPod's own 24 h wait
        (6 * 24 * 3600, None, (6 * 24 * 3600_000, 7 * 24 * 3600_000)),  # the default, shortened
        (0.0015 + 5, 10, (5_002, 15_002)),  # rounded up, never below what was asked
    ],
)
def test_the_policy_comes_from_the_jobs_timeouts(
    execution_s: float, queue_s: float | None, expected: tuple[int, int]
) -> None:
    policy = RunPolicy.for_job(execution_s, queue_s)
    assert (policy.execution_timeout_ms, policy.ttl_ms) == expected


@pytest.mark.parametrize(
    ("execution_s", "queue_s", "says"),
    [
        (4.9, 60, "execution timeout 4.9 s is outside"),
        (8 * 24 * 3600, None, "outside RunPod's range"),
        (5, 1, "= 6 s is outside"),
        (3600, 7 * 24 * 3600, "outside RunPod's range (10 s to 7 days)"),
    ],
)
def test_a_policy_outside_runpods_ranges_is_refused_before_sending(
    execution_s: float, queue_s: float | None, says: str
) -> None:
    with pytest.raises(RunPodPolicyError, match=re.escape(says)):
        RunPolicy.for_job(execution_s, queue_s)
    error = from_runpod(RunPodPolicyError("x"), "submitting")
    assert (error.type, error.non_retryable) == (ErrorType.INVALID_REQUEST, True)


async def test_a_body_over_10_mb_is_never_sent_and_one_at_the_limit_is() -> None:
    overhead = len(run_body(job_input(1), POLICY)) - 1
    async with harness({"POST /run": [answer("IN_QUEUE")]}) as h:
        with pytest.raises(RunPodRequestTooLarge) as caught:
            await h.client.run(job_input(MAX_RUN_BYTES - overhead + 1), POLICY)
        assert h.fake.requests == [], "nothing was sent"
        assert (caught.value.size, caught.value.limit) == (MAX_RUN_BYTES + 1, MAX_RUN_BYTES)
        assert caught.value.status_code is None
        assert "not sent" in str(caught.value) and "S3" in str(caught.value)
        await h.client.run(job_input(MAX_RUN_BYTES - overhead), POLICY)
        assert len(h.fake.requests[0].content) == MAX_RUN_BYTES
    error = from_runpod(caught.value, "submitting")
    assert (error.type, error.non_retryable) == (ErrorType.INVALID_REQUEST, True)


async def test_a_413_is_the_same_typed_error() -> None:
    async with harness({"POST /run": [httpx.Response(413, text="too big")]}) as h:
        with pytest.raises(RunPodRequestTooLarge) as caught:
            await h.client.run(job_input(), POLICY)
    assert caught.value.status_code == 413 and len(h.fake.requests) == 1


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        (raising(httpx.ReadTimeout), "ReadTimeout"),
        (raising(httpx.RemoteProtocolError, "closed without a response"), "RemoteProtocolError"),
        (raising(httpx.ReadError), "ReadError"),
        (raising(httpx.WriteError), "WriteError"),
        (httpx.Response(502, text="bad gateway"), "HTTP 502"),
        (httpx.Response(500, text="oops"), "HTTP 500"),
        (httpx.Response(200, text="<html>cloudflare</html>"), "unreadable body"),
        (httpx.Response(200, json={"status": "IN_QUEUE"}), "without a readable job id"),
    ],
)
async def test_a_lost_run_answer_is_ambiguous_and_never_retried(reply: Reply, why: str) -> None:
    async with harness({"POST /run": [reply, answer("IN_QUEUE")]}) as h:
        with pytest.raises(RunPodSubmissionAmbiguous) as caught:
            await h.client.run(job_input(), POLICY)
    assert len(h.fake.requests) == 1, "a /run that may have arrived is not sent again"
    assert h.sleeps == []
    assert why in str(caught.value) and "a job may exist" in str(caught.value)
    assert not isinstance(caught.value, RunPodUnavailable), "not caught by 'retry if unavailable'"
    error = from_runpod(caught.value, "submitting")
    assert (error.type, error.non_retryable) == (ErrorType.SUBMISSION_AMBIGUOUS, True)


@pytest.mark.parametrize(
    "refusal",
    [
        raising(httpx.ConnectError, "connection refused"),
        raising(httpx.ConnectTimeout),
        httpx.Response(429, headers={"Retry-After": "1"}),
    ],
)
async def test_a_refused_run_created_nothing_and_is_retried(refusal: Reply) -> None:
    async with harness({"POST /run": [refusal, refusal, answer("IN_QUEUE")]}) as h:
        job = await h.client.run(job_input(), POLICY)
    assert job.id == JOB and len(h.fake.requests) == 3 and len(h.sleeps) == 2


async def test_a_run_refused_for_good_is_typed_as_refused_not_ambiguous() -> None:
    async with harness({"POST /run": [raising(httpx.ConnectError, "refused")]}) as h:
        with pytest.raises(RunPodUnavailable) as down:
            await h.client.run(job_input(), POLICY)
    assert len(h.fake.requests) == RetryPolicy().attempts
    error = from_runpod(down.value, "submitting")
    assert (error.type, error.non_retryable) == (ErrorType.BACKEND_UNAVAILABLE, False)

    bad = httpx.Response(400, json={"error": "invalid policy"})
    async with harness({"POST /run": [bad]}) as h:
        with pytest.raises(RunPodRefused) as refused:
            await h.client.run(job_input(), POLICY)
    assert refused.value.status_code == 400 and "invalid policy" in str(refused.value)
    assert len(h.fake.requests) == 1
    error = from_runpod(refused.value, "submitting")
    assert (error.type, error.non_retryable) == (ErrorType.BACKEND_ERROR, True)


# --- following: every status sequence ----------------------------------------------------------


async def test_queued_then_running_with_progress_then_completed_with_s3_records() -> None:
    output = {"images": [s3_record()], "status": "success", "submission": SUBMISSION}
    script: dict[str, list[Reply]] = {
        f"GET /status/{JOB}": [
            answer("IN_QUEUE", delayTime=850),
            answer("IN_PROGRESS", workerId="w-1", output=progress(3, stage="running")),
            answer("IN_PROGRESS", workerId="w-1", output=progress(20, stage="uploading")),
            answer("COMPLETED", workerId="w-1", delayTime=850, executionTime=42_000, output=output),
        ]
    }
    async with harness(script) as h:
        seen = [
            read_job(await h.client.status(JOB), submission=SUBMISSION, policy=POLICY)
            for _ in range(4)
        ]
    queued, running, uploading, done = seen
    assert queued == Queued(JOB, 850)
    assert isinstance(running, Running) and running.worker_id == "w-1"
    assert running.progress is not None
    assert (running.progress.step, running.progress.total_steps) == (3, 20)
    assert isinstance(uploading, Running) and uploading.progress is not None
    assert uploading.progress.stage == "uploading"
    assert isinstance(done, Succeeded) and not done.stock
    assert (done.worker_id, done.delay_ms, done.execution_ms) == ("w-1", 850, 42_000)
    [record] = done.output.images
    assert artifact_source(record, verifiable=True) == "s3"
    assert s3_location(record) == ("artifacts", "jobs/job-1/0/9/out_00001_.png")
    assert (record.size, record.sha256) == (1234, SHA)


async def test_a_stock_worker_running_without_progress_then_base64_images() -> None:
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(64))
    images = [
        {
            "filename": "ComfyUI_00001_.png",
            "type": "base64",
            "data": base64.b64encode(png).decode(),
        },
        {
            "filename": "ComfyUI_00002_.png",
            "type": "base64",
            "data": "data:image/png;base64," + base64.b64encode(png).decode(),
        },
        {"filename": "c.png", "type": "s3_url", "data": "https://bucket.example/c.png?X-Sig=1"},
    ]
    script: dict[str, list[Reply]] = {
        f"GET /status/{JOB}": [
            answer("IN_PROGRESS", workerId="w-2"),  # stock: no progress at all
            answer("IN_PROGRESS", workerId="w-2", output={"some": "other handler's"}),
            answer("COMPLETED", workerId="w-2", output={"images": images, "status": "success"}),
        ]
    }
    async with harness(script) as h:
        seen = [read_job(await h.client.status(JOB)) for _ in range(3)]
    assert seen[0] == Running(JOB, "w-2", None) and seen[1] == Running(JOB, "w-2", None)
    done = seen[2]
    assert isinstance(done, Succeeded) and done.stock
    first, second, third = done.output.images
    assert [artifact_source(r, verifiable=False) for r in done.output.images] == [
        "inline",
        "inline",
        "url",
    ]
    assert inline_bytes(first) == png and inline_bytes(second) == png
    with pytest.raises(UnusableArtifact, match="not valid base64"):
        inline_bytes(ArtifactRecord(filename="x.png", type="base64", data="not*base64"))
    assert third.data.startswith("https://")


def test_progress_from_another_submission_or_unreadable_is_ignored() -> None:
    running = read_job(
        RunPodJob(id=JOB, status="IN_PROGRESS", output=progress(5)), submission="someone-else1"
    )
    assert running == Running(JOB, None, None)
    garbled = read_job(
        RunPodJob(id=JOB, status="IN_PROGRESS", output={"kind": "durable_comfy.progress"})
    )
    assert garbled == Running(JOB, None, None)


def test_success_without_images_is_the_workflows_to_judge() -> None:
    done = read_job(RunPodJob(id=JOB, status="COMPLETED", output={"status": "success_no_images"}))
    assert isinstance(done, Succeeded) and done.output.images == []


@pytest.mark.parametrize(
    ("output", "error_type", "says"),
    [
        (
            {"error": "Workflow validation failed", "details": ["node 3: bad seed"]},
            "PromptRejected",
            "node 3: bad seed",
        ),
        (
            {
                "error": "Job processing failed",
                "details": ["Workflow execution error: Node Type: KSampler, Node ID: 3"],
            },
            "ExecutionError",
            "Node Type: KSampler, Node ID: 3",
        ),
        ({"error": "CUDA oom", "error_type": "OutOfMemory"}, "OutOfMemory", "CUDA oom"),
        (
            {"images": [s3_record()], "errors": ["Failed to upload c.png"]},
            "OutputMissing",
            "1 error(s): Failed to upload c.png",
        ),
        (None, "OutputMissing", "without any output"),
        ({}, "OutputMissing", "without any output"),
        ("just a string", "BackendError", "not an object"),
        ({"images": [{"filename": "x"}]}, "BackendError", "unreadable output"),
        (
            {"images": [s3_record(sha256=None)], "submission": SUBMISSION},
            "OutputMissing",
            "cannot be verified",
        ),
        (
            {"images": [s3_record(data="ftp://x", bucket=None, key=None)]},
            "OutputMissing",
            "unrecognised reference",
        ),
        ({"images": [], "submission": "another-sub-1"}, "BackendError", "another-sub-1"),
    ],
)
async def test_completed_is_not_always_a_success(output: Any, error_type: str, says: str) -> None:
    fields = {} if output is None else {"output": output}
    script: dict[str, list[Reply]] = {
        f"GET /status/{JOB}": [answer("COMPLETED", workerId="w-3", **fields)]
    }
    async with harness(script) as h:
        outcome = read_job(await h.client.status(JOB), submission=SUBMISSION)
    assert isinstance(outcome, Failed), outcome
    assert (outcome.error_type, outcome.state, outcome.resubmit) == (error_type, "COMPLETED", False)
    assert says in outcome.message and JOB in outcome.message and "w-3" in outcome.message
    error = from_failure(outcome)
    assert (error.type, error.non_retryable) == (error_type, True)


async def test_claimed_elsewhere_is_followed_to_the_claim_holder() -> None:
    claimed = {"status": "claimed_elsewhere", "submission": SUBMISSION, "claim_holder": OTHER_JOB}
    done = {"images": [s3_record()], "status": "success", "submission": SUBMISSION}
    script: dict[str, list[Reply]] = {
        f"GET /status/{JOB}": [answer("COMPLETED", workerId="w-4", output=claimed)],
        f"GET /status/{OTHER_JOB}": [answer("COMPLETED", OTHER_JOB, output=done)],
    }
    async with harness(script) as h:
        outcome = read_job(await h.client.status(JOB), submission=SUBMISSION)
        assert outcome == ClaimedElsewhere(JOB, OTHER_JOB, SUBMISSION)
        assert isinstance(outcome, ClaimedElsewhere) and outcome.holder is not None
        followed = read_job(await h.client.status(outcome.holder), submission=SUBMISSION)
    assert isinstance(followed, Succeeded) and followed.job_id == OTHER_JOB
    # A holder that is no job id (untrusted output) or this job itself: read the claim instead.
    for holder in ("../../purge-queue", JOB, None):
        odd = read_job(
            RunPodJob(id=JOB, status="COMPLETED", output={**claimed, "claim_holder": holder})
        )
        assert odd == ClaimedElsewhere(JOB, None, SUBMISSION)


async def test_failed_carries_the_error_text_and_refresh_worker() -> None:
    sdk_error = json.dumps(
        {
            "error_type": "<class 'RuntimeError'>",
            "error_message": "something broke in the handler",
            "error_traceback": "Traceback (most recent call last): ...",
        }
    )
    fault = {
        "error_type": "BackendFault",
        "details": ["CUDA error: an illegal memory access was encountered"],
        "images": [s3_record()],
        "submission": SUBMISSION,
    }
    script: dict[str, list[Reply]] = {
        f"GET /status/{JOB}": [
            answer("FAILED", workerId="w-5", error=sdk_error),
            answer("FAILED", workerId="w-5", error="ComfyUI died", output=fault),
            answer("FAILED", error="torch.OutOfMemoryError: CUDA out of memory. Tried 2 GiB"),
            answer("FAILED", error="RuntimeError: an illegal memory access was encountered"),
            answer(
                "FAILED", error="ComfyUI never came up", output={"error_type": "BackendUnavailable"}
            ),
        ]
    }
    async with harness(script) as h:
        sdk, handler, oom, device, unavailable = [
            read_job(await h.client.status(JOB)) for _ in range(5)
        ]
    assert isinstance(sdk, Failed) and sdk.error_type == ErrorType.EXECUTION_ERROR
    assert "something broke in the handler" in sdk.message and "Traceback" not in sdk.message
    assert not sdk.refresh_worker and not sdk.resubmit

    assert isinstance(handler, Failed) and handler.error_type == ErrorType.BACKEND_FAULT
    assert handler.refresh_worker and not handler.resubmit
    assert "ComfyUI died" in handler.message and "illegal memory access" in handler.message
    assert [a.key for a in handler.artifacts] == [s3_record()["key"]], "stored outputs are kept"
    error = from_failure(handler)
    assert (error.type, error.non_retryable) == (ErrorType.BACKEND_FAULT, True)
    assert error.details[0]["refresh_worker"] is True and error.details[0]["worker_id"] == "w-5"

    assert isinstance(oom, Failed) and oom.error_type == ErrorType.OUT_OF_MEMORY
    assert isinstance(device, Failed) and device.error_type == ErrorType.BACKEND_FAULT
    assert device.refresh_worker
    # A worker's trouble, not the graph's: worth a fresh submission.
    assert isinstance(unavailable, Failed) and unavailable.resubmit
    assert from_failure(unavailable).type == ErrorType.PROMPT_LOST
    assert from_failure(unavailable).details[0]["cause_type"] == ErrorType.BACKEND_UNAVAILABLE


async def test_cancelled() -> None:
    script: dict[str, list[Reply]] = {
        f"GET /status/{JOB}": [answer("CANCELLED", workerId="w-6", executionTime=3000)]
    }
    async with harness(script) as h:
        outcome = read_job(await h.client.status(JOB))
    assert isinstance(outcome, Failed)
    assert (outcome.error_type, outcome.state) == (ErrorType.CANCELLED, "CANCELLED")


async def test_timed_out_is_a_queue_timeout_a_timeout_or_a_lost_worker() -> None:
    script: dict[str, list[Reply]] = {
        f"GET /status/{JOB}": [
            answer("TIMED_OUT", delayTime=120_000),  # nobody took it
            answer("TIMED_OUT", workerId="w-7", executionTime=1_799_500),  # at executionTimeout
            answer("TIMED_OUT", workerId="w-7", executionTime=61_000),  # its worker died
        ]
    }
    async with harness(script) as h:
        queued, timeout, crash = [
            read_job(await h.client.status(JOB), policy=POLICY) for _ in "abc"
        ]
    assert isinstance(queued, Failed) and queued.error_type == ErrorType.QUEUE_TIMEOUT
    assert not queued.resubmit
    assert isinstance(timeout, Failed) and timeout.error_type == ErrorType.TIMEOUT
    assert isinstance(crash, Failed) and crash.error_type == ErrorType.PROMPT_LOST
    assert crash.resubmit and "stopped reporting" in crash.message
    assert (from_failure(crash).type, from_failure(crash).non_retryable) == (
        ErrorType.PROMPT_LOST,
        True,
    )


async def test_a_404_after_the_ttl_is_a_typed_gone_job() -> None:
    gone = httpx.Response(404, json={"error": "request does not exist"})
    async with harness({f"GET /status/{JOB}": [answer("IN_QUEUE"), gone]}) as h:
        last = read_job(await h.client.status(JOB))
        with pytest.raises(RunPodJobGone) as caught:
            await h.client.status(JOB)
    assert len(h.fake.requests) == 2 and h.sleeps == [], "a 404 is an answer, not retried"
    assert caught.value.job_id == JOB and "TTL" in str(caught.value)
    assert isinstance(last, Queued)
    expired = read_gone(JOB, RunPodState.IN_QUEUE)
    assert (expired.error_type, expired.state, expired.resubmit) == (
        ErrorType.QUEUE_TIMEOUT,
        "GONE",
        False,
    )
    assert read_gone(JOB, RunPodState.IN_PROGRESS).resubmit
    assert read_gone(JOB, None).error_type == ErrorType.PROMPT_LOST
    assert read_gone(JOB, RunPodState.COMPLETED).error_type == ErrorType.OUTPUT_MISSING
    error = from_runpod(caught.value, "following")
    assert (error.type, error.non_retryable) == (ErrorType.PROMPT_LOST, True)


def test_a_state_nobody_knows_yet_is_asked_again() -> None:
    outcome = read_job(RunPodJob(id=JOB, status="IN_REVIEW"))
    assert isinstance(outcome, Failed) and outcome.retryable
    error = from_failure(outcome)
    assert (error.type, error.non_retryable) == (ErrorType.BACKEND_UNAVAILABLE, False)


# --- the other routes ----------------------------------------------------------------------------


async def test_stream_cancel_retry_purge_and_health() -> None:
    script: dict[str, list[Reply]] = {
        f"GET /stream/{JOB}": [
            httpx.Response(
                200, json={"status": "IN_PROGRESS", "stream": [{"output": 1}, {"output": {"b": 2}}]}
            )
        ],
        f"POST /cancel/{JOB}": [answer("CANCELLED")],
        f"POST /retry/{JOB}": [answer("IN_QUEUE")],
        "POST /purge-queue": [httpx.Response(200, json={"removed": 3, "status": "completed"})],
        "GET /health": [
            httpx.Response(
                200,
                json={
                    "jobs": {
                        "completed": 5,
                        "failed": 1,
                        "inProgress": 2,
                        "inQueue": 4,
                        "retried": 0,
                    },
                    "workers": {"idle": 1, "running": 2},
                },
            )
        ],
    }
    async with harness(script) as h:
        stream = await h.client.stream(JOB)
        cancelled = await h.client.cancel(JOB)
        retried = await h.client.retry(JOB)
        purged = await h.client.purge_queue()
        health = await h.client.health()
    assert [c.output for c in stream.stream] == [1, {"b": 2}]
    assert (cancelled.state, retried.state, retried.id) == (
        RunPodState.CANCELLED,
        RunPodState.IN_QUEUE,
        JOB,
    )
    assert (purged.removed, purged.status) == (3, "completed")
    assert (health.jobs.in_progress, health.jobs.in_queue, health.workers.running) == (2, 4, 2)
    assert health.workers.throttled == 0
    assert h.fake.routes() == [
        f"GET /stream/{JOB}",
        f"POST /cancel/{JOB}",
        f"POST /retry/{JOB}",
        "POST /purge-queue",
        "GET /health",
    ]


async def test_ids_that_are_not_runpods_never_reach_a_url() -> None:
    async with harness({}) as h:
        for bad in ("../health", "a/b", "", "x" * 300):
            with pytest.raises(RunPodRefused, match="not a RunPod job id"):
                await h.client.cancel(bad)
    assert h.fake.requests == []
    with pytest.raises(ValueError, match="endpoint id"):
        RunPodClient(BASE, "../other", SecretStr(KEY), httpx.AsyncClient())


async def test_a_404_on_an_endpoint_route_names_the_endpoint() -> None:
    async with harness({"GET /health": [httpx.Response(404)]}) as h:
        with pytest.raises(RunPodRefused, match=f"no endpoint {ENDPOINT}.*endpoint_id"):
            await h.client.health()


async def test_an_answer_of_the_wrong_shape_is_unavailable() -> None:
    async with harness({"GET /health": [httpx.Response(200, json={"jobs": "many"})]}) as h:
        with pytest.raises(RunPodUnavailable, match="unexpected answer"):
            await h.client.health()


def test_a_client_for_a_pool() -> None:
    pool = PoolConfig(kind="runpod", endpoint_id=ENDPOINT, api_key_env="RP_KEY_PROD")
    client = RunPodClient.for_pool(pool, SecretStr(KEY), httpx.AsyncClient())
    assert (client.base_url, client.endpoint_id, client.api_key_env) == (
        "https://api.runpod.ai/v2",
        ENDPOINT,
        "RP_KEY_PROD",
    )
    with pytest.raises(ValueError, match="runpod pool"):
        RunPodClient.for_pool(PoolConfig(url="http://x"), SecretStr(KEY), httpx.AsyncClient())


# --- auth, 429, 5xx, transport errors --------------------------------------------------------


@pytest.mark.parametrize("code", [401, 403])
async def test_auth_errors_are_fatal_and_say_which_variable_to_set(code: int) -> None:
    async with harness(
        {f"GET /status/{JOB}": [httpx.Response(code)]}, api_key_env="RUNPOD_KEY_TEAM_A"
    ) as h:
        with pytest.raises(RunPodAuthError) as caught:
            await h.client.status(JOB)
    assert len(h.fake.requests) == 1, "no retry brings a key"
    assert "set RUNPOD_KEY_TEAM_A" in str(caught.value) and KEY not in str(caught.value)
    assert (caught.value.status_code, caught.value.variable) == (code, "RUNPOD_KEY_TEAM_A")
    error = from_runpod(caught.value, "following")
    assert (error.type, error.non_retryable) == (ErrorType.BACKEND_ERROR, True)


async def test_a_429_burst_with_retry_after_then_success() -> None:
    limited = httpx.Response(429, headers={"Retry-After": "2"}, json={"error": "rate limited"})
    script: dict[str, list[Reply]] = {f"GET /status/{JOB}": [limited, limited, answer("IN_QUEUE")]}
    retry = RetryPolicy(base_s=0.5, max_s=8.0, budget_s=10.0)
    async with harness(script, retry=retry) as h:
        job = await h.client.status(JOB)
    assert job.state == RunPodState.IN_QUEUE and len(h.fake.requests) == 3
    first, second = h.sleeps
    # Retry-After is a floor; the jittered backoff comes on top of it.
    assert 2 + 0.25 <= first <= 2 + 0.5 and 2 + 0.5 <= second <= 2 + 1.0


async def test_a_429_beyond_the_budget_goes_to_the_caller_with_retry_after() -> None:
    limited = httpx.Response(429, headers={"Retry-After": "30"})
    async with harness({f"GET /status/{JOB}": [limited]}) as h:
        with pytest.raises(RunPodRateLimited) as caught:
            await h.client.status(JOB)
    assert h.sleeps == [] and len(h.fake.requests) == 1, "30 s is over the 10 s budget"
    assert caught.value.retry_after == 30
    error = from_runpod(caught.value, "following")
    assert (error.type, error.non_retryable) == (ErrorType.BACKEND_UNAVAILABLE, False)
    assert error.next_retry_delay is not None and error.next_retry_delay.total_seconds() == 30


async def test_5xx_then_success() -> None:
    script: dict[str, list[Reply]] = {
        f"GET /status/{JOB}": [httpx.Response(503), httpx.Response(502), answer("IN_PROGRESS")]
    }
    async with harness(script) as h:
        job = await h.client.status(JOB)
    assert job.state == RunPodState.IN_PROGRESS and len(h.sleeps) == 2


async def test_transport_errors_then_success_and_for_good() -> None:
    script: dict[str, list[Reply]] = {
        f"GET /status/{JOB}": [
            raising(httpx.ReadTimeout),
            raising(httpx.ConnectError),
            answer("IN_QUEUE"),
        ]
    }
    async with harness(script) as h:
        assert (await h.client.status(JOB)).state == RunPodState.IN_QUEUE

    retry = RetryPolicy(attempts=4, base_s=0.5, max_s=8.0, budget_s=10.0)
    async with harness({f"POST /cancel/{JOB}": [httpx.Response(500)]}, retry=retry) as h:
        with pytest.raises(RunPodUnavailable, match="HTTP 500"):
            await h.client.cancel(JOB)
    assert len(h.fake.requests) == 4 and len(h.sleeps) == 3, "bounded by attempts"
    assert sum(h.sleeps) <= 10.0
    error = from_runpod(RunPodUnavailable("x"), "cancelling")
    assert (error.type, error.non_retryable) == (ErrorType.BACKEND_UNAVAILABLE, False)


async def test_the_budget_bounds_the_total_wait() -> None:
    retry = RetryPolicy(attempts=100, base_s=1.0, max_s=4.0, budget_s=9.0)
    async with harness({"GET /health": [httpx.Response(503)]}, retry=retry) as h:
        with pytest.raises(RunPodUnavailable):
            await h.client.health()
    assert sum(h.sleeps) <= 9.0 and len(h.fake.requests) == len(h.sleeps) + 1 < 100


# --- the jitter is real --------------------------------------------------------------------------


def test_each_delay_is_drawn_over_half_to_all_of_its_ceiling() -> None:
    policy = RetryPolicy(base_s=0.5, max_s=8.0)
    draws = random.Random(1)
    for attempt, ceiling in [(0, 0.5), (1, 1.0), (3, 4.0), (4, 8.0), (30, 8.0)]:
        delays = [policy.delay(attempt, None, draws.random()) for _ in range(500)]
        assert ceiling / 2 <= min(delays) and max(delays) < ceiling
        # Spread over the whole band, not bunched at one end.
        assert max(delays) - min(delays) > 0.4 * ceiling
        assert statistics.pstdev(delays) > 0.1 * ceiling
        retry_after = [policy.delay(attempt, 3.0, draws.random()) for _ in range(100)]
        assert min(retry_after) >= 3.0 + ceiling / 2 and len(set(retry_after)) == 100


async def _sleeps_of(rng: random.Random | None) -> list[float]:
    limited: list[Reply] = [httpx.Response(429)] * 4
    replies = [*limited, answer("IN_QUEUE")]
    script: dict[str, list[Reply]] = {f"GET /status/{JOB}": replies}
    fake = FakeRunPod(script)
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as http:
        # No rng given: the client's own, the system's randomness.
        client = RunPodClient(BASE, ENDPOINT, SecretStr(KEY), http, sleep=sleep, rng=rng)
        await client.status(JOB)
    return sleeps


async def test_two_clients_throttled_together_do_not_come_back_together() -> None:
    first, second = await _sleeps_of(None), await _sleeps_of(None)
    assert len(first) == len(second) == 4
    assert first != second
    assert all(a != b for a, b in zip(first, second, strict=True))
    # The dice are what drive it: the same seed, the same waits.
    assert await _sleeps_of(random.Random(3)) == await _sleeps_of(random.Random(3))


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("5", 5.0),
        ("0.5", 0.5),
        ("-3", 0.0),
        ("99999", 3600.0),
        ("soon", None),
        ("", None),
        (None, None),
        ("Wed, 01 Jan 2025 00:00:07 GMT", 7.0),
        ("Tue, 31 Dec 2024 23:59:00 GMT", 0.0),
        ("nan", None),
    ],
)
def test_retry_after_as_seconds_or_a_date(header: str | None, seconds: float | None) -> None:
    now = datetime(2025, 1, 1, tzinfo=UTC)
    assert parse_retry_after(header, now=now) == seconds


# --- the key is never shown ----------------------------------------------------------------------


@contextmanager
def captured_logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """structlog events of the client, whatever the process's logging configuration."""
    with capture_logs() as logs:
        original = client_module.log
        client_module.log = structlog.get_logger(client_module.__name__)
        try:
            yield logs
        finally:
            client_module.log = original


async def test_the_api_key_is_in_no_log_repr_or_message() -> None:
    echo = f"Authorization: Bearer {KEY}"  # a proxy that echoes the request back
    scenarios: list[tuple[str, dict[str, list[Reply]]]] = [
        ("status", {f"GET /status/{JOB}": [httpx.Response(400, text=echo)]}),
        ("status", {f"GET /status/{JOB}": [httpx.Response(500, text=echo)]}),
        ("status", {f"GET /status/{JOB}": [httpx.Response(401, text=echo)]}),
        ("status", {f"GET /status/{JOB}": [httpx.Response(404, text=echo)]}),
        ("status", {f"GET /status/{JOB}": [httpx.Response(429, text=echo)]}),
        ("status", {f"GET /status/{JOB}": [httpx.Response(200, text=echo)]}),
        ("status", {f"GET /status/{JOB}": [raising(httpx.ConnectError, echo)]}),
        ("run", {"POST /run": [httpx.Response(502, text=echo)]}),
        ("run", {"POST /run": [httpx.Response(200, json={"echo": echo})]}),
        ("run", {"POST /run": [raising(httpx.ReadTimeout, echo)]}),
        ("run", {"POST /run": [httpx.Response(413, text=echo)]}),
        ("run", {"POST /run": [answer("IN_QUEUE")]}),
    ]
    shown: list[str] = []
    with captured_logs() as logs:
        for call, script in scenarios:
            async with harness(script) as h:
                shown += [repr(h.client), str(h.client)]
                try:
                    if call == "run":
                        await h.client.run(job_input(), POLICY)
                    else:
                        await h.client.status(JOB)
                except RunPodError as exc:
                    shown += [str(exc), repr(exc)]
                    application_error = from_runpod(exc, "calling RunPod")
                    shown += [str(application_error), repr(application_error.details)]
                    cause = exc.__cause__
                    shown += [str(cause), repr(cause)] if cause is not None else []
    assert len(logs) >= 5, logs
    shown += [json.dumps(event, default=str) for event in logs]
    leaks = [text for text in shown if KEY in text]
    assert leaks == []
    assert any("[redacted]" in text for text in shown), "the echoed key was scrubbed, not lost"
