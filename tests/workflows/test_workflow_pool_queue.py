"""A bounded pool's queue on the time-skipping server: `InferenceJob` with its dispatcher
(`PoolQueue`) and the stand-in activities: the wait, the grant, the release, a cancel while
PENDING, and the dispatcher's continue-as-new carrying its line."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime

from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from faults.wait import eventually
from tests.support.workflow_fakes import FakeBackend, Script, job_worker, request, start_job
from workflows.admission import PoolQueueView, QueueState, SlotRequest
from workflows.contracts import JobState, JobStatus
from workflows.pool_queue import PoolQueue
from workflows.shared import (
    QUERY_POOL_QUEUE,
    QUERY_STATUS,
    SIGNAL_CANCEL,
    SIGNAL_SLOT_REQUEST,
    pool_queue_id,
)


@contextlib.asynccontextmanager
async def queue_worker(client: Client, backend: FakeBackend) -> AsyncIterator[str]:
    """`job_worker`, and the pool's queue ended with it: a queue left running with no worker
    would hold the time-skipping server's clock for the next test."""
    async with job_worker(client, backend) as task_queue:
        try:
            yield task_queue
        finally:
            with contextlib.suppress(RPCError):
                handle = client.get_workflow_handle(pool_queue_id(task_queue, "comfyui"))
                await handle.terminate("the test is over")


async def view(client: Client, task_queue: str) -> PoolQueueView:
    handle = client.get_workflow_handle(pool_queue_id(task_queue, "comfyui"))
    answer: PoolQueueView = await handle.query(QUERY_POOL_QUEUE, result_type=PoolQueueView)
    return answer


async def status(handle: WorkflowHandle[object, JobStatus]) -> JobStatus:
    answer: JobStatus = await handle.query(QUERY_STATUS, result_type=JobStatus)
    return answer


async def test_a_job_on_an_idle_bounded_pool_is_granted_at_once_and_gives_its_slot_back(
    env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend(Script(max_running=1))
    async with queue_worker(env.client, backend) as task_queue:
        handle = await start_job(env.client, task_queue, request(abandon_after_s=None))
        final = await handle.result()
        assert final.state == JobState.COMPLETED
        assert final.admission is not None and final.admission.granted
        # Checked first (the follow that found the pool bounded), then submitted once.
        assert len(backend.submitted) == 1 and backend.followed[0].graph is not None
        assert [f.slot_held for f in backend.followed] == [False, True]
        emptied = await eventually(
            lambda: view(env.client, task_queue),
            timeout_s=10,
            what="the slot given back",
            accept=lambda v: v.running == 0 and v.waiting == 0,
        )
        assert emptied.max_running == 1


async def test_a_second_job_waits_pending_and_starts_when_the_first_ends(
    env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend(Script(max_running=1, block_in="follow_prompt"))
    async with queue_worker(env.client, backend) as task_queue:
        first = await start_job(env.client, task_queue, request(abandon_after_s=None))
        await eventually(
            lambda: status(first),
            timeout_s=10,
            what="the first running",
            accept=lambda s: (
                s.state in (JobState.RUNNING, JobState.SUBMITTING)
                and s.admission is not None
                and s.admission.granted
            ),
        )
        second = await start_job(env.client, task_queue, request(abandon_after_s=None))
        pending = await eventually(
            lambda: status(second),
            timeout_s=10,
            what="the second PENDING",
            accept=lambda s: s.state == JobState.PENDING,
        )
        assert pending.admission is not None and pending.admission.position == 1
        assert pending.admission.ahead == 0 and pending.admission.pool == "comfyui"
        # The Temporal UI's Current Details say it in words.
        metadata = await second.query("__temporal_workflow_metadata")
        details = str(metadata.current_details)
        assert "**PENDING**" in details and "1st of 1 for pool comfyui" in details, details
        assert len(backend.submitted) == 1, "nothing of the waiting job reached the pool"
        await first.signal(SIGNAL_CANCEL, {"reason": "make room"})
        assert (await first.result()).state == JobState.CANCELLED
        await eventually(
            lambda: status(second),
            timeout_s=10,
            what="the second granted",
            accept=lambda s: s.admission is not None and s.admission.granted,
        )
        await eventually(
            lambda: asyncio.sleep(0, len(backend.submitted)),
            timeout_s=10,
            what="the second submitted",
            accept=lambda n: n == 2,
        )
        # (The stand-in backend interrupts every blocked follow once any stop was asked: the
        # second may have ended already.)
        with contextlib.suppress(RPCError):
            await second.signal(SIGNAL_CANCEL, {"reason": "done"})
        with contextlib.suppress(WorkflowFailureError):
            await second.result()


async def test_a_job_cancelled_while_pending_leaves_the_line_with_nothing_to_stop(
    env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend(Script(max_running=1, block_in="follow_prompt"))
    async with queue_worker(env.client, backend) as task_queue:
        first = await start_job(env.client, task_queue, request(abandon_after_s=None))
        await eventually(
            lambda: status(first),
            timeout_s=10,
            what="the first granted",
            accept=lambda s: s.admission is not None and s.admission.granted,
        )
        second = await start_job(env.client, task_queue, request(abandon_after_s=None))
        await eventually(
            lambda: status(second),
            timeout_s=10,
            what="PENDING",
            accept=lambda s: s.state == JobState.PENDING,
        )
        await second.signal(SIGNAL_CANCEL, {"reason": "not needed"})
        ended = await second.result()
        assert ended.state == JobState.CANCELLED and ended.teardown.state == "SKIPPED"
        line = await eventually(
            lambda: view(env.client, task_queue),
            timeout_s=10,
            what="out of line",
            accept=lambda v: v.waiting == 0,
        )
        assert [e.job_id for e in line.entries] == [first.id]
        await first.signal(SIGNAL_CANCEL, {"reason": "done"})
        await first.result()


async def test_the_dispatcher_continues_as_new_with_its_holders_and_its_line(
    env: WorkflowEnvironment,
) -> None:
    async with queue_worker(env.client, FakeBackend()) as task_queue:
        queue_id = pool_queue_id(task_queue, "comfyui")
        handle = await env.client.start_workflow(
            PoolQueue.run,
            QueueState(pool="comfyui", history_limit=40),
            id=queue_id,
            task_queue=task_queue,
        )
        now = datetime.now(UTC)
        # Requests of jobs that do not exist: each grant fails and frees its slot again, so
        # the line moves, and its history grows past the limit several times.
        for n in range(30):
            ask = SlotRequest(job_id=f"ghost-{n}", tenant="t", max_running=1, accepted_at=now)
            await handle.signal(SIGNAL_SLOT_REQUEST, ask)
        done = await eventually(
            lambda: view(env.client, task_queue),
            timeout_s=30,
            what="every ghost gone",
            accept=lambda v: v.waiting == 0 and v.running == 0,
        )
        assert done.max_running == 1
        history = await handle.fetch_history()  # the latest run's
        [started] = [
            e.workflow_execution_started_event_attributes
            for e in history.events
            if e.HasField("workflow_execution_started_event_attributes")
        ]
        assert started.continued_execution_run_id, "the dispatcher never continued as new"
