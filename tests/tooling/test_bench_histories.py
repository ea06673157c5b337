"""bench/histories.py on a hand-made history: round trips counted, and the critical path that
adds up to the job's time while leaving out work off the path (a signal during an activity)."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.json_format import ParseDict
from google.protobuf.timestamp_pb2 import Timestamp
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent

from bench.histories import critical_path, round_trips, shares, split

T0 = 1_700_000_000.0


def event(event_id: int, kind: str, at_ms: float, **attributes: Any) -> HistoryEvent:
    fields = {f"{kind.lower()}_event_attributes": attributes} if attributes else {}
    built = ParseDict(fields, HistoryEvent())
    built.event_id = event_id
    built.event_type = EventType.Value(f"EVENT_TYPE_{kind}")
    stamp = Timestamp()
    stamp.FromMicroseconds(round((T0 + at_ms / 1000) * 1e6))
    built.event_time.CopyFrom(stamp)
    return built


def one_activity_history() -> list[HistoryEvent]:
    """A workflow running one activity, with a signal arriving while the activity runs; the
    activity's start is written when it ends (after the signal), as Temporal does."""
    return [
        event(1, "WORKFLOW_EXECUTION_STARTED", 0),
        event(2, "WORKFLOW_TASK_SCHEDULED", 1),
        event(3, "WORKFLOW_TASK_STARTED", 11, scheduled_event_id=2),
        event(4, "WORKFLOW_TASK_COMPLETED", 21, scheduled_event_id=2, started_event_id=3),
        event(
            5,
            "ACTIVITY_TASK_SCHEDULED",
            22,
            activity_type={"name": "noop"},
            workflow_task_completed_event_id=4,
        ),
        event(6, "WORKFLOW_EXECUTION_SIGNALED", 25, signal_name="progress"),
        event(7, "ACTIVITY_TASK_STARTED", 23, scheduled_event_id=5),
        event(8, "ACTIVITY_TASK_COMPLETED", 40, scheduled_event_id=5, started_event_id=7),
        event(9, "WORKFLOW_TASK_SCHEDULED", 41),
        event(10, "WORKFLOW_TASK_STARTED", 45, scheduled_event_id=9),
        event(11, "WORKFLOW_TASK_COMPLETED", 50, scheduled_event_id=9, started_event_id=10),
        event(12, "WORKFLOW_EXECUTION_COMPLETED", 51, workflow_task_completed_event_id=11),
    ]


def test_round_trips_name_the_activities_and_signals() -> None:
    trips = round_trips(one_activity_history())
    assert (trips.events, trips.runs, trips.workflow_tasks) == (12, 1, 2)
    assert (trips.activities, trips.signals, trips.timers) == ({"noop": 1}, {"progress": 1}, 0)
    assert trips.round_trips == 4
    assert trips.by_type["WORKFLOW_TASK_STARTED"] == 2


def test_the_critical_path_adds_up_and_skips_what_ran_beside_it() -> None:
    events = one_activity_history()
    path = critical_path(events, submitted=T0 - 0.002, after=[("client: done", T0 + 0.060)])
    assert sum(step.ms for step in path) == pytest.approx(62, abs=0.01)
    assert all(step.ms >= 0 for step in path)
    assert not any("SIGNALED" in step.label for step in path)  # off the path
    assert path[0].label == "client submit → WORKFLOW_EXECUTION_STARTED"
    assert path[-1].label == "WORKFLOW_EXECUTION_COMPLETED → client: done"
    by_category = {s.category: s.p50_ms for s in shares([path])}
    assert by_category["activity noop running"] == pytest.approx(17, abs=0.01)
    assert by_category["workflow code on the worker (workflow task)"] == pytest.approx(15, abs=0.01)
    assert by_category["workflow task dispatch (server to worker)"] == pytest.approx(14, abs=0.01)
    assert by_category["client: done"] == pytest.approx(9, abs=0.01)


def test_a_wait_is_cut_where_another_witness_saw_something_happen() -> None:
    path = critical_path(one_activity_history(), submitted=T0)
    cut = split(
        path,
        "activity noop running",
        [("noop: before", T0 + 0.030), ("outside the step", T0 + 0.045)],
        "noop: after",
    )
    assert sum(s.ms for s in cut) == pytest.approx(sum(s.ms for s in path))
    pieces = {s.category: s.ms for s in cut}
    assert "activity noop running" not in pieces and "outside the step" not in pieces
    assert pieces["noop: before"] == pytest.approx(7, abs=0.01)  # 23 ms -> 30 ms
    assert pieces["noop: after"] == pytest.approx(10, abs=0.01)  # 30 ms -> 40 ms
