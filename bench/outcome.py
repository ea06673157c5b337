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
    # Group 2: `throughput_clients` clients, each running `throughput_jobs` jobs one after the
    # other, of `throughput_steps` steps at `throughput_step_ms` on a simulator running as many
    # prompts at once as there are clients (and the same clients on the simulator directly).
    throughput_clients: int = Field(50, ge=1)
    throughput_jobs: int = Field(4, ge=1)
    throughput_steps: int = Field(10, ge=1)
    throughput_step_ms: int = Field(10, ge=0)
    # Group 3: the killed job's heartbeat timeout (JobPolicy's default unless told).
    recovery_heartbeat_s: float = Field(20.0, gt=0)
    # Group 4: the batches of jobs submitted at once to one worker (parallel simulator), and the
    # jobs of the deep serial queue (one prompt at a time); 20 steps x 10 ms each.
    scale_jobs: tuple[int, ...] = (100, 300, 1000)
    scale_serial_jobs: int = Field(60, ge=1)
    # Group 5: output sizes in MiB (drop 1024 to skip the 1 GiB upload).
    offload_sizes_mib: tuple[int, ...] = (100, 1024)
    # Group 9: running jobs per round on the RunPod path (a handler process each).
    runpod_jobs: int = Field(100, ge=1)
    # Group 10 (our queue): the bounded pools' `max_running`; the jobs of the start-rate batch;
    # each tenant's jobs in the fairness runs; the jobs waiting ahead of the priority-1 job;
    # the backlog's jobs (RSS, history events, time against the pool's own queue).
    queue_slots: int = Field(10, ge=1)
    queue_rate_jobs: int = Field(300, ge=2)
    queue_fair_jobs: int = Field(300, ge=1)
    queue_priority_behind: int = Field(1000, ge=1)
    queue_backlog_jobs: int = Field(2000, ge=1)
    # The backlog's simulator's time per step (each job 10 steps): 10 ms makes the machine's
    # CPU the bottleneck of both sides; a longer step, the GPU (the simulator's K slots).
    queue_backlog_step_ms: int = Field(10, ge=0)
    # Group 11 (batches): the jobs of each phase (a batch holds at most 1,000), and the timed
    # reads of a batch's status while its jobs wait and after they ended.
    batch_jobs: int = Field(1000, ge=2, le=1000)
    batch_reads: int = Field(50, ge=1)
    # Group 12 (pools of many servers): the jobs spread over four servers (and sent round-robin
    # to four single-server pools), and how many rounds of both sides (each side's median).
    pools_jobs: int = Field(24, ge=1)
    pools_rounds: int = Field(3, ge=1)


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
    group: int  # the groups' numbering (bench/README.md)
    title: str
    run: Callable[[BenchContext, BenchOptions], Awaitable[Outcome]]
    # The harness gives up on a benchmark after this long (its error is recorded, the rest run).
    timeout_s: float = 300.0
