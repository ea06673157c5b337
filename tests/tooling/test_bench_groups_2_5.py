"""The pure parts of `make bench`'s groups 2-5: /proc parsing, the RSS line fit, py-spy's
collapsed stacks, the recovery's parts, the option lists. No stack, no timing."""

from __future__ import annotations

import argparse

import pytest

from bench.__main__ import _counts
from bench.jobs import Seen
from bench.procs import linear_fit, parse_stat, status_kib
from bench.profile import parse_collapsed, summarize
from bench.recovery_parts import Mark, parts, step_gaps, step_seen_after, timeline
from workflows.contracts import JobState


def test_stat_is_split_after_the_command_name() -> None:
    text = "1234 (weird) name)) S 77 1234 1234 0 -1 0 0 0 0 0 150 25 0 0 20 0 1 0 99"
    assert parse_stat(text) == (77, 175.0)


def test_status_fields_in_kib() -> None:
    text = "Name:\tpython\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n"
    assert status_kib(text, "VmRSS") == 102400
    assert status_kib(text, "VmHWM") == 204800
    assert status_kib(text, "VmSwap") is None


def test_linear_fit() -> None:
    assert linear_fit([100, 300], [150.0, 250.0]) == pytest.approx((0.5, 100.0))
    with pytest.raises(ValueError):
        linear_fit([100, 100], [1.0, 2.0])


def test_collapsed_stacks_leave_out_idle_and_imports() -> None:
    text = "\n".join(
        [
            "main (a/b/app.py:3);work (pkg/w.py:10) 6",
            "main (a/b/app.py:3);work (pkg/w.py:12);hash (pkg/h.py:1) 4",
            "_bootstrap (threading.py:1);Condition.wait (threading.py:300) 50",
            "<module> (x.py:1);_find_and_load (<frozen importlib._bootstrap>:1) 9",
            "garbage line",
        ]
    )
    profile = parse_collapsed(text)
    assert profile.samples == 10
    assert profile.self_counts["work (pkg/w.py)"] == 6  # two lines of one function: one row
    assert profile.inclusive_counts["work (pkg/w.py)"] == 10
    lines = summarize(text, top=2)
    assert lines[0].startswith("10 samples")
    assert "| work (pkg/w.py) | 6 | 60% |" in lines
    assert summarize("") == ["(py-spy recorded no samples)"]


def _seen(at: float, step: int) -> Seen:
    return Seen(at=at, state=JobState.RUNNING, step=step, total_steps=100)


def test_the_next_step_is_one_the_simulator_sent_after_the_kill() -> None:
    seen = [_seen(1, 5), _seen(3, 10), _seen(11, 12), _seen(30, 40), _seen(32, 45)]
    sent = {5: 0.5, 10: 2.5, 12: 9.9, 40: 29.0, 45: 31.5}
    # Step 12 reached the client after the kill (at 10) but was sent before it.
    before, after = step_seen_after(seen, 10.0, sent)
    assert before == 10 and after == _seen(30, 40)
    assert step_seen_after(seen[:3], 10.0, sent)[1] is None
    assert step_gaps(seen, 10.0, 30.0) == [2, 2]  # gaps ending in the recovery left out


def test_recovery_parts_add_up_to_the_time_seen() -> None:
    marks = [
        Mark(5, "ACTIVITY_TASK_SCHEDULED follow_prompt"),  # before the kill: ignored
        Mark(28, "ACTIVITY_TASK_TIMED_OUT follow_prompt"),
        Mark(28, "WORKFLOW_TASK_SCHEDULED"),
        Mark(31, "WORKFLOW_TASK_TIMED_OUT"),
        Mark(31, "WORKFLOW_TASK_SCHEDULED"),
        Mark(31.1, "TIMER_STARTED 1"),
        Mark(32.1, "TIMER_FIRED"),
        Mark(32.2, "ACTIVITY_TASK_SCHEDULED follow_prompt"),
        Mark(33.0, "WORKFLOW_EXECUTION_SIGNALED progress"),
    ]
    named = dict(parts(10.0, 33.5, marks))
    assert named["heartbeat timeout (kill -> ACTIVITY_TASK_TIMED_OUT)"] == 18
    assert named["sticky-queue timeout (WORKFLOW_TASK_TIMED_OUT waits)"] == 3
    assert named["backoff timer (TIMER_STARTED -> TIMER_FIRED)"] == pytest.approx(1.0)
    assert named["re-attach (follow scheduled again -> its first progress signal)"] == (
        pytest.approx(0.8)
    )
    assert named["signal -> the client saw the step"] == pytest.approx(0.5)
    assert sum(named.values()) == pytest.approx(23.5)
    assert parts(10.0, 12.0, []) == [("unexplained (no activity timeout in the history)", 2.0)]
    rows = timeline(10.0, 29.0, marks)
    assert rows[0] == (0.0, 0.0, "worker killed (SIGKILL)")
    assert [r[2] for r in rows[1:]] == [
        "ACTIVITY_TASK_TIMED_OUT follow_prompt",
        "WORKFLOW_TASK_SCHEDULED",
    ]


def test_counts_option() -> None:
    assert _counts("300,100,100") == (100, 300)
    for bad in ("", "0,5", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError):
            _counts(bad)
