"""The pure parts of `make bench`'s batch group (bench/groups/batch.py): where one
`submit_batch` call's time went, from its Temporal calls; one single start's parts; its
options; what a batch's history says it waited on. No stack, no timing."""

from __future__ import annotations

from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import (
    HistoryEvent,
    WorkflowExecutionSignaledEventAttributes,
    WorkflowTaskCompletedEventAttributes,
    WorkflowTaskStartedEventAttributes,
    WorkflowTaskTimedOutEventAttributes,
)

from bench.__main__ import parse
from bench.calls import Call
from bench.groups.batch import (
    Window,
    during,
    during_text,
    history_marks,
    per_start_parts,
    submit_parts,
)
from bench.outcome import BenchOptions
from workflows.shared import SIGNAL_BATCH_JOB_ENDED


def test_a_batch_submit_is_split_at_its_calls_and_the_parts_add_up() -> None:
    calls = [
        Call("query:room", 10.10, 10.12),
        Call("start_workflow", 10.12, 10.15),  # the batch's own workflow
        *(Call("start_workflow", 10.15 + i * 0.01, 10.17 + i * 0.01) for i in range(10)),
        Call("signal:submitted", 10.30, 10.31),
        Call("query:status", 10.31, 10.43),
    ]
    parts = dict(submit_parts(calls, 10.0, 10.50))
    values = list(parts.values())
    assert values[0] == pytest.approx(0.10)  # the client's checks before its first call
    assert values[1] == pytest.approx(0.02)  # the room
    assert values[2] == pytest.approx(0.03)  # the batch's workflow
    assert values[3] == pytest.approx(0.26 - 0.15)  # the ten jobs' starts, to the last one's end
    assert values[4] == pytest.approx(0.31 - 0.26)  # the signal
    assert values[5] == pytest.approx(0.12)  # the status's query
    assert values[6] == pytest.approx(0.07)  # the status's visibility list, after the query
    assert sum(values) == pytest.approx(0.50)
    assert any("10 jobs started" in name for name in parts)


def test_a_batch_submit_without_its_calls_is_not_split() -> None:
    assert submit_parts([Call("start_workflow", 1, 2)], 0, 3) == []
    assert submit_parts([], 0, 3) == []


def test_a_single_start_is_its_own_calls_and_the_rest() -> None:
    # Two starts at once (tasks 1 and 2): each start's rest counts only its own calls.
    windows = [Window(1, 0.0, 0.010), Window(2, 0.0, 0.020)]
    calls = [
        Call("query:room", 0.000, 0.002, task=1),
        Call("start_workflow", 0.002, 0.006, task=1),
        Call("query:room", 0.008, 0.010, task=2),  # waited 8 ms for its turn first
        Call("start_workflow", 0.010, 0.014, task=2),
        Call("start_workflow", 0.030, 0.034, task=2),  # after its window: not its start's
    ]
    rows = per_start_parts(calls, windows)
    by_name = {name.split(" (")[0]: (p50, p95) for name, p50, p95 in rows}
    assert by_name["call query:room"] == pytest.approx((2.0, 2.0))
    assert by_name["call start_workflow"] == pytest.approx((4.0, 4.0))
    rest = by_name["outside its calls: the client's own work and its waits in the client"]
    assert rest[0] == pytest.approx((4.0 + 14.0) / 2)  # 10 - 6 and 20 - 6
    assert per_start_parts(calls, []) == []


def test_the_batch_options_reach_the_benchmark() -> None:
    args = parse(["--only", "batch", "--batch-jobs", "200", "--batch-reads", "20"])
    assert (args.batch_jobs, args.batch_reads) == (200, 20)
    assert (BenchOptions().batch_jobs, BenchOptions().batch_reads) == (1000, 50)
    with pytest.raises(ValueError):
        BenchOptions(batch_jobs=1001)  # a batch holds at most 1,000 jobs


def _event(event_id: int, kind: EventType.ValueType, at: float, **attributes: Any) -> HistoryEvent:
    event = HistoryEvent(event_id=event_id, event_type=kind, **attributes)
    event.event_time.FromMicroseconds(int(at * 1e6))
    return event


def test_a_batch_history_says_what_it_received_and_how_long_its_tasks_waited() -> None:
    ended = WorkflowExecutionSignaledEventAttributes(signal_name=SIGNAL_BATCH_JOB_ENDED)
    submitted = WorkflowExecutionSignaledEventAttributes(signal_name="submitted")
    signaled = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
    events = [
        _event(1, signaled, 10.0, workflow_execution_signaled_event_attributes=ended),
        _event(2, EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED, 10.0),
        _event(
            3,
            EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED,
            12.5,
            workflow_task_started_event_attributes=WorkflowTaskStartedEventAttributes(
                scheduled_event_id=2
            ),
        ),
        _event(4, signaled, 13.0, workflow_execution_signaled_event_attributes=submitted),
        _event(
            5,
            EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT,
            22.5,
            workflow_task_timed_out_event_attributes=WorkflowTaskTimedOutEventAttributes(
                scheduled_event_id=2, started_event_id=3
            ),
        ),
        _event(6, EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED, 22.5),
        _event(
            7,
            EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED,
            23.0,
            workflow_task_started_event_attributes=WorkflowTaskStartedEventAttributes(
                scheduled_event_id=6
            ),
        ),
        _event(
            8,
            EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED,
            23.1,
            workflow_task_completed_event_attributes=WorkflowTaskCompletedEventAttributes(
                scheduled_event_id=6, started_event_id=7
            ),
        ),
        _event(9, signaled, 24.0, workflow_execution_signaled_event_attributes=ended),
    ]
    marks = history_marks(events)
    assert [m.kind for m in marks] == ["signal", "task", "signal", "task", "signal"]
    first, second = marks[1], marks[3]
    assert first.waited == pytest.approx(2.5) and first.ran == pytest.approx(10.0)
    assert first.outcome == "timed out"
    assert second.waited == pytest.approx(0.5) and second.ran == pytest.approx(0.1)
    assert second.outcome == "completed"
    seen = during(marks, 9.0, 14.0)
    assert seen.signals == {SIGNAL_BATCH_JOB_ENDED: 1, "submitted": 1}
    assert seen.task_waits == pytest.approx([2.5])
    text = during_text("while it ran", seen)
    assert text.startswith(f"while it ran: 1 `{SIGNAL_BATCH_JOB_ENDED}` signals")
    assert "waited for the worker p50 2500 ms" in text and "ran on it p50 10000 ms" in text
    assert text.endswith("; 1 timed out")
    later = during_text("later", during(marks, 22.8, 25.0))
    assert "1 workflow tasks" in later and "timed out" not in later
    assert "no workflow task" in during_text("after", during(marks, 23.5, 30.0))
