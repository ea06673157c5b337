"""A job waiting for a worker slot says so, on the local stack (the real Temporal dev server).

One worker with a single activity slot: the first job's follow holds it for a few seconds of
sampling, so the second job's next activity (its prepare) is scheduled and not started. Its
status says so (`worker_wait`: `slots_busy`, and the server's backlog of activity tasks), and
stops saying so once the first job has ended and the slot is the second's. No timing is
asserted: the second job is watched to its end and what it showed is checked.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import cast

from devstack.models import RunningStack
from starter import JobRequest, JobState, JobStatus
from tests.support.cli import example, running_worker
from workflows.shared import ACTIVITY_FOLLOW, ACTIVITY_PREPARE

FIRST_STEPS = 250  # 5 s at the stack's 20 ms a step: the slot is taken meanwhile
SECOND_STEPS = 5


def graph(steps: int) -> dict[str, object]:
    made = example(steps)
    made["3"]["inputs"]["seed"] = uuid.uuid4().int % 2**32  # never served from a cache
    return made


async def test_a_job_waiting_for_the_only_slot_says_so_until_it_gets_it(
    local_stack: RunningStack,
) -> None:
    async with (
        asyncio.timeout(60),
        running_worker(local_stack, "slots", max_concurrent_activities=1) as worker,
    ):
        client = worker.client
        first = await client.submit(JobRequest(graph=graph(FIRST_STEPS)))
        watched = cast(AsyncGenerator[JobStatus, None], client.watch(first.job_id))
        async with aclosing(watched) as statuses:
            async for status in statuses:
                if status.state == JobState.RUNNING or status.terminal:
                    break
        assert status.state == JobState.RUNNING, "the first job holds the slot"

        second = await client.submit(JobRequest(graph=graph(SECOND_STEPS)))
        seen: list[JobStatus] = []
        asked: JobStatus | None = None
        first_meanwhile: JobStatus | None = None
        async for status in client.watch(second.job_id):
            seen.append(status)
            if status.worker_wait is not None and asked is None:
                asked = await client.status(second.job_id)  # what a one-off status says
                first_meanwhile = await client.status(first.job_id)
        assert seen[-1].state == JobState.COMPLETED, seen[-1].error

        assert asked is not None, [(s.state, s.worker_wait) for s in seen]
        wait = asked.worker_wait
        assert wait is not None, "status, not only watch, shows the wait"
        assert wait.reason == "slots_busy", wait
        assert wait.activity in (ACTIVITY_PREPARE, ACTIVITY_FOLLOW), wait
        assert wait.task_queue == worker.task_queue
        # The dev server counts the activity tasks waiting on the queue: at least this one.
        assert wait.backlog is not None and wait.backlog >= 1, wait
        assert first_meanwhile is not None and not first_meanwhile.terminal, "the slot was held"

        # Once the first job ended the slot was the second's: the wait is gone for good, and
        # the job then ran (each status after the last wait has none, and one is RUNNING).
        last_wait = max(i for i, s in enumerate(seen) if s.worker_wait is not None)
        after = seen[last_wait + 1 :]
        assert after and all(s.worker_wait is None for s in after)
        assert JobState.RUNNING in {s.state for s in after} or after[-1].progress.step > 0
        assert all(s.state != JobState.RUNNING for s in seen[: last_wait + 1])
        assert (await client.wait(first.job_id)).state == JobState.COMPLETED
