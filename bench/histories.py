"""Reading a job's workflow history: its events across continue-as-new runs, what Temporal
round trips they are, and the time between them (where a job's latency goes)."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

from pydantic import BaseModel, Field
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client

from bench.results import fmt, percentile


async def job_history(client: Client, workflow_id: str) -> list[HistoryEvent]:
    """Every event of every run of the workflow, oldest run first (a job that continued as new
    is one job: its history is the sum of its runs)."""
    runs: list[list[HistoryEvent]] = []
    run_id: str | None = None
    while True:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        events = list(history.events)
        runs.insert(0, events)
        started = events[0].workflow_execution_started_event_attributes
        if not started.continued_execution_run_id:
            break
        run_id = started.continued_execution_run_id
    return [event for run in runs for event in run]


def event_type(event: HistoryEvent) -> str:
    """ACTIVITY_TASK_SCHEDULED for EVENT_TYPE_ACTIVITY_TASK_SCHEDULED."""
    return EventType.Name(event.event_type).removeprefix("EVENT_TYPE_")


def event_time(event: HistoryEvent) -> float:
    return event.event_time.ToMicroseconds() / 1e6


def labels(events: Sequence[HistoryEvent]) -> list[str]:
    """A readable name per event: its type, plus the activity, signal, timer or marker name."""
    activities: dict[int, str] = {}
    out: list[str] = []
    for event in events:
        kind = event_type(event)
        name = ""
        if kind == "ACTIVITY_TASK_SCHEDULED":
            name = event.activity_task_scheduled_event_attributes.activity_type.name
            activities[event.event_id] = name
        elif kind == "ACTIVITY_TASK_STARTED":
            name = activities.get(
                event.activity_task_started_event_attributes.scheduled_event_id, ""
            )
        elif kind == "ACTIVITY_TASK_COMPLETED":
            scheduled = event.activity_task_completed_event_attributes.scheduled_event_id
            name = activities.get(scheduled, "")
        elif kind == "ACTIVITY_TASK_FAILED":
            name = activities.get(
                event.activity_task_failed_event_attributes.scheduled_event_id, ""
            )
        elif kind == "WORKFLOW_EXECUTION_SIGNALED":
            name = event.workflow_execution_signaled_event_attributes.signal_name
        elif kind == "TIMER_STARTED":
            name = event.timer_started_event_attributes.timer_id
        elif kind == "MARKER_RECORDED":
            name = event.marker_recorded_event_attributes.marker_name
        elif kind == "WORKFLOW_EXECUTION_UPDATE_ACCEPTED":
            accepted = event.workflow_execution_update_accepted_event_attributes
            name = accepted.accepted_request.input.name
        out.append(f"{kind} {name}".rstrip())
    return out


class RoundTrips(BaseModel):
    """What a job costs in Temporal terms, from its history."""

    events: int
    runs: int
    workflow_tasks: int
    activities: dict[str, int] = Field(default_factory=dict)
    signals: dict[str, int] = Field(default_factory=dict)
    timers: int = 0
    markers: dict[str, int] = Field(default_factory=dict)  # local activities, patches
    updates: int = 0
    upserts: int = 0  # search attributes
    properties_modified: int = 0  # memo
    by_type: dict[str, int] = Field(default_factory=dict)

    @property
    def round_trips(self) -> int:
        """Each a wait on the server: a workflow task, an activity, a signal, a timer."""
        return (
            self.workflow_tasks
            + sum(self.activities.values())
            + sum(self.signals.values())
            + self.timers
            + self.updates
        )

    def lines(self) -> list[str]:
        def names(counts: dict[str, int]) -> str:
            return ", ".join(f"{k} x{v}" for k, v in counts.items()) or "none"

        return [
            f"- {self.events} events in {self.runs} run(s); {self.round_trips} round trips:",
            f"  - workflow tasks: {self.workflow_tasks}",
            f"  - activities ({sum(self.activities.values())}): {names(self.activities)}",
            f"  - signals ({sum(self.signals.values())}): {names(self.signals)}",
            f"  - timers: {self.timers}; updates: {self.updates}",
            f"  - no round trip of their own: search-attribute upserts {self.upserts}, memo "
            f"changes {self.properties_modified}, markers: {names(self.markers)}",
            f"- events by type: {names(self.by_type)}",
        ]


def round_trips(events: Sequence[HistoryEvent]) -> RoundTrips:
    kinds = [event_type(e) for e in events]
    named = labels(events)
    by_name = Counter(named)

    def prefixed(prefix: str) -> dict[str, int]:
        return {
            label.removeprefix(prefix).strip() or "?": count
            for label, count in by_name.items()
            if label.startswith(prefix)
        }

    return RoundTrips(
        events=len(events),
        runs=kinds.count("WORKFLOW_EXECUTION_STARTED"),
        workflow_tasks=kinds.count("WORKFLOW_TASK_SCHEDULED"),
        activities=prefixed("ACTIVITY_TASK_SCHEDULED"),
        signals=prefixed("WORKFLOW_EXECUTION_SIGNALED"),
        timers=kinds.count("TIMER_STARTED"),
        markers=prefixed("MARKER_RECORDED"),
        updates=kinds.count("WORKFLOW_EXECUTION_UPDATE_ACCEPTED"),
        upserts=kinds.count("UPSERT_WORKFLOW_SEARCH_ATTRIBUTES"),
        properties_modified=kinds.count("WORKFLOW_PROPERTIES_MODIFIED"),
        by_type=dict(Counter(kinds).most_common()),
    )


# Which earlier event an event waited for, by the first of these fields its attributes have:
# an activity's completion waited for its start, its start for its scheduling, a command
# (schedule, upsert, timer, completion) for the workflow task that issued it, and so on.
_CAUSE_FIELDS = ("started_event_id", "scheduled_event_id", "workflow_task_completed_event_id")


def _cause(event: HistoryEvent, by_id: dict[int, HistoryEvent]) -> HistoryEvent | None:
    kind = event.WhichOneof("attributes")
    attributes = getattr(event, kind) if kind else None
    for name in _CAUSE_FIELDS:
        cause_id = getattr(attributes, name, 0) if attributes is not None else 0
        if cause_id:
            return by_id.get(cause_id)
    if event_type(event) == "WORKFLOW_EXECUTION_STARTED":
        return None
    # A workflow task is scheduled by whatever was written just before it (an activity's end, a
    # signal, a timer, or the previous task's commands when something arrived meanwhile).
    return by_id.get(event.event_id - 1)


class Step(BaseModel):
    """One link of the critical path: what the job waited on, and for how long."""

    label: str
    category: str
    ms: float
    end: float  # epoch seconds

    @property
    def start(self) -> float:
        return self.end - self.ms / 1000


def _category(label: str) -> str:
    kind, _, name = label.partition(" ")
    if kind == "WORKFLOW_TASK_STARTED":
        return "workflow task dispatch (server to worker)"
    if kind == "WORKFLOW_TASK_COMPLETED":
        return "workflow code on the worker (workflow task)"
    if kind == "ACTIVITY_TASK_STARTED":
        return "activity dispatch (server to worker)"
    if kind in ("ACTIVITY_TASK_COMPLETED", "ACTIVITY_TASK_FAILED"):
        return f"activity {name} running"
    if kind == "TIMER_FIRED":
        return "timer"
    # Includes a new workflow task waiting for the one in flight (a progress signal's) to end.
    return "server: events written, tasks scheduled (or waiting for a task in flight)"


def critical_path(
    events: Sequence[HistoryEvent],
    submitted: float,
    after: Sequence[tuple[str, float]] = (),
) -> list[Step]:
    """From the client's submit to its last mark: the chain of waits, each ended by an event
    that waited for the one before it (walked back from the last event), so the steps add up
    to the whole time and concurrent work off the path (progress signals while an activity
    runs) is not counted. `after` are the client's own marks after the last event."""
    by_id = {e.event_id: e for e in events}
    names = dict(zip((e.event_id for e in events), labels(events), strict=True))
    chain: list[HistoryEvent] = []
    event: HistoryEvent | None = events[-1]
    while event is not None:
        chain.insert(0, event)
        event = _cause(event, by_id)
    steps = [
        Step(
            label=f"client submit → {names[chain[0].event_id]}",
            category="client: start_workflow",
            ms=(event_time(chain[0]) - submitted) * 1000,
            end=event_time(chain[0]),
        )
    ]
    for before, now in itertools.pairwise(chain):
        label = names[now.event_id]
        steps.append(
            Step(
                label=f"{names[before.event_id]} → {label}",
                category=_category(label),
                ms=(event_time(now) - event_time(before)) * 1000,
                end=event_time(now),
            )
        )
    previous = (names[chain[-1].event_id], event_time(chain[-1]))
    for mark in after:
        steps.append(
            Step(
                label=f"{previous[0]} → {mark[0]}",
                category=mark[0],
                ms=(mark[1] - previous[1]) * 1000,
                end=mark[1],
            )
        )
        previous = mark
    return steps


def split(
    path: Sequence[Step], category: str, marks: Sequence[tuple[str, float]], rest: str
) -> list[Step]:
    """The path with its `category` step cut at `marks` (label, epoch seconds): each piece is
    named by the mark that ends it, the last one `rest`. What another witness (the simulator)
    saw happen inside one wait. Marks outside the step are ignored."""
    out: list[Step] = []
    for step in path:
        inside = sorted((m for m in marks if step.start <= m[1] <= step.end), key=lambda m: m[1])
        if step.category != category or not inside:
            out.append(step)
            continue
        begin = step.start
        for label, at in inside:
            out.append(Step(label=label, category=label, ms=(at - begin) * 1000, end=at))
            begin = at
        out.append(Step(label=rest, category=rest, ms=(step.end - begin) * 1000, end=step.end))
    return out


class Share(BaseModel):
    category: str
    p50_ms: float
    p95_ms: float


def shares(paths: Sequence[Sequence[Step]]) -> list[Share]:
    """Per category, its time on each job's critical path (summed per job), p50 and p95 over
    the jobs; largest first."""
    categories = {step.category for path in paths for step in path}
    out = []
    for category in categories:
        per_job = [sum(s.ms for s in path if s.category == category) for path in paths]
        out.append(
            Share(category=category, p50_ms=percentile(per_job, 50), p95_ms=percentile(per_job, 95))
        )
    return sorted(out, key=lambda share: -share.p50_ms)


def shares_table(rows: Sequence[Share], total_ms: float) -> list[str]:
    lines = ["| waiting on | p50 ms | p95 ms | share of p50 total |", "|---|---|---|---|"]
    lines += [
        f"| {r.category} | {fmt(r.p50_ms)} | {fmt(r.p95_ms)} | {r.p50_ms / total_ms:.0%} |"
        for r in rows
    ]
    return lines


def path_table(path: Sequence[Step]) -> list[str]:
    lines = ["| # | waited for | ms |", "|---|---|---|"]
    lines += [f"| {i} | {s.label} | {fmt(s.ms)} |" for i, s in enumerate(path, 1)]
    return lines
