"""Webhooks end to end on the real local stack: a worker in this process with a signing secret
per tenant and 127.0.0.1 allow-listed (development only), a receiver on 127.0.0.1 that checks
every signature with its own implementation, jobs through `JobClient`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx
import pytest
import pytest_asyncio
from temporalio.api.enums.v1 import EventType

from activities.storage import ArtifactStore
from configuration.settings import WebhookSettings, WorkerSettings
from devstack.config import PoolConfig
from devstack.models import RunningStack
from starter import JobClient, JobRequest, JobState
from starter.connection import connect_temporal
from tests.support.cli import example, s3_settings
from tests.support.webhook_receiver import WebhookReceiver, signing_secret
from worker import run_worker
from workflows.contracts import JobPolicy, JobStatus, WebhookSpec
from workflows.shared import ErrorType
from workflows.webhooks import webhook_event

SECRET = signing_secret("webhooks e2e")
T = TypeVar("T")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(local_stack: RunningStack) -> AsyncIterator[JobClient]:
    """A worker with webhook secrets for tenants `acme` and `local`, and its client."""
    stack = local_stack
    task_queue = f"webhooks-{uuid.uuid4().hex[:8]}"
    settings = WorkerSettings(
        task_queue=task_queue,
        pools={"comfyui": PoolConfig(kind="comfyui", url=stack.comfyui_url)},
    )
    webhooks = WebhookSettings(
        secrets={"acme": SECRET, "local": SECRET}, allow_hosts=("127.0.0.1",)
    )
    temporal = await connect_temporal(stack.temporal_address, stack.namespace)
    stop = asyncio.Event()
    running = asyncio.create_task(
        run_worker(settings, s3_settings(stack), stop=stop, client=temporal, webhooks=webhooks)
    )
    try:
        async with ArtifactStore(s3_settings(stack)) as store:
            yield JobClient(temporal, task_queue=task_queue, store=store)
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


async def eventually(check: Callable[[], Awaitable[T | None]], what: str) -> T:
    """Poll until `check` answers (not a timing assertion: a bound so a hang fails)."""
    for _ in range(600):
        answer = await check()
        if answer is not None and answer is not False:
            return answer
        await asyncio.sleep(0.2)
    raise AssertionError(f"never: {what}")


async def sim_prompts(stack: RunningStack) -> dict[str, Any]:
    async with httpx.AsyncClient(trust_env=False) as http:
        response = await http.get(f"{stack.comfyui_url}/sim/stats")
    response.raise_for_status()
    prompts: dict[str, Any] = response.json()["prompts"]
    return prompts


async def workflow_closed(client: JobClient, job_id: str) -> None:
    """The workflow's own end: after the job's end, once every delivery is settled."""
    try:
        await client.handle(job_id).result()
    except Exception:  # a FAILED job's workflow fails: its end is all that is waited for
        pass


async def expected_types(client: JobClient, job_id: str, events: list[str]) -> list[str]:
    """The job's journal, as the webhook should have seen it: the subscribed entries in order."""
    journal = (await client.events(job_id, 0)).events
    return [
        f"job.{name}"
        for entry in journal
        if (name := webhook_event(entry)) is not None and name in events
    ]


async def continued_as_new(client: JobClient, job_id: str) -> bool:
    async for event in client.handle(job_id).fetch_history_events():
        assert event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED
        started = event.workflow_execution_started_event_attributes
        return bool(started.continued_execution_run_id)
    return False


async def test_every_subscribed_event_is_delivered_once_in_order_signed_across_runs(
    client: JobClient, receiver: WebhookReceiver
) -> None:
    events: list[Any] = ["output_stored", "progress", "completed"]
    request = JobRequest(
        graph=example(steps=4),
        # Three segments with a tiny history budget: the job continues as new between them,
        # and the sender's cursor goes with it.
        segments=[{"3": {"seed": seed}} for seed in range(3)],
        policy=JobPolicy(abandon_after_s=None, history_budget_events=10),
        labels={"tenant": "acme"},
        webhook=WebhookSpec(url=receiver.url, events=events, retry_horizon_s=60.0),
    )
    job_id = (await client.submit(request)).job_id
    await workflow_closed(client, job_id)
    final = await client.status(job_id)
    assert final.state == JobState.COMPLETED, final.error
    assert await continued_as_new(client, job_id), "the job ran in more than one run"

    wanted = await expected_types(client, job_id, events)
    delivered = receiver.delivered()
    assert [r.type for r in delivered] == wanted
    assert wanted.count("job.output_stored") == 3 and wanted[-1] == "job.completed"
    assert "job.progress" in wanted
    assert all(r.signature_valid for r in receiver.received)
    assert len({r.webhook_id for r in delivered}) == len(delivered), "one id per event"
    assert {r.body["data"]["job_id"] for r in delivered} == {job_id}
    assert [r.body["data"]["seq"] for r in delivered] == sorted(
        r.body["data"]["seq"] for r in delivered
    )
    keys = [r.body["data"]["artifact"]["key"] for r in delivered if r.type == "job.output_stored"]
    assert keys == [a.key for a in final.artifacts]
    webhook = final.webhook
    assert webhook is not None
    assert (webhook.delivered, webhook.failed, webhook.pending) == (len(wanted), 0, 0)
    assert webhook.url == receiver.url.split("?")[0], "the status shows no query string"
    assert all(d.state == "delivered" for d in webhook.deliveries)
    history = (await client.handle(job_id).fetch_history()).to_json()
    assert SECRET.split("_", 1)[1] not in history, "the secret stays on the worker"
    assert "webhook-signature" not in history.lower()


async def test_deliveries_outlive_the_receiver_being_down_and_never_delay_the_job(
    client: JobClient, receiver: WebhookReceiver
) -> None:
    receiver.answer = 503  # up, but failing
    events: list[Any] = ["output_stored", "completed"]
    request = JobRequest(
        graph=example(steps=4),
        policy=JobPolicy(abandon_after_s=None),
        webhook=WebhookSpec(url=receiver.url, events=events, retry_horizon_s=120.0),
    )  # no tenant label: the tenant is `local`
    job_id = (await client.submit(request)).job_id

    final = await client.wait(job_id)
    assert final.state == JobState.COMPLETED, final.error
    assert final.webhook is not None and final.webhook.pending == 2, (
        "wait() returned while both deliveries were still pending",
        final.webhook,
    )
    assert final.webhook.delivered == 0

    # Down altogether: connections are refused, and the job's status says so.
    await eventually(lambda: _some_answer(receiver, 503), "a 503 was answered")
    await receiver.stop()

    async def refused_attempt() -> JobStatus | None:
        status = await client.status(job_id)
        assert status.webhook is not None
        last = status.webhook.deliveries[-1]
        seen = last.state == "retrying" and last.last_status_code is None and last.last_error
        return status if seen else None

    while_down = await eventually(refused_attempt, "an attempt while the receiver was down")
    assert while_down.state == JobState.COMPLETED
    receiver.answer = None
    await receiver.start()
    await workflow_closed(client, job_id)

    done = await client.status(job_id)
    assert done.webhook is not None
    assert (done.webhook.delivered, done.webhook.failed, done.webhook.pending) == (2, 0, 0)
    delivered = receiver.delivered()
    assert [r.type for r in delivered] == await expected_types(client, job_id, events)
    assert all(r.signature_valid for r in receiver.received)
    first = delivered[0]
    tries = [r for r in receiver.received if r.webhook_id == first.webhook_id]
    assert len(tries) >= 2 and {r.answered for r in tries} == {503, 200}, "retried, same id"
    assert all(r.body == first.body for r in tries), "the same body on every attempt"
    by_id = {d.webhook_id: d for d in done.webhook.deliveries}
    assert by_id[first.webhook_id].attempts > len(tries), "attempts while down count too"


async def _some_answer(receiver: WebhookReceiver, status: int) -> bool:
    return any(r.answered == status for r in receiver.received)


@pytest.mark.parametrize(
    ("url", "refusal"),
    [
        ("http://10.0.0.1/hook", "must be https"),
        ("https://10.0.0.1/hook", "private (10/8)"),
        ("https://169.254.169.254/latest", "cloud metadata service"),
    ],
)
async def test_a_webhook_to_a_private_address_is_refused_before_any_gpu_work(
    client: JobClient, local_stack: RunningStack, url: str, refusal: str
) -> None:
    before = await sim_prompts(local_stack)
    request = JobRequest(graph=example(steps=2), webhook=WebhookSpec(url=url))
    job_id = (await client.submit(request)).job_id
    final = await client.wait(job_id)
    assert final.state == JobState.FAILED
    assert final.error is not None and final.error.type == ErrorType.INVALID_REQUEST
    assert refusal in final.error.message and "webhook.url" in final.error.message
    assert final.teardown.state == "SKIPPED"
    assert await sim_prompts(local_stack) == before, "nothing reached the GPU"
    await workflow_closed(client, job_id)
    status = await client.status(job_id)
    assert status.webhook is not None and status.webhook.refused is not None
    assert (status.webhook.delivered, status.webhook.pending) == (0, 0)


async def test_a_tenant_without_a_secret_is_refused(
    client: JobClient, receiver: WebhookReceiver, local_stack: RunningStack
) -> None:
    before = await sim_prompts(local_stack)
    request = JobRequest(
        graph=example(steps=2),
        labels={"tenant": "nobody"},
        webhook=WebhookSpec(url=receiver.url),
    )
    job_id = (await client.submit(request)).job_id
    final = await client.wait(job_id)
    assert final.state == JobState.FAILED and final.teardown.state == "SKIPPED"
    assert final.error is not None and final.error.type == ErrorType.INVALID_REQUEST
    assert "tenant 'nobody'" in final.error.message
    assert await sim_prompts(local_stack) == before
    await workflow_closed(client, job_id)
    assert receiver.received == [], "nothing is sent unsigned"
