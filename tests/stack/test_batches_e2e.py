"""Batches end to end on the real local stack: a worker in this process whose pool is bounded
(so a batch's jobs wait in our queue, and cancels find them at every stage), a webhook receiver
on 127.0.0.1 that checks signatures, batches through `JobClient`."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import pytest
import pytest_asyncio
from temporalio.api.enums.v1 import EventType

from activities.storage import ArtifactStore
from configuration.settings import WebhookSettings, WorkerSettings
from devstack.config import PoolConfig
from devstack.models import RunningStack
from starter import BatchConflict, BatchRequest, BatchState, InvalidBatch, JobClient, JobRequest
from starter.connection import connect_temporal
from tests.support.cli import example, s3_settings
from tests.support.webhook_receiver import WebhookReceiver, signing_secret
from worker import run_worker
from workflows.batches import BatchStatus
from workflows.contracts import JobState, JobStatus, WebhookSpec
from workflows.job_input import JobInput

SECRET = signing_secret("batches e2e")
POOL = "gpu"
ONE = "one"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(local_stack: RunningStack) -> AsyncIterator[JobClient]:
    """A worker with two bounded pools on the stack's simulator (`gpu`: 2 at once, `one`: 1),
    a webhook secret for the tenants, and its client."""
    stack = local_stack
    task_queue = f"batches-{uuid.uuid4().hex[:8]}"
    settings = WorkerSettings(
        task_queue=task_queue,
        pools={
            POOL: PoolConfig(kind="comfyui", url=stack.comfyui_url, max_running=2),
            ONE: PoolConfig(kind="comfyui", url=stack.comfyui_url, max_running=1),
        },
        default_pool=POOL,
    )
    webhooks = WebhookSettings(
        secrets={"local": SECRET, "acme": SECRET}, allow_hosts=("127.0.0.1",)
    )
    temporal = await connect_temporal(stack.temporal_address, stack.namespace)
    stop = asyncio.Event()
    running = asyncio.create_task(
        run_worker(settings, s3_settings(stack), stop=stop, client=temporal, webhooks=webhooks)
    )
    try:
        async with ArtifactStore(s3_settings(stack)) as store:
            yield JobClient(temporal, task_queue=task_queue, store=store, default_pool=POOL)
    finally:
        stop.set()
        await asyncio.wait_for(running, timeout=30)


@pytest_asyncio.fixture(loop_scope="session")
async def receiver() -> AsyncIterator[WebhookReceiver]:
    running = WebhookReceiver(SECRET)
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


async def until(client: JobClient, batch_id: str, check: Any, what: str) -> BatchStatus:
    """The batch's status once `check` holds (a bound so that a hang fails, not a timing)."""
    for _ in range(900):
        status = await client.batch_status(batch_id)
        if check(status):
            return status
        await asyncio.sleep(0.2)
    raise AssertionError(f"never: {what}; last {status.model_dump(exclude={'jobs'})}")


async def job_request_of(client: JobClient, job_id: str) -> JobRequest:
    """The request the job was started with, from the first event of its history."""
    async for event in client.handle(job_id).fetch_history_events():
        assert event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED
        payloads = event.workflow_execution_started_event_attributes.input.payloads
        [raw] = await client.temporal.data_converter.decode(payloads, [JobInput])
        assert isinstance(raw, JobInput)
        return raw.request
    raise AssertionError("no history")


async def test_a_batch_of_20_three_cancelled_one_by_one_then_the_batch_ends_every_job_once(
    client: JobClient, receiver: WebhookReceiver
) -> None:
    template = JobRequest(graph=example(steps=1000), labels={"tenant": "acme"})
    webhook = WebhookSpec(url=receiver.url, retry_horizon_s=60.0)
    submitted = await client.submit_batch(BatchRequest(request=template, count=20, webhook=webhook))
    batch_id, job_ids = submitted.batch_id, submitted.job_ids
    assert len(job_ids) == 20 and submitted.started == 20 and not submitted.existed
    assert job_ids[0] == f"{batch_id}-0001" and job_ids[-1] == f"{batch_id}-0020"
    await until(client, batch_id, lambda s: s.counts.get("RUNNING", 0) >= 1, "a job runs")

    # Three jobs cancelled one by one, as single jobs: one that may run, two still waiting.
    for job_id in (job_ids[0], job_ids[10], job_ids[19]):
        await client.cancel(job_id, "not this one")
        final = await client.wait(job_id)
        assert final.state == JobState.CANCELLED
    heard = await until(
        client, batch_id, lambda s: s.ended >= 3, "the batch hears the three cancels"
    )
    assert heard.counts.get("CANCELLED", 0) >= 3 and heard.state == BatchState.RUNNING

    cancelling = await client.cancel_batch(batch_id, "enough")
    assert cancelling.state in (BatchState.CANCELLING, BatchState.CANCELLED)
    final_batch = await client.wait_batch(batch_id, interval_s=0.2)
    assert final_batch.state == BatchState.CANCELLED
    assert final_batch.total == 20 and final_batch.ended == 20
    assert sum(final_batch.counts.values()) == 20

    # Every job ended, each as the batch counted it, each stop confirmed as one job's is.
    statuses: list[JobStatus] = [await client.status(job_id) for job_id in job_ids]
    assert all(status.terminal for status in statuses)
    assert Counter(str(status.state) for status in statuses) == Counter(final_batch.counts)
    for status in statuses:
        if status.state == JobState.CANCELLED:
            assert status.teardown.state in ("CONFIRMED", "SKIPPED"), status.teardown
    by_job = {job.job_id: str(job.state) for job in final_batch.jobs}
    assert by_job == {status.job_id: str(status.state) for status in statuses}
    assert final_batch.counts.get("CANCELLED", 0) >= 3

    # One webhook, at the batch's end, with its summary, signed.
    async def one_delivery() -> Any:
        for _ in range(300):
            delivered = [r for r in receiver.delivered() if r.type.startswith("batch.")]
            if delivered:
                return delivered
            await asyncio.sleep(0.2)
        raise AssertionError("the batch's webhook never came")

    [delivery] = await one_delivery()
    await asyncio.sleep(1.0)  # nothing more follows
    assert [r.type for r in receiver.delivered() if r.type.startswith("batch.")] == [
        "batch.cancelled"
    ]
    data = delivery.body["data"]
    assert data["batch_id"] == batch_id and data["state"] == "CANCELLED"
    assert data["counts"] == final_batch.counts and data["total"] == 20
    assert not any(r.type.startswith("job.") for r in receiver.delivered())


async def test_count_5_gives_five_jobs_with_distinct_seeds_that_all_complete(
    client: JobClient,
) -> None:
    graph = example(steps=2)
    submitted = await client.submit_batch(BatchRequest(request=JobRequest(graph=graph), count=5))
    final = await client.wait_batch(submitted.batch_id, interval_s=0.2)
    assert final.state == BatchState.COMPLETED
    assert final.counts == {"COMPLETED": 5} and final.progress == 1.0
    assert final.artifacts == 5
    seeds = [
        (await job_request_of(client, job_id)).graph["3"]["inputs"]["seed"]
        for job_id in submitted.job_ids
    ]
    base = graph["3"]["inputs"]["seed"]
    assert seeds == [base + n for n in range(5)]
    results = await client.batch_results(submitted.batch_id)
    assert [end.job_id for end in results.ends] == submitted.job_ids
    # The batch's own history: its start, a signal per job end with its workflow task (often
    # shared), `submitted`, its end: a few events per job, never a call per job per look.
    history = await client.temporal.get_workflow_handle(submitted.batch_id).fetch_history()
    print("batch history events", len(history.events))
    assert len(history.events) <= 4 * 5 + 15
    assert all(len(end.artifacts) == 1 and end.artifacts[0].url for end in results.ends)


async def activities_of(client: JobClient, workflow_id: str) -> list[str]:
    """The activity types a workflow's history scheduled, in order."""
    history = await client.temporal.get_workflow_handle(workflow_id).fetch_history()
    return [
        event.activity_task_scheduled_event_attributes.activity_type.name
        for event in history.events
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    ]


async def test_jobs_differing_in_values_are_started_by_the_batch_the_others_by_the_client(
    client: JobClient,
) -> None:
    """A batch by `count` goes in short: its workflow starts the jobs, and the submission
    ends once the batch is recorded. Jobs that differ in more (here, their labels) are started
    by the client, then `submitted`. Both run every job once, as sent."""
    by_count = await client.submit_batch(
        BatchRequest(request=JobRequest(graph=example(steps=1)), count=3)
    )
    labelled = [
        JobRequest(graph=example(steps=1), labels={"tenant": "acme", "shot": str(n)})
        for n in range(3)
    ]
    by_client = await client.submit_batch(labelled)
    for submitted, expected in ((by_count, ["start_batch_jobs"]), (by_client, [])):
        final = await client.wait_batch(submitted.batch_id, interval_s=0.2)
        assert final.counts == {"COMPLETED": 3}, final
        assert submitted.started == 3
        assert await activities_of(client, submitted.batch_id) == expected
    shots = [(await job_request_of(client, j)).labels["shot"] for j in by_client.job_ids]
    assert shots == ["0", "1", "2"]
    # The batch's jobs are ordinary jobs, each with its batch's label.
    for job_id in by_count.job_ids:
        assert (await job_request_of(client, job_id)).labels == {"batch": by_count.batch_id}


async def test_the_same_batch_again_starts_nothing_and_another_under_its_id_is_refused(
    client: JobClient,
) -> None:
    batch_id = f"batch-{uuid.uuid4().hex[:8]}"
    batch = BatchRequest(request=JobRequest(graph=example(steps=1)), count=2)
    first = await client.submit_batch(batch, batch_id=batch_id)
    again = await client.submit_batch(batch, batch_id=batch_id)
    assert again.existed and again.started == 0 and again.job_ids == first.job_ids
    other = BatchRequest(request=JobRequest(graph=example(steps=1)), count=3)
    with pytest.raises(BatchConflict):
        await client.submit_batch(other, batch_id=batch_id)
    assert (await client.wait_batch(batch_id, interval_s=0.2)).counts == {"COMPLETED": 2}


async def test_a_batch_that_cannot_start_whole_starts_nothing(client: JobClient) -> None:
    bad = [
        JobRequest(graph=example(), labels={"tenant": "acme"}),
        JobRequest(graph=example(), labels={"tenant": "other"}),
    ]
    with pytest.raises(InvalidBatch, match="one tenant"):
        await client.submit_batch(bad, batch_id="batch-two-tenants")
    with pytest.raises(InvalidBatch, match="override 0: node '99' is not in the graph"):
        await client.submit_batch(
            BatchRequest(request=JobRequest(graph=example()), overrides=[{"99": {"seed": 1}}]),
            batch_id="batch-bad-override",
        )
    with pytest.raises(InvalidBatch, match=r"override 1: node '3' .* has no input 'sede'"):
        await client.submit_batch(
            BatchRequest(
                request=JobRequest(graph=example()),
                overrides=[{"3": {"seed": 1}}, {"3": {"sede": 2}}],
            ),
            batch_id="batch-typo",
        )
    for batch_id in ("batch-two-tenants", "batch-bad-override", "batch-typo"):
        assert not await client._batch_exists(batch_id)


async def line_of(client: JobClient, job_id: str) -> tuple[datetime, datetime]:
    """When the job joined its pool's line (its PENDING) and when it left it, by its journal.
    A follow that waits in line itself reports its grant with its end: on a one-slot pool the
    next job's grant, so the order of leaving is the order of grants."""
    states = [e for e in (await client.events(job_id, 0)).events if e.kind == "state"]
    pending = next((e for e in states if e.state == JobState.PENDING), None)
    if pending is None:  # granted as it asked
        at = next(e.at for e in states if e.state != JobState.QUEUED)
        return at, at
    left = next(e for e in states if e.seq > pending.seq and e.state != JobState.PENDING)
    return pending.at, left.at


async def test_a_batchs_jobs_interleave_with_another_tenants_single_jobs(
    client: JobClient,
) -> None:
    """Pool `one` runs one job at a time: tenant acme's batch of 14 is in line first, then
    tenant beta's 4 single jobs; at equal weights beta's start alternating with acme's once
    they are in line, not after acme's whole batch (first come, first served)."""
    template = JobRequest(graph=example(steps=10), pool=ONE, labels={"tenant": "acme"})
    batch = await client.submit_batch(BatchRequest(request=template, count=14))
    await until(client, batch.batch_id, lambda s: s.counts.get("PENDING", 0) >= 12, "acme's line")
    beta = JobRequest(graph=example(steps=10), pool=ONE, labels={"tenant": "beta"})
    # Beta's four join together (sent at once): from then on the two tenants take turns.
    sent = await asyncio.gather(*(client.submit(beta) for _ in range(4)))
    singles = [status.job_id for status in sent]
    assert len(set(singles)) == 4
    await client.wait_batch(batch.batch_id, interval_s=0.5)
    for job_id in singles:
        assert (await client.wait(job_id)).state == JobState.COMPLETED
    # Each job's time in line, by its journal: from its first state past QUEUED (it joined the
    # line, a moment after it was sent: its checks first) to its first state past PENDING (its
    # grant). Told apart by grants, not by when beta's were sent: acme's go on starting
    # until beta's are in line, more of them the busier the machine.
    lines = {job_id: await line_of(client, job_id) for job_id in [*batch.job_ids, *singles]}
    acme_grants = [lines[job_id][1] for job_id in batch.job_ids]
    for k, job_id in enumerate(sorted(singles, key=lambda j: lines[j])):
        joined, granted = lines[job_id]
        passed = sum(1 for at in acme_grants if joined < at < granted)
        # Fair shares: the k-th of beta's waits for about k + 1 of acme's (acme may win the
        # first tie; one more, for the one that was running as it joined); first come, first
        # served would make the first wait for acme's whole line (8 or more).
        assert passed <= k + 2, (k, passed, sorted(lines.items(), key=lambda kv: kv[1]))
    # Acme's line was long enough when beta's joined for first come, first served to show.
    first_joined = min(lines[job_id][0] for job_id in singles)
    assert sum(1 for at in acme_grants if at > first_joined) >= 8
