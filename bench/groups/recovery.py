"""Group 3, recovery: `kill -9` of the worker mid-job, to the next step a client sees.

A worker of its own (`python worker.py`, a process of its own on a task queue of its own)
follows one job on the `comfyui_timed` pool (20 ms per step) whose policy has
`heartbeat_timeout_s` = `--recovery-heartbeat-s` (JobPolicy's default, 20 s, unless told). A
client watches it with `JobClient.watch` (default poll). A few seconds into sampling the worker
gets SIGKILL and a new one is started at once, as a supervisor would. Measured:

- **kill → next step seen**: from the kill to the first status the client is handed with a
  step the simulator sent after the kill (GET /sim/progress: a step sent before it may still
  reach the client later, in a heartbeat or signal already on its way; only a later one shows
  a live follower again); target <= heartbeat_timeout_s + 2 s;
- **resubmissions**: prompts the simulator was sent for the job beyond the first (its
  /sim/stats counter, read before and after; target 0);
- the parts of that time, from the job's history and the new worker's log (recovery_parts.py);
- baseline: the job's own step interval as the client sees it (longest gap between new steps
  outside the recovery).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from bench.histories import event_time, job_history, labels
from bench.jobs import BenchFailure, Seen, graph, prompt_id_of, watch
from bench.outcome import Benchmark, BenchOptions, Outcome, Section
from bench.recovery_parts import Mark, parts, step_gaps, step_seen_after, timeline
from bench.results import Target, fmt, percentile, result
from bench.sim import progress_times
from bench.stack import TIMED_POOL, BenchContext, extra_worker, logged_at
from starter import JobClient, JobPolicy, JobRequest
from workflows.contracts import JobStatus

SLACK_S = 2.0
KILL_AFTER_S = 4.0  # of sampling seen by the client
AFTER_RECOVERY_S = 12.0  # of sampling left after the expected recovery


async def _prompts(ctx: BenchContext) -> int:
    stats: dict[str, Any] = (await ctx.http.get(f"{ctx.timed.url}/sim/stats")).json()
    return sum(int(n) for n in stats["prompts"].values())


async def _watch(jobs: JobClient, job_id: str, seen: list[Seen]) -> JobStatus:
    return (await watch(jobs, job_id, seen))[1]


async def run(ctx: BenchContext, options: BenchOptions) -> Outcome:
    heartbeat = options.recovery_heartbeat_s
    step_s = ctx.timed.step_delay_ms / 1000
    steps = math.ceil((KILL_AFTER_S + heartbeat + SLACK_S + AFTER_RECOVERY_S) / step_s)
    policy = JobPolicy(heartbeat_timeout_s=heartbeat)
    seen: list[Seen] = []
    async with extra_worker(ctx, "recovery", [ctx.timed]) as worker:
        assert worker.killable is not None
        jobs, _ = ctx.job_client(worker.task_queue)
        before = await _prompts(ctx)
        submitted = await jobs.submit(
            JobRequest(graph=graph(steps), pool=TIMED_POOL, policy=policy)
        )
        job_id = submitted.job_id
        watching = asyncio.create_task(_watch(jobs, job_id, seen))
        deadline = time.monotonic() + 120
        while not any(s.step > 0 and time.time() - s.at < 60 for s in seen) or (
            time.time() - next(s.at for s in seen if s.step > 0) < KILL_AFTER_S
        ):
            if watching.done() or time.monotonic() > deadline:
                await watching
                raise BenchFailure("the job did not reach sampling before the kill")
            await asyncio.sleep(0.05)
        description = await ctx.temporal.get_workflow_handle(job_id).describe()
        pending = list(description.raw_description.pending_activities)
        last_heartbeat = (
            pending[0].last_heartbeat_time.ToDatetime().timestamp()
            if pending and pending[0].HasField("last_heartbeat_time")
            else None
        )
        killed_pid = worker.killable.pid
        kill_at = time.time()
        await worker.killable.kill()
        await worker.killable.start()
        ready_at = time.time()
        final = await watching
    after = await _prompts(ctx)

    prompt_id = prompt_id_of(final)
    sent_at = {int(p.value): p.at for p in await progress_times(ctx.http, ctx.timed.url, prompt_id)}
    step_at_kill, next_seen = step_seen_after(seen, kill_at, sent_at)
    if next_seen is None:
        raise BenchFailure(f"no step after the kill was seen (final {final.state.value})")
    recovery_s = next_seen.at - kill_at
    events = await job_history(ctx.temporal, job_id)
    marks = [Mark(event_time(e), label) for e, label in zip(events, labels(events), strict=True)]
    marks.append(Mark(ready_at, "replacement worker ready (worker_started logged)"))
    reattached = logged_at(worker.log_file, "follow_start").get(job_id)
    if reattached is not None and reattached > kill_at:
        marks.append(Mark(reattached, "the new worker's follow_prompt started (follow_start)"))
    marks.append(Mark(next_seen.at, f"the client saw step {next_seen.step}"))
    gaps = step_gaps(seen, kill_at, next_seen.at)
    normal_max = max(gaps) if gaps else None
    resubmissions = after - before - 1
    named = parts(kill_at, next_seen.at, marks)

    results = [
        result(
            "recovery.kill_to_next_step",
            recovery_s,
            "s",
            baseline=normal_max,
            target=Target(limit=heartbeat + SLACK_S),
        ),
        result("recovery.resubmissions", resubmissions, "prompts", target=Target(limit=0)),
        result(
            "recovery.heartbeat_timeout_part",
            dict(named).get("heartbeat timeout (kill -> ACTIVITY_TASK_TIMED_OUT)", math.nan),
            "s",
            baseline=heartbeat,
        ),
    ]
    lines = [
        f"One job of {steps} steps x {ctx.timed.step_delay_ms} ms, heartbeat_timeout_s "
        f"{fmt(heartbeat)}; worker pid {killed_pid} got SIGKILL at step {step_at_kill} (as the "
        f"client saw it), a new worker was ready {fmt(ready_at - kill_at)} s later. The job "
        f"ended {final.state.value}; prompts sent to the simulator: {after - before}.",
        "- the worker's last heartbeat before the kill: "
        + (
            f"{fmt(kill_at - last_heartbeat)} s before it (the server times the activity out "
            f"{fmt(heartbeat)} s after its last heartbeat)"
            if last_heartbeat is not None
            else "none recorded yet"
        ),
        f"- kill -> next step seen: {fmt(recovery_s)} s (step {step_at_kill} -> "
        f"{next_seen.step}); normal gaps between new steps seen: p50 "
        f"{fmt(percentile(gaps, 50)) if gaps else '-'} s, max {fmt(normal_max)} s",
        "",
        "| part | s |",
        "|---|---|",
        *(f"| {name} | {fmt(seconds)} |" for name, seconds in named),
        "",
        "| s since kill | s since previous | what |",
        "|---|---|---|",
        *(
            f"| {fmt(since)} | {fmt(step)} | {label} |"
            for since, step, label in timeline(kill_at, next_seen.at, marks)
        ),
    ]
    where = {
        "recovery.kill_to_next_step": [
            f"{fmt(recovery_s)} s from the kill to the next step seen, against "
            f"heartbeat_timeout_s {fmt(heartbeat)} + {fmt(SLACK_S)} s. The parts, from the "
            "job's history and the new worker's log:",
            "",
            *lines[4:],
        ],
        "recovery.resubmissions": [
            f"The simulator was sent {after - before} prompts for the job: the new worker "
            "submitted it again instead of re-attaching to the running prompt."
        ],
    }
    sections = [Section(title="Recovery: one job, its worker killed", lines=lines)]
    return Outcome(results=results, sections=sections, where=where)


BENCHMARK = Benchmark(name="recovery", group=3, title="Recovery", run=run)
