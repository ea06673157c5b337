"""Group 8, push: a progress event at the simulator → seen by a client of the HTTP gateway.

**Latency.** One job of `latency_steps` steps on the `comfyui_timed` pool, submitted through
the gateway (`POST /v1/jobs`) and followed at once by an SSE client of
`GET /v1/jobs/{id}/events` (the push path) and by `JobClient.watch` at its default poll
interval (the baseline: what the CLI and a Python client do today). The simulator says when it
sent each step (GET /sim/progress); for every step, the first moment each client held a status
with that step or a later one, minus when it was sent.

**Fan-out.** 100 jobs on a parallel simulator of its own, followed through a gateway of their
own: first by 100 SSE clients (one per job), then by 1,000 (ten per job), each for the same
window; the gateway's CPU (from /proc, by PID) per second of each. The gateway follows a job
once whoever listens, so 1,000 followers should cost about what 100 do: the ratio says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from bench.gateway import GatewayProcess, extra_gateway, sse_events
from bench.groups.client_latency import event_to_seen_ms
from bench.jobs import BenchFailure, Seen, graph, prompt_id_of, watch
from bench.outcome import Benchmark, BenchOptions, Outcome, Section
from bench.procs import cpu_seconds
from bench.results import fmt, percentile, result
from bench.sim import progress_times
from bench.stack import TIMED_POOL, BenchContext, Pool, extra_sim, extra_worker
from workflows.contracts import JobState, JobStatus

FANOUT_JOBS = 100
FOLLOWERS_PER_JOB = (1, 10)
FANOUT_WINDOW_S = 10.0
# Long enough that every job still runs through both windows (and the ramp-up before them).
FANOUT_STEPS = 3000
FANOUT_STEP_MS = 20


async def _submit(gateway: GatewayProcess, ctx: BenchContext, body: dict[str, Any]) -> str:
    answer = await ctx.http.post(f"{gateway.url}/v1/jobs", json=body)
    if answer.status_code != 201:
        raise BenchFailure(f"the gateway refused a job: {answer.status_code} {answer.text}")
    job_id: str = answer.json()["job_id"]
    return job_id


async def _pushed(
    gateway: GatewayProcess, ctx: BenchContext, job_id: str, seen: list[Seen]
) -> JobStatus:
    """Follow the job's SSE stream to its end; every status event into `seen`."""
    last: JobStatus | None = None
    async for event in sse_events(ctx.http, f"{gateway.url}/v1/jobs/{job_id}/events"):
        if event.event != "status":
            continue
        status = JobStatus.model_validate(
            {k: v for k, v in event.data.items() if k in JobStatus.model_fields}
        )
        seen.append(
            Seen(
                at=event.at,
                state=status.state,
                step=status.progress.step,
                total_steps=status.progress.total_steps,
            )
        )
        last = status
    if last is None or last.state != JobState.COMPLETED:
        raise BenchFailure(f"the stream of {job_id} ended without COMPLETED: {last}")
    return last


async def _latency(ctx: BenchContext, options: BenchOptions) -> tuple[list[float], list[float]]:
    jobs, _ = ctx.job_client()
    async with extra_gateway(ctx, "push", ctx.task_queue) as gateway:
        body = {"graph": graph(options.latency_steps), "pool": TIMED_POOL}
        job_id = await _submit(gateway, ctx, body)
        pushed: list[Seen] = []
        polled: list[Seen] = []
        final, _ = await asyncio.gather(
            _pushed(gateway, ctx, job_id, pushed), watch(jobs, job_id, polled)
        )
    steps = await progress_times(ctx.http, ctx.timed.url, prompt_id_of(final))
    return event_to_seen_ms(steps, pushed), event_to_seen_ms(steps, polled)


async def _follow_for(gateway: GatewayProcess, ctx: BenchContext, job_id: str) -> None:
    async for _ in sse_events(ctx.http, f"{gateway.url}/v1/jobs/{job_id}/events"):
        pass


async def _cpu_per_s(
    gateway: GatewayProcess, ctx: BenchContext, job_ids: list[str], n: int
) -> float:
    """The gateway's CPU seconds per second while `n` SSE clients follow each job."""
    followers = [
        asyncio.create_task(_follow_for(gateway, ctx, job_id))
        for job_id in job_ids
        for _ in range(n)
    ]
    try:
        await asyncio.sleep(2.0)  # every stream open and past its replay
        before, started = cpu_seconds(gateway.pid), time.monotonic()
        await asyncio.sleep(FANOUT_WINDOW_S)
        after, ended = cpu_seconds(gateway.pid), time.monotonic()
    finally:
        for task in followers:
            task.cancel()
        for task in followers:
            with contextlib.suppress(BaseException):
                await task
    if before is None or after is None:
        raise BenchFailure("the gateway's CPU time could not be read")
    broken = [t for t in followers if t.done() and not t.cancelled() and t.exception()]
    if broken:
        raise BenchFailure(f"{len(broken)} streams failed: {broken[0].exception()}")
    return (after - before) / (ended - started)


async def _fanout(ctx: BenchContext) -> dict[int, float]:
    async with (
        extra_sim(ctx, "push", step_delay_ms=FANOUT_STEP_MS, parallel=FANOUT_JOBS) as sim,
        extra_worker(ctx, "push", [sim.pool], max_concurrent_activities=FANOUT_JOBS) as worker,
        extra_gateway(ctx, "fanout", worker.task_queue) as gateway,
    ):
        pool: Pool = sim.pool
        body = {"graph": graph(FANOUT_STEPS), "pool": pool.name}
        job_ids = [
            await _submit(gateway, ctx, {**body, "graph": graph(FANOUT_STEPS)})
            for _ in range(FANOUT_JOBS)
        ]
        jobs, _ = ctx.job_client(worker.task_queue)
        try:
            return {n: await _cpu_per_s(gateway, ctx, job_ids, n) for n in FOLLOWERS_PER_JOB}
        finally:
            for job_id in job_ids:
                with contextlib.suppress(Exception):
                    await jobs.cancel(job_id, "benchmark over")


async def run(ctx: BenchContext, options: BenchOptions) -> Outcome:
    pushed, polled = await _latency(ctx, options)
    cpu = await _fanout(ctx)
    few, many = (cpu[n] for n in FOLLOWERS_PER_JOB)
    followers = {n: n * FANOUT_JOBS for n in FOLLOWERS_PER_JOB}
    # ms of the gateway's CPU per second, per 1,000 followers.
    per_1000 = {n: cpu[n] * 1000 * 1000 / followers[n] for n in FOLLOWERS_PER_JOB}
    results = [
        result(
            "push.event_to_seen_p50", percentile(pushed, 50), "ms", baseline=percentile(polled, 50)
        ),
        result(
            "push.event_to_seen_p95", percentile(pushed, 95), "ms", baseline=percentile(polled, 95)
        ),
        result(
            "push.gateway_cpu_1000_followers",
            many * 1000,
            "ms CPU/s",
            baseline=few * 1000,
        ),
    ]
    sections = [
        Section(
            title="Push: the gateway's SSE stream against JobClient.watch",
            lines=[
                f"One job of {options.latency_steps} steps at {ctx.timed.step_delay_ms} ms, "
                "submitted through the gateway and followed at once by an SSE client and by "
                "`JobClient.watch` (default poll interval).",
                f"- SSE (push): p50 {fmt(percentile(pushed, 50))} ms, p95 "
                f"{fmt(percentile(pushed, 95))} ms over {len(pushed)} steps",
                f"- watch (poll): p50 {fmt(percentile(polled, 50))} ms, p95 "
                f"{fmt(percentile(polled, 95))} ms over {len(polled)} steps",
                f"Fan-out: {FANOUT_JOBS} jobs of {FANOUT_STEPS} steps at {FANOUT_STEP_MS} ms on a "
                f"parallel simulator, each window {fmt(FANOUT_WINDOW_S)} s:",
                *(
                    f"- {followers[n]:,} SSE followers ({n} per job): the gateway used "
                    f"{fmt(cpu[n] * 1000)} ms of CPU per second ({fmt(per_1000[n])} per 1,000 "
                    "followers)"
                    for n in FOLLOWERS_PER_JOB
                ),
                "- the gateway follows each job once (one watcher per job) and fans its events "
                "out, so ten times the followers cost "
                f"{fmt(many / few if few else None)}x the CPU, not 10x.",
            ],
        )
    ]
    return Outcome(results=results, sections=sections)


BENCHMARK = Benchmark(name="push", group=8, title="Push (HTTP gateway)", run=run, timeout_s=600)
