"""Group 4, scale, second part: how fresh progress is while a worker follows 100, 300, then 1,000
running jobs.

The burst batches (scale.py) submit every job at once: their lag is the time the stack takes to
start a batch on 2 cores (about 8 jobs a second), not how fresh a followed job's progress is.
Here the jobs are long (`STEPS` steps of `STEP_MS`: a GPU's pace), started a chunk at a time
until the worker follows the population, and only then are 10 of them watched for a window:

- **pushed**: `JobClient.watch` with the workers' live-progress key (the worker pushes each
  step to it: docs/configuration.md, *Live progress*);
- **polled** (the baseline, same jobs, same window): `JobClient.watch` without it, reading the
  heartbeat every 0.5 s, which the worker's heartbeat budget paces (each job once a second at
  1,000 jobs).

Lag: every step the simulator sent in the window (but its last second) → the first status the
watcher was handed with that step or a later one. The jobs are terminated at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import httpx

from bench.groups.client_latency import event_to_seen_ms
from bench.jobs import BenchFailure, Seen, request, submit_idempotently
from bench.results import fmt, percentile
from bench.sim import progress_times
from bench.stack import BenchContext, Pool
from starter import JobClient, JobStatus
from starter.errors import JobUnanswered

STEPS = 2400
STEP_MS = 500
WATCHED = 10
WINDOW_S = 10.0
SETTLE_S = 3.0
TAIL_S = 1.0
# Jobs started at once while the population grows: the next chunk waits for this one to run.
CHUNK = 25
START_TIMEOUT_S = 300.0


@dataclass
class Population:
    """One population level: the lags of the watched jobs' steps, pushed and polled."""

    jobs: int
    pushed: list[float] = field(default_factory=list)
    polled: list[float] = field(default_factory=list)
    started_s: float = 0.0  # how long the stack took to grow to it

    @property
    def pushed_p99(self) -> float:
        return percentile(self.pushed, 99)

    @property
    def polled_p99(self) -> float:
        return percentile(self.polled, 99)


async def _running(http: httpx.AsyncClient, pool: Pool) -> int:
    stats = (await http.get(f"{pool.url}/sim/stats")).json()
    return len(stats["started_at"]) - len(stats["ended_at"])


class Stalled(BenchFailure):
    """The population did not grow: said in the results, with the worker's slot metrics."""


async def _worker_metrics(http: httpx.AsyncClient, url: str | None) -> str:
    """The worker's own Temporal metrics that say why tasks wait: its free slots, and how long
    tasks waited to be picked up."""
    if url is None:
        return ""
    try:
        text = (await http.get(url, timeout=5)).text
    except httpx.HTTPError as exc:
        return f"(the worker's metrics could not be read: {exc!r})"
    wanted = ("slots_available", "slots_used", "schedule_to_start_latency_sum", "sticky_cache")
    return "; ".join(
        line for line in text.splitlines() if any(w in line for w in wanted) and "#" not in line
    )


async def grow(
    ctx: BenchContext,
    jobs: JobClient,
    pool: Pool,
    ids: list[str],
    target: int,
    metrics_url: str | None,
) -> None:
    """Start jobs a chunk at a time until `target` prompts run on the simulator."""
    while len(ids) < target:
        chunk = min(CHUNK, target - len(ids))
        submitted = await asyncio.gather(
            *(submit_idempotently(jobs, request(STEPS, pool.name)) for _ in range(chunk))
        )
        ids += [s.job_id for s in submitted]
        deadline = time.monotonic() + START_TIMEOUT_S
        while await _running(ctx.http, pool) < len(ids):
            if time.monotonic() > deadline:
                running = await _running(ctx.http, pool)
                raise Stalled(
                    f"{len(ids)} jobs submitted, {running} running after "
                    f"{fmt(START_TIMEOUT_S)} s; the worker's metrics: "
                    f"{await _worker_metrics(ctx.http, metrics_url)}"
                )
            await asyncio.sleep(0.25)


async def _seen_for(jobs: JobClient, job_id: str, seen: list[Seen]) -> None:
    async for status in jobs.watch(job_id):
        seen.append(
            Seen.model_construct(
                at=time.time(),
                state=status.state,
                step=status.progress.step,
                total_steps=status.progress.total_steps,
            )
        )


async def window(
    ctx: BenchContext, pool: Pool, pushing: JobClient, polling: JobClient, watched: list[str]
) -> tuple[list[float], list[float]]:
    pushed: dict[str, list[Seen]] = {job_id: [] for job_id in watched}
    polled: dict[str, list[Seen]] = {job_id: [] for job_id in watched}
    tasks = [asyncio.create_task(_seen_for(pushing, j, pushed[j])) for j in watched]
    tasks += [asyncio.create_task(_seen_for(polling, j, polled[j])) for j in watched]
    try:
        await asyncio.sleep(SETTLE_S)
        started = time.time()
        await asyncio.sleep(WINDOW_S)
        ended = time.time()
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
    broken = [t for t in tasks if not t.cancelled() and t.exception() is not None]
    if broken:
        raise BenchFailure(f"a watch failed: {broken[0].exception()!r}")
    lags: tuple[list[float], list[float]] = ([], [])
    for job_id in watched:
        status = await _status(polling, job_id)
        if status.checkpoint is None or status.checkpoint.prompt_id is None:
            raise BenchFailure(f"watched job {job_id} has no prompt: {status.state}")
        steps = [
            step
            for step in await progress_times(ctx.http, pool.url, status.checkpoint.prompt_id)
            if started <= step.at <= ended - TAIL_S
        ]
        for lag, seen in zip(lags, (pushed[job_id], polled[job_id]), strict=True):
            lag += event_to_seen_ms(steps, [s for s in seen if s.at >= started])
    if not lags[0] or not lags[1]:
        raise BenchFailure("no step of the watched jobs was seen in the window")
    return lags


async def measure(
    ctx: BenchContext,
    pool: Pool,
    pushing: JobClient,
    polling: JobClient,
    counts: list[int],
    metrics_url: str | None = None,
) -> tuple[list[Population], str | None]:
    """Grow the population to each of `counts` in turn, watching 10 jobs at each; the
    populations measured, and why the next one could not be reached (None: all were)."""
    ids: list[str] = []
    populations: list[Population] = []
    began = time.monotonic()
    stalled: str | None = None
    try:
        for n in sorted(counts):
            try:
                await grow(ctx, polling, pool, ids, n, metrics_url)
            except Stalled as exc:
                stalled = str(exc)
                break
            population = Population(n, started_s=time.monotonic() - began)
            population.pushed, population.polled = await window(
                ctx, pool, pushing, polling, ids[:WATCHED]
            )
            populations.append(population)
    finally:
        await _terminate(polling, ids)
    return populations, stalled


async def _terminate(jobs: JobClient, ids: list[str]) -> None:
    """Terminate (not cancel): a thousand cancels would each stop its prompt first."""
    for start in range(0, len(ids), 100):
        await asyncio.gather(
            *(
                jobs.handle(job_id).terminate("benchmark over")
                for job_id in ids[start : start + 100]
            ),
            return_exceptions=True,
        )


async def _status(jobs: JobClient, job_id: str, attempts: int = 4) -> JobStatus:
    """A watched job's status, for its prompt id: asked again when the worker, following 1,000
    prompts, leaves a query unanswered for its 10 s (seen once in a trial)."""
    for attempt in range(attempts):
        try:
            return await jobs.status(job_id)
        except JobUnanswered:
            if attempt + 1 == attempts:
                raise
    raise AssertionError("unreachable")
