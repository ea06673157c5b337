"""Bounded pools over real HTTP (docs/http-api.md: `priority`, `policy.start_by_s`, PENDING and
`admission`, `GET /v1/pools/{pool}/queue`, `429 QueueFull`, EXPIRED): uvicorn in this process in
front of a worker of the module's own, whose pools on the local stack's simulator are bounded,
`line` to one job at a time and `tiny` to one at a time with one waiting.

Each test holds a pool's one slot with a long job (3,000 steps, a minute at the stack's 20 ms a
step) and cancels it at its end, so the jobs behind it wait as long as the test needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest_asyncio
from temporalio.service import RPCError

from configuration.settings import WorkerSettings
from devstack.config import PoolConfig
from devstack.models import RunningStack
from faults.wait import eventually
from gateway.errors import QUEUE_FULL_RETRY_AFTER_S
from gateway.submission import job_id_for
from starter import JobClient
from starter.connection import connect_temporal
from tests.support.cli import s3_settings
from tests.support.gateway import RunningGateway, job_body, running_gateway, sse_events
from worker import run_worker

LINE = "line"
TINY = "tiny"
LONG = 3000
SHORT = 4


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def bounded(local_stack: RunningStack) -> AsyncIterator[RunningGateway]:
    """The gateway in front of a worker (in this process) whose pools are bounded."""
    task_queue = f"gateway-pool-queue-{uuid.uuid4().hex[:8]}"
    sim = local_stack.comfyui_url
    settings = WorkerSettings(
        task_queue=task_queue,
        pools={
            "comfyui": PoolConfig(kind="comfyui", url=sim),
            LINE: PoolConfig(kind="comfyui", url=sim, max_running=1),
            TINY: PoolConfig(kind="comfyui", url=sim, max_running=1, max_pending=1),
        },
    )
    temporal = await connect_temporal(local_stack.temporal_address, local_stack.namespace)
    stop = asyncio.Event()
    worker = asyncio.create_task(
        run_worker(settings, s3_settings(local_stack), stop=stop, client=temporal)
    )

    async def connect() -> JobClient:
        return await JobClient.connect(
            local_stack.temporal_address,
            local_stack.namespace,
            task_queue=task_queue,
            s3=s3_settings(local_stack),
        )

    try:
        async with running_gateway(connect) as gateway:
            yield gateway
    finally:
        try:
            # Nothing of this module stays open on the dev server.
            query = f'TaskQueue = "{task_queue}" AND ExecutionStatus = "Running"'
            async for execution in temporal.list_workflows(query):
                # The list is eventually consistent: a job it names may have ended meanwhile.
                with contextlib.suppress(RPCError):
                    await temporal.get_workflow_handle(execution.id).terminate("test over")
        finally:
            stop.set()
            await asyncio.wait_for(worker, timeout=30)


@pytest_asyncio.fixture(loop_scope="session")
async def api(bounded: RunningGateway) -> AsyncIterator[Api]:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        api = Api(bounded, http)
        try:
            yield api
        finally:
            await api.clean_up()


class Api:
    """The gateway as a tenant calls it; every job submitted is cancelled at the test's end."""

    def __init__(self, gateway: RunningGateway, http: httpx.AsyncClient) -> None:
        self.url = gateway.url
        self.http = http
        self.jobs: dict[str, str] = {}  # job ID -> its tenant

    async def post(
        self, body: dict[str, Any], tenant: str = "acme", key: str | None = None
    ) -> httpx.Response:
        headers = RunningGateway.auth(tenant) | ({"Idempotency-Key": key} if key else {})
        answer = await self.http.post(f"{self.url}/v1/jobs", json=body, headers=headers)
        if answer.status_code in (200, 201):
            self.jobs[answer.json()["job_id"]] = tenant
        return answer

    async def submit(self, pool: str, steps: int, tenant: str = "acme", **fields: Any) -> str:
        answer = await self.post(job_body(steps, pool=pool, **fields), tenant)
        assert answer.status_code == 201, answer.text
        job_id: str = answer.json()["job_id"]
        return job_id

    async def job(self, job_id: str) -> dict[str, Any]:
        tenant = self.jobs.get(job_id, "acme")
        answer = await self.http.get(
            f"{self.url}/v1/jobs/{job_id}", headers=RunningGateway.auth(tenant)
        )
        assert answer.status_code == 200, answer.text
        view: dict[str, Any] = answer.json()
        return view

    async def until(
        self,
        job_id: str,
        accept: Callable[[dict[str, Any]], bool],
        what: str,
        timeout_s: float = 60,
    ) -> dict[str, Any]:
        return await eventually(
            lambda: self.job(job_id), timeout_s=timeout_s, what=what, accept=accept, interval_s=0.1
        )

    async def holding(self, pool: str) -> str:
        """A long job of acme's that holds the pool's one slot, once its prompt is at the pool."""
        job_id = await self.submit(pool, LONG)
        await self.until(job_id, lambda v: v["state"] in ("WAITING", "RUNNING"), f"{pool} held")
        return job_id

    async def queue(self, pool: str, tenant: str = "acme") -> httpx.Response:
        return await self.http.get(
            f"{self.url}/v1/pools/{pool}/queue", headers=RunningGateway.auth(tenant)
        )

    async def clean_up(self) -> None:
        for job_id, tenant in self.jobs.items():
            await self.http.post(
                f"{self.url}/v1/jobs/{job_id}/cancel", headers=RunningGateway.auth(tenant)
            )
        for job_id in self.jobs:
            await self.until(job_id, lambda v: v["terminal"], f"{job_id} ended")


# --- PENDING: the job's place, by GET, by its stream and in the pool's queue ------------------


async def test_a_pending_job_shows_its_place_in_get_its_stream_and_the_pools_queue(
    api: Api,
) -> None:
    blocker = await api.holding(LINE)
    waiter = await api.submit(LINE, SHORT, priority=2)
    view = await api.until(
        waiter,
        lambda v: v["state"] == "PENDING" and (v["admission"] or {}).get("position") == 1,
        "PENDING first in line",
    )
    admission = view["admission"]
    assert admission["pool"] == LINE and admission["granted"] is False, admission
    assert (admission["ahead"], admission["waiting"], admission["priority"]) == (0, 1, 2)
    # The caller's own tenant is not repeated; eta_s is there (null until a job has ended).
    assert "tenant" not in admission and "job_id" not in admission and "eta_s" in admission
    assert view["terminal"] is False

    # Its stream's first status says the same.
    url = f"{api.url}/v1/jobs/{waiter}/events"
    async with asyncio.timeout(30):
        async for event in sse_events(api.http, url, RunningGateway.auth("acme")):
            if event.event == "status":
                assert event.data["state"] == "PENDING", event.data
                assert event.data["admission"]["position"] == 1, event.data
                assert "tenant" not in event.data["admission"]
                break

    # The pool's queue: acme's own jobs; beta sees acme's only as totals.
    mine = await api.queue(LINE)
    assert mine.status_code == 200, mine.text
    shown = mine.json()
    assert [(j["job_id"], j["state"], j["position"], j["priority"]) for j in shown["jobs"]] == [
        (waiter, "waiting", 1, 2),
        (blocker, "running", None, 3),
    ]
    assert all(j["age_s"] >= 0 for j in shown["jobs"])
    assert (shown["max_running"], shown["running"], shown["waiting"]) == (1, 1, 1)
    assert shown["mine"] == {"waiting": 1, "running": 1}
    assert shown["others"] == {"waiting": 0, "running": 0}
    theirs_before = (await api.queue(LINE, "beta")).json()
    assert theirs_before["jobs"] == [] and theirs_before["others"] == {"waiting": 1, "running": 1}

    beta_job = await api.submit(LINE, SHORT, tenant="beta")
    await api.until(beta_job, lambda v: v["state"] == "PENDING", "beta's job PENDING")
    theirs = await api.queue(LINE, "beta")
    assert [j["job_id"] for j in theirs.json()["jobs"]] == [beta_job], theirs.text
    assert theirs.json()["others"] == {"waiting": 1, "running": 1}
    assert "acme" not in theirs.text, theirs.text
    mine_after = await api.queue(LINE)
    assert mine_after.json()["others"] == {"waiting": 1, "running": 0}
    assert "beta" not in mine_after.text, mine_after.text


async def test_the_queue_of_a_pool_without_one_is_404(api: Api) -> None:
    for pool in ("comfyui", f"nowhere-{uuid.uuid4().hex[:6]}"):
        answer = await api.queue(pool)
        assert answer.status_code == 404, answer.text
        error = answer.json()["error"]
        assert (
            error["type"] == "NoPoolQueue"
            and f"no queue runs for pool {pool!r}" in error["message"]
        )
    nobody = await api.http.get(f"{api.url}/v1/pools/{LINE}/queue")
    assert nobody.status_code == 401


# --- EXPIRED ----------------------------------------------------------------------------------


async def test_a_job_not_started_by_its_start_by_s_ends_expired_everywhere(api: Api) -> None:
    await api.holding(LINE)
    expiring = await api.submit(LINE, SHORT, policy={"start_by_s": 2.0})
    url = f"{api.url}/v1/jobs/{expiring}/events"
    statuses: list[dict[str, Any]] = []
    end: dict[str, Any] | None = None
    async with asyncio.timeout(60):
        async for event in sse_events(api.http, url, RunningGateway.auth("acme")):
            if event.event == "status":
                statuses.append(event.data)
            if event.event == "end":
                end = event.data
                break
    assert end == {"state": "EXPIRED"}, statuses[-1:]
    final = statuses[-1]
    assert (final["state"], final["terminal"]) == ("EXPIRED", True), final
    assert final["error"]["type"] == "Expired", final["error"]
    assert (await api.job(expiring))["state"] == "EXPIRED"
    config = (await api.http.get(f"{api.url}/v1/config")).json()
    assert "EXPIRED" in config["terminal_states"]

    async def listed() -> list[str]:
        answer = await api.http.get(
            f"{api.url}/v1/jobs", params={"state": "expired"}, headers=RunningGateway.auth("acme")
        )
        return [job["job_id"] for job in answer.json()["jobs"]]

    await eventually(
        listed, timeout_s=10, what="listed EXPIRED", accept=lambda ids: expiring in ids
    )


# --- QueueFull --------------------------------------------------------------------------------


def assert_queue_full(answer: httpx.Response) -> dict[str, Any]:
    """429 QueueFull, its Retry-After the queue's estimate rounded up (the fallback without)."""
    assert answer.status_code == 429, answer.text
    error: dict[str, Any] = answer.json()["error"]
    assert error["type"] == "QueueFull" and error["pool"] == TINY, error
    assert error["message"].startswith("queue full: ") and "nothing was started" in error["message"]
    estimate = error["retry_after_s"]
    expected = QUEUE_FULL_RETRY_AFTER_S if estimate is None else math.ceil(estimate)
    assert answer.headers["retry-after"] == str(expected), (answer.headers, error)
    return error


async def test_above_max_pending_a_submission_is_429_queue_full_and_nothing_starts(
    api: Api,
) -> None:
    blocker = await api.holding(TINY)
    body = job_body(SHORT, pool=TINY)
    waiting_key = f"waiting-{uuid.uuid4().hex[:6]}"
    first = await api.post(body, key=waiting_key)
    assert first.status_code == 201, first.text
    waiter = first.json()["job_id"]
    await api.until(waiter, lambda v: v["state"] == "PENDING", "one waiting")

    key = f"one-too-many-{uuid.uuid4().hex[:6]}"
    refused = await api.post(job_body(SHORT, pool=TINY), key=key)
    error = assert_queue_full(refused)
    assert "max_pending is 1" in error["reason"] and error["reason"] in error["message"]
    # Nothing was started under its key's ID.
    gone = await api.http.get(
        f"{api.url}/v1/jobs/{job_id_for('acme', key)}", headers=RunningGateway.auth("acme")
    )
    assert gone.status_code == 404, gone.text
    # A repeat of the submission that got in is answered, not refused.
    again = await api.post(body, key=waiting_key)
    assert again.status_code == 200 and again.json()["job_id"] == waiter, again.text
    # The pool's own bound holds for every tenant; beta is told the totals, not acme's jobs.
    theirs = await api.post(job_body(SHORT, pool=TINY), tenant="beta")
    assert "acme" not in assert_queue_full(theirs)["message"]

    # Once a job of the pool has ended, the queue knows its hold times: the wait is its own.
    await api.http.post(f"{api.url}/v1/jobs/{blocker}/cancel", headers=RunningGateway.auth("acme"))
    await api.until(waiter, lambda v: v["state"] == "COMPLETED", "the waiter ran", timeout_s=90)
    await api.holding(TINY)
    await api.until(await api.submit(TINY, SHORT), lambda v: v["state"] == "PENDING", "waiting")
    estimated = assert_queue_full(await api.post(job_body(SHORT, pool=TINY)))
    assert estimated["retry_after_s"] is not None and estimated["retry_after_s"] >= 1, estimated
