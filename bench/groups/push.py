"""Group 8, push: a progress event at the simulator → seen by a client of the HTTP gateway.

100 jobs of `FANOUT_STEPS` steps on a parallel simulator of their own, one worker following
them all with live progress on (docs/configuration.md, *Live progress*), and two gateways in
front of it: one that holds the live-progress key (its followers subscribe to the steps the
worker pushes) and one that does not (its followers poll the job, every 0.5 s: the baseline,
what every stream did before the push). Each window is `FANOUT_WINDOW_S` long:

1. **polled**: 100 SSE clients (one per job) of the gateway without the key;
2. **pushed**: 100 SSE clients of the gateway with it;
3. **fan-out**: 1,000 SSE clients (ten per job) of the gateway with it.

**Latency**, windows 1 and 2: the simulator says when it sent each step (GET /sim/progress);
for every step of every job sent in the window, the first moment its stream held a status with
that step or a later one, minus when it was sent. **CPU**: the gateway's and the worker's (from
/proc, by PID) per second of each window. The gateway follows a job once whoever listens, so
1,000 followers should cost about what 100 do; and the push costs the worker what building and
sending the subscribed jobs' steps costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from bench.gateway import GatewayProcess, extra_gateway, sse_events
from bench.groups.client_latency import event_to_seen_ms
from bench.jobs import BenchFailure, Seen, graph
from bench.outcome import Benchmark, BenchOptions, Outcome, Section
from bench.procs import cpu_seconds
from bench.results import Target, fmt, percentile, result
from bench.sim import progress_times
from bench.stack import BenchContext, extra_sim, extra_worker
from devstack.free_ports import free_port
from workflows.contracts import JobState

FANOUT_JOBS = 100
# A step at the simulator is seen by an SSE client within 50 ms (p50) at 100 jobs.
PUSH_P50_MAX_MS = 50.0
FOLLOWERS_PER_JOB = (1, 10)
FANOUT_WINDOW_S = 10.0
# Streams open and past their replay before a window starts.
SETTLE_S = 2.0
# Steps sent in a window's last second may be seen after it: they are not counted.
TAIL_S = 1.0
# KSampler takes at most 10,000 steps: far longer than the windows and the ramp-up before them.
# The jobs are cancelled once measured.
FANOUT_STEPS = 10_000
# A fast GPU's pace (10 steps a second per job, 1,000 a second in all). At 20 ms (5,000 a second)
# the simulator, the worker, two gateways and 1,100 streams saturate 2 cores, and every path's
# lag is the queue in front of the CPU.
FANOUT_STEP_MS = 100
# Both gateways: a follower leaves with its last stream, so one window's followers do not poll
# through the next.
GATEWAY_ENV = {"DURABLE_COMFY_GATEWAY_FOLLOWER_GRACE_S": "0"}


async def _submit(gateway: GatewayProcess, ctx: BenchContext, body: dict[str, Any]) -> str:
    answer = await ctx.http.post(f"{gateway.url}/v1/jobs", json=body)
    if answer.status_code != 201:
        raise BenchFailure(f"the gateway refused a job: {answer.status_code} {answer.text}")
    job_id: str = answer.json()["job_id"]
    return job_id


@dataclass
class Window:
    """One window: the CPU seconds per second of the gateway and the worker, and each job's
    statuses as its first stream saw them."""

    started: float = 0.0  # epoch seconds
    ended: float = 0.0
    gateway_cpu: float = 0.0
    worker_cpu: float = 0.0
    seen: dict[str, list[Seen]] = field(default_factory=dict)


async def _follow(
    gateway: GatewayProcess, ctx: BenchContext, job_id: str, seen: list[Seen] | None
) -> None:
    async for event in sse_events(ctx.http, f"{gateway.url}/v1/jobs/{job_id}/events"):
        if seen is not None and event.event == "status":
            progress = event.data["progress"]
            seen.append(
                Seen.model_construct(
                    at=event.at,
                    state=JobState(event.data["state"]),
                    step=progress["step"],
                    total_steps=progress["total_steps"],
                )
            )


def _cpu(pid: int) -> float:
    seconds = cpu_seconds(pid)
    if seconds is None:
        raise BenchFailure(f"the CPU time of process {pid} could not be read")
    return seconds


async def _window(
    gateway: GatewayProcess, worker_pid: int, ctx: BenchContext, job_ids: list[str], n: int
) -> Window:
    """`n` SSE clients per job for one window; the first of each job's records what it saw."""
    window = Window(seen={job_id: [] for job_id in job_ids})
    followers = [
        asyncio.create_task(_follow(gateway, ctx, job_id, window.seen[job_id] if k == 0 else None))
        for job_id in job_ids
        for k in range(n)
    ]
    try:
        await asyncio.sleep(SETTLE_S)
        gateway_before, worker_before = _cpu(gateway.pid), _cpu(worker_pid)
        started, window.started = time.monotonic(), time.time()
        await asyncio.sleep(FANOUT_WINDOW_S)
        gateway_after, worker_after = _cpu(gateway.pid), _cpu(worker_pid)
        elapsed, window.ended = time.monotonic() - started, time.time()
    finally:
        for task in followers:
            task.cancel()
        for task in followers:
            with contextlib.suppress(BaseException):
                await task
    broken = [t for t in followers if t.done() and not t.cancelled() and t.exception()]
    if broken:
        raise BenchFailure(f"{len(broken)} streams failed: {broken[0].exception()}")
    window.gateway_cpu = (gateway_after - gateway_before) / elapsed
    window.worker_cpu = (worker_after - worker_before) / elapsed
    return window


async def _lags(
    ctx: BenchContext, sim_url: str, prompts: dict[str, str], window: Window
) -> list[float]:
    """Event → seen (ms) for every step the simulator sent inside the window."""
    lags: list[float] = []
    for job_id, prompt_id in prompts.items():
        steps = [
            step
            for step in await progress_times(ctx.http, sim_url, prompt_id)
            if window.started <= step.at <= window.ended - TAIL_S
        ]
        seen = [s for s in window.seen[job_id] if s.at >= window.started]
        lags += event_to_seen_ms(steps, seen)
    if not lags:
        raise BenchFailure("no step was seen in the window")
    return lags


async def _measured(ctx: BenchContext) -> tuple[Window, Window, Window, list[float], list[float]]:
    key = "bench-live-" + uuid.uuid4().hex
    live = {
        "DURABLE_COMFY_LIVE_PROGRESS_PORT": str(free_port()),
        "DURABLE_COMFY_LIVE_PROGRESS_KEY": key,
    }
    async with (
        extra_sim(ctx, "push", step_delay_ms=FANOUT_STEP_MS, parallel=FANOUT_JOBS) as sim,
        extra_worker(
            ctx, "push", [sim.pool], max_concurrent_activities=FANOUT_JOBS, env=live
        ) as worker,
        extra_gateway(ctx, "polled", worker.task_queue, GATEWAY_ENV) as polled,
        extra_gateway(
            ctx,
            "pushed",
            worker.task_queue,
            {**GATEWAY_ENV, "DURABLE_COMFY_LIVE_PROGRESS_KEY": key},
        ) as pushed,
    ):
        job_ids = [
            await _submit(pushed, ctx, {"graph": graph(FANOUT_STEPS), "pool": sim.pool.name})
            for _ in range(FANOUT_JOBS)
        ]
        jobs, _ = ctx.job_client(worker.task_queue)
        try:
            prompts = await _all_running(pushed, ctx, job_ids)
            by_poll = await _window(polled, worker.pid, ctx, job_ids, 1)
            by_push = await _window(pushed, worker.pid, ctx, job_ids, 1)
            fanout = await _window(pushed, worker.pid, ctx, job_ids, FOLLOWERS_PER_JOB[1])
            polled_lags = await _lags(ctx, sim.pool.url, prompts, by_poll)
            pushed_lags = await _lags(ctx, sim.pool.url, prompts, by_push)
        finally:
            for job_id in job_ids:
                with contextlib.suppress(Exception):
                    await jobs.cancel(job_id, "benchmark over")
    return by_poll, by_push, fanout, polled_lags, pushed_lags


async def _all_running(
    gateway: GatewayProcess, ctx: BenchContext, job_ids: list[str]
) -> dict[str, str]:
    """Once every job runs: each one's prompt id, from its checkpoint."""
    prompts: dict[str, str] = {}
    deadline = time.monotonic() + 180
    for job_id in job_ids:
        while True:
            answer = await ctx.http.get(f"{gateway.url}/v1/jobs/{job_id}")
            view: dict[str, Any] = (
                answer.json() if answer.status_code == 200 else {"state": answer.text[:300]}
            )
            prompt_id = (view.get("checkpoint") or {}).get("prompt_id")
            if view["state"] == "RUNNING" and prompt_id:
                prompts[job_id] = prompt_id
                break
            if time.monotonic() > deadline:
                raise BenchFailure(f"job {job_id} is still {view['state']} after 180 s")
            await asyncio.sleep(0.2)
    return prompts


async def run(ctx: BenchContext, options: BenchOptions) -> Outcome:
    by_poll, by_push, fanout, polled, pushed = await _measured(ctx)
    few, many = by_push.gateway_cpu, fanout.gateway_cpu
    followers = {n: n * FANOUT_JOBS for n in FOLLOWERS_PER_JOB}
    results = [
        result(
            "push.event_to_seen_p50",
            percentile(pushed, 50),
            "ms",
            baseline=percentile(polled, 50),
            target=Target(limit=PUSH_P50_MAX_MS),
        ),
        result(
            "push.event_to_seen_p95", percentile(pushed, 95), "ms", baseline=percentile(polled, 95)
        ),
        result("push.gateway_cpu_1000_followers", many * 1000, "ms CPU/s", baseline=few * 1000),
        result(
            "push.worker_cpu_pushing",
            by_push.worker_cpu * 1000,
            "ms CPU/s",
            baseline=by_poll.worker_cpu * 1000,
        ),
    ]
    window = fmt(FANOUT_WINDOW_S)
    sections = [
        Section(
            title="Push: a step at the simulator → seen by an SSE client, 100 jobs followed",
            lines=[
                f"{FANOUT_JOBS} jobs of {FANOUT_STEPS} steps at {FANOUT_STEP_MS} ms on a parallel "
                "simulator, one worker with live progress on, two gateways; each window "
                f"{window} s, every step sent in it (but its last {fmt(TAIL_S)} s) counted:",
                f"- pushed (the gateway with the live-progress key, 1 SSE client per job): p50 "
                f"{fmt(percentile(pushed, 50))} ms, p95 {fmt(percentile(pushed, 95))} ms over "
                f"{len(pushed):,} steps",
                f"- polled (the gateway without it, its followers polling every 0.5 s): p50 "
                f"{fmt(percentile(polled, 50))} ms, p95 {fmt(percentile(polled, 95))} ms over "
                f"{len(polled):,} steps",
                f"- the worker used {fmt(by_push.worker_cpu * 1000)} ms of CPU per second while "
                f"pushing to 100 streams' jobs, {fmt(by_poll.worker_cpu * 1000)} while they were "
                "polled",
                *(
                    f"- {followers[n]:,} SSE followers ({n} per job) of the pushing gateway: it "
                    f"used {fmt(cpu * 1000)} ms of CPU per second ({fmt(cpu * 1e6 / followers[n])} "
                    "per 1,000 followers)"
                    for n, cpu in zip(FOLLOWERS_PER_JOB, (few, many), strict=True)
                ),
                f"- the polling gateway used {fmt(by_poll.gateway_cpu * 1000)} ms of CPU per "
                "second for its 100 followers",
                "- the gateway follows each job once (one watcher per job) and fans its events "
                "out, so ten times the followers cost "
                f"{fmt(many / few if few else None)}x the CPU, not 10x.",
            ],
        )
    ]
    return Outcome(results=results, sections=sections)


BENCHMARK = Benchmark(name="push", group=8, title="Push (HTTP gateway)", run=run, timeout_s=600)
