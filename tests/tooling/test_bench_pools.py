"""The pure parts of `make bench`'s pools group (bench/groups/pools.py): the job lengths'
sequence, the makespans of round-robin and of first-free dispatch, the handovers between
prompts on a server and their split at the dispatcher; the group's options. No stack, no
timing."""

from __future__ import annotations

import pytest

from bench.__main__ import parse
from bench.groups.pools import (
    MAX_STEPS,
    MIN_STEPS,
    Prompt,
    first_free_makespan,
    handover_gaps,
    ideal_ratio,
    job_steps,
    longest_first_makespan,
    lower_bound,
    release_grant_parts,
    round_robin,
    round_robin_makespan,
    start_order_steps,
)
from bench.outcome import BenchOptions
from bench.registry import select


def test_the_job_lengths_are_the_same_list_every_time_and_within_1_to_5_s() -> None:
    steps = job_steps(24)
    assert steps == job_steps(24)
    assert len(steps) == 24
    assert all(MIN_STEPS <= s <= MAX_STEPS for s in steps)
    assert len(set(steps)) > 1  # uneven
    # A longer list starts with the shorter one: --pools-jobs changes only how many.
    assert job_steps(30)[:24] == steps
    assert job_steps(24, seed=1) != steps


def test_round_robin_sends_job_i_to_server_i_mod_n() -> None:
    assert round_robin(6, 4) == [0, 1, 2, 3, 0, 1]


def test_round_robin_makespan_is_the_busiest_servers_sum() -> None:
    # Servers get (5 + 1), (1 + 1), (1), (1): the first ends last.
    assert round_robin_makespan([5, 1, 1, 1, 1, 1], 4) == 6
    assert round_robin_makespan([], 4) == 0


def test_first_free_sends_each_job_to_the_server_that_frees_first() -> None:
    # 5 on one server; the five 1s go over the other three and then the first of them freed.
    assert first_free_makespan([5, 1, 1, 1, 1, 1], 4) == 5
    # One server: everything back to back.
    assert first_free_makespan([2, 3, 4], 1) == 9
    # Order matters: a long job last lands on a busy server (list scheduling is not optimal).
    assert first_free_makespan([1, 1, 2], 2) == 3
    assert first_free_makespan([2, 1, 1], 2) == 2
    assert ideal_ratio([5, 1, 1, 1, 1, 1], 4) == pytest.approx(5 / 6)


def test_longest_first_and_the_lower_bound() -> None:
    # First free in this order ends at 3 (the 2 lands on a server that already ran a 1)...
    assert first_free_makespan([1, 1, 2], 2) == 3
    # ...longest first puts it alone: 2, which is the lower bound (the work is 4 on 2 servers).
    assert longest_first_makespan([1, 1, 2], 2) == 2
    assert lower_bound([1, 1, 2], 2) == 2
    # The longest job bounds it when it outweighs an even share.
    assert lower_bound([10, 1, 1], 4) == 10
    assert lower_bound([], 4) == 0


def _prompt(job: str, server: str, started: float, ended: float, steps: int = 20) -> Prompt:
    return Prompt(job, server, started, ended, steps)


def test_handovers_are_per_server_from_an_end_to_the_next_start() -> None:
    prompts = [
        _prompt("b1", "B", 0.0, 3.0, steps=60),
        _prompt("a1", "A", 0.0, 1.0, steps=20),
        _prompt("a2", "A", 1.2, 2.0, steps=16),
        _prompt("b2", "B", 3.5, 4.0, steps=10),
    ]
    gaps = handover_gaps(prompts)
    assert [(a.job_id, b.job_id) for a, b, _ in gaps] == [("a1", "a2"), ("b1", "b2")]
    assert [g for _, _, g in gaps] == pytest.approx([0.2, 0.5])
    # The line's order is the start order over all servers.
    assert start_order_steps(prompts) == [60, 20, 16, 10]
    assert handover_gaps(prompts[:1]) == []


def test_a_handover_is_split_at_the_release_signal_and_the_next_task_done() -> None:
    a1 = _prompt("a1", "A", 0.0, 1.0)
    a2 = _prompt("a2", "A", 1.3, 2.0)
    b1 = _prompt("b1", "B", 0.0, 2.0)
    b2 = _prompt("b2", "B", 2.5, 3.0)
    gaps = handover_gaps([a1, a2, b1, b2])
    released = {"a1": 1.05, "b1": 2.1}
    tasks_done = [0.5, 1.1, 1.15, 2.2]
    parts = release_grant_parts(gaps, released, tasks_done)
    assert parts == [
        pytest.approx((0.05, 0.05, 0.2)),
        pytest.approx((0.1, 0.1, 0.3)),
    ]
    # No release seen for a job: that handover is left out, not guessed.
    assert release_grant_parts(gaps, {"a1": 1.05}, tasks_done) == [pytest.approx((0.05, 0.05, 0.2))]
    # A task done only after the next start is not its grant.
    assert release_grant_parts(gaps[:1], {"a1": 1.05}, [1.5]) == []


def test_the_pools_group_is_registered_with_its_options() -> None:
    assert [b.name for b in select("pools")] == ["pools"]
    args = parse(["--only", "pools", "--pools-jobs", "8", "--pools-rounds", "1"])
    assert (args.pools_jobs, args.pools_rounds) == (8, 1)
    defaults = BenchOptions()
    assert (defaults.pools_jobs, defaults.pools_rounds) == (24, 3)
