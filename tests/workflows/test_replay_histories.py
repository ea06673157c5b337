"""The recorded histories (tests/workflows/histories, the 1.0 baseline) replay against today's
workflow.

A failure here means a change to InferenceJob changed the commands a recorded job issues: a job
running when its workers upgrade would fail the same way. Running jobs stay pinned to the worker
version they started on (docs/upgrading.md), so re-record the histories with the change
(`python -m tests.workflows.histories.record`); a `workflow.patched()` branch is only for a
change that must reach jobs already running.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from tests.workflows.histories.record import SCENARIOS
from workflows.inference_job import InferenceJob

HISTORIES = Path(__file__).parent / "histories"
COMPLETED = "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED"
FAILED = "EVENT_TYPE_WORKFLOW_EXECUTION_FAILED"
# How each recorded job's last run ended in Temporal (the job's own end state is in its status).
ENDINGS = {
    "completed": COMPLETED,
    "cancelled": COMPLETED,
    "canceled_with_reason": "EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED",
    "abandoned": COMPLETED,
    "failed": FAILED,
    "refused": FAILED,
    "queue_timeout": FAILED,
    "stopped_slowly": COMPLETED,
    "lost": COMPLETED,
    "reconnected": COMPLETED,
    "decided": COMPLETED,
    "continued": COMPLETED,
    "webhook": COMPLETED,
    "batched": COMPLETED,
    "budgeted": COMPLETED,
    "budget_held": COMPLETED,
    "queued": COMPLETED,
    "queued_asked": COMPLETED,
    "queued_in_line": COMPLETED,
    "expired": COMPLETED,
}
RECORDED = sorted(path.stem for path in HISTORIES.glob("*.json"))


def events(name: str) -> list[dict[str, Any]]:
    return list(json.loads((HISTORIES / f"{name}.json").read_text())["events"])


def test_one_recording_per_scenario_and_nothing_else() -> None:
    assert RECORDED == sorted(ENDINGS) == sorted(SCENARIOS)


@pytest.mark.parametrize("name", RECORDED)
async def test_recorded_history_replays(name: str) -> None:
    assert events(name)[-1]["eventType"] == ENDINGS[name]
    history = WorkflowHistory.from_json(
        f"recorded-{name}", (HISTORIES / f"{name}.json").read_text()
    )
    replayer = Replayer(workflows=[InferenceJob], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(history)


PREVIOUS = HISTORIES / "previous"
PREVIOUS_RECORDED = sorted(path.stem for path in PREVIOUS.glob("*.json"))


@pytest.mark.parametrize("name", PREVIOUS_RECORDED)
async def test_the_previous_releases_history_replays(name: str) -> None:
    """What the release before this one wrote is read by this one
    (tests/workflows/histories/previous):
    a job pinned to the old version is served by old workers, but its inputs, results and
    status are read by every client and gateway of both versions during an upgrade."""
    history = WorkflowHistory.from_json(f"previous-{name}", (PREVIOUS / f"{name}.json").read_text())
    replayer = Replayer(workflows=[InferenceJob], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(history)


def test_the_previous_release_kept_every_scenario() -> None:
    assert set(PREVIOUS_RECORDED) <= set(ENDINGS) and len(PREVIOUS_RECORDED) >= 10


def test_no_recording_holds_a_marker() -> None:
    """The baseline has no open patches (a `workflow.patched()` call writes a marker), and no
    local activity (its result is a marker too): a request that stages nothing is checked by
    its first follow, not in a prepare of its own."""
    markers = {
        name: [
            e["markerRecordedEventAttributes"]["markerName"]
            for e in events(name)
            if e["eventType"] == "EVENT_TYPE_MARKER_RECORDED"
        ]
        for name in RECORDED
    }
    assert {name: found for name, found in markers.items() if found} == {}


# What a workflow task's completion writes: its commands, right after WORKFLOW_TASK_COMPLETED.
COMMAND_EVENTS = {
    "EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES",
    "EVENT_TYPE_TIMER_STARTED",
    "EVENT_TYPE_TIMER_CANCELED",
    "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED",
    "EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED",
    "EVENT_TYPE_MARKER_RECORDED",
    "EVENT_TYPE_WORKFLOW_PROPERTIES_MODIFIED",
    "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED",
    "EVENT_TYPE_WORKFLOW_EXECUTION_FAILED",
    "EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED",
    "EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW",
    "EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_COMPLETED",
}


# What a workflow task's activation can carry: messages (signals, updates), which the SDK runs
# first, on their own (see the test below), and everything else that resolves workflow code.
MESSAGE_EVENTS = {
    "EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED",
    "EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ADMITTED",
    "EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED",
}
RESOLVING_EVENTS = {
    "EVENT_TYPE_ACTIVITY_TASK_COMPLETED",
    "EVENT_TYPE_ACTIVITY_TASK_FAILED",
    "EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT",
    "EVENT_TYPE_ACTIVITY_TASK_CANCELED",
    "EVENT_TYPE_TIMER_FIRED",
}


@pytest.mark.parametrize("name", RECORDED)
def test_each_workflow_task_upserts_its_search_attributes_at_most_once(name: str) -> None:
    """Every change a workflow task makes to state, progress and pool is one history event
    (JobBook holds them to the task's end). One exception, the SDK's: a task that brings both a
    message (a progress signal) and a result (an activity's, a timer's) is run in two passes,
    the message's first (its default activation order, kept for histories written without its
    single-batch flag), and each pass ends with the book's upsert: at most two there."""
    allowed: list[int] = []
    upserts_per_task: list[int] = []
    counting = False
    since_last_task: set[str] = set()
    for event in events(name):
        kind = event["eventType"]
        if kind == "EVENT_TYPE_WORKFLOW_TASK_COMPLETED":
            two_passes = bool(since_last_task & MESSAGE_EVENTS) and bool(
                since_last_task & RESOLVING_EVENTS
            )
            allowed.append(2 if two_passes else 1)
            upserts_per_task.append(0)
            counting = True
            since_last_task = set()
        elif counting and kind in COMMAND_EVENTS:
            upserts_per_task[-1] += kind == "EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES"
        else:
            counting = False
            since_last_task.add(kind)
    assert upserts_per_task, name
    over = [(n, a) for n, a in zip(upserts_per_task, allowed, strict=True) if n > a]
    assert over == [], upserts_per_task


def timer_summary(event: dict[str, Any]) -> str:
    data = event.get("userMetadata", {}).get("summary", {}).get("data", "")
    return str(json.loads(base64.b64decode(data))) if data else ""


def test_reconnected_history_has_bounded_jittered_reconnect_timers() -> None:
    timers = [e for e in events("reconnected") if e["eventType"] == "EVENT_TYPE_TIMER_STARTED"]
    reconnects = [t for t in timers if timer_summary(t).startswith("reconnect")]
    assert [timer_summary(t) for t in reconnects] == ["reconnect 1", "reconnect 2", "reconnect 3"]
    for attempt, timer in enumerate(reconnects):
        seconds = float(timer["timerStartedEventAttributes"]["startToFireTimeout"].rstrip("s"))
        ceiling = min(2.0**attempt, 30.0)
        assert ceiling / 2 <= seconds <= ceiling


def test_the_continued_history_is_a_continuation() -> None:
    started = events("continued")[0]["workflowExecutionStartedEventAttributes"]
    assert started.get("continuedExecutionRunId")
