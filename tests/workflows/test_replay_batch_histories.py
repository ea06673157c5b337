"""The recorded batch histories (tests/workflows/batch_histories) replay against today's
`JobBatch`: a batch is as long-lived as its jobs, pinned to its version like them, and a change
to the commands it issues would fail a batch running when its workers upgrade. Re-record with
`python -m tests.workflows.batch_histories.record` when the change is meant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from tests.workflows.batch_histories.record import SCENARIOS
from workflows.job_batch import JobBatch

HISTORIES = Path(__file__).parent / "batch_histories"
RECORDED = sorted(path.stem for path in HISTORIES.glob("*.json"))
# What each history must hold for its replay to test what it is named for.
HOLDS = {
    "started_by_batch": ("start_batch_jobs", "deliver_webhook"),
    "started_by_client": (),
    "cancelled": ("start_batch_jobs", "cancel_batch_jobs"),
}


def test_one_recording_per_scenario() -> None:
    assert RECORDED == sorted(SCENARIOS) == sorted(HOLDS)


@pytest.mark.parametrize("name", RECORDED)
async def test_recorded_batch_history_replays(name: str) -> None:
    text = (HISTORIES / f"{name}.json").read_text()
    events = json.loads(text)["events"]
    assert events[-1]["eventType"] == "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED"
    activities = {
        e["activityTaskScheduledEventAttributes"]["activityType"]["name"]
        for e in events
        if e["eventType"] == "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED"
    }
    assert set(HOLDS[name]) <= activities, activities
    if name == "started_by_client":
        assert "start_batch_jobs" not in activities
    replayer = Replayer(workflows=[JobBatch], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(WorkflowHistory.from_json(f"recorded-batch-{name}", text))
