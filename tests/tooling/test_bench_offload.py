"""The pure parts of `make bench`'s group 5 (offload): rounds, the order of the sides, medians,
each round's ratio, CPU per GiB. No stack, no timing."""

from __future__ import annotations

import pytest

from bench.groups import offload
from bench.procs import MIB


def run(mib_per_s: float, *, cpu_seconds: float = 1.0, mib: int = 1024) -> dict[str, float]:
    size = mib * MIB
    return {"bytes": size, "seconds": mib / mib_per_s, "cpu_seconds": cpu_seconds}


def test_sides_alternate_which_goes_first() -> None:
    assert [offload.round_order(i) for i in range(3)] == [
        ("raw", "project"),
        ("project", "raw"),
        ("raw", "project"),
    ]


def test_small_sizes_get_more_rounds() -> None:
    assert offload.rounds_for(100) == offload.ROUNDS_SMALL == 5
    assert offload.rounds_for(1024) == offload.ROUNDS_LARGE == 3


def test_medians_and_each_round_s_ratio() -> None:
    runs = {
        "raw": [run(100), run(50), run(120)],
        "project": [run(90), run(60), run(100)],
    }
    assert offload.median_speed(runs["raw"]) == pytest.approx(100)
    assert offload.median_speed(runs["project"]) == pytest.approx(90)
    assert offload.round_ratios(runs) == pytest.approx([0.9, 1.2, 100 / 120])


def test_cpu_is_per_gib() -> None:
    assert offload.cpu_s_per_gib(run(100, cpu_seconds=0.5, mib=512)) == pytest.approx(1.0)


def test_the_target_is_issue_20_s() -> None:
    assert offload.THROUGHPUT_MIN_RATIO == 0.95
