"""A long job on the local stack: its history stays small while a watcher still sees its steps
move about once a second (what bench group 6 measures).

The follow activity signals the workflow only on milestones (its first report, stage changes,
each tenth of the steps, an artifact stored while the prompt runs); every step in between is in
its heartbeat, which `JobClient.watch` reads from the workflow's description. No timing is
asserted: the events are counted, and so are the distinct steps the watcher was handed, against
what milestones alone could show.
"""

from __future__ import annotations

import uuid
from collections import Counter

from temporalio.api.enums.v1 import EventType

from starter import JobRequest, JobState
from tests.support.cli import RunningWorker, example
from workflows.shared import SIGNAL_PROGRESS

STEPS = 700  # 14 s at the stack's 20 ms a step


async def test_a_long_jobs_history_stays_small_while_its_steps_are_seen(
    worker: RunningWorker,
) -> None:
    client = worker.client
    graph = example(STEPS)
    graph["3"]["inputs"]["seed"] = uuid.uuid4().int % 2**32  # never served from a cache
    submitted = await client.submit(JobRequest(graph=graph))
    seen: list[tuple[str, int]] = []
    async for status in client.watch(submitted.job_id):  # the default poll, as the CLI
        seen.append((status.state, status.progress.step))
    final = await client.wait(submitted.job_id)
    assert final.state == JobState.COMPLETED, final.error
    assert final.progress.step == STEPS

    steps = [step for _, step in seen]
    assert steps == sorted(steps), f"progress never goes backwards: {steps}"
    running = {step for state, step in seen if state == JobState.RUNNING and 0 < step < STEPS}
    # Milestones alone show at most the nine tenths in between; the heartbeat, read at every
    # poll, about one step a second or better (~28 in 14 s of sampling on a quiet machine).
    assert len(running) >= 12, sorted(running)

    events = [event async for event in client.handle(submitted.job_id).fetch_history_events()]
    by_type = Counter(EventType.Name(event.event_type) for event in events)
    signals = Counter(
        event.workflow_execution_signaled_event_attributes.signal_name
        for event in events
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
    )
    # The first report, queued -> running, each tenth: not one per 2 s (the artifact and the
    # end come with the result).
    assert signals[SIGNAL_PROGRESS] <= 16, signals
    assert len(events) <= 150, by_type
