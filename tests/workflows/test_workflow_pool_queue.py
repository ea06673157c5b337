"""A bounded pool's queue on the time-skipping server: `InferenceJob` with its dispatcher
(`PoolQueue`) and the stand-in activities: the wait, the grant, the release, a cancel while
PENDING, and the dispatcher's continue-as-new carrying its line."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio.client import Client, WorkflowFailureError, WorkflowHandle, WorkflowHistory
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from faults.wait import eventually
from tests.support.queue_listener import LISTENER_WORKFLOW_TYPE, QueueListener
from tests.support.workflow_fakes import (
    FakeBackend,
    Script,
    job_worker,
    queue_activities,
    request,
    start_job,
)
from workflows.admission import (
    Admission,
    Holder,
    PoolQueueView,
    QueueState,
    SlotRelease,
    SlotRequest,
)
from workflows.contracts import EventsQuery, JobEvents, JobState, JobStatus
from workflows.pool_queue import PoolQueue
from workflows.shared import (
    QUERY_EVENTS,
    QUERY_POOL_QUEUE,
    QUERY_STATUS,
    SIGNAL_ADMISSION,
    SIGNAL_CANCEL,
    SIGNAL_SLOT_RELEASE,
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


@contextlib.asynccontextmanager
async def listeners_worker(client: Client) -> AsyncIterator[str]:
    """A worker of the dispatcher and of stand-in jobs that record what they hear."""
    task_queue = f"tq-{uuid.uuid4()}"
    async with Worker(
        client,
        task_queue=task_queue,
        workflows=[PoolQueue, QueueListener],
        activities=queue_activities(),
        graceful_shutdown_timeout=timedelta(seconds=1),
    ):
        yield task_queue


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


def signals_named(history: WorkflowHistory, name: str) -> int:
    return sum(
        1
        for e in history.events
        if e.HasField("workflow_execution_signaled_event_attributes")
        and e.workflow_execution_signaled_event_attributes.signal_name == name
    )


def queue_timers(history: WorkflowHistory) -> int:
    """Timers of a wait for the queue's first answer (the others are the stop's)."""
    summaries = [
        e.user_metadata.summary.data
        for e in history.events
        if e.HasField("timer_started_event_attributes")
    ]
    return sum(1 for summary in summaries if b"pool queue answer" in summary)


async def one_holds_one_waits(
    client: Client, task_queue: str
) -> tuple[WorkflowHandle[Any, JobStatus], WorkflowHandle[Any, JobStatus], JobStatus]:
    """A first job granted the one slot (its follow blocked), a second PENDING behind it."""
    first = await start_job(client, task_queue, request(abandon_after_s=None))
    await eventually(
        lambda: status(first),
        timeout_s=30,
        what="the first granted",
        accept=lambda s: s.admission is not None and s.admission.granted,
    )
    second = await start_job(client, task_queue, request(abandon_after_s=None))
    pending = await eventually(
        lambda: status(second),
        timeout_s=30,
        what="the second PENDING",
        accept=lambda s: s.state == JobState.PENDING,
    )
    return first, second, pending


async def make_room_then_end(
    first: WorkflowHandle[Any, JobStatus],
    second: WorkflowHandle[Any, JobStatus],
    backend: FakeBackend,
    *,
    by_query: bool = False,
) -> None:
    """Cancel the first; the second is submitted in its place, then ends too: the stand-in
    backend interrupts every blocked follow once any stop was asked, so its follow fails
    `Interrupted` by itself. It is not cancelled as well: a cancel crossing that failure made
    the time-skipping server refuse the job's workflow task (`ACTIVITY_UNKNOWN`) and the job
    hang (seen once in CI). `by_query`: each end is awaited by query, not by its result (a
    client waiting on a result lets the time-skipping server jump its clock, and a follow
    waiting in line heartbeats by the wall clock: its heartbeat timeout would pass in a
    jump)."""
    await first.signal(SIGNAL_CANCEL, {"reason": "make room"})
    first_end = await ended(first) if by_query else await asyncio.wait_for(first.result(), 60)
    assert first_end.state == JobState.CANCELLED
    await eventually(
        lambda: asyncio.sleep(0, len(backend.submitted)),
        timeout_s=10,
        what="the second submitted",
        accept=lambda n: n == 2,
    )
    assert backend.interrupted.is_set()
    if by_query:
        await ended(second)
        return
    with contextlib.suppress(WorkflowFailureError):
        await asyncio.wait_for(second.result(), 60)


async def test_a_check_that_asks_the_queue_hands_the_job_its_grant_or_its_place(
    env: WorkflowEnvironment,
) -> None:
    """The check asks the dispatcher by update (as the real check does): on an idle pool the
    job hears its grant with the check's result, and a job that must wait hears its place
    the same way; neither waits on a timer, and only the grant that ends a wait is signalled."""
    backend = FakeBackend(Script(max_running=1, block_in="follow_prompt", ask_in_check=True))
    async with queue_worker(env.client, backend) as task_queue:
        first, second, pending = await one_holds_one_waits(env.client, task_queue)
        assert pending.admission is not None and pending.admission.position == 1
        assert signals_named(await second.fetch_history(), SIGNAL_ADMISSION) == 0, (
            "the place came with the check's result, not by signal"
        )
        await make_room_then_end(first, second, backend)
        first_history, second_history = await first.fetch_history(), await second.fetch_history()
        assert signals_named(first_history, SIGNAL_ADMISSION) == 0
        assert signals_named(second_history, SIGNAL_ADMISSION) == 1, "the grant, by signal"
        assert queue_timers(first_history) == queue_timers(second_history) == 0


async def ended(handle: WorkflowHandle[Any, JobStatus]) -> JobStatus:
    """The job's final status, by query (no time skipping meanwhile)."""
    return await eventually(
        lambda: status(handle), timeout_s=30, what="the job ended", accept=lambda s: s.terminal
    )


def follows_scheduled(history: WorkflowHistory) -> int:
    return sum(
        1
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes")
        and e.activity_task_scheduled_event_attributes.activity_type.name == "follow_prompt"
    )


async def test_a_check_told_a_place_waits_in_line_in_its_own_follow_and_submits_there(
    env: WorkflowEnvironment,
) -> None:
    """The check's follow, told a place, waits for the grant itself (watching the queue): the
    job is PENDING at its place from the follow's report, and once granted the same follow
    submits. No grant signal, no second follow; the dispatcher signals no job."""
    script = Script(max_running=1, block_in="follow_prompt", ask_in_check=True, wait_in_line=True)
    backend = FakeBackend(script)
    async with queue_worker(env.client, backend) as task_queue:
        first, second, pending = await one_holds_one_waits(env.client, task_queue)
        assert pending.admission is not None and pending.admission.position == 1
        metadata = await second.query("__temporal_workflow_metadata")
        assert "1st of 1 for pool comfyui" in str(metadata.current_details)
        assert len(backend.submitted) == 1, "nothing of the waiting job reached the pool"
        await make_room_then_end(first, second, backend, by_query=True)
        # Its follow's report (with the slot) took it out of PENDING: its prompt ran.
        journal = await second.query(QUERY_EVENTS, EventsQuery(since=0), result_type=JobEvents)
        states = [e.state for e in journal.events if e.kind == "state"]
        assert JobState.PENDING in states and JobState.RUNNING in states, states
        assert states.index(JobState.RUNNING) > states.index(JobState.PENDING), states
        history = await second.fetch_history()
        assert follows_scheduled(history) == 1, "granted in line, the same follow submitted"
        assert signals_named(history, SIGNAL_ADMISSION) == 0
        assert backend.submitted[1].job_id == second.id
        granted = (await second.query(QUERY_STATUS, result_type=JobStatus)).admission
        assert granted is not None and granted.granted
        queue = env.client.get_workflow_handle(pool_queue_id(task_queue, "comfyui"))
        told = [
            e
            for e in (await queue.fetch_history()).events
            if e.HasField("signal_external_workflow_execution_initiated_event_attributes")
        ]
        assert told == [], "the dispatcher signalled no job"
        await eventually(
            lambda: view(env.client, task_queue),
            timeout_s=10,
            what="every slot and place given back",
            accept=lambda v: v.running == 0 and v.waiting == 0,
        )


async def test_the_follow_that_saw_the_prompt_end_gives_the_slot_back_itself(
    env: WorkflowEnvironment,
) -> None:
    """On an idle bounded pool the check's own follow is granted and submits (one follow, as
    on an open pool), and releases the slot when the job's last prompt ended: the job's own
    history sends nothing to the queue (no signal, no workflow task for it)."""
    backend = FakeBackend(Script(max_running=1, ask_in_check=True))
    async with queue_worker(env.client, backend) as task_queue:
        handle = await start_job(env.client, task_queue, request(abandon_after_s=None))
        final = await asyncio.wait_for(handle.result(), 60)
        assert final.state == JobState.COMPLETED
        assert len(backend.followed) == 1, "granted in its check, the first follow submitted"
        assert final.admission is not None and final.admission.granted
        history = await handle.fetch_history()
        sent = [
            e
            for e in history.events
            if e.HasField("signal_external_workflow_execution_initiated_event_attributes")
        ]
        assert sent == [], "the follow gave the slot back, not the job"
        emptied = await eventually(
            lambda: view(env.client, task_queue),
            timeout_s=10,
            what="the slot given back",
            accept=lambda v: v.running == 0 and v.waiting == 0,
        )
        assert emptied.max_running == 1
        queue = env.client.get_workflow_handle(pool_queue_id(task_queue, "comfyui"))
        assert signals_named(await queue.fetch_history(), SIGNAL_SLOT_RELEASE) == 1


async def test_a_second_job_waits_pending_and_starts_when_the_first_ends(
    env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend(Script(max_running=1, block_in="follow_prompt"))
    async with queue_worker(env.client, backend) as task_queue:
        first, second, pending = await one_holds_one_waits(env.client, task_queue)
        assert (await status(first)).state in (JobState.RUNNING, JobState.SUBMITTING)
        assert pending.admission is not None and pending.admission.position == 1
        assert pending.admission.ahead == 0 and pending.admission.pool == "comfyui"
        # The Temporal UI's Current Details say it in words.
        metadata = await second.query("__temporal_workflow_metadata")
        details = str(metadata.current_details)
        assert "**PENDING**" in details and "1st of 1 for pool comfyui" in details, details
        assert len(backend.submitted) == 1, "nothing of the waiting job reached the pool"
        queue = env.client.get_workflow_handle(pool_queue_id(task_queue, "comfyui"))
        assert signals_named(await queue.fetch_history(), SIGNAL_SLOT_REQUEST) == 2, (
            "a job asks once; once answered, it waits for its grant without asking again"
        )
        await make_room_then_end(first, second, backend)
        granted = (await second.query(QUERY_STATUS, result_type=JobStatus)).admission
        assert granted is not None and granted.granted


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
            QueueState(pool="comfyui", history_limit=60),
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
            timeout_s=60,
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


async def test_a_long_line_hears_each_place_once_across_continue_as_new_and_grants_go_on(
    env: WorkflowEnvironment,
) -> None:
    """150 waiting: each hears its place once, when it joins; a run that continues as new does
    not tell its carried waiters again (only the first 50's refresh may, when their place
    moved); a freed slot goes to the first in line."""
    async with listeners_worker(env.client) as task_queue:
        queue = await env.client.start_workflow(
            PoolQueue.run,
            QueueState(pool="comfyui", history_limit=300),
            id=pool_queue_id(task_queue, "comfyui"),
            task_queue=task_queue,
        )
        listeners = [
            await env.client.start_workflow(
                LISTENER_WORKFLOW_TYPE, id=f"listener-{n}-{uuid.uuid4()}", task_queue=task_queue
            )
            for n in range(151)
        ]
        now = datetime.now(UTC)
        for listener in listeners:
            ask = SlotRequest(job_id=listener.id, tenant="t", max_running=1, accepted_at=now)
            await queue.signal(SIGNAL_SLOT_REQUEST, ask)

        async def heard(listener: WorkflowHandle[Any, Any]) -> list[Admission]:
            answer: list[Admission] = await listener.query("heard", result_type=list[Admission])
            return answer

        last = await eventually(
            lambda: heard(listeners[-1]),
            timeout_s=30,
            what="the last in line told its place",
            accept=lambda h: len(h) >= 1,
        )
        assert last[0].position == 150 and last[0].waiting == 150
        # The line takes several runs (300 events each): each carries its told waiters as told.
        runs = await eventually(
            lambda: runs_of(queue),
            timeout_s=30,
            what="continued as new",
            accept=lambda n: n >= 2,
        )
        assert runs >= 2
        # The one holder gives its slot back: the first in line is granted.
        await queue.signal(SIGNAL_SLOT_RELEASE, SlotRelease(job_id=listeners[0].id))
        granted = await eventually(
            lambda: heard(listeners[1]),
            timeout_s=30,
            what="the grant",
            accept=lambda h: any(a.granted for a in h),
        )
        places = [a for a in granted if not a.granted]
        assert places and places[0].position == 1
        for listener in listeners[51:]:
            told = await heard(listener)
            assert len(told) == 1, (listener.id, told)
        for listener in listeners[2:51]:
            told = await heard(listener)
            # The join, then at most once per run's refresh (positions moved by one at the grant).
            assert 1 <= len(told) <= 1 + runs + 1, (listener.id, len(told))
        await queue.terminate("the test is over")
        for listener in listeners:
            await listener.signal("done")
        # Ended before their worker stops: a workflow left running would hold the
        # time-skipping server's clock for the next test.
        for listener in listeners:
            await listener.result()


async def test_a_grant_not_yet_told_when_the_run_continued_as_new_is_told_by_the_next(
    env: WorkflowEnvironment,
) -> None:
    """A holder granted in the pass before a continue-as-new (or by an `ask` for another job)
    hears its grant from the next run: the bench's 2,000-job backlog once stranded 10 such
    holders PENDING for good, their slots held for nothing."""
    async with listeners_worker(env.client) as task_queue:
        listener = await env.client.start_workflow(
            LISTENER_WORKFLOW_TYPE, id=f"listener-{uuid.uuid4()}", task_queue=task_queue
        )
        now = datetime.now(UTC)
        holder = Holder(job_id=listener.id, tenant="t", granted_at=now, asked_at=now)
        carried = QueueState(
            pool="comfyui", max_running=1, holders={listener.id: holder}, unheard=[listener.id]
        )
        queue = await env.client.start_workflow(
            PoolQueue.run, carried, id=pool_queue_id(task_queue, "comfyui"), task_queue=task_queue
        )

        async def heard() -> list[Admission]:
            answer: list[Admission] = await listener.query("heard", result_type=list[Admission])
            return answer

        told = await eventually(
            heard, timeout_s=30, what="the carried grant told", accept=lambda h: bool(h)
        )
        assert told[0].granted and told[0].job_id == listener.id
        await queue.terminate("the test is over")
        await listener.signal("done")
        await listener.result()


async def runs_of(queue: WorkflowHandle[Any, Any]) -> int:
    """How many runs the dispatcher has had: its first, and one per continue-as-new."""
    client, run_id, runs = queue._client, queue.first_execution_run_id, 0
    while run_id:
        runs += 1
        history = await client.get_workflow_handle(queue.id, run_id=run_id).fetch_history()
        run_id = next(
            (
                e.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
                for e in history.events
                if e.HasField("workflow_execution_continued_as_new_event_attributes")
            ),
            None,
        )
    return runs
