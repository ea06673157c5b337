"""Group 2, throughput: short jobs completed per second with many concurrent clients.

A simulator of its own in parallel mode, running as many prompts at once as there are clients
(they stand for that many GPU workers), `throughput_steps` steps at `throughput_step_ms` each;
a worker of its own (`python worker.py`) on a task queue of its own. Then, after a short
unmeasured warm-up of each:

- **direct**: `throughput_clients` clients, each running `throughput_jobs` prompts one after
  the other the direct script's way (bench/direct.py: socket, POST /prompt, GET /view,
  put_object);
- **project**: the same clients, each running as many jobs one after the other with `JobClient`
  (`submit` + `wait`).

Jobs per second = jobs / wall time of the phase (target: project >= 0.5x direct). The CPU
seconds of the Temporal server (its process tree, from /proc by PID), the worker, the simulator
and this process (the clients) are read before and after each phase: CPU per job says where a
job's cost goes. When the target is missed, py-spy records the worker during one more
(unmeasured) round.
"""

from __future__ import annotations

import asyncio
import os

from bench.direct import DirectRun
from bench.load import (
    CpuUse,
    clients_loop,
    cpu_table,
    direct_job,
    direct_phases,
    jobs_per_s,
    project_job,
    spread,
)
from bench.outcome import Benchmark, BenchOptions, Outcome, Section
from bench.profile import profile_lines, record
from bench.results import Target, fmt, result
from bench.server_calls import calls_table, server_calls
from bench.stack import BenchContext, extra_sim, extra_worker

RATIO_MIN = 0.5
# Half the Temporal server's CPU per short job recorded before the scale work of 2026-12-02
# (115 ms, this machine).
SERVER_CPU_MAX_MS = 57.5
SERVER = "Temporal server"
WORKER = "worker"
SIM = "simulator"
S3 = "S3 (SeaweedFS)"


async def run(ctx: BenchContext, options: BenchOptions) -> Outcome:
    clients, per = options.throughput_clients, options.throughput_jobs
    steps, step_ms = options.throughput_steps, options.throughput_step_ms
    total = clients * per
    async with (
        extra_sim(ctx, "throughput", step_delay_ms=step_ms, parallel=clients) as sim,
        extra_worker(ctx, "throughput", [sim.pool]) as worker,
    ):
        jobs, _ = ctx.job_client(worker.task_queue)
        pool = sim.pool.name

        async def project() -> float:
            return await project_job(jobs, steps, pool)

        runs: list[DirectRun] = []

        async def direct() -> float:
            return await direct_job(ctx.http, ctx.store, sim.pool.url, steps, runs)

        warm = min(clients, 10)
        await clients_loop(warm, 1, direct)
        await clients_loop(warm, 1, project)
        pids = {SERVER: ctx.temporal_pid, S3: ctx.s3_pid, WORKER: worker.pid, SIM: sim.record.pid}
        runs.clear()

        direct_cpu = CpuUse.start(pids)
        direct_wall, direct_each = await clients_loop(clients, per, direct)
        direct_cpu.stop()
        calls_before = await server_calls(ctx.http, ctx.temporal_metrics_url)
        project_cpu = CpuUse.start(pids)
        project_wall, project_each = await clients_loop(clients, per, project)
        project_cpu.stop()
        calls = (await server_calls(ctx.http, ctx.temporal_metrics_url)).minus(calls_before)

        rate, direct_rate = jobs_per_s(total, project_wall), jobs_per_s(total, direct_wall)
        profiled: list[str] = []
        if rate < RATIO_MIN * direct_rate:
            # One more round, unmeasured, with py-spy on the worker meanwhile.
            seconds = max(3.0, project_wall / per)
            out = ctx.work_dir / "profiles" / "throughput-worker.txt"
            recording = asyncio.create_task(record(worker.pid, seconds, out))
            await clients_loop(clients, max(1, per // 2), project)
            profiled = profile_lines(await recording, "the worker during one more round")

    server_ms = 1000 * project_cpu.seconds.get(SERVER, 0.0) / total
    worker_ms = 1000 * project_cpu.seconds.get(WORKER, 0.0) / total
    results = [
        result(
            "throughput.jobs_per_s",
            rate,
            "jobs/s",
            baseline=direct_rate,
            target=Target(metric="ratio", op=">=", limit=RATIO_MIN),
        ),
        result(
            "throughput.server_cpu_per_job",
            server_ms,
            "CPU ms",
            baseline=1000 * direct_cpu.seconds.get(SERVER, 0.0) / total,
            target=Target(limit=SERVER_CPU_MAX_MS),
        ),
        result("throughput.server_rpcs_per_job", calls.rpcs / total, "calls"),
        result("throughput.worker_cpu_per_job", worker_ms, "CPU ms"),
        result(
            "throughput.server_cores",
            project_cpu.seconds.get(SERVER, 0.0) / project_wall,
            "cores",
        ),
    ]
    phases = {
        "project": (project_cpu, project_wall, total),
        "direct": (direct_cpu, direct_wall, total),
    }
    table = cpu_table(phases)
    sections = [
        Section(
            title="Throughput: the two phases",
            lines=[
                f"{clients} clients x {per} jobs each ({total} jobs), {steps} steps x {step_ms} ms "
                f"on a simulator running {clients} prompts at once.",
                f"- project: {fmt(project_wall)} s, {fmt(rate)} jobs/s; each job "
                f"{spread(project_each)}",
                f"- direct: {fmt(direct_wall)} s, {fmt(direct_rate)} jobs/s; each job "
                f"{spread(direct_each)}; its phases: {direct_phases(runs)}",
                "",
                "CPU per job and cores used, by process (from /proc, before and after each phase):",
                "",
                *table,
                "",
                "The project phase's calls to the Temporal server (its own metrics):",
                "",
                *calls_table(calls, total, "job"),
            ],
        )
    ]
    where: dict[str, list[str]] = {}
    if results[0].meets is False:
        all_ms = 1000 * sum(project_cpu.seconds.values()) / total
        where["throughput.jobs_per_s"] = [
            f"{fmt(rate)} jobs/s against {fmt(direct_rate)} direct. A job costs {fmt(all_ms)} "
            f"CPU ms across the processes below (the Temporal server {fmt(server_ms)}, the "
            f"worker {fmt(worker_ms)}; the direct way "
            f"{fmt(1000 * sum(direct_cpu.seconds.values()) / total)}), so {_cores()} cores "
            f"would cap it at {fmt(_cores() * 1000 / all_ms)} jobs/s; these processes used "
            f"{fmt(sum(project_cpu.seconds.values()) / project_wall)} of {_cores()} cores "
            "meanwhile, so the rest of the time jobs waited (on Temporal round trips, task "
            "dispatch and each other), not on this CPU.",
            "",
            *table,
            "",
            *profiled,
        ]
        sections.append(Section(title="Throughput: profile", lines=profiled, console=False))
    return Outcome(results=results, sections=sections, where=where)


def _cores() -> int:
    return os.cpu_count() or 1


BENCHMARK = Benchmark(name="throughput", group=2, title="Throughput", run=run)
