"""Batches over real HTTP (docs/http-api.md, Batches): submit by `count` and by `overrides`,
status, its event stream to the end, results, cancel; idempotency, tenants, refusals (422 at the
job's place, 413 saying how to send less, 429 for the tenant's cap and for a full queue); and a
batch of a thousand jobs in one request.

The gateway is the conftest's, in front of this module's own worker, whose pools on the local
stack's simulator are bounded: `comfyui` runs four jobs at once, `bulk` one (a thousand jobs
wait in its line, cheap to cancel), `tiny` one with at most two waiting (a full queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest_asyncio
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.service import RPCError

from activities.storage import ArtifactStore
from configuration.settings import GatewaySettings, WorkerSettings
from devstack.config import PoolConfig
from devstack.models import RunningStack
from faults.wait import eventually
from gateway.limits import jobs_in_flight_query
from starter import JobClient
from starter.connection import connect_temporal
from tests.support.cli import RunningWorker, example, s3_settings
from tests.support.gateway import (
    TEST_SETTINGS,
    RunningGateway,
    job_body,
    running_gateway,
    serving_app,
    sse_events,
    stack_client_factory,
    wait_state,
)
from worker import run_worker
from workflows.job_input import JobInput

POOL = "comfyui"
BULK = "bulk"
TINY = "tiny"
# Steps of a job that holds its pool's slot as long as a test needs (a minute at the stack's
# 20 ms a step); each test cancels what it started.
LONG = 3000
# The test gateway's body limit (tests/support/gateway.py): tighter than the 4 MiB default.
BODY_LIMIT = int(TEST_SETTINGS["DURABLE_COMFY_GATEWAY_MAX_BODY_BYTES"])


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def worker(local_stack: RunningStack) -> AsyncIterator[RunningWorker]:
    """This module's worker, behind the conftest's `gateway`, with bounded pools; whatever a
    test leaves running is terminated at the end."""
    task_queue = f"gateway-batches-{uuid.uuid4().hex[:8]}"
    sim = local_stack.comfyui_url
    settings = WorkerSettings(
        task_queue=task_queue,
        pools={
            POOL: PoolConfig(kind="comfyui", url=sim, max_running=4),
            BULK: PoolConfig(kind="comfyui", url=sim, max_running=1),
            TINY: PoolConfig(kind="comfyui", url=sim, max_running=1, max_pending=2),
        },
    )
    temporal = await connect_temporal(local_stack.temporal_address, local_stack.namespace)
    stop = asyncio.Event()
    running = asyncio.create_task(
        run_worker(settings, s3_settings(local_stack), stop=stop, client=temporal)
    )
    try:
        async with ArtifactStore(s3_settings(local_stack)) as store:
            client = JobClient(temporal, task_queue=task_queue, store=store)
            yield RunningWorker(task_queue, client, store)
    finally:
        # The worker first: a batch's workflow starts its jobs there, and a start still going
        # after the terminations would leave jobs running.
        stop.set()
        try:
            await asyncio.wait_for(running, timeout=60)
        finally:
            await terminate_all(temporal, task_queue)


def template(steps: int = 2, pool: str = POOL, **extra: Any) -> dict[str, Any]:
    """A job's request: the example graph with a fresh seed (never answered from a cache)."""
    return job_body(steps, **extra) | {"pool": pool}


async def submit(
    http: httpx.AsyncClient,
    gateway: RunningGateway,
    body: dict[str, Any],
    tenant: str = "acme",
    key: str | None = None,
) -> httpx.Response:
    headers = gateway.auth(tenant) | ({"Idempotency-Key": key} if key else {})
    return await http.post(f"{gateway.url}/v1/batches", json=body, headers=headers, timeout=180)


def batch_id_of(tenant: str, key: str) -> str:
    """The batch ID an Idempotency-Key names (docs/http-api.md, Batches)."""
    return f"{tenant}.batch-{hashlib.sha256(key.encode()).hexdigest()[:32]}"


async def batch_of(
    http: httpx.AsyncClient, gateway: RunningGateway, batch_id: str, tenant: str = "acme"
) -> dict[str, Any]:
    answer = await http.get(f"{gateway.url}/v1/batches/{batch_id}", headers=gateway.auth(tenant))
    assert answer.status_code == 200, answer.text
    view: dict[str, Any] = answer.json()
    return view


async def wait_batch(
    http: httpx.AsyncClient,
    gateway: RunningGateway,
    batch_id: str,
    tenant: str = "acme",
    until: str = "terminal",
) -> dict[str, Any]:
    """Polls GET until the batch has ended, or until `until` is among its counts (bounded by
    the test's own timeout)."""
    while True:
        view = await batch_of(http, gateway, batch_id, tenant)
        if view["terminal"] or view["counts"].get(until, 0) > 0:
            return view
        await asyncio.sleep(0.2)


async def cancel(
    http: httpx.AsyncClient, gateway: RunningGateway, batch_id: str, tenant: str = "acme"
) -> dict[str, Any]:
    url = f"{gateway.url}/v1/batches/{batch_id}/cancel"
    answer = await http.post(url, headers=gateway.auth(tenant))
    assert answer.status_code == 202, answer.text
    view: dict[str, Any] = answer.json()
    return view


def error_of(answer: httpx.Response, status: int, error_type: str) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    error: dict[str, Any] = answer.json()["error"]
    assert error["type"] == error_type, error
    return error


def locs(answer: httpx.Response) -> list[list[Any]]:
    return [problem["loc"] for problem in answer.json()["error"]["problems"]]


async def seed_of(worker: RunningWorker, job_id: str) -> int:
    """The KSampler seed the job was started with, from the first event of its history."""
    client = worker.client
    # The batch's workflow starts its jobs: the submission may have answered before.
    await client._until_started(job_id)
    async for event in client.handle(job_id).fetch_history_events():
        assert event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED
        payloads = event.workflow_execution_started_event_attributes.input.payloads
        [job_input] = await client.temporal.data_converter.decode(payloads, [JobInput])
        assert isinstance(job_input, JobInput)
        seed: int = job_input.request.graph["3"]["inputs"]["seed"]
        return seed
    raise AssertionError(f"{job_id} has no history")


async def test_a_batch_by_count_streams_its_status_to_the_end_then_gives_its_results(
    gateway: RunningGateway, http: httpx.AsyncClient, worker: RunningWorker
) -> None:
    request = template(steps=20)
    answer = await submit(http, gateway, {"request": request, "count": 3})
    assert answer.status_code == 201, answer.text
    view = answer.json()
    batch_id = view["batch_id"]
    assert batch_id.startswith("acme.batch-") and view["total"] == 3
    assert answer.headers["location"] == view["links"]["self"] == f"/v1/batches/{batch_id}"
    assert view["links"]["events"] == f"/v1/batches/{batch_id}/events"
    assert view["links"]["results"] == f"/v1/batches/{batch_id}/results"
    job_ids = [job["job_id"] for job in view["jobs"]]
    assert job_ids == [f"{batch_id}-0001", f"{batch_id}-0002", f"{batch_id}-0003"]
    assert [job["links"]["self"] for job in view["jobs"]] == [f"/v1/jobs/{j}" for j in job_ids]
    # `count` varies the seeds: job i adds i to the request's.
    seed = request["graph"]["3"]["inputs"]["seed"]
    assert [await seed_of(worker, job_id) for job_id in job_ids] == [seed, seed + 1, seed + 2]

    url = f"{gateway.url}/v1/batches/{batch_id}/events"
    events = [event async for event in sse_events(http, url, gateway.auth())]
    assert [event.event for event in events[-2:]] == ["status", "end"]
    assert {event.event for event in events[:-1]} == {"status"}
    statuses = [event.data for event in events[:-1]]
    final = statuses[-1]
    assert final["state"] == "COMPLETED" and final["terminal"] is True
    assert final["counts"] == {"COMPLETED": 3} and final["ended"] == 3
    assert events[-1].data == {"state": "COMPLETED"} and events[-1].id == str(final["seq"])
    assert len(statuses) >= 2 and not any(status["terminal"] for status in statuses[:-1])
    # One event per change, each with the batch's seq as its id.
    assert [event.id for event in events[:-1]] == [str(status["seq"]) for status in statuses]
    shown = [(s["state"], s["seq"], sorted(s["counts"].items())) for s in statuses]
    assert all(before != after for before, after in itertools.pairwise(shown))
    assert final["links"]["self"] == f"/v1/batches/{batch_id}"

    first = await http.get(f"{gateway.url}/v1/batches/{batch_id}", headers=gateway.auth())
    assert first.json()["counts"] == {"COMPLETED": 3} and first.json()["artifacts"] == 3
    tag = first.headers["etag"]
    assert tag.startswith(f'"{final["seq"]}.')
    same = await http.get(
        f"{gateway.url}/v1/batches/{batch_id}", headers=gateway.auth() | {"If-None-Match": tag}
    )
    assert same.status_code == 304 and same.content == b""

    results = await http.get(f"{gateway.url}/v1/batches/{batch_id}/results", headers=gateway.auth())
    assert results.status_code == 200, results.text
    ends = results.json()["ends"]
    assert results.json()["state"] == "COMPLETED"
    assert sorted(end["job_id"] for end in ends) == job_ids
    assert all(end["state"] == "COMPLETED" and len(end["artifacts"]) == 1 for end in ends)
    assert all(end["links"]["self"] == f"/v1/jobs/{end['job_id']}" for end in ends)
    image = await http.get(ends[0]["artifacts"][0]["url"])
    assert image.status_code == 200 and image.content.startswith(b"\x89PNG")
    # Each job of the batch is an ordinary job of its tenant.
    assert (await wait_state(http, gateway, job_ids[1]))["state"] == "COMPLETED"


async def test_a_batch_by_overrides_runs_each_job_with_its_own(
    gateway: RunningGateway, http: httpx.AsyncClient, worker: RunningWorker
) -> None:
    seeds = [uuid.uuid4().int % 2**32 for _ in range(2)]
    body = {
        "request": {"graph": example(steps=2), "pool": POOL},
        "overrides": [{"3": {"seed": seed}} for seed in seeds],
    }
    answer = await submit(http, gateway, body)
    assert answer.status_code == 201, answer.text
    batch_id = answer.json()["batch_id"]
    job_ids = [job["job_id"] for job in answer.json()["jobs"]]
    assert [await seed_of(worker, job_id) for job_id in job_ids] == seeds
    final = await wait_batch(http, gateway, batch_id)
    assert final["state"] == "COMPLETED" and final["counts"] == {"COMPLETED": 2}
    assert final["artifacts"] == 2 and final["progress"] == 1.0


async def test_cancel_stops_every_job_and_the_batch_ends_cancelled(
    gateway: RunningGateway, http: httpx.AsyncClient
) -> None:
    answer = await submit(http, gateway, {"request": template(LONG, pool=BULK), "count": 3})
    assert answer.status_code == 201, answer.text
    batch_id = answer.json()["batch_id"]
    job_ids = [job["job_id"] for job in answer.json()["jobs"]]
    await wait_batch(http, gateway, batch_id, until="RUNNING")

    url = f"{gateway.url}/v1/batches/{batch_id}/cancel"
    bad = await http.post(url, json={"colour": "red"}, headers=gateway.auth())
    assert bad.status_code == 422 and locs(bad) == [["colour"]]
    sent = await http.post(url, json={"reason": "enough"}, headers=gateway.auth())
    assert sent.status_code == 202, sent.text
    assert sent.json()["state"] in ("CANCELLING", "CANCELLED")
    assert sent.json()["cancel_reason"] == "enough"
    final = await wait_batch(http, gateway, batch_id)
    assert final["state"] == "CANCELLED" and final["counts"] == {"CANCELLED": 3}
    for job_id in job_ids:
        assert (await wait_state(http, gateway, job_id))["state"] == "CANCELLED"
    results = await http.get(f"{gateway.url}/v1/batches/{batch_id}/results", headers=gateway.auth())
    assert sorted(end["job_id"] for end in results.json()["ends"]) == job_ids
    assert all(end["state"] == "CANCELLED" for end in results.json()["ends"])
    # A batch that has ended stays as it is.
    again = await cancel(http, gateway, batch_id)
    assert again["state"] == "CANCELLED" and again["cancel_reason"] == "enough"


async def test_the_same_key_and_body_is_the_same_batch_and_another_body_conflicts(
    gateway: RunningGateway, http: httpx.AsyncClient
) -> None:
    key = f"order-{uuid.uuid4().hex}"
    body = {"request": template(LONG, pool=BULK), "count": 2}
    first = await submit(http, gateway, body, key=key)
    assert first.status_code == 201, first.text
    batch_id = first.json()["batch_id"]
    assert batch_id == batch_id_of("acme", key)

    again = await submit(http, gateway, body, key=key)
    assert again.status_code == 200, again.text
    assert again.json()["batch_id"] == batch_id and again.json()["total"] == 2

    other = await submit(http, gateway, body | {"count": 3}, key=key)
    error = error_of(other, 409, "BatchConflict")
    assert error["batch_id"] == batch_id
    assert (await batch_of(http, gateway, batch_id))["total"] == 2

    # The same key of another tenant is another batch, and of a job another job.
    theirs = await submit(http, gateway, body, tenant="beta", key=key)
    assert theirs.status_code == 201 and theirs.json()["batch_id"] == batch_id_of("beta", key)
    headers = gateway.auth() | {"Idempotency-Key": key}
    job = await http.post(f"{gateway.url}/v1/jobs", json=template(2), headers=headers)
    assert job.status_code == 201 and not job.json()["job_id"].startswith(batch_id)

    await cancel(http, gateway, batch_id)
    await cancel(http, gateway, theirs.json()["batch_id"], tenant="beta")


async def test_another_tenants_batch_is_not_found_anywhere(
    gateway: RunningGateway, http: httpx.AsyncClient
) -> None:
    answer = await submit(http, gateway, {"request": template(), "count": 1})
    assert answer.status_code == 201, answer.text
    batch_id = answer.json()["batch_id"]
    [job_id] = [job["job_id"] for job in answer.json()["jobs"]]
    base = f"{gateway.url}/v1/batches"
    beta = gateway.auth("beta")
    unknown = f"beta.batch-{uuid.uuid4().hex}"
    for path in ("", "/results", "/events"):
        theirs = await http.get(f"{base}/{batch_id}{path}", headers=beta)
        nobody = await http.get(f"{base}/{unknown}{path}", headers=beta)
        # One body for both, but for the ID it names.
        shown = error_of(theirs, 404, "BatchNotFound")
        assert shown == {"type": "BatchNotFound", "message": f"no batch {batch_id!r}"} | {
            "batch_id": batch_id
        }
        assert error_of(nobody, 404, "BatchNotFound")["message"] == f"no batch {unknown!r}"
    error_of(await http.post(f"{base}/{batch_id}/cancel", headers=beta), 404, "BatchNotFound")
    # A job is no batch, even its owner's; nor is an ID no batch could have.
    error_of(await http.get(f"{base}/{job_id}", headers=gateway.auth()), 404, "BatchNotFound")
    error_of(await http.get(f"{base}/no%20such", headers=gateway.auth()), 404, "BatchNotFound")
    error_of(await http.get(f"{base}/{batch_id}"), 401, "Unauthorized")
    # The owner still sees it, and it runs to its end.
    assert (await wait_batch(http, gateway, batch_id))["state"] == "COMPLETED"


async def test_a_refused_batch_names_the_job_and_field_and_starts_nothing(
    gateway: RunningGateway, http: httpx.AsyncClient
) -> None:
    key = f"refused-{uuid.uuid4().hex}"
    good = template()
    no_class = template()
    del no_class["graph"]["8"]["class_type"]

    graph = await submit(http, gateway, {"requests": [good, no_class]}, key=key)
    error_of(graph, 422, "InvalidGraph")
    assert locs(graph) == [["requests", 1, "graph", "8", "class_type"]]

    elsewhere = template(output={"prefix": "jobs/beta"})
    outside = await submit(http, gateway, {"requests": [good, good, elsewhere]}, key=key)
    error_of(outside, 422, "InvalidRequest")
    assert locs(outside) == [["requests", 2, "output", "prefix"]]

    hook = template(webhook={"url": "http://hooks.example.com/h"})
    job_hook = await submit(http, gateway, {"requests": [good, hook]}, key=key)
    assert locs(job_hook) == [["requests", 1, "webhook", "url"]]
    batch_hook = {"request": good, "count": 2, "webhook": {"url": "https://127.0.0.1/h"}}
    assert locs(await submit(http, gateway, batch_hook, key=key)) == [["webhook", "url"]]

    overrides = [{"3": {"seed": 1}}, {"99": {"seed": 2}}, {"3": {"sede": 3}}]
    overridden = await submit(http, gateway, {"request": good, "overrides": overrides}, key=key)
    error_of(overridden, 422, "InvalidRequest")
    assert locs(overridden) == [["overrides", 1, "99"], ["overrides", 2, "3", "sede"]]
    # An override may make a graph the worker would refuse: each job's is checked again.
    links = [{"3": {"seed": 1}}, {"8": {"samples": ["42", 0]}}]
    relinked = await submit(http, gateway, {"request": good, "overrides": links}, key=key)
    error_of(relinked, 422, "InvalidGraph")
    assert locs(relinked) == [["overrides", 1, "graph", "8", "inputs.samples"]]

    template_bad = await submit(http, gateway, {"request": good | {"priority": 9}, "count": 2})
    assert locs(template_bad) == [["request", "priority"]]
    too_many = await submit(http, gateway, {"request": good, "count": 1001}, key=key)
    error_of(too_many, 422, "InvalidRequest")
    assert locs(too_many) == [["count"]] and "several batches" in too_many.text
    inside = await submit(http, gateway, {"requests": [good | {"detached": False}]}, key=key)
    assert locs(inside) == [["requests", 0, "detached"]]
    both = await submit(http, gateway, {"requests": [good], "request": good, "count": 1}, key=key)
    assert locs(both) == [[]] and "batch: send either" in both.json()["error"]["message"]
    empty = await http.post(
        f"{gateway.url}/v1/batches", content=b"", headers=gateway.auth() | {"Idempotency-Key": key}
    )
    assert empty.status_code == 422 and "BatchRequest" in empty.text

    nothing = await http.get(
        f"{gateway.url}/v1/batches/{batch_id_of('acme', key)}", headers=gateway.auth()
    )
    error_of(nothing, 404, "BatchNotFound")


async def test_a_body_over_the_limit_is_told_to_send_the_graph_once_or_split(
    gateway: RunningGateway, http: httpx.AsyncClient
) -> None:
    whole = json.dumps({"requests": [template() for _ in range(60)]}).encode()
    assert len(whole) > BODY_LIMIT
    url = f"{gateway.url}/v1/batches"
    headers = gateway.auth() | {"Content-Type": "application/json"}

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(whole), 8192):
            yield whole[start : start + 8192]

    for content in (whole, chunks()):
        answer = await http.post(url, content=content, headers=headers)
        error = error_of(answer, 413, "RequestTooLarge")
        assert error["limit"] == BODY_LIMIT
        for advice in ("`request`", "`count`", "`overrides`", "several batches", "1,000"):
            assert advice in error["message"], error["message"]
    # A single job's body is told what a job can do.
    job = await http.post(f"{gateway.url}/v1/jobs", content=whole, headers=headers)
    assert "`count`" not in error_of(job, 413, "RequestTooLarge")["message"]


@contextlib.asynccontextmanager
async def idling(local_stack: RunningStack) -> AsyncIterator[RunningGateway]:
    """A gateway in front of a worker of its own that runs one activity at a time: a thousand
    jobs start (their workflows, and the batch's) and wait for it, so what a test of them costs
    is the gateway's and Temporal's work, not a thousand jobs' runs. Everything on its task
    queue is terminated at the end."""
    task_queue = f"gateway-batches-idle-{uuid.uuid4().hex[:8]}"
    settings = WorkerSettings(
        task_queue=task_queue,
        pools={POOL: PoolConfig(kind="comfyui", url=local_stack.comfyui_url)},
        max_concurrent_activities=1,
    )
    temporal = await connect_temporal(local_stack.temporal_address, local_stack.namespace)
    stop = asyncio.Event()
    running = asyncio.create_task(
        run_worker(settings, s3_settings(local_stack), stop=stop, client=temporal)
    )
    try:
        async with ArtifactStore(s3_settings(local_stack)) as store:
            client = JobClient(temporal, task_queue=task_queue, store=store)
            idle = RunningWorker(task_queue, client, store)
            async with running_gateway(stack_client_factory(local_stack, idle)) as gateway:
                yield gateway
    finally:
        # The worker first: a batch's workflow starts its jobs there, and a start still going
        # after the terminations would leave jobs running.
        stop.set()
        try:
            await asyncio.wait_for(running, timeout=60)
        finally:
            await terminate_all(temporal, task_queue)


async def terminate_all(temporal: Client, task_queue: str) -> None:
    gate = asyncio.Semaphore(32)

    async def terminate(workflow_id: str) -> None:
        async with gate:
            # The list is eventually consistent: a workflow it names may have ended since.
            with contextlib.suppress(RPCError):
                await temporal.get_workflow_handle(workflow_id).terminate("test over")

    query = f'TaskQueue = "{task_queue}" AND ExecutionStatus = "Running"'
    ids = [execution.id async for execution in temporal.list_workflows(query)]
    await asyncio.gather(*(terminate(workflow_id) for workflow_id in ids))


async def test_a_thousand_jobs_in_one_request_by_count_or_by_overrides(
    local_stack: RunningStack, http: httpx.AsyncClient
) -> None:
    request = {"graph": example(steps=LONG), "pool": POOL}
    by_count = {"request": request, "count": 1000}
    by_overrides = {"request": request, "overrides": [{"3": {"seed": n}} for n in range(1000)]}
    # Under the test gateway's limit (64 KiB), a sixty-fourth of the default's.
    assert len(json.dumps(by_overrides)) < BODY_LIMIT
    async with idling(local_stack) as gateway:
        answer = await submit(http, gateway, by_count, tenant="delta")
        assert answer.status_code == 201, answer.text
        view = answer.json()
        batch_id = view["batch_id"]
        assert view["total"] == 1000 and len(view["jobs"]) == 1000
        assert [job["job_id"] for job in view["jobs"][::999]] == [
            f"{batch_id}-0001",
            f"{batch_id}-1000",
        ]
        again = await batch_of(http, gateway, batch_id, tenant="delta")
        assert again["total"] == 1000 and again["ended"] == 0
        # The 1,000 overrides are read whole in one body too: one that names no node, last,
        # refuses the batch before any of its jobs starts (what starting them costs is the
        # count form's, above).
        overrides: list[dict[str, Any]] = [{"3": {"seed": n}} for n in range(999)]
        bad = [*overrides, {"99": {"seed": 1}}]
        refused = await submit(http, gateway, by_overrides | {"overrides": bad}, tenant="delta")
        assert refused.status_code == 422, refused.text
        assert ["overrides", 999, "99"] in locs(refused), refused.text


async def test_a_batch_over_the_tenants_open_jobs_is_refused_whole(
    local_stack: RunningStack, worker: RunningWorker, http: httpx.AsyncClient
) -> None:
    """A gateway whose tenant may have three jobs in flight."""
    tenant, key = f"capped-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    settings = GatewaySettings(
        **{"DURABLE_COMFY_API_KEYS": f"{tenant}:{key} max_jobs=3", **TEST_SETTINGS}  # type: ignore[arg-type]
    )
    async with serving_app(settings, stack_client_factory(local_stack, worker)) as capped:
        url = f"{capped.url}/v1/batches"
        auth = {"Authorization": f"Bearer {key}"}
        body = {"request": template(LONG, pool=BULK), "count": 4}

        over = await http.post(url, json=body, headers=auth | {"Idempotency-Key": "four"})
        error = error_of(over, 429, "TooManyJobs")
        assert "a batch of 4 jobs" in error["message"] and over.headers["retry-after"] == "5"
        nothing = await http.get(f"{url}/{batch_id_of(tenant, 'four')}", headers=auth)
        error_of(nothing, 404, "BatchNotFound")

        three = body | {"count": 3}
        first = await http.post(url, json=three, headers=auth | {"Idempotency-Key": "three"})
        assert first.status_code == 201, first.text
        query = jobs_in_flight_query(tenant)
        await eventually(
            lambda: worker.client.temporal.count_workflows(query),
            accept=lambda counted: counted.count >= 3,
            timeout_s=30,
            what="visibility counts the three jobs",
            interval_s=0.1,
        )
        # A repeat of the batch that got in is answered, not counted again.
        again = await http.post(url, json=three, headers=auth | {"Idempotency-Key": "three"})
        assert again.status_code == 200, again.text
        two = await http.post(url, json=body | {"count": 2}, headers=auth)
        error = error_of(two, 429, "TooManyJobs")
        assert "3 jobs in flight and the batch would add 2" in error["message"], error
        cancelled = await http.post(f"{url}/{first.json()['batch_id']}/cancel", headers=auth)
        assert cancelled.status_code == 202, cancelled.text


async def test_a_batch_the_pools_queue_has_no_room_for_is_refused_whole(
    gateway: RunningGateway, http: httpx.AsyncClient
) -> None:
    """`tiny` runs one job and lets two wait: with its slot held, three more do not fit."""
    holder = await http.post(
        f"{gateway.url}/v1/jobs", json=template(LONG, pool=TINY), headers=gateway.auth()
    )
    assert holder.status_code == 201, holder.text
    job_id = holder.json()["job_id"]
    while True:
        job = await http.get(f"{gateway.url}/v1/jobs/{job_id}", headers=gateway.auth())
        if job.json()["state"] == "RUNNING":
            break
        await asyncio.sleep(0.1)
    key = f"full-{uuid.uuid4().hex}"
    full = await submit(http, gateway, {"request": template(pool=TINY), "count": 3}, key=key)
    error = error_of(full, 429, "QueueFull")
    assert error["pool"] == TINY and int(full.headers["retry-after"]) >= 1
    nothing = await http.get(
        f"{gateway.url}/v1/batches/{batch_id_of('acme', key)}", headers=gateway.auth()
    )
    error_of(nothing, 404, "BatchNotFound")
    fits = await submit(http, gateway, {"request": template(pool=TINY), "count": 2})
    assert fits.status_code == 201, fits.text
    await cancel(http, gateway, fits.json()["batch_id"])
    stopped = await http.post(f"{gateway.url}/v1/jobs/{job_id}/cancel", headers=gateway.auth())
    assert stopped.status_code == 202, stopped.text
