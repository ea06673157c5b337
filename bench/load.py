"""Many jobs at once, the project's way and the direct way, with what they cost the machine.

Used by group 2 (throughput: clients each running jobs one after the other) and group 4 (scale:
a batch submitted at once). The CPU of every process involved is read from /proc by PID before
and after (`CpuUse`): the Temporal server, the worker, the simulator, and this process (the
clients).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import httpx

from activities.storage import ArtifactStore
from bench.direct import DirectRun, run_direct
from bench.jobs import completed, graph, request
from bench.procs import CpuMeter
from bench.results import fmt, percentile
from starter import JobClient


@dataclass
class CpuUse:
    """CPU seconds per process (name -> seconds) over a timed part."""

    meters: dict[str, CpuMeter]
    began_self: float = field(default_factory=time.process_time)
    seconds: dict[str, float] = field(default_factory=dict)

    @classmethod
    def start(cls, pids: dict[str, int | None]) -> CpuUse:
        return cls({name: CpuMeter(pid) for name, pid in pids.items() if pid is not None})

    def stop(self) -> dict[str, float]:
        self.seconds = {name: meter.seconds() for name, meter in self.meters.items()}
        self.seconds["clients (the bench process)"] = time.process_time() - self.began_self
        return self.seconds


def cpu_table(phases: dict[str, tuple[CpuUse, float, int]]) -> list[str]:
    """Markdown: per process, CPU ms per job and cores used, one column pair per phase
    (phase name -> (its CpuUse, wall seconds, jobs))."""
    names: list[str] = []
    for use, _, _ in phases.values():
        names += [n for n in use.seconds if n not in names]
    head = " | ".join(f"{p}: CPU ms/job | {p}: cores" for p in phases)
    lines = [f"| process | {head} |", "|---|" + "---|" * (2 * len(phases))]
    for name in [*names, "all"]:
        cells = []
        for use, wall, jobs in phases.values():
            cpu = sum(use.seconds.values()) if name == "all" else use.seconds.get(name)
            cells += ["-", "-"] if cpu is None else [fmt(1000 * cpu / jobs), fmt(cpu / wall)]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    lines.append(f"\nThe machine has {os.cpu_count()} cores.")
    return lines


async def project_job(jobs: JobClient, steps: int, pool: str) -> float:
    """Submit and wait for one job; its seconds."""
    began = time.perf_counter()
    status = await jobs.submit(request(steps, pool))
    completed(await jobs.wait(status.job_id))
    return time.perf_counter() - began


async def direct_job(
    http: httpx.AsyncClient,
    store: ArtifactStore,
    url: str,
    steps: int,
    phases: list[DirectRun] | None = None,
) -> float:
    run = await run_direct(http, store, url, graph(steps))
    if phases is not None:
        phases.append(run)
    return run.seconds


def direct_phases(runs: Sequence[DirectRun]) -> str:
    """Where the direct jobs' time went: p50 / p95 of each phase."""
    parts = {
        "socket + POST /prompt": [r.queued - r.started for r in runs],
        "until the socket said done": [r.executed - r.queued for r in runs],
        "socket closed": [r.closed - r.executed for r in runs],
        "GET /view + put_object": [r.stored - r.closed for r in runs],
    }
    return "; ".join(f"{name} {spread(values)}" for name, values in parts.items())


async def clients_loop(
    clients: int, per_client: int, one: Callable[[], Awaitable[float]]
) -> tuple[float, list[float]]:
    """`clients` concurrent loops, each running `one` `per_client` times in a row: (wall seconds,
    each job's seconds)."""
    each: list[float] = []

    async def client() -> None:
        for _ in range(per_client):
            each.append(await one())

    began = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - began, each


def jobs_per_s(jobs: int, wall: float) -> float:
    return jobs / wall if wall > 0 else 0.0


def spread(values: Sequence[float]) -> str:
    return (
        f"p50 {fmt(percentile(values, 50) * 1000)} ms, p95 {fmt(percentile(values, 95) * 1000)} ms"
    )
