"""What a benchmark reports, and the arithmetic on it: percentiles, ratios, targets.

Pure: no I/O, so tests/tooling/test_bench_results.py checks it without a stack.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict


class Target(BaseModel):
    """A benchmark's goal: `metric op limit`, on the value itself or on value / baseline."""

    model_config = ConfigDict(frozen=True)

    metric: Literal["value", "ratio"] = "value"
    op: Literal["<=", ">="] = "<="
    limit: float

    def met_by(self, value: float, ratio: float | None) -> bool | None:
        """None when the target is on the ratio and there is none (no baseline, or zero)."""
        subject = value if self.metric == "value" else ratio
        if subject is None:
            return None
        return subject <= self.limit if self.op == "<=" else subject >= self.limit

    def text(self, unit: str) -> str:
        if self.metric == "ratio":
            return f"{self.op} {fmt(self.limit)}x baseline"
        return f"{self.op} {fmt(self.limit)} {unit}".rstrip()


class Result(BaseModel):
    """One row of bench/results.json (exactly these fields) and of the printed table."""

    name: str
    value: float
    unit: str
    baseline: float | None = None
    ratio: float | None = None
    target: Target | None = None
    meets: bool | None = None


def result(
    name: str,
    value: float,
    unit: str,
    *,
    baseline: float | None = None,
    target: Target | None = None,
) -> Result:
    """A row with its ratio (value / baseline) and whether it meets its target computed here,
    once, so the table, the JSON and the markdown can never disagree."""
    ratio = None
    if baseline is not None and baseline != 0 and math.isfinite(baseline):
        ratio = value / baseline
    meets = target.met_by(value, ratio) if target is not None else None
    return Result(
        name=name,
        value=value,
        unit=unit,
        baseline=baseline,
        ratio=ratio,
        target=target,
        meets=meets,
    )


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation between closest ranks (numpy's
    default), so p50 of an even count is the mean of the middle two."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} is not within 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def fmt(number: float | None) -> str:
    """Short and stable for tables: integers as integers, then 0, 1 or 2 decimals by size
    (138, 27.4, 5.12), small numbers to 3 significant digits (0.0123); None as a dash."""
    if number is None:
        return "-"
    if not math.isfinite(number):
        return str(number)
    if number == int(number) and abs(number) < 1e15:
        return str(int(number))
    size = abs(number)
    if size >= 100:
        return f"{number:.0f}"
    if size >= 10:
        return f"{number:.1f}"
    if size >= 1:
        return f"{number:.2f}"
    return f"{number:.3g}"
