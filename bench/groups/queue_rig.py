"""The queue group's rig (bench/groups/queue.py): its simulators, its worker's pools, and the
moves its measurements are made of: many jobs submitted and awaited, slots held by blockers
and freed, the dispatcher's view polled, the simulator's starts mapped back to jobs.

Pools of the group's worker (one `PoolQueue` dispatcher per bounded pool, so each
measurement's dispatcher history is its own):

| pool | simulator | bound |
|---|---|---|
| `idle_bounded`, `idle_open` | `queue_idle`: step delay 0, one prompt at a time | K / none |
| `rate_bounded`, `rate_open` | `queue_parallel`: 10 ms steps, every prompt at once | K / none |
| `fair_even`, `fair_weighted`, `priority` | `queue_parallel` | K |
| `backlog_bounded`, `backlog_open` | `queue_backlog`: 10 ms steps, K prompts at once | K / none |
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from bench.jobs import BenchFailure, graph, prompt_id_of, submit_idempotently
from bench.stack import BenchContext, BenchWorker, SimProcess
from faults.graphs import SAMPLER_NODE
from starter import JobClient, JobRequest, JobStatus
from workflows import shared
from workflows.admission import PoolQueueView

STEPS = 10  # each measured job's sampler steps
STEP_MS = 10  # the parallel and backlog simulators' time per step
IDLE_BOUNDED, IDLE_OPEN = "idle_bounded", "idle_open"
RATE_BOUNDED, RATE_OPEN = "rate_bounded", "rate_open"
FAIR_EVEN, FAIR_WEIGHTED = "fair_even", "fair_weighted"
PRIORITY = "priority"
BACKLOG_BOUNDED, BACKLOG_OPEN = "backlog_bounded", "backlog_open"
# The worker's DURABLE_COMFY_TENANTS: `heavy` weighs 2, every other tenant 1 (the default).
HEAVY = "heavy"
TENANTS = {HEAVY: {"weight": 2}}
# Submits in flight at once (a burst; each sent again while Temporal times out).
SUBMIT_AT_ONCE = 200
# `JobClient.wait`s in flight at once: each is a long poll of the job's history, and the dev
# server refuses a namespace more than about a thousand concurrent polls (the worker's own
# task polls among them: "namespace concurrent poller limit exceeded").
WAIT_AT_ONCE = 300
# A blocker holds a slot until it is cancelled: samplers of the most steps the simulator takes,
# one after the other (10,000 x 10 ms = 100 s each).
BLOCKER_SAMPLERS = 6
BLOCKER_STEPS = 10_000

T = TypeVar("T")


def blocker_graph() -> dict[str, Any]:
    """The txt2img graph with `BLOCKER_SAMPLERS` KSamplers in a chain (each denoising the
    previous one's latent): a prompt that runs for minutes and stops at an interrupt."""
    chain = graph(BLOCKER_STEPS)
    previous = SAMPLER_NODE
    for index in range(1, BLOCKER_SAMPLERS):
        node = f"{100 + index}"
        sampler = {**chain[SAMPLER_NODE], "inputs": dict(chain[SAMPLER_NODE]["inputs"])}
        sampler["inputs"]["latent_image"] = [previous, 0]
        chain[node] = sampler
        previous = node
    chain["8"]["inputs"]["samples"] = [previous, 0]
    return chain


def job_request(
    pool: str,
    *,
    steps: int = STEPS,
    tenant: str | None = None,
    priority: int | None = None,
    blocker: bool = False,
) -> JobRequest:
    fields: dict[str, Any] = {"graph": blocker_graph() if blocker else graph(steps), "pool": pool}
    if tenant is not None:
        fields["labels"] = {shared.TENANT_LABEL: tenant}
    if priority is not None:
        fields["priority"] = priority
    return JobRequest(**fields)


@dataclass(frozen=True)
class Submitted:
    job_id: str
    at: float  # epoch seconds: just before the submit call
    tenant: str = shared.DEFAULT_TENANT
    priority: int = 3


@dataclass
class Rig:
    ctx: BenchContext
    jobs: JobClient
    worker: BenchWorker
    slots: int  # max_running of every bounded pool
    pool_sims: dict[str, SimProcess]

    def sim_url(self, pool: str) -> str:
        return self.pool_sims[pool].pool.url

    def queue_id(self, pool: str) -> str:
        return shared.pool_queue_id(self.worker.task_queue, pool)

    async def view(self, pool: str) -> PoolQueueView:
        handle = self.ctx.temporal.get_workflow_handle(self.queue_id(pool))
        view: PoolQueueView = await handle.query(shared.QUERY_POOL_QUEUE, result_type=PoolQueueView)
        return view

    async def stats(self, pool: str) -> dict[str, Any]:
        response = await self.ctx.http.get(f"{self.sim_url(pool)}/sim/stats", timeout=30)
        response.raise_for_status()
        stats: dict[str, Any] = response.json()
        return stats

    async def fresh_worker(self) -> None:
        """The worker stopped (gracefully) and started again: a measurement of its memory
        then starts from a new process, not from what earlier runs left in its heap (Python
        keeps the arenas it grew)."""
        await self.worker.killable.terminate()
        await self.worker.killable.start()

    async def reset(self, pool: str) -> None:
        """The simulator's counters (starts, peak) at zero before a measurement."""
        (await self.ctx.http.post(f"{self.sim_url(pool)}/sim/reset", timeout=30)).raise_for_status()

    # -- many jobs ----------------------------------------------------------------------------

    async def submit(self, requests: Sequence[JobRequest]) -> list[Submitted]:
        """Every request at once (`SUBMIT_AT_ONCE` in flight), in order; each job's time of
        submission is taken just before its own submit call."""
        gate = asyncio.Semaphore(SUBMIT_AT_ONCE)

        async def one(request: JobRequest) -> Submitted:
            async with gate:
                at = time.time()
                status = await submit_idempotently(self.jobs, request)
            tenant = request.labels.get(shared.TENANT_LABEL, shared.DEFAULT_TENANT)
            return Submitted(status.job_id, at, tenant, request.priority)

        return list(await asyncio.gather(*(one(r) for r in requests)))

    async def wait_some(self, job_ids: Sequence[str], timeout_s: float) -> dict[str, JobStatus]:
        """The final status of every job that ended within `timeout_s` (`WAIT_AT_ONCE` awaited
        at a time, in order: a job that ended before its turn answers at once)."""
        ended: dict[str, JobStatus] = {}
        gate = asyncio.Semaphore(WAIT_AT_ONCE)

        async def one(job_id: str) -> None:
            async with gate:
                ended[job_id] = await self.jobs.wait(job_id)

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*(one(j) for j in job_ids))
        return dict(ended)

    async def wait(
        self, job_ids: Sequence[str], pool: str, timeout_s: float
    ) -> dict[str, JobStatus]:
        """Every job's final status; a job not ended within `timeout_s` is a failure of the
        system under measurement, reported with what it and its pool's queue said."""
        ended = await self.wait_some(job_ids, timeout_s)
        if len(ended) < len(job_ids):
            left = [j for j in job_ids if j not in ended]
            raise BenchFailure(
                f"{len(left)} of {len(job_ids)} jobs on pool {pool} had not ended after "
                f"{timeout_s:.0f} s: {await self.stuck(pool, left)}"
            )
        return ended

    async def stuck(self, pool: str, job_ids: Sequence[str]) -> str:
        """What the first jobs still running say, and what their pool's queue says."""
        lines: list[str] = []
        for job_id in job_ids[:8]:
            try:
                status = await self.jobs.status(job_id)
                lines.append(
                    f"{job_id} {status.state.value} admission={status.admission!r} "
                    f"prompt={status.checkpoint.prompt_id if status.checkpoint else None}"
                )
            except Exception as exc:  # a report of what is wrong must not fail itself
                lines.append(f"{job_id}: status failed: {exc!r}")
        try:
            view = await self.view(pool)
            holders = [e.job_id for e in view.entries if e.state != "waiting"]
            lines.append(
                f"queue of {pool}: max_running={view.max_running} running={view.running} "
                f"waiting={view.waiting} holders={holders[:12]}"
            )
        except Exception as exc:
            lines.append(f"queue of {pool}: query failed: {exc!r}")
        return "; ".join(lines)

    # -- slots held, and freed ----------------------------------------------------------------

    async def hold_slots(self, pool: str) -> list[Submitted]:
        """Every slot of the pool held by a blocker (a long prompt), so what comes next waits."""
        blockers = await self.submit([job_request(pool, blocker=True) for _ in range(self.slots)])
        await self.until_view(pool, lambda v: v.running >= self.slots, 120, "all slots held")
        return blockers

    async def free_slots(self, blockers: Sequence[Submitted]) -> float:
        """Cancel the blockers (their prompts are interrupted, their slots given back); the
        epoch time the cancels were sent."""
        at = time.time()
        await asyncio.gather(*(self.jobs.cancel(b.job_id, "bench: slot freed") for b in blockers))
        return at

    async def until_view(
        self, pool: str, accept: Callable[[PoolQueueView], bool], timeout_s: float, what: str
    ) -> PoolQueueView:
        async def probe() -> PoolQueueView:
            return await self.view(pool)

        return await until(probe, accept, timeout_s, f"{what} (pool {pool})")


async def until(
    probe: Callable[[], Awaitable[T]],
    accept: Callable[[T], bool],
    timeout_s: float,
    what: str,
    interval_s: float = 0.25,
) -> T:
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while True:
        try:
            last = await probe()
            if accept(last):
                return last
        except Exception as exc:  # not there yet (a dispatcher not started): try again
            if time.monotonic() > deadline:
                raise BenchFailure(f"{what}: not seen in {timeout_s:.0f} s ({exc!r})") from exc
        if time.monotonic() > deadline:
            raise BenchFailure(f"{what}: not seen in {timeout_s:.0f} s; last seen {last!r:.600}")
        await asyncio.sleep(interval_s)


def starts_of(stats: Mapping[str, Any], finals: Mapping[str, JobStatus]) -> dict[str, float]:
    """job_id -> when the simulator started its prompt (epoch s), for the jobs it started."""
    return _prompt_marks(stats, "started_at", finals)


def ends_of(stats: Mapping[str, Any], finals: Mapping[str, JobStatus]) -> dict[str, float]:
    """job_id -> when the simulator ended its prompt (epoch s)."""
    return _prompt_marks(stats, "ended_at", finals)


def _prompt_marks(
    stats: Mapping[str, Any], mark: str, finals: Mapping[str, JobStatus]
) -> dict[str, float]:
    """job_id -> the simulator's `mark` time of its prompt, for the jobs that have one."""
    marks: Mapping[str, float] = stats.get(mark, {})
    out: dict[str, float] = {}
    for job_id, status in finals.items():
        try:
            prompt = prompt_id_of(status)
        except BenchFailure:
            continue
        if prompt in marks:
            out[job_id] = marks[prompt]
    return out


def fill_timeout_s(jobs: int) -> float:
    """How long `jobs` submitted at once may take to be all in line (generous: 5 a second)."""
    return 120 + jobs / 5


def drain_timeout_s(jobs: int) -> float:
    """How long `jobs` may take to run (generous: 2 a second)."""
    return 180 + jobs / 2
