"""The arithmetic of `make bench`'s queue group (bench/queue_math.py): tenants' shares over
sliding windows of starts, the starts between a job's submission and its own, the start rate of
a draining queue, events per job. No stack, no timing."""

from __future__ import annotations

import math

import pytest

from bench.queue_math import (
    contested,
    events_per_job,
    spread_sample,
    start_rate,
    starts_between,
    window_shares,
)


def test_contested_starts_end_at_the_first_tenant_to_run_out() -> None:
    # b's last start is the 4th: until then both had a job waiting.
    assert contested(list("abab" + "aaa"), {"a", "b"}) == 4
    # a's last job started 3rd: b's start after it was no longer contested.
    assert contested(list("aaab"), {"a", "b"}) == 3
    # A tenant that never started was never contested with.
    assert contested(list("aaaa"), {"a", "b"}) == 0
    assert contested([], {"a"}) == 0


def test_alternating_starts_hold_an_even_share_in_every_window() -> None:
    order = list("ab" * 150)
    shares = window_shares(order, {"a": 1.0, "b": 1.0}, window=100)
    assert shares.contested == 299  # the last start (b's) had no a waiting beside it
    assert shares.windows == 200
    assert shares.window == 100
    assert shares.expected == {"a": 0.5, "b": 0.5}
    assert shares.max_deviation == pytest.approx(0.0)
    assert shares.low["a"] == shares.high["a"] == pytest.approx(0.5)


def test_two_to_one_starts_hold_the_weight_share_within_a_point() -> None:
    order = list("aab" * 100)
    shares = window_shares(order, {"a": 2.0, "b": 1.0}, window=100)
    assert shares.expected["a"] == pytest.approx(2 / 3)
    # 100 starts hold 66 or 67 of a's: the worst is 66, two thirds of a point under 66.67 %.
    assert shares.low["a"] == pytest.approx(0.66)
    assert shares.high["a"] == pytest.approx(0.67)
    assert shares.max_deviation == pytest.approx(100 * (2 / 3 - 0.66))


def test_first_come_first_served_gives_the_first_tenant_every_contested_start() -> None:
    # One tenant's jobs all in before the other's: in arrival order, b's first start comes after
    # a's last, so every contested window is a's alone.
    order = ["a"] * 300 + ["b"] * 300
    shares = window_shares(order, {"a": 1.0, "b": 1.0}, window=100)
    assert shares.contested == 300
    assert shares.windows == 201
    assert shares.max_deviation == pytest.approx(50.0)
    assert shares.high["a"] == 1.0 and shares.low["b"] == 0.0
    assert shares.worst_window == 0


def test_a_burst_of_one_tenant_shows_in_the_window_that_holds_it() -> None:
    order = list("ab" * 100) + ["a"] * 20 + list("ba" * 100) + ["b"] * 20
    shares = window_shares(order, {"a": 1.0, "b": 1.0}, window=100)
    # The windows over the 20 a's in a row hold 60 of them: ten points over the even share.
    assert shares.max_deviation == pytest.approx(10.0)
    assert shares.worst_tenant in {"a", "b"}
    assert shares.high["a"] == pytest.approx(0.6)


def test_windows_shrink_to_the_contested_starts_and_none_without_them() -> None:
    shares = window_shares(list("abab"), {"a": 1.0, "b": 1.0}, window=100)
    assert (shares.contested, shares.window, shares.windows) == (3, 3, 1)
    assert shares.max_deviation == pytest.approx(100 * (2 / 3 - 1 / 2))
    empty = window_shares(list("aaaa"), {"a": 1.0, "b": 1.0}, window=100)
    assert empty.windows == 0 and math.isnan(empty.max_deviation)


def test_starts_between_count_the_others_after_the_submission_and_before_its_start() -> None:
    started = {"blocker": 1.0, "early": 9.0, "x": 10.5, "y": 11.0, "urgent": 12.0, "late": 13.0}
    # Submitted at 10: x and y started in between; the blocker and `early` before, `late` after.
    assert starts_between(started, "urgent", 10.0) == ["x", "y"]
    assert starts_between(started, "urgent", 11.5) == []
    assert starts_between(started, "late", 10.0) == ["x", "y", "urgent"]
    with pytest.raises(KeyError):
        starts_between(started, "nobody", 0.0)


def test_start_rate_counts_the_starts_after_the_free_slots() -> None:
    # 3 slots free at once (t = 0), then a start every 0.5 s: 4 starts over 2 s.
    starts = [0.0, 0.0, 0.0, 0.5, 1.0, 1.5, 2.0]
    assert start_rate(starts, 3) == pytest.approx(2.0)
    assert start_rate(list(reversed(starts)), 3) == pytest.approx(2.0)
    # Without skipping: (n - 1) / (last - first).
    assert start_rate([0.0, 1.0, 2.0], 0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        start_rate([1.0], 0)
    with pytest.raises(ValueError):
        start_rate([1.0, 2.0], 2)


def test_events_per_job_adds_the_dispatchers_share() -> None:
    assert events_per_job([30, 32], 500, 100) == pytest.approx(36.0)
    with pytest.raises(ValueError):
        events_per_job([], 10, 1)


def test_a_spread_sample_keeps_the_first_and_the_last() -> None:
    items = [str(i) for i in range(10)]
    assert spread_sample(items, 3) == ["0", "4", "9"]  # round(4.5) is 4
    assert spread_sample(items, 20) == items
    assert spread_sample(items, 1) == ["0"]
