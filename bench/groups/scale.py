"""Group 4, scale: many concurrently monitored jobs in one worker process.

A worker of its own (`python worker.py` with DURABLE_COMFY_MAX_CONCURRENT_ACTIVITIES raised to
the largest batch, since the default 100 caps one worker at 100 followed prompts), two
simulators of its own at 10 ms per step: one in parallel mode running every prompt of a batch
at once, one serial (ComfyUI's one at a time: the deep queue). Jobs of 20 steps.

For each batch size in `--scale-jobs` (100, 300 and 1,000 by default):
- **direct**: the same number of prompts sent at once the direct script's way (bench/direct.py);
- **project**: that many jobs submitted at once (`JobClient.submit`), then awaited; 10 of them
  (submitted attached by this process; the others by another one, bench/burst_child.py, as the
  burst's other clients would) watched with `JobClient.watch` for the lag from each progress
  event at the simulator
  (GET /sim/progress) to the status the client is handed, twice: with the worker's
  live-progress key (pushed: the target row) and without it (polled); the baseline is the
  direct batch's lag, event at the simulator → the `progress` frame at the direct script's
  socket, for 10 of its prompts; the worker's RSS sampled every
  0.25 s (peak), the CPU of every process read before and after.
Then the deep serial queue: `--scale-serial-jobs` jobs at once vs the same prompts directly.
RSS growth per job is the slope of the peak RSS over the batch sizes (a line fit); the 1,000-job
figure is measured when 1,000 is among the batches, else extrapolated on that line (said so).
Then the running populations (scale_running.py): the same worker follows 100, 300, then 1,000
long jobs, and the lag of 10 watched ones is measured with live progress and by polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from pydantic import SecretStr

from bench.burst_child import READY
from bench.direct import run_direct
from bench.groups import scale_running
from bench.groups.client_latency import event_to_seen_ms
from bench.groups.scale_running import Population
from bench.jobs import (
    BenchFailure,
    Seen,
    completed,
    graph,
    prompt_id_of,
    request,
    submit_idempotently,
    watch,
)
from bench.load import CpuUse, cpu_table
from bench.outcome import Benchmark, BenchOptions, Outcome, Section
from bench.procs import RssSampler, linear_fit, rss_bytes
from bench.profile import profile_lines, record
from bench.results import Result, Target, fmt, percentile, result
from bench.server_calls import ServerCalls, calls_table, server_calls
from bench.sim import progress_times
from bench.stack import ROOT, BenchContext, Pool, extra_sim, extra_worker
from bench.worker_counters import worker_counters
from devstack.free_ports import free_port
from faults.worker_proc import clean_environ
from starter import JobClient, JobState, JobStatus

STEPS = 20
STEP_MS = 10
WATCHED = 10
RSS_MAX_MB = 300.0
THROUGHPUT_MIN_RATIO = 0.9
LAG_P99_MAX_MS = 1000.0
SCALE_TARGET_JOBS = 1000
LIVE_COUNTERS = ("live_follows", "live_subscribed_late")


class Batch:
    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self.wall = 0.0
        self.direct_wall = 0.0
        self.rss_before = 0
        self.rss_peak = 0
        self.watched = Watched()
        self.direct_lags: list[float] = []  # the direct batch's steps, as its client got them
        self.cpu: CpuUse | None = None
        self.direct_cpu: CpuUse | None = None
        self.calls = ServerCalls()
        # The worker's live-progress counters over the batch (activities/live_progress.py).
        self.live: Counter[str] = Counter()


async def _direct_batch(ctx: BenchContext, pool: Pool, n: int) -> tuple[float, list[float]]:
    """The wall time of `n` prompts sent at once directly, and the lags of the first `WATCHED`
    prompts' steps as the direct client received them (the baseline of a batch's lag)."""
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    async with httpx.AsyncClient(trust_env=False, timeout=300, limits=limits) as http:
        began = time.perf_counter()
        runs = await asyncio.gather(
            *(run_direct(http, ctx.store, pool.url, graph(STEPS)) for _ in range(n))
        )
        wall = time.perf_counter() - began
    lags: list[float] = []
    for run in runs[:WATCHED]:
        received = [
            Seen.model_construct(at=at, state=JobState.RUNNING, step=step, total_steps=STEPS)
            for step, at in run.steps
        ]
        lags += event_to_seen_ms(await progress_times(ctx.http, pool.url, run.prompt_id), received)
    return wall, lags


def _p50_max(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{fmt(percentile(values, 50))} / {fmt(max(values))}"


@dataclass
class Watched:
    """How the watched jobs of a batch were seen."""

    polled: list[float] = field(default_factory=list)  # lags of their steps, ms
    pushed: list[float] = field(default_factory=list)
    # From the watch's start to the first status it was handed, polled (the job's first
    # answer, or what the record says while that is late) and pushed (a step pushed over what
    # the submit answered, else as polled).
    first_status: list[float] = field(default_factory=list)  # ms
    first_pushed: list[float] = field(default_factory=list)  # ms
    # Jobs whose last step the simulator had sent before their polled watcher's first status.
    over_before_first_status: int = 0
    # The watched jobs with a pushed step later than the target, each said in a line.
    late: list[str] = field(default_factory=list)


async def _watched(
    ctx: BenchContext,
    pool: Pool,
    submitted: JobStatus,
    polling: JobClient,
    pushing: JobClient | None,
    into: Watched,
) -> None:
    """One job's steps as a polling watcher and a pushed one saw them, each watching from the
    status its submit answered (as `durable-comfy submit --watch` does); the pushed one's
    client submitted the job."""
    began = time.time()
    seen_pushed: list[Seen] = []
    job_id = submitted.job_id
    if pushing is None:
        seen, final = await watch(polling, job_id, since=submitted)
    else:
        (seen, final), (seen_pushed, _) = await asyncio.gather(
            watch(polling, job_id, since=submitted), watch(pushing, job_id, since=submitted)
        )
    steps = await progress_times(ctx.http, pool.url, prompt_id_of(final))
    into.polled += event_to_seen_ms(steps, seen)
    pushed = event_to_seen_ms(steps, seen_pushed)
    into.pushed += pushed
    if pushed and max(pushed) > LAG_P99_MAX_MS:
        # Enough to tell a subscription that came late from a slow push: when the steps were
        # sent and when the pushed watcher saw anything, against its start.
        def at(t: float) -> str:
            return f"{(t - began) * 1000:.0f}"

        into.late.append(
            f"{job_id}: {sum(lag > LAG_P99_MAX_MS for lag in pushed)} of {len(pushed)} steps "
            f"late, max {max(pushed):.0f} ms; steps sent {at(steps[0].at)}-{at(steps[-1].at)} "
            f"ms, pushed watcher's statuses at {', '.join(at(s.at) for s in seen_pushed[:8])}"
            f"{' ...' if len(seen_pushed) > 8 else ''} ms, polled watcher's first at "
            f"{at(seen[0].at)} ms (after its submit returned)"
        )
    into.first_status.append((seen[0].at - began) * 1000)
    if seen_pushed:
        into.first_pushed.append((seen_pushed[0].at - began) * 1000)
    into.over_before_first_status += bool(steps) and steps[-1].at < seen[0].at


async def _project_batch(
    ctx: BenchContext,
    jobs: JobClient,
    pool: Pool,
    n: int,
    pushing: JobClient | None = None,
    *,
    others_apart: bool = False,
) -> tuple[float, Watched]:
    """Submit `n` jobs at once and wait for them all; the wall time, and how the watched jobs
    were seen, polled and (with `pushing`) pushed. A watched job is watched from the moment
    its own submit returns, as its client would, not once the whole burst is in: a job of
    20 x 10 ms is over before the last of 1,000 submits returns. `others_apart`: the jobs
    nobody watches are sent by another process (bench/burst_child.py), as the burst's other
    clients would send them; else by this one, whose loop then hands out the watched steps
    behind a thousand starts."""
    watched_n = min(WATCHED, n)
    apart = n - watched_n if others_apart else 0
    async with _other_clients(ctx, jobs.task_queue, pool, apart) as others:
        began = time.perf_counter()
        ended, seen = await _burst(ctx, jobs, pool, n, watched_n, pushing, others)
    return ended - began, seen


async def _burst(
    ctx: BenchContext,
    jobs: JobClient,
    pool: Pool,
    n: int,
    watched_n: int,
    pushing: JobClient | None,
    others: OtherClients | None,
) -> tuple[float, Watched]:
    """The burst of `_project_batch`; the time it ended (`perf_counter`) and the watched."""
    seen = Watched()

    async def watched() -> None:
        # Submitted as `durable-comfy submit --watch` does: attached, by the client that
        # watches (with the key, it subscribes to the job's pushed steps before the job exists).
        submitter = pushing or jobs
        submitted = await submit_idempotently(submitter, request(STEPS, pool.name), detached=False)
        await _watched(ctx, pool, submitted, jobs, pushing, seen)

    async def waited() -> JobStatus:
        submitted = await submit_idempotently(jobs, request(STEPS, pool.name))
        return await jobs.wait(submitted.job_id)

    watching = [watched() for _ in range(watched_n)]
    if others is not None:
        await asyncio.gather(others.send(), *watching)
        return time.perf_counter(), seen
    waiting = [waited() for _ in range(n - watched_n)]
    _, finals = await asyncio.gather(asyncio.gather(*watching), asyncio.gather(*waiting))
    for final in finals:
        completed(final)
    return time.perf_counter(), seen


@dataclass
class OtherClients:
    """bench/burst_child.py, connected and waiting for the burst's start."""

    proc: asyncio.subprocess.Process
    jobs: int

    async def send(self) -> None:
        """Start the burst there and wait until all its jobs have completed."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"go\n")
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        await self.proc.wait()
        if self.proc.returncode != 0 or not line:
            raise BenchFailure(f"the other clients' process ended {self.proc.returncode}")
        ended = json.loads(line)
        if ended["completed"] != self.jobs:
            raise BenchFailure(f"of the other clients' {self.jobs} jobs: {ended['failed']}")


@contextlib.asynccontextmanager
async def _other_clients(
    ctx: BenchContext, task_queue: str, pool: Pool, jobs: int
) -> AsyncIterator[OtherClients | None]:
    """The process that sends `jobs` unwatched jobs (None for none), once it is connected."""
    if jobs == 0:
        yield None
        return
    stack = ctx.stack
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.burst_child",
        *("--address", stack.temporal_address, "--namespace", stack.namespace),
        *("--task-queue", task_queue, "--pool", pool.name),
        *("--jobs", str(jobs), "--steps", str(STEPS)),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env={**clean_environ(), "PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        ready = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
        if ready.decode().strip() != READY:
            raise BenchFailure(f"the other clients' process did not connect: {ready!r}")
        yield OtherClients(proc, jobs)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def run(ctx: BenchContext, options: BenchOptions) -> Outcome:
    counts = sorted(options.scale_jobs)
    biggest = max(*counts, options.scale_serial_jobs)
    log_size = biggest + WATCHED + 64
    batches: list[Batch] = []
    profiled: list[str] = []
    live_key = "bench-live-" + uuid.uuid4().hex
    metrics_port = free_port()
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    async with (
        extra_sim(
            ctx, "scale", step_delay_ms=STEP_MS, parallel=biggest, progress_log_prompts=log_size
        ) as sim,
        extra_sim(
            ctx, "scale_serial", step_delay_ms=STEP_MS, progress_log_prompts=log_size
        ) as serial,
        extra_sim(
            ctx,
            "scale_running",
            step_delay_ms=scale_running.STEP_MS,
            parallel=max(counts),
            progress_log_prompts=max(counts) + 64,
        ) as running,
        extra_worker(
            ctx,
            "scale",
            [sim.pool, serial.pool, running.pool],
            max_concurrent_activities=biggest,
            env={
                "DURABLE_COMFY_LIVE_PROGRESS_PORT": str(free_port()),
                "DURABLE_COMFY_LIVE_PROGRESS_KEY": live_key,
                "DURABLE_COMFY_METRICS_PORT": str(metrics_port),
            },
        ) as worker,
        contextlib.AsyncExitStack() as stack,
    ):
        jobs, _ = ctx.job_client(worker.task_queue)
        pushing = JobClient(
            ctx.temporal, task_queue=worker.task_queue, live_progress_key=SecretStr(live_key)
        )
        stack.push_async_callback(pushing.close)
        pids = {
            "Temporal server": ctx.temporal_pid,
            "S3 (SeaweedFS)": ctx.s3_pid,
            "worker": worker.pid,
            "simulator": sim.record.pid,
        }
        # Warm-up (unmeasured): the pushing client has listed the workers and holds its
        # connection to the worker, as a client that has run before does.
        await _project_batch(ctx, jobs, sim.pool, 5, pushing)
        await _direct_batch(ctx, sim.pool, 5)
        idle_rss = rss_bytes(worker.pid) or 0
        for n in counts:
            batch = Batch(n)
            batch.direct_cpu = CpuUse.start(pids)
            batch.direct_wall, batch.direct_lags = await _direct_batch(ctx, sim.pool, n)
            batch.direct_cpu.stop()
            batch.rss_before = rss_bytes(worker.pid) or 0
            async with RssSampler(worker.pid) as rss:
                calls_before = await server_calls(ctx.http, ctx.temporal_metrics_url)
                live_before = await worker_counters(ctx.http, metrics_url, LIVE_COUNTERS)
                batch.cpu = CpuUse.start(pids)
                profiling = None
                if n == counts[-1]:
                    # py-spy on the worker during the largest batch's first seconds: where its
                    # CPU goes (sampling costs little, but it is said here: it ran meanwhile).
                    out = ctx.work_dir / "profiles" / "scale-worker.txt"
                    profiling = asyncio.create_task(record(worker.pid, 10, out))
                batch.wall, batch.watched = await _project_batch(
                    ctx, jobs, sim.pool, n, pushing, others_apart=True
                )
                batch.cpu.stop()
                calls_after = await server_calls(ctx.http, ctx.temporal_metrics_url)
                batch.calls = calls_after.minus(calls_before)
                batch.live = await worker_counters(ctx.http, metrics_url, LIVE_COUNTERS)
                batch.live.subtract(live_before)
                if profiling is not None:
                    profiled = profile_lines(
                        await profiling, f"the worker, first 10 s of the {n}-job batch"
                    )
            batch.rss_peak = rss.peak
            batches.append(batch)
        serial_n = options.scale_serial_jobs
        serial_direct, _ = await _direct_batch(ctx, serial.pool, serial_n)
        serial_wall, _ = await _project_batch(ctx, jobs, serial.pool, serial_n)
        populations, stalled = await scale_running.measure(
            ctx,
            running.pool,
            pushing,
            jobs,
            counts,
            metrics_url=metrics_url,
        )

    return _outcome(
        batches, idle_rss, serial_n, serial_wall, serial_direct, profiled, populations, stalled
    )


def _outcome(
    batches: list[Batch],
    idle_rss: int,
    serial_n: int,
    serial_wall: float,
    serial_direct: float,
    profiled: list[str],
    populations: list[Population],
    stalled: str | None,
) -> Outcome:
    results: list[Result] = []
    lags = [lag for b in batches for lag in b.watched.polled]
    for b in batches:
        results.append(
            result(
                f"scale.rss_mb_at_{b.jobs}",
                b.rss_peak / 1e6,
                "MB",
                baseline=idle_rss / 1e6,
                target=Target(limit=RSS_MAX_MB) if b.jobs == SCALE_TARGET_JOBS else None,
            )
        )
        results.append(
            result(
                f"scale.lag_p99_at_{b.jobs}",
                percentile(b.watched.pushed, 99),
                "ms",
                baseline=percentile(b.direct_lags, 99),
                target=Target(limit=LAG_P99_MAX_MS),
            )
        )
        results.append(
            result(
                f"scale.throughput_{b.jobs}_parallel",
                b.jobs / b.wall,
                "jobs/s",
                baseline=b.jobs / b.direct_wall,
            )
        )
    slope = intercept = None
    if len(batches) >= 2:
        slope, intercept = linear_fit(
            [b.jobs for b in batches], [float(b.rss_peak) for b in batches]
        )
        results.append(result("scale.rss_growth_per_job", slope / 1e3, "KB/job"))
        if all(b.jobs != SCALE_TARGET_JOBS for b in batches):
            results.append(
                result(
                    f"scale.rss_mb_at_{SCALE_TARGET_JOBS}_extrapolated",
                    (intercept + slope * SCALE_TARGET_JOBS) / 1e6,
                    "MB",
                    baseline=idle_rss / 1e6,
                    target=Target(limit=RSS_MAX_MB),
                )
            )
    for population in populations:
        results.append(
            result(
                f"scale.running_lag_p99_at_{population.jobs}",
                population.pushed_p99,
                "ms",
                baseline=population.polled_p99,
                target=Target(limit=LAG_P99_MAX_MS),
            )
        )
    results.append(
        result(
            "scale.throughput_deep_serial_queue",
            serial_n / serial_wall,
            "jobs/s",
            baseline=serial_n / serial_direct,
            target=Target(metric="ratio", op=">=", limit=THROUGHPUT_MIN_RATIO),
        )
    )
    rows = []
    for b in batches:
        assert b.cpu is not None
        server = b.cpu.seconds.get("Temporal server", 0.0)
        rows.append(
            f"| {b.jobs} | {fmt(b.wall)} | {fmt(b.direct_wall)} | {fmt(b.jobs / b.wall)} | "
            f"{fmt(b.jobs / b.direct_wall)} | {fmt(b.rss_before / 1e6)} | "
            f"{fmt(b.rss_peak / 1e6)} | "
            f"{fmt((b.rss_peak - idle_rss) / b.jobs / 1e3)} | {fmt(server / b.wall)} | "
            f"{fmt(percentile(b.watched.pushed, 50))} / {fmt(percentile(b.watched.pushed, 99))} | "
            f"{fmt(percentile(b.watched.polled, 50))} / {fmt(percentile(b.watched.polled, 99))} | "
            f"{fmt(percentile(b.direct_lags, 50))} / {fmt(percentile(b.direct_lags, 99))} | "
            f"{_p50_max(b.watched.first_pushed)} | {_p50_max(b.watched.first_status)} | "
            f"{b.watched.over_before_first_status} of {len(b.watched.first_status)} | "
            f"{len(b.watched.late)} | {b.live['live_follows{subscribed=yes}']} / "
            f"{b.live['live_follows{subscribed=no}']} / {b.live['live_subscribed_late']} |"
        )
    late_lines = [f"- late at {b.jobs}: {line}" for b in batches for line in b.watched.late]
    cpu_lines: list[str] = []
    for b in batches:
        assert b.cpu is not None and b.direct_cpu is not None
        heartbeats = b.calls.counts.get("RecordActivityTaskHeartbeat", 0)
        cpu_lines += [
            f"{b.jobs} jobs:",
            "",
            *cpu_table(
                {
                    "project": (b.cpu, b.wall, b.jobs),
                    "direct": (b.direct_cpu, b.direct_wall, b.jobs),
                }
            ),
            "",
            f"The Temporal server's calls during the {b.jobs}-job batch ({fmt(b.wall)} s; "
            f"heartbeats: {fmt(heartbeats / b.wall)} per second, {fmt(heartbeats / b.jobs)} "
            "per job):",
            "",
            *calls_table(b.calls, b.wall, "second"),
            "",
        ]
    summary = [
        f"Jobs of {STEPS} steps x {STEP_MS} ms; one worker (max_concurrent_activities raised to "
        f"the largest batch); the parallel simulator runs a whole batch at once. Worker RSS idle "
        f"(after a warm-up): {fmt(idle_rss / 1e6)} MB.",
        "",
        "| jobs | project s | direct s | project jobs/s | direct jobs/s | RSS before (MB) | "
        "RSS peak (MB) | peak - idle per job (KB) | server cores | pushed lag p50 / p99 (ms) | "
        "polled lag p50 / p99 (ms) | direct lag p50 / p99 (ms) | first status pushed p50 / max "
        "(ms) | first status polled p50 / max (ms) | ended before it (polled) | "
        "pushed late | follows subscribed / not / subscribed late |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"- RSS line fit: {fmt(slope / 1e3) if slope else '-'} KB per job, "
        f"{fmt(intercept / 1e6) if intercept else '-'} MB at 0 jobs",
        f"- deep serial queue: {serial_n} jobs in {fmt(serial_wall)} s, the same prompts directly "
        f"in {fmt(serial_direct)} s",
        f"- lag: {len(lags)} progress events of {WATCHED} watched jobs per batch, event at the "
        f"simulator -> status handed to `JobClient.watch`, with the live-progress key (pushed: "
        "the target row) and without it (polled); the baseline is the direct batch's: event at "
        "the simulator -> the same step's `progress` frame at the direct script's socket, for "
        f"{WATCHED} of its prompts (what a client of ComfyUI itself sees on this machine under "
        "the same burst)",
        "- first status: from a watch's start (its submit returned) to the first status "
        "`JobClient.watch` handed it: pushed, a step pushed over what its submit answered; "
        "polled, the job's answer to the status query, or what Temporal's record says while that "
        "answer is late; ended before it: watched jobs whose last step the simulator had sent "
        "before the polled watcher's first status",
        f"- the burst: the {WATCHED} watched jobs are submitted (attached) and watched by this "
        "process; the others, detached, by another one (bench/burst_child.py), started when the "
        "watched ones are, as the burst's other clients would send them",
        f"- pushed late: watched jobs with a pushed step over {fmt(LAG_P99_MAX_MS)} ms late "
        "(each in a line below); follows: the worker's count of the batch's follow attempts "
        "begun with a gateway's subscription to their job (the watched ones should), without "
        "(the others), and subscriptions that came after their job's follow began "
        "(`durable_comfy_live_follows`, `durable_comfy_live_subscribed_late`)",
        *late_lines,
    ]
    running_lines = [
        f"Running populations: jobs of {scale_running.STEPS} steps x {scale_running.STEP_MS} ms "
        f"on the same worker (live progress on), started {scale_running.CHUNK} at a time; at "
        f"each, {scale_running.WATCHED} jobs watched for {fmt(scale_running.WINDOW_S)} s by "
        "`JobClient.watch` with the live-progress key (pushed) and without it (polled).",
        "",
        "| jobs running | reached after (s) | pushed lag p50 / p99 (ms) | polled lag p50 / p99 "
        "(ms) | steps counted |",
        "|---|---|---|---|---|",
        *(
            f"| {p.jobs} | {fmt(p.started_s)} | {fmt(percentile(p.pushed, 50))} / "
            f"{fmt(p.pushed_p99)} | {fmt(percentile(p.polled, 50))} / {fmt(p.polled_p99)} | "
            f"{len(p.pushed)} |"
            for p in populations
        ),
        *([] if stalled is None else ["", f"The next population was not reached: {stalled}"]),
    ]
    summary += ["", *running_lines]
    where_lines = [*summary, "", *cpu_lines, *profiled]
    where = {r.name: where_lines for r in results if r.meets is False}
    sections = [
        Section(title="Scale: batches", lines=summary),
        Section(title="Scale: CPU by process", lines=cpu_lines, console=False),
    ]
    if profiled:
        sections.append(Section(title="Scale: profile", lines=profiled, console=False))
    return Outcome(results=results, sections=sections, where=where)


BENCHMARK = Benchmark(name="scale", group=4, title="Scale", run=run, timeout_s=1800.0)
