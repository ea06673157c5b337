"""Group 9, the RunPod path: how fresh a running job's step is on a `runpod` pool, and what
following it costs in RunPod API calls.

A RunPod simulator whose workers run our handler under the real `runpod` loop (one shared
ComfyUI simulator at 500 ms a step, the pace of scale_running.py's populations) serves two
pools of one worker of ours, on the same endpoint:

- **today's** (the baseline): `status_poll_s: 1.0`, `report_interval_s: 2.0`, the earlier
  cadences (the follow then slept a second after each answer; here it reads start to
  start, a little more often than it did);
- **the default**: the pool's defaults (activities/runpod/follow.py `POLL_S`, `REPORT_S`).

For each in turn the worker is brought to `runpod_jobs` running jobs (started 25 at a time, as
scale_running.py grows its populations), 10 of them are watched for 10 s with the workers'
live-progress key (pushed: the target row) and without it (polled), and the simulator's count
of `/status` calls over the window gives the calls per running job-second. Then the jobs are
cancelled (each follow stops its RunPod job, freeing its worker for the next round).

Lag: every step the ComfyUI simulator sent in the window (but its last second) → the first
status the watcher was handed with that step or a later one (scale_running.py's `window`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field

import httpx
from pydantic import SecretStr

from activities.runpod.follow import POLL_S, REPORT_S
from bench.groups import scale_running
from bench.jobs import BenchFailure
from bench.outcome import Benchmark, BenchOptions, Outcome, Section
from bench.results import Result, Target, fmt, percentile, result
from bench.stack import (
    BenchContext,
    Pool,
    RunPodSimProcess,
    extra_runpod_sim,
    extra_sim,
    extra_worker,
)
from devstack.free_ports import free_port
from starter import JobClient

TODAY_POLL_S, TODAY_REPORT_S = 1.0, 2.0
TODAY: dict[str, object] = {"status_poll_s": TODAY_POLL_S, "report_interval_s": TODAY_REPORT_S}
LAG_P99_MAX_MS = 1000.0
CANCEL_TIMEOUT_S = 180.0


@dataclass
class Round:
    pool: str
    jobs: int
    pushed: list[float] = field(default_factory=list)
    polled: list[float] = field(default_factory=list)
    status_calls: int = 0
    window_s: float = 0.0
    grown_s: float = 0.0
    updates: int = 0  # progress updates the handlers sent over the window

    @property
    def calls_per_job_s(self) -> float:
        return self.status_calls / (self.jobs * self.window_s) if self.window_s else 0.0

    @property
    def updates_per_job_s(self) -> float:
        return self.updates / (self.jobs * self.window_s) if self.window_s else 0.0


async def _ledger_counts(http: httpx.AsyncClient, sim: RunPodSimProcess) -> tuple[int, int]:
    """`/status` calls so far, and the progress updates every delivery has sent."""
    ledger = (await http.get(f"{sim.url}/sim/ledger", timeout=30)).json()
    updates = sum(d["progress_updates"] for job in ledger["jobs"] for d in job["deliveries"])
    return int(ledger.get("api_calls", {}).get("status", 0)), updates


async def _running(http: httpx.AsyncClient, comfy: Pool) -> int:
    stats = (await http.get(f"{comfy.url}/sim/stats")).json()
    return len(stats["started_at"]) - len(stats["ended_at"])


async def _round(
    ctx: BenchContext,
    sim: RunPodSimProcess,
    comfy: Pool,
    pool: str,
    n: int,
    polling: JobClient,
    pushing: JobClient,
) -> Round:
    measured = Round(pool, n)
    ids: list[str] = []
    began = time.monotonic()
    # The jobs go to `pool`; their steps are read at the shared ComfyUI simulator.
    target = Pool(pool, comfy.url, comfy.step_delay_ms)
    try:
        await scale_running.grow(ctx, polling, target, ids, n, None)
        measured.grown_s = time.monotonic() - began
        calls_before, updates_before = await _ledger_counts(ctx.http, sim)
        started = time.monotonic()
        measured.pushed, measured.polled = await scale_running.window(
            ctx, target, pushing, polling, ids[: scale_running.WATCHED]
        )
        measured.window_s = time.monotonic() - started
        calls_after, updates_after = await _ledger_counts(ctx.http, sim)
        measured.status_calls = calls_after - calls_before
        measured.updates = updates_after - updates_before
    finally:
        await _cancel_all(ctx, polling, comfy, ids)
    return measured


async def _cancel_all(ctx: BenchContext, jobs: JobClient, comfy: Pool, ids: list[str]) -> None:
    """Cancel every job (each follow stops its RunPod job) and wait for the jobs and their
    prompts to end, so the next round finds the workers idle."""
    for start in range(0, len(ids), 25):
        await asyncio.gather(
            *(jobs.cancel(job_id, "benchmark round over") for job_id in ids[start : start + 25]),
            return_exceptions=True,
        )
    # Every job ended (its stop confirmed, its RunPod job cancelled): the next round's window
    # shares the worker with no stop of this one.
    try:
        async with asyncio.timeout(CANCEL_TIMEOUT_S):
            for start in range(0, len(ids), 25):
                await asyncio.gather(*(jobs.wait(job_id) for job_id in ids[start : start + 25]))
            while True:
                if await _running(ctx.http, comfy) == 0:
                    break
                await asyncio.sleep(0.5)
    except TimeoutError:
        raise BenchFailure(
            f"{await _running(ctx.http, comfy)} prompts still ran, or jobs had not ended, "
            f"{fmt(CANCEL_TIMEOUT_S)} s after the jobs were cancelled"
        ) from None


async def run(ctx: BenchContext, options: BenchOptions) -> Outcome:
    n = options.runpod_jobs
    live_key = "bench-live-" + uuid.uuid4().hex
    async with (
        extra_sim(
            ctx,
            "runpod_comfy",
            step_delay_ms=scale_running.STEP_MS,
            parallel=n,
            progress_log_prompts=2 * n + 64,
        ) as comfy,
        extra_runpod_sim(ctx, "path", comfy.pool.url, max_workers=n) as sim,
    ):
        base: dict[str, object] = {
            "kind": "runpod",
            "url": f"{sim.url}/v2",
            "endpoint_id": sim.endpoint_id,
            "node_registry": "off",
        }
        pools: dict[str, dict[str, object]] = {"runpod_today": base | TODAY, "runpod": base}
        async with (
            extra_worker(
                ctx,
                "runpod",
                [Pool(name, sim.url, 0) for name in pools],
                max_concurrent_activities=2 * n + 20,
                env={
                    "RUNPOD_API_KEY": sim.api_key,
                    "DURABLE_COMFY_LIVE_PROGRESS_PORT": str(free_port()),
                    "DURABLE_COMFY_LIVE_PROGRESS_KEY": live_key,
                },
                pool_settings=pools,
            ) as worker,
            contextlib.AsyncExitStack() as stack,
        ):
            polling, _ = ctx.job_client(worker.task_queue)
            pushing = JobClient(
                ctx.temporal, task_queue=worker.task_queue, live_progress_key=SecretStr(live_key)
            )
            stack.push_async_callback(pushing.close)
            today = await _round(ctx, sim, comfy.pool, "runpod_today", n, polling, pushing)
            now = await _round(ctx, sim, comfy.pool, "runpod", n, polling, pushing)
    return _outcome(today, now)


def _outcome(today: Round, now: Round) -> Outcome:
    n = now.jobs
    results: list[Result] = [
        result(
            f"runpod.step_lag_p99_at_{n}",
            percentile(now.pushed, 99),
            "ms",
            baseline=percentile(today.pushed, 99),
            target=Target(limit=LAG_P99_MAX_MS),
        ),
        result(
            f"runpod.polled_step_lag_p99_at_{n}",
            percentile(now.polled, 99),
            "ms",
            baseline=percentile(today.polled, 99),
        ),
        result(
            f"runpod.status_calls_per_job_s_at_{n}",
            now.calls_per_job_s,
            "calls/s",
            baseline=today.calls_per_job_s,
        ),
    ]
    lines = [
        f"{n} running jobs per round, 10 watched for {fmt(scale_running.WINDOW_S)} s "
        f"({scale_running.STEP_MS} ms a step); the default pool reads `/status` every "
        f"{fmt(POLL_S)} s and its handler reports every {fmt(REPORT_S)} s, today's "
        f"{fmt(TODAY_POLL_S)} s and {fmt(TODAY_REPORT_S)} s.",
        "",
        "| pool | lag p50 / p99 pushed (ms) | lag p50 / p99 polled (ms) | `/status` per job-s "
        "| updates per job-s | grown in (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in (today, now):
        lines.append(
            f"| {r.pool} | {fmt(percentile(r.pushed, 50))} / {fmt(percentile(r.pushed, 99))} "
            f"| {fmt(percentile(r.polled, 50))} / {fmt(percentile(r.polled, 99))} "
            f"| {fmt(r.calls_per_job_s)} | {fmt(r.updates_per_job_s)} | {fmt(r.grown_s)} |"
        )
    return Outcome(
        results=results,
        sections=[Section(title="RunPod path (group 9)", lines=lines)],
        where={
            f"runpod.step_lag_p99_at_{n}": [
                "The lag adds the handler's wait to report (at most its interval), the "
                "follow's wait for its next read (at most its interval, start to start), "
                "RunPod's answer and the push. On a 2-core machine the 100 handlers (at idle "
                "priority) share the cores with the worker, whose event loop the `/status` "
                "reads mostly fill (bench/RESULTS.md, *The RunPod path*)."
            ]
        },
    )


BENCHMARK = Benchmark(
    name="runpod",
    group=9,
    title="RunPod path: step lag and /status calls",
    run=run,
    timeout_s=1200.0,
)
