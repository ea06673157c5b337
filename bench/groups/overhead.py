"""Group 1, overhead: what durability adds to one short job.

Three ways to do about the same thing, interleaved (the order rotates every round so load
drifts hit all three alike), N measured rounds after a warm-up:

- **job**: `JobClient.submit` + `wait` of a 1-segment, 10-step job on the `comfyui` pool (the
  stack's simulator, step delay 0): client → Temporal → worker → simulator → S3 → COMPLETED;
- **direct**: the script in bench/direct.py doing the simulator and S3 work itself;
- **bare**: a workflow with one no-op activity on the same server (bench/bare.py), started and
  awaited with `execute_workflow`: the floor any Temporal workflow pays.

Added latency = job - direct (p50, p95); the target compares it with the bare workflow. Every
job's history is read afterwards (outside the timed part) for its round trips and for the time
between its events: where the added latency goes.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from typing import Any

from temporalio.api.history.v1 import HistoryEvent

from bench.calls import Call, CallLog
from bench.direct import DirectRun, run_direct
from bench.histories import (
    RoundTrips,
    Step,
    critical_path,
    event_time,
    job_history,
    labels,
    path_table,
    round_trips,
    shares,
    shares_table,
    split,
)
from bench.jobs import completed, graph, prompt_id_of, request
from bench.outcome import Benchmark, BenchOptions, Outcome, Section
from bench.profile import parse_collapsed, profile_lines, record
from bench.results import Target, fmt, percentile, result
from bench.stack import FAST_POOL, BenchContext, logged_at
from starter import JobClient

STEPS = 10
ADDED_P50_MAX_MS = 100.0
# What durability adds to a short job, at most 1.5x a bare one-activity workflow.
ADDED_VS_BARE_MAX = 1.5
ADDED_P95_MAX_MS = 250.0
KINDS = ("job", "direct", "bare")


class JobSample:
    """One measured job: its ID, the client's own marks and the calls it made."""

    def __init__(
        self, job_id: str, prompt_id: str, started: float, ended: float, calls: list[Call]
    ) -> None:
        self.job_id = job_id
        self.prompt_id = prompt_id
        self.started = started
        self.ended = ended
        self.calls = calls

    @property
    def ms(self) -> float:
        return (self.ended - self.started) * 1000

    def call(self, method: str) -> Call | None:
        return next((c for c in self.calls if c.method == method), None)


async def _job(jobs: JobClient, log: CallLog) -> JobSample:
    log.clear()
    started = time.time()
    status = await jobs.submit(request(STEPS, FAST_POOL))
    final = completed(await jobs.wait(status.job_id))
    ended = time.time()
    return JobSample(status.job_id, prompt_id_of(final), started, ended, list(log.calls))


async def _bare(ctx: BenchContext) -> tuple[str, float, float]:
    workflow_id = f"bench-bare-{uuid.uuid4().hex[:12]}"
    started = time.time()
    await ctx.temporal.execute_workflow("BenchBare", id=workflow_id, task_queue=ctx.bare_task_queue)
    return workflow_id, started, time.time()


async def _direct(ctx: BenchContext) -> DirectRun:
    return await run_direct(ctx.http, ctx.store, ctx.fast.url, graph(STEPS))


def _p(values: list[float]) -> tuple[float, float]:
    return percentile(values, 50), percentile(values, 95)


def _timeline(events: list[HistoryEvent], submitted: float) -> list[tuple[float, str]]:
    """Every event in time order (an activity's start is written only when it ends)."""
    named = zip((event_time(e) for e in events), labels(events), strict=True)
    return sorted([(submitted, "client: submit called"), *named])


def _job_marks(sample: JobSample) -> list[tuple[str, float]]:
    """After the workflow completed: `wait` got the result, then queried the final status."""
    query = sample.call("query:status")
    if query is None:
        return [("client: wait returned", sample.ended)]
    return [
        ("client: result received", query.started),
        ("client: final status query answered", sample.ended),
    ]


PROFILE_S = 6.0
PROFILE_RATE = 250


async def _profile_worker(ctx: BenchContext, jobs: JobClient, log: CallLog) -> list[str]:
    """py-spy on the worker while jobs run one after another, as in the measured rounds
    (unmeasured): which of the worker's own code the job's time goes through."""
    if ctx.worker_pid is None:
        return ["(no profile: the worker's process is not known)"]
    out = ctx.work_dir / "profiles" / "overhead-worker.txt"
    recording = asyncio.create_task(record(ctx.worker_pid, PROFILE_S, out, rate=PROFILE_RATE))
    count = 0
    while not recording.done():
        await _job(jobs, log)
        count += 1
    text = await recording
    lines = profile_lines(text, f"the worker during {count} more jobs, one at a time")
    if text is None:
        return lines
    busy = parse_collapsed(text).samples / (PROFILE_RATE * PROFILE_S)
    return [
        f"The worker was on CPU about {fmt(100 * busy)} % of one core meanwhile ({count} jobs "
        f"in {fmt(PROFILE_S)} s): most of a job's time it waits on the server, not on its own "
        "CPU.",
        "",
        *lines,
    ]


FOLLOW = "activity follow_prompt running"


def _split_follow(
    path: list[Step], sample: JobSample, sim_stats: dict[str, Any], stored: dict[str, float]
) -> list[Step]:
    """follow_prompt's wait cut where the simulator started and ended the prompt (/sim/stats)
    and where the worker logged its output stored (`artifact_stored`): one machine, one clock."""
    marks = [
        (
            f"{FOLLOW}: socket + POST /prompt, until the simulator starts the prompt",
            sim_stats.get("started_at", {}).get(sample.prompt_id),
        ),
        (
            f"{FOLLOW}: the prompt on the simulator",
            sim_stats.get("ended_at", {}).get(sample.prompt_id),
        ),
        (f"{FOLLOW}: its output to S3 (until artifact_stored)", stored.get(sample.job_id)),
    ]
    known = [(label, at) for label, at in marks if at is not None]
    return split(path, FOLLOW, known, f"{FOLLOW}: after its output was stored, until completed")


WT_CODE = "workflow code on the worker (workflow task)"
WT_DISPATCH = "workflow task dispatch (server to worker)"


def _per_task(paths: list[list[Step]], category: str) -> tuple[int, float]:
    """Workflow tasks on the critical path (median over the jobs) and the p50 ms of one."""
    counts = [sum(1 for s in path if s.category == category) for path in paths]
    each = [s.ms for path in paths for s in path if s.category == category]
    return int(statistics.median_low(counts)), percentile(each, 50) if each else 0.0


def _where(
    job_paths: list[list[Step]],
    bare_paths: list[list[Step]],
    p50: dict[str, float],
    trips: RoundTrips,
    profiled: list[str],
) -> list[str]:
    rows = shares(job_paths)
    share = {row.category: row.p50_ms for row in rows}
    tasks, code_each = _per_task(job_paths, WT_CODE)
    _, dispatch_each = _per_task(job_paths, WT_DISPATCH)
    bare_tasks, bare_code_each = _per_task(bare_paths, WT_CODE)
    _, bare_dispatch_each = _per_task(bare_paths, WT_DISPATCH)
    # Per activity on the path, with follow_prompt's pieces (cut by the simulator's clock).
    pieces: dict[str, list[str]] = {}
    totals: dict[str, float] = {}
    for row in rows:
        if not row.category.startswith("activity ") or "dispatch" in row.category:
            continue
        name, _, piece = row.category.removeprefix("activity ").partition(": ")
        name = name.removesuffix(" running")
        totals[name] = totals.get(name, 0.0) + row.p50_ms
        if piece:
            pieces.setdefault(name, []).append(f"{piece} {fmt(row.p50_ms)}")
    activity_text = "; ".join(
        f"{name} {fmt(ms)} ms" + (f" ({', '.join(pieces[name])})" if name in pieces else "")
        for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])
    )
    query = share.get("client: final status query answered", 0.0)
    prepare_trip = dispatch_each + code_each + totals.get("prepare_prompt", 0.0)
    return [
        f"Job p50 {fmt(p50['job'])} ms, direct script {fmt(p50['direct'])} ms, bare workflow "
        f"{fmt(p50['bare'])} ms. Each job's critical path (its history's event times and the "
        "client's own marks; each step is what one event waited for since the one before it, "
        "so the steps add up to the job's time and work beside the path, such as progress "
        "signals during follow_prompt, is left out), summed by what it waited on, p50 over "
        "the jobs. follow_prompt is cut where the simulator started and ended the prompt "
        "(/sim/stats) and where the worker logged the output stored (`artifact_stored`):",
        "",
        *shares_table(rows, p50["job"]),
        "",
        f"- **Workflow tasks**: {tasks} on the critical path (the bare workflow has "
        f"{bare_tasks}), each about {fmt(dispatch_each)} ms from the server to the worker and "
        f"{fmt(code_each)} ms of workflow code (bare: {fmt(bare_dispatch_each)} + "
        f"{fmt(bare_code_each)} ms): {fmt(share.get(WT_CODE, 0) + share.get(WT_DISPATCH, 0))} "
        "ms. A completed job's tasks: the start (the follow is scheduled; a request that "
        "stages no input has no prepare of its own, its first follow checks it before "
        "submitting), follow done (the follow "
        "stored and verified the outputs and saw the prompt end, so no offload or stop check "
        "follows); a follow attempt sends no signal in its first second, so a short job has "
        "none beside the path. The workflow code per task is above the bare workflow's: the "
        "job's status (a pydantic model) is rewritten, its journal and Current Details "
        "written, and its search attributes upserted once per task.",
        f"- **Activities** (p50 of each piece): {activity_text}. The direct script does the "
        f"same simulator and S3 work in {fmt(p50['direct'])} ms in all; the follow adds a /history "
        "read at the end (the source of truth for the outputs) and the sha256 the store checks "
        "each put against.",
        *(
            [
                f"- **The final status query**: {fmt(query)} ms. `JobClient.wait` queried the "
                "closed workflow after reading its result."
            ]
            if query > 0
            else []
        ),
        "- **What would cut the rest**: (1) workflow code per task "
        f"({fmt(code_each)} ms against the bare workflow's {fmt(bare_code_each)}): fewer status "
        "rewrites per task, fewer payloads per task (each one the SDK visits several times, "
        "entering the sandbox for each); (2) the /history read after a success whose outputs "
        "every `executed` event already named"
        + (
            f"; (3) the prepare activity's round trip ({fmt(prepare_trip)} ms): it is on the "
            "path only when the request stages inputs"
            if "prepare_prompt" in totals
            else ""
        )
        + ".",
        f"- The job's round trips: {trips.round_trips} ({trips.workflow_tasks} workflow tasks, "
        f"{sum(trips.activities.values())} activities, {sum(trips.signals.values())} signals, "
        f"{trips.timers} timers) against the bare workflow's 3.",
        *(["", *profiled] if profiled else []),
    ]


async def run(ctx: BenchContext, options: BenchOptions) -> Outcome:
    jobs, log = ctx.job_client()
    ms: dict[str, list[float]] = {kind: [] for kind in KINDS}
    job_samples: list[JobSample] = []
    bare_runs: list[tuple[str, float, float]] = []
    direct_runs: list[DirectRun] = []
    for round_no in range(options.warmup + options.n):
        measured = round_no >= options.warmup
        shift = round_no % len(KINDS)
        for kind in KINDS[shift:] + KINDS[:shift]:
            if kind == "job":
                sample = await _job(jobs, log)
                if measured:
                    job_samples.append(sample)
                    ms["job"].append(sample.ms)
            elif kind == "direct":
                direct = await _direct(ctx)
                if measured:
                    direct_runs.append(direct)
                    ms["direct"].append(direct.seconds * 1000)
            else:
                bare = await _bare(ctx)
                if measured:
                    bare_runs.append(bare)
                    ms["bare"].append((bare[2] - bare[1]) * 1000)

    job_p50, job_p95 = _p(ms["job"])
    direct_p50, direct_p95 = _p(ms["direct"])
    bare_p50, bare_p95 = _p(ms["bare"])
    added_p50, added_p95 = job_p50 - direct_p50, job_p95 - direct_p95
    missed = (
        added_p50 > ADDED_P50_MAX_MS
        or added_p50 > ADDED_VS_BARE_MAX * bare_p50
        or added_p95 > ADDED_P95_MAX_MS
    )
    profiled = await _profile_worker(ctx, jobs, log) if missed else []

    # Outside the timed part: every job's and bare workflow's history.
    job_events = [await job_history(ctx.temporal, s.job_id) for s in job_samples]
    bare_events = [await job_history(ctx.temporal, b[0]) for b in bare_runs]
    trips = [round_trips(events) for events in job_events]
    bare_trips = round_trips(bare_events[0])
    median_trips = statistics.median_low(t.round_trips for t in trips)
    typical: RoundTrips = next(t for t in trips if t.round_trips == median_trips)
    calls_per_job = statistics.median_low(len(s.calls) for s in job_samples)
    typical_calls = next(s for s in job_samples if len(s.calls) == calls_per_job)

    sim_stats = (await ctx.http.get(f"{ctx.fast.url}/sim/stats")).json()
    stored = logged_at(ctx.worker_log, "artifact_stored")
    job_paths = [
        _split_follow(critical_path(events, s.started, _job_marks(s)), s, sim_stats, stored)
        for events, s in zip(job_events, job_samples, strict=True)
    ]
    bare_paths = [
        critical_path(events, b[1], [("client: result received", b[2])])
        for events, b in zip(bare_events, bare_runs, strict=True)
    ]
    job_rows = shares(job_paths)
    median_index = sorted(range(len(job_samples)), key=lambda i: job_samples[i].ms)[
        len(job_samples) // 2
    ]
    median_job = job_samples[median_index]
    timeline = _timeline(job_events[median_index], median_job.started)

    results = [
        result("overhead.job_p50", job_p50, "ms", baseline=direct_p50),
        result("overhead.job_p95", job_p95, "ms", baseline=direct_p95),
        result("overhead.direct_p50", direct_p50, "ms"),
        result("overhead.direct_p95", direct_p95, "ms"),
        result("overhead.bare_p50", bare_p50, "ms"),
        result("overhead.bare_p95", bare_p95, "ms"),
        result(
            "overhead.added_p50",
            added_p50,
            "ms",
            baseline=bare_p50,
            target=Target(limit=ADDED_P50_MAX_MS),
        ),
        result(
            "overhead.added_p50_vs_bare",
            added_p50,
            "ms",
            baseline=bare_p50,
            target=Target(metric="ratio", limit=ADDED_VS_BARE_MAX),
        ),
        result(
            "overhead.added_p95",
            added_p95,
            "ms",
            baseline=bare_p95,
            target=Target(limit=ADDED_P95_MAX_MS),
        ),
        result(
            "overhead.round_trips", median_trips, "round trips", baseline=bare_trips.round_trips
        ),
        result("overhead.client_calls", calls_per_job, "calls", baseline=2),
    ]
    spread = [
        f"| {kind} | {fmt(percentile(v, 50))} | {fmt(percentile(v, 95))} | {fmt(min(v))} "
        f"| {fmt(max(v))} |"
        for kind, v in ms.items()
    ]
    start_call = [c.seconds * 1000 for s in job_samples if (c := s.call("start_workflow"))]
    query_call = [c.seconds * 1000 for s in job_samples if (c := s.call("query:status"))]
    direct_phases = {
        "open socket + POST /prompt": [(d.queued - d.started) * 1000 for d in direct_runs],
        "follow the socket to the end": [(d.executed - d.queued) * 1000 for d in direct_runs],
        "socket closed": [(d.closed - d.executed) * 1000 for d in direct_runs],
        "GET /view + put_object": [(d.stored - d.closed) * 1000 for d in direct_runs],
    }
    sections = [
        Section(
            title="Overhead: samples (ms)",
            lines=[
                f"{options.n} rounds of job, direct and bare (order rotated each round) after "
                f"{options.warmup} warm-up rounds; {STEPS}-step graph, simulator step delay 0.",
                "",
                "| kind | p50 | p95 | min | max |",
                "|---|---|---|---|---|",
                *spread,
            ],
        ),
        Section(
            title="Overhead: Temporal round trips of one job (the list to cut)",
            lines=[
                *typical.lines(),
                f"- the bare workflow: {bare_trips.round_trips} round trips "
                f"({bare_trips.events} events)",
                f"- client calls for submit + wait: {len(typical_calls.calls)} ("
                + ", ".join(
                    f"{k} x{v}" for k, v in CallLog(typical_calls.calls).by_method().items()
                )
                + f"); start_workflow p50 {fmt(percentile(start_call, 50))} ms"
                + (
                    f", final status query p50 {fmt(percentile(query_call, 50))} ms"
                    if query_call
                    else ""
                ),
            ],
        ),
        Section(
            title="Overhead: where the job's time goes (critical path, p50 over all jobs)",
            lines=shares_table(job_rows, job_p50),
        ),
        Section(
            title=f"Overhead: the median job's critical path ({fmt(median_job.ms)} ms)",
            lines=path_table(job_paths[median_index]),
            console=False,
        ),
        Section(
            title="Overhead: the median job, event by event",
            lines=[
                "| ms since submit | event |",
                "|---|---|",
                *(f"| {fmt((t - timeline[0][0]) * 1000)} | {label} |" for t, label in timeline),
            ],
            console=False,
        ),
        Section(
            title="Overhead: the bare workflow's critical path (p50 over all runs)",
            lines=shares_table(shares(bare_paths), bare_p50),
        ),
        Section(
            title="Overhead: the direct script's time",
            lines=[
                "| phase | p50 ms | p95 ms |",
                "|---|---|---|",
                *(
                    f"| {name} | {fmt(percentile(v, 50))} | {fmt(percentile(v, 95))} |"
                    for name, v in direct_phases.items()
                ),
            ],
        ),
    ]
    where = _where(
        job_paths,
        bare_paths,
        {"job": job_p50, "direct": direct_p50, "bare": bare_p50},
        typical,
        profiled,
    )
    return Outcome(
        results=results,
        sections=sections,
        where={
            name: where
            for name in ("overhead.added_p50", "overhead.added_p50_vs_bare", "overhead.added_p95")
        },
    )


BENCHMARK = Benchmark(name="overhead", group=1, title="Overhead", run=run)
