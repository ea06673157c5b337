"""The arithmetic of the queue group (bench/groups/queue.py): tenants' shares over sliding
windows of starts, the starts that came between a job's submission and its own, the start rate
of a draining queue, the events a job costs with its share of the dispatcher's.

Pure: no I/O, so tests/tooling/test_bench_queue.py checks it without a stack.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from pydantic import BaseModel

# The sliding window fair shares are measured over (starts).
WINDOW = 100


def contested(order: Sequence[str], tenants: Collection[str]) -> int:
    """How many of the first starts (in start order, each named by its tenant) happened while
    every one of `tenants` still had a job waiting: up to and including the earliest of their
    last starts (a tenant's last job was waiting until it started). 0 when one never started."""
    last: dict[str, int] = {}
    for index, tenant in enumerate(order):
        last[tenant] = index
    if not tenants or any(t not in last for t in tenants):
        return 0
    return min(last[t] for t in tenants) + 1


class WindowShares(BaseModel):
    """Each tenant's share of the starts over every window of `window` consecutive starts
    while all had jobs waiting, against its weight's share."""

    window: int  # starts per window (WINDOW, or fewer when fewer starts were contested)
    windows: int  # how many windows (0: too few contested starts)
    contested: int  # the starts while every tenant had a job waiting
    expected: dict[str, float]  # tenant -> weight / sum of weights, 0..1
    low: dict[str, float]  # tenant -> its lowest share in a window, 0..1
    high: dict[str, float]  # tenant -> its highest share in a window, 0..1
    # The largest |share - expected| over the windows and tenants, in percentage points of a
    # window's starts (nan when there is no window).
    max_deviation: float
    worst_window: int | None = None  # index of the worst window's first start
    worst_tenant: str | None = None


def window_shares(
    order: Sequence[str], weights: Mapping[str, float], window: int = WINDOW
) -> WindowShares:
    """Shares over every window of `window` starts (fewer when fewer were contested: then one
    window of them all) within the contested starts of `order`, for the tenants of `weights`."""
    total = sum(weights.values())
    expected = {t: w / total for t, w in weights.items()}
    span = contested(order, weights.keys())
    size = min(window, span)
    low = dict.fromkeys(weights, float("nan"))
    high = dict.fromkeys(weights, float("nan"))
    if size == 0:
        return WindowShares(
            window=0,
            windows=0,
            contested=span,
            expected=expected,
            low=low,
            high=high,
            max_deviation=float("nan"),
        )
    counts = dict.fromkeys(weights, 0)
    for tenant in order[:size]:
        if tenant in counts:
            counts[tenant] += 1
    worst = -1.0
    worst_window: int | None = None
    worst_tenant: str | None = None
    windows = span - size + 1
    for first in range(windows):
        if first > 0:
            gone, came = order[first - 1], order[first + size - 1]
            if gone in counts:
                counts[gone] -= 1
            if came in counts:
                counts[came] += 1
        for tenant, count in counts.items():
            share = count / size
            low[tenant] = share if first == 0 else min(low[tenant], share)
            high[tenant] = share if first == 0 else max(high[tenant], share)
            deviation = abs(share - expected[tenant]) * 100
            if deviation > worst:
                worst, worst_window, worst_tenant = deviation, first, tenant
    return WindowShares(
        window=size,
        windows=windows,
        contested=span,
        expected=expected,
        low=low,
        high=high,
        max_deviation=worst,
        worst_window=worst_window,
        worst_tenant=worst_tenant,
    )


def starts_between(started_at: Mapping[str, float], job_id: str, since: float) -> list[str]:
    """The other jobs whose start (epoch s) fell after `since` (the job's submission) and
    before `job_id`'s own start, in start order."""
    own = started_at[job_id]
    others = [(at, j) for j, at in started_at.items() if j != job_id and since < at < own]
    return [j for _, j in sorted(others)]


def start_rate(starts: Sequence[float], skip: int) -> float:
    """Starts per second of a draining queue: the starts after the first `skip` (those that
    found a slot free at once), over the time from the `skip`-th start to the last:
    (n - skip) / (t[n-1] - t[skip-1]) of the sorted times; `skip` 0: (n - 1) / (t[n-1] - t[0])."""
    times = sorted(starts)
    n = len(times)
    if n < 2 or skip >= n:
        raise ValueError(f"a rate needs more starts than {max(skip, 1)}, not {n}")
    first = times[skip - 1] if skip > 0 else times[0]
    counted = n - skip if skip > 0 else n - 1
    span = times[-1] - first
    return counted / span if span > 0 else float("inf")


def events_per_job(own: Sequence[int], dispatcher_events: int, jobs: int) -> float:
    """A bounded job's events: the mean of the jobs' own histories plus its share of the
    dispatcher's (every run of it, divided by the jobs it served)."""
    if not own or jobs < 1:
        raise ValueError("events per job need jobs")
    return sum(own) / len(own) + dispatcher_events / jobs


def spread_sample(items: Sequence[str], size: int) -> list[str]:
    """`size` items spread evenly over `items` (all when there are no more): the first, the
    last and evenly between."""
    n = len(items)
    if size >= n:
        return list(items)
    if size <= 1:
        return list(items[:size])
    return [items[round(i * (n - 1) / (size - 1))] for i in range(size)]
