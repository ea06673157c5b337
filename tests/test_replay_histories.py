"""Committed histories of real endings must replay against today's workflow code.

A failure here means a change to InferenceJob is not deterministic for jobs already running:
guard it with `workflow.patched()` instead of re-recording (tests/histories/record.py).
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

from workflows.inference_job import InferenceJob

HISTORIES = Path(__file__).parent / "histories"
ENDINGS = {
    "completed": "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED",
    "cancelled": "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED",
    "abandoned": "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED",
    "reconnected": "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED",
    "stopped_slowly": "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED",
    "lost": "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED",
    "decided": "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED",
    "canceled_with_reason": "EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED",
    "queue_timeout": "EVENT_TYPE_WORKFLOW_EXECUTION_FAILED",
    "continued": "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED",
    "refused": "EVENT_TYPE_WORKFLOW_EXECUTION_FAILED",
}


RECORDED = sorted(path.stem for path in HISTORIES.glob("*.json"))


def test_every_ending_is_recorded() -> None:
    assert set(ENDINGS) <= {name.split("-")[0] for name in RECORDED}


@pytest.mark.parametrize("name", RECORDED)
async def test_committed_history_replays(name: str) -> None:
    text = (HISTORIES / f"{name}.json").read_text()
    events = json.loads(text)["events"]
    assert events[-1]["eventType"] == ENDINGS[name.split("-")[0]]
    history = WorkflowHistory.from_json(f"recorded-{name}", text)
    replayer = Replayer(workflows=[InferenceJob], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(history)


def timer_summary(event: dict[str, Any]) -> str:
    data = event.get("userMetadata", {}).get("summary", {}).get("data", "")
    return str(json.loads(base64.b64decode(data))) if data else ""


def test_reconnected_history_has_bounded_jittered_reconnect_timers() -> None:
    events = json.loads((HISTORIES / "reconnected.json").read_text())["events"]
    timers = [e for e in events if e["eventType"] == "EVENT_TYPE_TIMER_STARTED"]
    reconnects = [t for t in timers if timer_summary(t).startswith("reconnect")]
    assert [timer_summary(t) for t in reconnects] == ["reconnect 1", "reconnect 2", "reconnect 3"]
    for attempt, timer in enumerate(reconnects):
        seconds = float(timer["timerStartedEventAttributes"]["startToFireTimeout"].rstrip("s"))
        ceiling = min(2.0**attempt, 30.0)
        assert ceiling / 2 <= seconds <= ceiling
