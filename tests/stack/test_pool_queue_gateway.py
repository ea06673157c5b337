"""Tenants' fair shares of a bounded pool, through the HTTP gateway, on the real Temporal server.

Two worker processes serve a pool bounded to one job at a time (`max_running: 1`) on a
simulator of this module's own (parallel: a prompt starts the moment it arrives, so the order
of the prompts' starts is the order of the queue's grants). Tenant acme (weight 1) submits 60
jobs through the gateway; once they are in line, tenant beta submits 6. The starts counted are
the simulator's (`started_at` of each job's `checkpoint.prompt_id`) from beta's first accepted
submission up to beta's last start.

Why the bounds (workflows/admission.py, stride scheduling). acme's pass after its k-th start is
k; beta comes in line at the pass of the last start, k - 1, so it starts next; with weight 1
its pass then equals acme's, and a tie goes to the tenant whose first waiting job came first
(acme): B A B A B A B A B A B, beta's 6 within 11 starts. With weight 2 its pass grows by 1/2
a start: B B A B B A B B, within 8. One start more is allowed for the acme job the queue had
granted before beta's requests reached it (its prompt may begin after beta's acceptance): 12
and 9. A job holds the slot about a second (80 steps at 10 ms, and the job's own work), longer
than beta's request takes to reach the queue, so no second acme start comes before it.

Why it fails when fairness breaks: first come, first served would start every one of acme's 40
or more waiting jobs before beta's first (over 40 starts against 12 and 9); weights ignored
(beta's 2 taken as 1) give the weight-1 order, 11 starts against the bound of 9.

The test also reads, through the gateway, the stream of a job waiting in line: its status
says PENDING with its `admission.position`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from temporalio.service import RPCError

from devstack.models import RunningStack
from devstack.processes import terminate
from faults.wait import eventually
from faults.worker_proc import KillableWorker
from starter import JobClient
from starter.connection import connect_temporal
from tests.stack.parallel_sim import start_parallel_sim
from tests.support.cli import s3_settings
from tests.support.gateway import RunningGateway, job_body, running_gateway, sse_events

POOL = "fair"
WORKERS = 2
STEP_DELAY_MS = 10
# About 0.8 s of prompt a job: a start about every second, slower than a request reaches the
# queue (the module's docstring), quick enough for the 20 or so starts the test waits for.
STEPS = 80
A, B = "acme", "beta"
A_JOBS, B_JOBS = 60, 6
# acme's submissions in flight at once.
SUBMITTING_AT_ONCE = 8


@dataclass
class Sim:
    url: str
    http: httpx.AsyncClient

    async def started_at(self) -> dict[str, float]:
        """prompt_id -> when the simulator began to run it (epoch seconds)."""
        stats = (await self.http.get(f"{self.url}/sim/stats", timeout=5)).json()
        started: dict[str, float] = stats["started_at"]
        return started


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def sim(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Sim]:
    base = tmp_path_factory.mktemp("fair-sim")
    record, url = await start_parallel_sim(base, step_delay_ms=STEP_DELAY_MS, parallel=100)
    try:
        async with httpx.AsyncClient(trust_env=False) as http:
            yield Sim(url, http)
    finally:
        await terminate(record, grace_s=10)


@dataclass
class Fleet:
    gateway: RunningGateway
    client: JobClient
    http: httpx.AsyncClient

    async def submit(self, tenant: str) -> tuple[str, float]:
        """A job of `tenant` through the gateway: its ID and when it was accepted."""
        answer = await self.http.post(
            f"{self.gateway.url}/v1/jobs",
            json=job_body(STEPS, pool=POOL),
            headers=RunningGateway.auth(tenant),
        )
        accepted = time.time()
        assert answer.status_code == 201, answer.text
        return answer.json()["job_id"], accepted

    async def queue(self, tenant: str) -> dict[str, Any]:
        answer = await self.http.get(
            f"{self.gateway.url}/v1/pools/{POOL}/queue", headers=RunningGateway.auth(tenant)
        )
        assert answer.status_code == 200, answer.text
        shown: dict[str, Any] = answer.json()
        return shown

    async def prompts(self, job_ids: list[str]) -> dict[str, str]:
        """job ID -> its prompt's ID, for the jobs that have one."""
        statuses = await asyncio.gather(*(self.client.status(j) for j in job_ids))
        return {
            s.job_id: s.checkpoint.prompt_id
            for s in statuses
            if s.checkpoint is not None and s.checkpoint.prompt_id is not None
        }


@asynccontextmanager
async def fleet_of(
    stack: RunningStack, sim: Sim, base: Path, tenants: dict[str, Any]
) -> AsyncIterator[Fleet]:
    """Worker processes serving the bounded pool with `tenants` (DURABLE_COMFY_TENANTS), on a
    task queue of their own, and the gateway in front of them; everything of the task queue is
    terminated on the way out."""
    task_queue = f"fair-{uuid.uuid4().hex[:8]}"
    env = {
        **stack.worker_env(),
        "DURABLE_COMFY_TASK_QUEUE": task_queue,
        "DURABLE_COMFY_POOLS": json.dumps({POOL: {"url": sim.url, "max_running": 1}}),
        "DURABLE_COMFY_DEFAULT_POOL": POOL,
        "DURABLE_COMFY_TENANTS": json.dumps(tenants),
    }
    workers = [
        KillableWorker(env, base / f"worker-{n}.log", name=f"worker-{n}")
        for n in range(1, WORKERS + 1)
    ]
    temporal = await connect_temporal(stack.temporal_address, stack.namespace)

    async def connect() -> JobClient:
        return await JobClient.connect(
            stack.temporal_address, stack.namespace, task_queue=task_queue, s3=s3_settings(stack)
        )

    try:
        await asyncio.gather(*(w.start() for w in workers))
        async with (
            running_gateway(connect) as gateway,
            httpx.AsyncClient(trust_env=False, timeout=60) as http,
        ):
            yield Fleet(gateway, JobClient(temporal, task_queue=task_queue), http)
    finally:
        try:
            query = f'TaskQueue = "{task_queue}" AND ExecutionStatus = "Running"'
            async for execution in temporal.list_workflows(query):
                # The list is eventually consistent: a job it names may have ended meanwhile.
                with contextlib.suppress(RPCError):
                    await temporal.get_workflow_handle(execution.id).terminate("test over")
        finally:
            # Whatever happened above, no worker process outlives the test.
            await asyncio.gather(*(w.terminate(grace_s=10.0) for w in workers))
            for worker in workers:
                print(f"==== {worker.name} ====\n{worker.log_tail(30)}")
    assert [pid for w in workers for pid in w.running_pids()] == []


async def pending_position(fleet: Fleet, job_id: str) -> int:
    """The `admission.position` of the job's stream: PENDING once its check is done (its place
    told with the check's result, or shortly after when the check could not wait for it)."""
    url = f"{fleet.gateway.url}/v1/jobs/{job_id}/events"
    async with asyncio.timeout(30):
        async for event in sse_events(fleet.http, url, RunningGateway.auth(A)):
            if event.event == "status":
                if event.data["state"] in ("QUEUED", "PREPARING", "SUBMITTING"):
                    continue  # its check (which asks the queue) not answered yet
                assert event.data["state"] == "PENDING", event.data
                admission = event.data["admission"]
                assert admission["pool"] == POOL and "tenant" not in admission, admission
                position: int | None = admission["position"]
                if position is not None:
                    return position
    raise AssertionError("the stream ended without a place in line")


@pytest.mark.parametrize(("weight", "within"), [(1, 12), (2, 9)], ids=["weight-1", "weight-2"])
async def test_a_tenant_behind_a_batch_of_another_gets_its_share_of_the_starts(
    local_stack: RunningStack, sim: Sim, tmp_path: Path, weight: int, within: int
) -> None:
    tenants = {B: {"weight": weight}} if weight != 1 else {}
    began = time.monotonic()
    async with fleet_of(local_stack, sim, tmp_path, tenants) as fleet:
        slots = asyncio.Semaphore(SUBMITTING_AT_ONCE)

        async def submit_a() -> str:
            async with slots:
                job_id, _ = await fleet.submit(A)
                return job_id

        a_ids = await asyncio.gather(*(submit_a() for _ in range(A_JOBS)))
        # acme's jobs are in line (their requests reached the queue): a backlog of 40 or more.
        await eventually(
            lambda: fleet.queue(A),
            timeout_s=60,
            what="acme's backlog in line",
            accept=lambda q: q["mine"]["waiting"] >= 40,
            interval_s=0.2,
        )
        position = await pending_position(fleet, a_ids[-1])
        assert position > 1, position

        accepted = await asyncio.gather(*(fleet.submit(B) for _ in range(B_JOBS)))
        b_ids = [job_id for job_id, _ in accepted]
        since = min(at for _, at in accepted)

        async def b_started() -> list[float]:
            prompts = await fleet.prompts(b_ids)
            started = await sim.started_at()
            return [started[p] for p in prompts.values() if p in started]

        b_starts = await eventually(
            b_started,
            timeout_s=90,
            what=f"beta's {B_JOBS} jobs started",
            accept=lambda s: len(s) == B_JOBS,
            interval_s=0.3,
        )
        a_prompts = await fleet.prompts(a_ids)
        started = await sim.started_at()
        a_starts = [started[p] for p in a_prompts.values() if p in started]
        last = max(b_starts)
        counted = sorted(t for t in [*a_starts, *b_starts] if since <= t <= last)
        order = "".join("B" if t in b_starts else "A" for t in counted)
        print(f"weight {weight}: starts after beta's first acceptance: {order}")
        assert min(b_starts) >= since
        assert len(counted) <= within, (
            f"beta's {B_JOBS} jobs took {len(counted)} starts (at most {within}): {order}"
        )
    print(f"weight {weight}: {time.monotonic() - began:.1f} s")
