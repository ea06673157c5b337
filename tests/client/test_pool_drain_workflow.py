"""`JobClient.drain_pool` / `undrain_pool` against a real `PoolQueue` on the time-skipping server:
a pool of two servers whose dispatcher an earlier job started (here: the test), drained and
undrained server by server and as a whole, a server it does not have refused with its servers
named, and a pool without a dispatcher left without one."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from temporalio import activity
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from starter import JobClient, queues
from starter.errors import NoPoolQueue, UnknownServer
from workflows.admission import QueueState, ServerWatch
from workflows.pool_queue import PoolQueue
from workflows.shared import ACTIVITY_WATCH_SERVERS, POOL_QUEUE_WORKFLOW_TYPE, pool_queue_id

A, B = "http://gpu-a:8188", "http://gpu-b:8188"


@activity.defn(name=ACTIVITY_WATCH_SERVERS)
async def servers_stay_healthy(watch: ServerWatch) -> dict[str, str | None]:
    """The health watch, seeing nothing change: it waits until the dispatcher cancels it."""
    while True:
        activity.heartbeat()
        await asyncio.sleep(1)


@contextlib.asynccontextmanager
async def dispatcher(client: Client, pool: str, servers: list[str]) -> AsyncIterator[str]:
    """A worker of the dispatcher, and `pool`'s dispatcher running on it (as a job's ask would
    have started it), terminated on the way out: one left running would hold the
    time-skipping server's clock for the next test."""
    task_queue = f"tq-{uuid.uuid4()}"
    async with Worker(
        client,
        task_queue=task_queue,
        workflows=[PoolQueue],
        activities=[servers_stay_healthy],
        graceful_shutdown_timeout=timedelta(seconds=1),
    ):
        handle = await client.start_workflow(
            POOL_QUEUE_WORKFLOW_TYPE,
            QueueState(pool=pool, max_running=len(servers), servers=servers),
            id=pool_queue_id(task_queue, pool),
            task_queue=task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        )
        try:
            yield task_queue
        finally:
            with contextlib.suppress(RPCError):
                await handle.terminate("the test is over")


async def test_a_server_drained_then_undrained_and_the_whole_pool(env: WorkflowEnvironment) -> None:
    async with dispatcher(env.client, "gpu", [A, B]) as task_queue:
        client = JobClient(env.client, task_queue=task_queue)
        drained = await client.drain_pool("gpu", A, by="alice")
        assert [(s.url, s.health) for s in drained.servers] == [(A, "drained"), (B, "healthy")]
        assert drained.servers[0].since is not None and drained.drained is None
        # What the queue says afterwards, not only the update's answer.
        seen = await client.pool_queue("gpu")
        assert [s.health for s in seen.servers] == ["drained", "healthy"]

        undrained = await client.undrain_pool("gpu", A + "/")
        assert [s.health for s in undrained.servers] == ["healthy", "healthy"]

        whole = await client.drain_pool("gpu", by="bob")
        assert whole.drained == "bob" and [s.health for s in whole.servers] == ["healthy"] * 2
        assert (await client.undrain_pool("gpu")).drained is None


async def test_a_server_the_pool_does_not_have_is_refused(env: WorkflowEnvironment) -> None:
    async with dispatcher(env.client, "gpu", [A, B]) as task_queue:
        client = JobClient(env.client, task_queue=task_queue)
        with pytest.raises(UnknownServer) as refused:
            await client.drain_pool("gpu", "http://gpu-z:8188", by="alice")
        assert refused.value.servers == [A, B]
        assert "http://gpu-z:8188 is not one of its servers" in str(refused.value)
        assert [s.health for s in (await client.pool_queue("gpu")).servers] == ["healthy"] * 2


async def test_a_pool_without_a_dispatcher_gets_none(env: WorkflowEnvironment) -> None:
    task_queue = f"tq-{uuid.uuid4()}"
    client = JobClient(env.client, task_queue=task_queue)
    with pytest.raises(NoPoolQueue):
        await client.drain_pool("gpu", by="alice")
    with pytest.raises(RPCError) as missing:
        await env.client.get_workflow_handle(pool_queue_id(task_queue, "gpu")).describe()
    assert missing.value.status == RPCStatusCode.NOT_FOUND


async def test_the_queues_own_refusal_of_a_server_is_an_unknown_server_too(
    env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dispatcher's validator refuses a server its pool does not have (as when its
    servers change between the client's look and the update): the same typed error."""
    monkeypatch.setattr(queues, "_server_of", lambda view, server, *, drain: server)
    async with dispatcher(env.client, "gpu", [A, B]) as task_queue:
        client = JobClient(env.client, task_queue=task_queue)
        with pytest.raises(UnknownServer) as refused:
            await client.drain_pool("gpu", "http://gpu-z:8188", by="alice")
        assert refused.value.server == "http://gpu-z:8188" and refused.value.servers == [A, B]
