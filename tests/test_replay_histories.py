"""The recorded histories (tests/histories, the 1.0 baseline) replay against today's workflow.

A failure here means a change to InferenceJob changed the commands a recorded job issues: a job
running when its workers upgrade would fail the same way. Running jobs stay pinned to the worker
version they started on (docs/upgrading.md), so re-record the histories with the change
(`python -m tests.histories.record`); a `workflow.patched()` branch is only for a change that
must reach jobs already running.
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

from tests.histories.record import SCENARIOS
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


# The SDK's marker for a local activity's result.
LOCAL_ACTIVITY_MARKER = "core_local_activity"


def test_no_recording_holds_a_patch_marker() -> None:
    """The baseline has no open patches: a patch marker here is a `workflow.patched()` call (a
    local activity's result is a marker too, of its own name: the quick prepare's)."""
    markers = {
        name: [
            e["markerRecordedEventAttributes"]["markerName"]
            for e in events(name)
            if e["eventType"] == "EVENT_TYPE_MARKER_RECORDED"
        ]
        for name in RECORDED
    }
    patches = {
        name: [m for m in found if m != LOCAL_ACTIVITY_MARKER] for name, found in markers.items()
    }
    assert {name: found for name, found in patches.items() if found} == {}
    assert LOCAL_ACTIVITY_MARKER in markers["completed"], "a request with no inputs: local prepare"


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


@pytest.mark.parametrize("name", RECORDED)
def test_each_workflow_task_upserts_its_search_attributes_at_most_once(name: str) -> None:
    """Every change a workflow task makes to state, progress and pool is one history event
    (JobBook holds them to the task's end, a local prepare's included)."""
    upserts_per_task: list[int] = []
    counting = False
    for event in events(name):
        kind = event["eventType"]
        if kind == "EVENT_TYPE_WORKFLOW_TASK_COMPLETED":
            upserts_per_task.append(0)
            counting = True
        elif counting and kind in COMMAND_EVENTS:
            upserts_per_task[-1] += kind == "EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES"
        else:
            counting = False
    assert upserts_per_task and max(upserts_per_task) <= 1, upserts_per_task


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
