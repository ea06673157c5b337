"""The registry of live RunPod submissions (activities/runpod/submissions.py) and the orphan
sweep's RunPod side (activities/orphans.py): a fake Temporal (describe), a RunPod over
httpx.MockTransport and the in-memory bucket of test_runpod_backend_unit. No server."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from structlog.testing import capture_logs
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from activities.orphans import OrphanSweeper, RunPodSweep, SweptPrompt
from activities.runpod import submissions
from activities.runpod.client import RunPodClient
from activities.runpod.retry import RetryPolicy
from activities.runpod.submissions import SubmissionRecord, record_key
from configuration.pools import PoolConfig
from protocol.runpod.contract import Claim, S3Target, claim_key
from tests.activities.test_runpod_backend_unit import (
    BUCKET,
    HOLDER,
    JOB_ID,
    OUR_KEY,
    PNG,
    PROMPT,
    RUNPOD_JOB,
    MemoryStore,
    RecordingStore,
    backend,
    completed,
    env,
    follow_input,
    record,
)

NAMESPACE = "default"  # ActivityEnvironment's, and the fake Temporal's
POOL = "cloud"
ENDPOINT = "ep1"


@dataclass
class FakeTemporal:
    """`Client.namespace` and `get_workflow_handle(id).describe().status`."""

    workflows: dict[str, WorkflowExecutionStatus]
    namespace: str = NAMESPACE

    def get_workflow_handle(self, workflow_id: str) -> FakeHandle:
        return FakeHandle(self.workflows.get(workflow_id))


@dataclass
class FakeHandle:
    status: WorkflowExecutionStatus | None

    async def describe(self) -> FakeHandle:
        if self.status is None:
            raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")
        return self


@dataclass
class FakeRunPod:
    """RunPod's /status and /cancel over a table of jobs; an id not in it is a 404."""

    jobs: dict[str, str]
    cancelled: list[str] = field(default_factory=list)
    asked: list[str] = field(default_factory=list)

    def handle(self, request: httpx.Request) -> httpx.Response:
        route, job_id = request.url.path.split("/")[3:5]
        self.asked.append(f"{route} {job_id}")
        if job_id not in self.jobs:
            return httpx.Response(404, json={"error": "job not found"})
        if route == "cancel":
            self.cancelled.append(job_id)
            if self.jobs[job_id] in ("IN_QUEUE", "IN_PROGRESS"):
                self.jobs[job_id] = "CANCELLED"
        return httpx.Response(200, json={"id": job_id, "status": self.jobs[job_id]})


def a_record(
    *,
    runpod_job_id: str | None = RUNPOD_JOB,
    namespace: str = NAMESPACE,
    job_id: str = JOB_ID,
    claims: bool = True,
    endpoint_id: str = ENDPOINT,
    expires_in: timedelta = timedelta(hours=1),
) -> SubmissionRecord:
    now = datetime.now(UTC)
    return SubmissionRecord(
        namespace=namespace,
        pool=POOL,
        endpoint_id=endpoint_id,
        job_id=job_id,
        submission=PROMPT,
        runpod_job_id=runpod_job_id,
        claims=claims,
        output=S3Target(bucket=BUCKET, prefix="jobs"),
        at=now,
        expires_at=now + expires_in,
    )


def stored(store: MemoryStore, item: SubmissionRecord) -> str:
    key = record_key(item.pool, item.job_id, item.submission)
    store.put(key, item.model_dump_json().encode())
    return key


def sweeper(
    store: MemoryStore,
    runpod: FakeRunPod,
    workflows: dict[str, WorkflowExecutionStatus],
    swept: list[SweptPrompt] | None = None,
) -> OrphanSweeper:
    pool = PoolConfig(kind="runpod", endpoint_id=ENDPOINT, claims=True)
    http = httpx.AsyncClient(transport=httpx.MockTransport(runpod.handle))
    client = RunPodClient.for_pool(pool, SecretStr("k"), http, retry=RetryPolicy(attempts=1))
    return OrphanSweeper(
        FakeTemporal(workflows),  # type: ignore[arg-type]
        {},
        runpod=RunPodSweep(store, {POOL: (pool, client)}),  # type: ignore[arg-type]
        on_swept=None if swept is None else swept.append,
    )


@pytest.mark.parametrize(
    "workflow", [WorkflowExecutionStatus.TERMINATED, WorkflowExecutionStatus.TIMED_OUT, None]
)
async def test_a_closed_or_unknown_workflows_runpod_job_is_cancelled_and_forgotten(
    workflow: WorkflowExecutionStatus | None,
) -> None:
    store, runpod = MemoryStore(), FakeRunPod({RUNPOD_JOB: "IN_PROGRESS"})
    key = stored(store, a_record())
    told: list[SweptPrompt] = []
    workflows = {} if workflow is None else {JOB_ID: workflow}
    swept = await sweeper(store, runpod, workflows, told).sweep_once()
    assert runpod.cancelled == [RUNPOD_JOB]
    assert runpod.jobs[RUNPOD_JOB] == "CANCELLED"
    assert [(s.action, s.provider_job_id, s.job_id, s.prompt_id) for s in swept] == [
        ("cancelled", RUNPOD_JOB, JOB_ID, PROMPT)
    ]
    assert swept[0].job == (workflow.name if workflow else "unknown")
    assert told == swept, "the metric hears of it"
    assert (BUCKET, key) not in store.objects


async def test_a_running_workflows_job_is_left_alone_and_its_record_not_even_read() -> None:
    store, runpod = RecordingStore(), FakeRunPod({RUNPOD_JOB: "IN_PROGRESS"})
    key = stored(store, a_record())
    swept = await sweeper(store, runpod, {JOB_ID: WorkflowExecutionStatus.RUNNING}).sweep_once()
    assert swept == [] and runpod.asked == []
    assert (BUCKET, key) in store.objects
    assert store.calls == [], "a sweep costs a live job one describe"


async def test_a_workflow_id_the_key_had_to_sanitise_is_asked_for_as_it_is() -> None:
    store, runpod = MemoryStore(), FakeRunPod({RUNPOD_JOB: "IN_PROGRESS"})
    odd = "job/with a slash"
    key = stored(store, a_record(job_id=odd))
    assert odd not in key
    running = {odd: WorkflowExecutionStatus.RUNNING}
    assert await sweeper(store, runpod, running).sweep_once() == []
    closed = {odd: WorkflowExecutionStatus.TERMINATED}
    [swept] = await sweeper(store, runpod, closed).sweep_once()
    assert (swept.job_id, swept.job) == (odd, "TERMINATED")
    assert (BUCKET, key) not in store.objects


async def test_a_record_that_is_not_one_is_left_and_the_sweep_goes_on() -> None:
    store, runpod = MemoryStore(), FakeRunPod({RUNPOD_JOB: "IN_PROGRESS"})
    junk = record_key(POOL, "job-0", "x" * 12)
    store.put(junk, b"{not json")
    key = stored(store, a_record())
    with capture_logs() as logs:
        swept = await sweeper(store, runpod, {}).sweep_once()
    assert [s.provider_job_id for s in swept] == [RUNPOD_JOB]
    assert (BUCKET, junk) in store.objects and (BUCKET, key) not in store.objects
    assert [e["record"] for e in logs if e["event"] == "orphan_record_unreadable"] == [junk]


async def test_another_namespaces_and_another_endpoints_records_are_left_alone() -> None:
    store, runpod = MemoryStore(), FakeRunPod({RUNPOD_JOB: "IN_PROGRESS"})
    keys = [
        stored(store, a_record(namespace="production", job_id="job-a")),
        stored(store, a_record(endpoint_id="other-endpoint", job_id="job-b")),
    ]
    swept = await sweeper(store, runpod, {}).sweep_once()
    assert swept == [] and runpod.asked == []
    assert all((BUCKET, key) in store.objects for key in keys)


async def test_a_lost_run_answer_is_found_through_the_claim() -> None:
    """`/run`'s answer never came: the record has no RunPod id, the claim names the holder."""
    store, runpod = MemoryStore(), FakeRunPod({HOLDER: "IN_PROGRESS"})
    key = stored(store, a_record(runpod_job_id=None))
    claim = Claim(
        submission=PROMPT,
        job_id=JOB_ID,
        prompt_id=PROMPT,
        holder=HOLDER,
        lease_until=datetime.now(UTC) + timedelta(minutes=1),
        renewed_at=datetime.now(UTC),
    )
    store.put(claim_key(S3Target(bucket=BUCKET), JOB_ID, PROMPT), claim.model_dump_json().encode())
    swept = await sweeper(store, runpod, {JOB_ID: WorkflowExecutionStatus.TERMINATED}).sweep_once()
    assert runpod.cancelled == [HOLDER]
    assert [s.provider_job_id for s in swept] == [HOLDER]
    assert (BUCKET, key) not in store.objects


@pytest.mark.parametrize("state", ["COMPLETED", "FAILED", "CANCELLED", "gone"])
async def test_an_ended_or_forgotten_runpod_job_is_not_cancelled_and_its_record_goes(
    state: str,
) -> None:
    store = MemoryStore()
    runpod = FakeRunPod({} if state == "gone" else {RUNPOD_JOB: state})
    key = stored(store, a_record(claims=False))
    swept = await sweeper(store, runpod, {JOB_ID: WorkflowExecutionStatus.COMPLETED}).sweep_once()
    assert swept == [] and runpod.cancelled == []
    assert (BUCKET, key) not in store.objects


async def test_a_record_nothing_resolves_is_kept_until_no_job_can_exist() -> None:
    store, runpod = MemoryStore(), FakeRunPod({})
    waiting = stored(store, a_record(runpod_job_id=None, claims=False))
    over = {JOB_ID: WorkflowExecutionStatus.TERMINATED}
    await sweeper(store, runpod, over).sweep_once()
    assert (BUCKET, waiting) in store.objects, "a queued job may still be picked up"
    stored(store, a_record(runpod_job_id=None, claims=False, expires_in=timedelta(seconds=-1)))
    await sweeper(store, runpod, over).sweep_once()
    assert (BUCKET, waiting) not in store.objects


async def test_a_follow_records_its_submission_and_forgets_it_when_it_ends() -> None:
    """One record before `/run` (no id), the id once `/run` answered, gone at the end."""
    store = MemoryStore()
    store.put(OUR_KEY, PNG)
    key = record_key(POOL, JOB_ID, PROMPT)
    seen: list[dict[str, Any] | None] = []

    def handle(request: httpx.Request) -> httpx.Response:
        found = store.objects.get((BUCKET, key))
        seen.append(json.loads(found[0]) if found else None)
        if request.url.path.endswith("/run"):
            return httpx.Response(200, json={"id": RUNPOD_JOB, "status": "IN_QUEUE"})
        return httpx.Response(200, json=completed([record(OUR_KEY)]))

    runpod = backend(None, store, transport=httpx.MockTransport(handle))  # type: ignore[arg-type]
    await env([]).run(runpod.follow, follow_input())
    at_run, at_status = seen
    assert at_run is not None and at_run["runpod_job_id"] is None
    assert (at_run["namespace"], at_run["pool"], at_run["endpoint_id"]) == (
        NAMESPACE,
        POOL,
        ENDPOINT,
    )
    assert at_run["output"] == {"bucket": BUCKET, "prefix": "jobs"} and at_run["claims"]
    assert at_status is not None and at_status["runpod_job_id"] == RUNPOD_JOB
    assert (BUCKET, key) not in store.objects


async def test_a_failed_submission_is_forgotten_too() -> None:
    store = MemoryStore()
    key = record_key(POOL, JOB_ID, PROMPT)

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/run"):
            return httpx.Response(200, json={"id": RUNPOD_JOB, "status": "IN_QUEUE"})
        return httpx.Response(200, json={"id": RUNPOD_JOB, "status": "FAILED", "error": "boom"})

    runpod = backend(None, store, transport=httpx.MockTransport(handle))  # type: ignore[arg-type]
    with pytest.raises(Exception):  # noqa: B017 (which failure is test_runpod_backend_unit's)
        await env([]).run(runpod.follow, follow_input())
    assert (BUCKET, key) not in store.objects


async def test_the_stop_path_can_forget_a_submission() -> None:
    store = MemoryStore()
    key = stored(store, a_record())
    await submissions.ended(store, POOL, JOB_ID, PROMPT)  # type: ignore[arg-type]
    assert (BUCKET, key) not in store.objects
    await submissions.ended(store, POOL, JOB_ID, PROMPT)  # type: ignore[arg-type]
