"""Group 3's arithmetic: from the moment a worker was killed to the next step a client saw, the
timeline of what happened (history events and marks) and the named parts of that time. Pure, so
tests/tooling/test_bench_groups_2_5.py checks it without a stack."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bench.jobs import Seen


@dataclass(frozen=True)
class Mark:
    at: float  # epoch seconds
    label: str


def step_seen_after(
    seen: Sequence[Seen], kill_at: float, sent_at: Mapping[int, float]
) -> tuple[int, Seen | None]:
    """(the highest step seen up to the kill, the first status after it showing a step that the
    simulator sent after the kill). A step sent before the kill may still reach the client
    afterwards (a heartbeat or signal already on its way): only a later one proves a live
    follower again. `sent_at`: step -> when the simulator sent it."""
    before = max((s.step for s in seen if s.at <= kill_at), default=0)
    after = next(
        (s for s in seen if s.at > kill_at and sent_at.get(s.step, -math.inf) > kill_at), None
    )
    return before, after


def step_gaps(seen: Sequence[Seen], skip_from: float, skip_to: float) -> list[float]:
    """Seconds between successive new steps a client saw, leaving out every gap that ends in
    (skip_from, skip_to] (the recovery): the job's own step interval as a client sees it."""
    gaps: list[float] = []
    last: Seen | None = None
    for status in seen:
        if status.step <= 0 or (last is not None and status.step <= last.step):
            continue
        if last is not None and not skip_from < status.at <= skip_to:
            gaps.append(status.at - last.at)
        last = status
    return gaps


def timeline(kill_at: float, until: float, marks: Sequence[Mark]) -> list[tuple[float, float, str]]:
    """(seconds since the kill, seconds since the previous line, label) for every mark in
    [kill_at, until], in time order, starting with the kill."""
    chosen = sorted((m for m in marks if kill_at <= m.at <= until), key=lambda m: (m.at, m.label))
    rows: list[tuple[float, float, str]] = [(0.0, 0.0, "worker killed (SIGKILL)")]
    previous = kill_at
    for mark in chosen:
        rows.append((mark.at - kill_at, mark.at - previous, mark.label))
        previous = mark.at
    return rows


def _first(marks: Sequence[Mark], text: str, after: float) -> Mark | None:
    return next(
        (m for m in sorted(marks, key=lambda m: m.at) if text in m.label and m.at >= after), None
    )


def parts(kill_at: float, seen_at: float, marks: Sequence[Mark]) -> list[tuple[str, float]]:
    """The recovery cut into what it waited for, as far as the marks show it (missing marks
    leave their part out; the parts add up to seen_at - kill_at):

    - heartbeat timeout: kill -> the follow activity's ACTIVITY_TASK_TIMED_OUT;
    - sticky-queue timeout: each WORKFLOW_TASK_TIMED_OUT after it, from its task's scheduling;
    - backoff timer: TIMER_STARTED -> TIMER_FIRED after the timeout;
    - re-attach: the next ACTIVITY_TASK_SCHEDULED -> the first `progress` signal after it;
    - to the client: that signal -> the client saw the step;
    - the rest (workflow tasks in between), as "other".
    """
    total = seen_at - kill_at
    named: list[tuple[str, float]] = []
    timed_out = _first(marks, "ACTIVITY_TASK_TIMED_OUT", kill_at)
    if timed_out is None:
        return [("unexplained (no activity timeout in the history)", total)]
    named.append(("heartbeat timeout (kill -> ACTIVITY_TASK_TIMED_OUT)", timed_out.at - kill_at))
    ordered = sorted((m for m in marks if timed_out.at <= m.at <= seen_at), key=lambda m: m.at)
    last_scheduled: Mark | None = None
    sticky = 0.0
    for mark in ordered:
        if "WORKFLOW_TASK_SCHEDULED" in mark.label:
            last_scheduled = mark
        elif "WORKFLOW_TASK_TIMED_OUT" in mark.label and last_scheduled is not None:
            sticky += mark.at - last_scheduled.at
    if sticky:
        named.append(("sticky-queue timeout (WORKFLOW_TASK_TIMED_OUT waits)", sticky))
    started = _first(ordered, "TIMER_STARTED", timed_out.at)
    fired = _first(ordered, "TIMER_FIRED", started.at) if started else None
    if started is not None and fired is not None:
        named.append(("backoff timer (TIMER_STARTED -> TIMER_FIRED)", fired.at - started.at))
    rescheduled = _first(ordered, "ACTIVITY_TASK_SCHEDULED", timed_out.at)
    signal = _first(ordered, "WORKFLOW_EXECUTION_SIGNALED", rescheduled.at) if rescheduled else None
    if rescheduled is not None and signal is not None:
        named.append(
            (
                "re-attach (follow scheduled again -> its first progress signal)",
                signal.at - rescheduled.at,
            )
        )
        named.append(("signal -> the client saw the step", seen_at - signal.at))
    named.append(("other (workflow tasks between these)", total - sum(s for _, s in named)))
    return named
