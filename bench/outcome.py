"""What a benchmark module hands back to the harness, and the options it is run with."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from bench.results import Result

if TYPE_CHECKING:
    from bench.stack import BenchContext


class BenchOptions(BaseModel):
    """`make bench N=... BENCH=...`; each benchmark reads what it needs."""

    model_config = ConfigDict(frozen=True)

    n: int = Field(30, ge=1)  # measured repetitions where a benchmark repeats (warm-up excluded)
    warmup: int = Field(3, ge=0)
    history_steps: int = Field(5000, ge=1)  # group 6's job
    latency_steps: int = Field(500, ge=1)  # group 7's job
    # The second simulator's time per step. Long enough that group 6's job samples for about
    # 100 s: a `progress` signal goes out at most every 2 s, so history grows with the sampling
    # time, and at 1 ms (7 s) the job would send a handful and say little.
    timed_step_delay_ms: int = Field(20, ge=1)


class Section(BaseModel):
    """A titled block of detail, printed and written into RESULTS.md as it is (markdown)."""

    title: str
    lines: list[str]
    # False: RESULTS.md only (long tables the terminal need not scroll through).
    console: bool = True


class Outcome(BaseModel):
    results: list[Result]
    sections: list[Section] = Field(default_factory=list)
    # For each result name that may miss its target: where the time (or the events) goes, as
    # measured in this run. RESULTS.md shows it under every missed target.
    where: dict[str, list[str]] = Field(default_factory=dict)


@dataclass(frozen=True)
class Benchmark:
    name: str  # what BENCH= selects
    group: int  # issue 10's numbering
    title: str
    run: Callable[[BenchContext, BenchOptions], Awaitable[Outcome]]
