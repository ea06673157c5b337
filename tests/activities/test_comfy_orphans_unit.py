"""The orphan sweep's ComfyUI side (activities/orphans.py): a fake Temporal (describe) and a
ComfyUI whose `/queue` answers are scripted, one per listing. No server."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from temporalio.client import WorkflowExecutionStatus

from activities.orphans import OrphanSweeper, prompt_tag
from tests.activities.test_runpod_orphans_unit import NAMESPACE, FakeTemporal

POOL = "local"


def item(number: int, prompt_id: str, job_id: str | None) -> list[Any]:
    """A `/queue` entry: [number, prompt id, graph, extra_data, outputs to execute]."""
    extra = {} if job_id is None else prompt_tag(job_id, 0)
    if job_id is not None:
        extra["durable_comfy"]["namespace"] = NAMESPACE
    return [number, prompt_id, {}, extra, ["9"]]


@dataclass
class ScriptedComfy:
    """`queue()` answers from a script (the last answer repeats); stops are recorded."""

    listings: list[dict[str, list[list[Any]]]]
    asked: int = 0
    interrupted: list[str] = field(default_factory=list)
    dequeued: list[str] = field(default_factory=list)

    async def queue(self) -> dict[str, list[list[Any]]]:
        answer = self.listings[min(self.asked, len(self.listings) - 1)]
        self.asked += 1
        return answer

    async def interrupt(self, prompt_id: str) -> None:
        self.interrupted.append(prompt_id)

    async def delete_pending(self, prompt_id: str) -> None:
        self.dequeued.append(prompt_id)


def sweeper(
    comfy: ScriptedComfy,
    workflows: dict[str, WorkflowExecutionStatus],
    temporal: FakeTemporal | None = None,
    followed_here: frozenset[str] = frozenset(),
) -> OrphanSweeper:
    return OrphanSweeper(
        temporal or FakeTemporal(workflows),  # type: ignore[arg-type]
        {POOL: [comfy]},  # type: ignore[list-item]
        followed_here=followed_here.__contains__,
    )


@dataclass
class CountingTemporal(FakeTemporal):
    """The fake Temporal, counting the workflows described."""

    described: list[str] = field(default_factory=list)

    def get_workflow_handle(self, workflow_id: str) -> Any:
        self.described.append(workflow_id)
        return super().get_workflow_handle(workflow_id)


async def test_a_closed_jobs_prompt_is_interrupted_if_running_and_dequeued_if_pending() -> None:
    listing = {
        "queue_running": [item(1, "p-run", "job-a")],
        "queue_pending": [
            item(2, "p-wait", "job-b"),
            item(3, "p-live", "job-c"),
            item(4, "p-other", None),  # not ours: never touched
        ],
    }
    comfy = ScriptedComfy([listing])
    workflows = {
        "job-a": WorkflowExecutionStatus.TERMINATED,
        "job-c": WorkflowExecutionStatus.RUNNING,
    }  # job-b is unknown to Temporal

    swept = await sweeper(comfy, workflows).sweep_once()

    assert comfy.interrupted == ["p-run"] and comfy.dequeued == ["p-wait"]
    assert [(s.prompt_id, s.job, s.action) for s in swept] == [
        ("p-run", "TERMINATED", "interrupted"),
        ("p-wait", "unknown", "dequeued"),
    ]


async def test_a_prompt_that_ended_with_its_job_between_listing_and_describe_is_left_alone() -> (
    None
):
    # The prompt was running when the queue was listed, then finished, and its job completed
    # before the sweep asked about it: the job is closed, but the prompt is no orphan.
    running = {"queue_running": [item(1, "p-done", "job-a")], "queue_pending": []}
    comfy = ScriptedComfy([running, {"queue_running": [], "queue_pending": []}])

    swept = await sweeper(comfy, {"job-a": WorkflowExecutionStatus.COMPLETED}).sweep_once()

    assert swept == [] and comfy.interrupted == [] and comfy.dequeued == []


async def test_a_pending_orphan_that_started_meanwhile_is_interrupted_not_dequeued() -> None:
    pending = {"queue_running": [], "queue_pending": [item(1, "p-orphan", "job-a")]}
    started = {"queue_running": [item(1, "p-orphan", "job-a")], "queue_pending": []}
    comfy = ScriptedComfy([pending, started])

    swept = await sweeper(comfy, {"job-a": WorkflowExecutionStatus.TERMINATED}).sweep_once()

    assert comfy.interrupted == ["p-orphan"] and comfy.dequeued == []
    assert [s.action for s in swept] == ["interrupted"]


async def test_a_queue_with_no_closed_jobs_is_listed_once() -> None:
    comfy = ScriptedComfy([{"queue_running": [item(1, "p", "job-a")], "queue_pending": []}])

    assert await sweeper(comfy, {"job-a": WorkflowExecutionStatus.RUNNING}).sweep_once() == []
    assert comfy.asked == 1 and comfy.interrupted == []


async def test_the_prompts_this_worker_follows_are_not_asked_about() -> None:
    listing = {
        "queue_running": [item(1, "p-mine", "job-mine"), item(2, "p-theirs", "job-theirs")],
        "queue_pending": [],
    }
    comfy = ScriptedComfy([listing])
    running = WorkflowExecutionStatus.RUNNING
    temporal = CountingTemporal({"job-mine": running, "job-theirs": running})

    swept = await sweeper(comfy, {}, temporal, followed_here=frozenset({"job-mine"})).sweep_once()

    assert swept == [] and temporal.described == ["job-theirs"]
