"""Group 10, our queue: what a bounded pool (`max_running`) costs and whether its order holds.

A worker of its own (`python worker.py` with DURABLE_COMFY_TENANTS `{"heavy": {"weight": 2}}`
and its slots raised to the backlog) serving bounded and open pools on three simulators of
its own (bench/groups/queue_rig.py lists them); K = `--queue-slots` (10) is every bounded
pool's `max_running`. Jobs of 10 steps, at 10 ms a step unless said. In order:

1. **idle**: one job at a time (step delay 0), on a bounded pool and on an open one of the same
   simulator, alternating, N rounds after the warm-up: latency p50 (target <= 1.3x the open
   pool's) and what the bound adds, with both sides' critical paths (bench/histories.py);
2. **start rate**: `--queue-rate-jobs` (300) jobs submitted at once to the open pool of a
   simulator running every prompt at once (its throughput: jobs / wall, the baseline), then
   the same number to a bounded pool of that simulator from a full queue (blockers hold the K
   slots until all wait in line, then are cancelled): starts per second once the line drains
   (bench/queue_math.py `start_rate`; target >= 0.8x);
3. **fairness**: two tenants, `--queue-fair-jobs` (300) jobs each, submitted one tenant after
   the other behind blockers, then drained: each tenant's share of every window of 100 starts
   (the simulator's start order) while both had jobs waiting, against its weight's share, at
   1:1 and 2:1 (target: within 5 percentage points); the baseline is the same windows over the
   order the jobs were submitted in (first come, first served: ComfyUI's own order);
4. **priority**: `--queue-priority-behind` (1,000) jobs wait behind blockers; a priority-1 job,
   then a priority-3 one, are submitted; once both wait, one slot is released: the other jobs
   that started between the priority-1 job's submission and its start (target 0: it takes the
   first slot released, the only one); the baseline is the priority-3 job's count;
5. **backlog**: `--queue-backlog-jobs` (2,000) jobs submitted at once to an open pool of a
   simulator running K prompts at once (its own queue holds the backlog: the baseline), then to
   a bounded pool of that simulator: the worker's peak RSS (target <= 300 MB), history events
   per job (its own history plus its share of the dispatcher's, target <= 6 more than an open
   pool's job), time to run them all (target <= 1.1x). The bounded side is given 3x the open
   side's time + 120 s; if it has not finished by then, its figures are lower bounds, said so.

A measurement that fails is reported in a section of its own (FAILED, with its error) and the
others still run and report.

Every bounded run's simulator must never hold more than K prompts (`queue.peak_prompts`).
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
import traceback
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from bench.groups.queue_phases import (
    BacklogRun,
    Dispatcher,
    FairRun,
    IdleRun,
    PriorityRun,
    RateRun,
    backlog,
    fair,
    idle,
    priority,
    profile_drain,
    rate,
)
from bench.groups.queue_rig import (
    BACKLOG_BOUNDED,
    BACKLOG_OPEN,
    FAIR_EVEN,
    FAIR_WEIGHTED,
    HEAVY,
    IDLE_BOUNDED,
    IDLE_OPEN,
    PRIORITY,
    RATE_BOUNDED,
    RATE_OPEN,
    STEP_MS,
    STEPS,
    TENANTS,
    Rig,
)
from bench.histories import RoundTrips, shares, shares_table
from bench.load import cpu_table
from bench.outcome import Benchmark, BenchOptions, Outcome, Section
from bench.queue_math import WINDOW, events_per_job, start_rate, starts_between, window_shares
from bench.results import Result, Target, fmt, percentile, result
from bench.stack import BenchContext, extra_sim, extra_worker
from starter import JobClient

IDLE_RATIO_MAX = 1.3
START_RATE_MIN = 0.8
FAIR_DEVIATION_MAX = 5.0  # percentage points of a window's starts
PRIORITY_BETWEEN_MAX = 0
RSS_MAX_MB = 300.0
ADDED_EVENTS_MAX = 6.0
BACKLOG_RATIO_MAX = 1.1
# Runs of the fairness measurement: (pool, tenants in the order they submit, with weights).
FAIR_RUNS = (
    ("1to1", FAIR_EVEN, {"even-a": 1.0, "even-b": 1.0}),
    ("2to1", FAIR_WEIGHTED, {"light": 1.0, HEAVY: float(TENANTS[HEAVY]["weight"])}),
)
PROFILE_JOBS = 150

T = TypeVar("T")


def _pools(
    slots: int, idle_url: str, parallel_url: str, backlog_url: str
) -> dict[str, dict[str, object]]:
    def pool(url: str, bounded: bool) -> dict[str, object]:
        return {"kind": "comfyui", "url": url, **({"max_running": slots} if bounded else {})}

    return {
        IDLE_BOUNDED: pool(idle_url, True),
        IDLE_OPEN: pool(idle_url, False),
        RATE_BOUNDED: pool(parallel_url, True),
        RATE_OPEN: pool(parallel_url, False),
        FAIR_EVEN: pool(parallel_url, True),
        FAIR_WEIGHTED: pool(parallel_url, True),
        PRIORITY: pool(parallel_url, True),
        BACKLOG_BOUNDED: pool(backlog_url, True),
        BACKLOG_OPEN: pool(backlog_url, False),
    }


async def run(ctx: BenchContext, options: BenchOptions) -> Outcome:
    slots = options.queue_slots
    backlog_jobs = options.queue_backlog_jobs
    async with (
        extra_sim(ctx, "queue_idle", step_delay_ms=0) as idle_sim,
        extra_sim(
            ctx,
            "queue_parallel",
            step_delay_ms=STEP_MS,
            parallel=max(options.queue_rate_jobs, slots),
        ) as parallel_sim,
        extra_sim(
            ctx, "queue_backlog", step_delay_ms=options.queue_backlog_step_ms, parallel=slots
        ) as backlog_sim,
        extra_worker(
            ctx,
            "queue",
            [idle_sim.pool],
            # The open backlog's follows all at once: its prompts wait in the simulator's queue.
            max_concurrent_activities=max(1000, backlog_jobs + options.queue_rate_jobs + 100),
            env={"DURABLE_COMFY_TENANTS": json.dumps(TENANTS)},
            pool_settings=_pools(
                slots, idle_sim.pool.url, parallel_sim.pool.url, backlog_sim.pool.url
            ),
        ) as worker,
    ):
        sims = {
            IDLE_BOUNDED: idle_sim,
            IDLE_OPEN: idle_sim,
            RATE_BOUNDED: parallel_sim,
            RATE_OPEN: parallel_sim,
            FAIR_EVEN: parallel_sim,
            FAIR_WEIGHTED: parallel_sim,
            PRIORITY: parallel_sim,
            BACKLOG_BOUNDED: backlog_sim,
            BACKLOG_OPEN: backlog_sim,
        }
        jobs = JobClient(ctx.temporal, task_queue=worker.task_queue, store=ctx.store)
        rig = Rig(ctx, jobs, worker, slots, sims)
        runs = Runs()
        runs.idle = await runs.measure("1 (idle)", idle(rig, options))
        runs.rate = await runs.measure("2 (start rate)", rate(rig, options.queue_rate_jobs))
        if runs.slow(slots):
            jobs_n = min(PROFILE_JOBS, options.queue_rate_jobs)
            runs.profiled = (
                await runs.measure("profile", profile_drain(rig, jobs_n), optional=True) or []
            )
        for label, pool, weights in FAIR_RUNS:
            done = await runs.measure(
                f"3 (fairness {label})", fair(rig, pool, weights, options.queue_fair_jobs)
            )
            if done is not None:
                runs.fair[label] = done
        runs.priority = await runs.measure(
            "4 (priority)", priority(rig, options.queue_priority_behind)
        )
        runs.backlog = await runs.measure("5 (backlog)", backlog(rig, backlog_jobs))
    return _outcome(slots, options, runs)


@dataclass
class Runs:
    """What each measurement saw (None: it failed, its error in `failed`), and how long each
    took."""

    idle: IdleRun | None = None
    rate: RateRun | None = None
    fair: dict[str, FairRun] = field(default_factory=dict)
    priority: PriorityRun | None = None
    backlog: BacklogRun | None = None
    profiled: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    failed: list[Section] = field(default_factory=list)

    async def measure(
        self, label: str, measurement: Coroutine[Any, Any, T], *, optional: bool = False
    ) -> T | None:
        """One measurement; one that fails is reported (its section says why), and the
        others still run and report: the jobs of a failed one may still be running then."""
        began = time.monotonic()
        try:
            return await measurement
        except Exception as exc:  # the other measurements' figures are worth keeping
            traceback.print_exc()
            self.failed.append(
                Section(
                    title=f"Queue {label}: FAILED",
                    lines=[
                        f"`{exc!r}`"[:6000],
                        "",
                        "The measurements after it ran with its jobs perhaps still running."
                        if not optional
                        else "",
                    ],
                )
            )
            return None
        finally:
            self.seconds[label] = time.monotonic() - began

    def slow(self, slots: int) -> bool:
        """The start rate missed its target: py-spy then records the worker during one more,
        unmeasured drain (after the start rate, before the rest)."""
        return self.rate is not None and start_rate(self.rate.starts, slots) < (
            START_RATE_MIN * self.rate.jobs / self.rate.open_wall
        )


def _outcome(slots: int, options: BenchOptions, runs: Runs) -> Outcome:
    results: list[Result] = []
    sections: list[Section] = []
    where: dict[str, list[str]] = {}
    parts: list[Outcome] = []
    if runs.idle is not None:
        parts.append(_idle(runs.idle, options))
    if runs.rate is not None:
        parts.append(_rate(slots, runs.rate, runs.profiled))
    if runs.fair:
        parts.append(_fair(runs.fair))
    if runs.priority is not None:
        parts.append(_priority(slots, runs.priority))
    if runs.backlog is not None:
        parts.append(_backlog(slots, runs.backlog, options.queue_backlog_step_ms))
    parts.append(_bound(slots, runs))
    for part in parts:
        results += part.results
        sections += part.sections
        where |= part.where
    if runs.profiled:
        sections.append(Section(title="Queue: profile", lines=runs.profiled, console=False))
    sections += runs.failed
    sections.append(
        Section(
            title="Queue: time per measurement",
            lines=[
                "| measurement | s |",
                "|---|---|",
                *(f"| {label} | {fmt(s)} |" for label, s in runs.seconds.items()),
            ],
        )
    )
    return Outcome(results=results, sections=sections, where=where)


# -- 1 ----------------------------------------------------------------------------------------


def _p(values: Sequence[float], p: float) -> float:
    return percentile(values, p) if values else float("nan")


def _typical(trips: Sequence[RoundTrips]) -> RoundTrips:
    middle = statistics.median_low(t.events for t in trips)
    return next(t for t in trips if t.events == middle)


def _idle(run: IdleRun, options: BenchOptions) -> Outcome:
    bounded, opened = run.ms("bounded"), run.ms("open")
    b50, o50 = percentile(bounded, 50), percentile(opened, 50)
    b95, o95 = percentile(bounded, 95), percentile(opened, 95)
    results = [
        result(
            "queue.idle_latency_p50",
            b50,
            "ms",
            baseline=o50,
            target=Target(metric="ratio", op="<=", limit=IDLE_RATIO_MAX),
        ),
        result("queue.idle_latency_p95", b95, "ms", baseline=o95),
        result("queue.idle_added_p50", b50 - o50, "ms"),
    ]
    rows_b, rows_o = shares(run.paths["bounded"]), shares(run.paths["open"])
    open_by = {r.category: r.p50_ms for r in rows_o}
    bounded_by = {r.category: r.p50_ms for r in rows_b}
    diff = sorted(
        ((c, bounded_by.get(c, 0.0) - open_by.get(c, 0.0)) for c in {*open_by, *bounded_by}),
        key=lambda kv: -abs(kv[1]),
    )
    tb, to = _typical(run.trips["bounded"]), _typical(run.trips["open"])
    explained = [
        f"A {IDLE_STEPS_TEXT} on an idle pool: p50 {fmt(b50)} ms bounded, {fmt(o50)} ms open "
        f"(+{fmt(b50 - o50)} ms, {fmt(b50 / o50)}x). Each job's critical path (its history's "
        "event times and the client's own mark; the steps add up to the job's time), summed "
        "by what it waited on, p50 over the jobs; bounded minus open:",
        "",
        "| waiting on | bounded p50 ms | open p50 ms | bounded - open |",
        "|---|---|---|---|",
        *(
            f"| {c} | {fmt(bounded_by.get(c, 0.0))} | {fmt(open_by.get(c, 0.0))} | {fmt(d)} |"
            for c, d in diff
        ),
        "",
        "The bounded job's history (median by events):",
        *tb.lines(),
        "",
        "The open job's:",
        *to.lines(),
    ]
    section = Section(
        title="Queue 1: one job on an idle bounded pool",
        lines=[
            f"{options.n} rounds of a bounded job and an open one (which goes first swaps each "
            f"round) after {options.warmup} warm-up rounds; {IDLE_STEPS_TEXT}, one simulator "
            "(one prompt at a time), one worker. The bounded pool's job asks the pool's "
            "dispatcher for a slot once its first follow has checked it, and is granted at once "
            "(nothing else holds the pool).",
            "",
            "| pool | p50 ms | p95 ms | min | max |",
            "|---|---|---|---|---|",
            *(
                f"| {kind} | {fmt(percentile(v, 50))} | {fmt(percentile(v, 95))} | "
                f"{fmt(min(v))} | {fmt(max(v))} |"
                for kind, v in (("bounded", bounded), ("open", opened))
            ),
            "",
            f"- added by the bound: p50 {fmt(b50 - o50)} ms, p95 {fmt(b95 - o95)} ms",
            f"- round trips per job: bounded {tb.round_trips} ({tb.events} events), open "
            f"{to.round_trips} ({to.events} events)",
            "",
            "Where the bounded job's time goes (critical path, p50 over the jobs):",
            "",
            *shares_table(rows_b, b50),
            "",
            "The open job's:",
            "",
            *shares_table(rows_o, o50),
        ],
    )
    detail = Section(
        title="Queue 1: bounded minus open, by what the job waited on",
        lines=explained,
        console=False,
    )
    where = {"queue.idle_latency_p50": explained} if results[0].meets is False else {}
    return Outcome(results=results, sections=[section, detail], where=where)


IDLE_STEPS_TEXT = "10-step job at step delay 0"


# -- 2 ----------------------------------------------------------------------------------------


def _dispatcher_lines(queue: Dispatcher, jobs: int, what: str) -> list[str]:
    tasks = queue.trips.workflow_tasks
    each = percentile(queue.task_ms, 50) if queue.task_ms else float("nan")
    p95 = percentile(queue.task_ms, 95) if queue.task_ms else float("nan")
    return [
        f"The pool's dispatcher ({what}; its history, every run): {queue.trips.events} events "
        f"in {queue.trips.runs} run(s), {tasks} workflow tasks ({fmt(tasks / jobs)} per job), "
        f"each {fmt(each)} ms p50, {fmt(p95)} ms p95 from scheduled to completed; signals in: "
        + ", ".join(f"{k} x{v}" for k, v in queue.trips.signals.items())
        + "; events by type: "
        + ", ".join(f"{k} {v}" for k, v in queue.trips.by_type.items()),
    ]


def _runs_table(queue: Dispatcher) -> list[str]:
    """The dispatcher's runs: each continues as new past its history limit."""
    if not queue.runs:
        return []
    first = queue.runs[0].began
    return [
        "The dispatcher's runs (each continues as new past its history limit, carrying its "
        "holders and its line):",
        "",
        "| run | began (s) | lasted (s) | events | requests in | releases in | admission signals "
        "out | workflow tasks | tasks timed out / failed | last event |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {i} | {fmt(r.began - first)} | {fmt(r.ended - r.began)} | {r.trips.events} | "
            f"{r.trips.signals.get('request', 0)} | {r.trips.signals.get('release', 0)} | "
            f"{r.signals_out} | {r.trips.workflow_tasks} | {r.faults} | {r.last} |"
            for i, r in enumerate(queue.runs, 1)
        ),
    ]


def _rate(slots: int, run: RateRun, profiled: list[str]) -> Outcome:
    value = start_rate(run.starts, slots)
    throughput = run.jobs / run.open_wall
    open_starts = start_rate(run.open_starts, 0) if len(run.open_starts) > 1 else float("nan")
    prompt_ms = percentile(run.prompt_s, 50) * 1000 if run.prompt_s else float("nan")
    cycle_ms = slots / value * 1000
    times = sorted(run.starts)[slots - 1 :]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    longest = max(gaps, default=float("nan"))
    results = [
        result(
            "queue.start_rate",
            value,
            "starts/s",
            baseline=throughput,
            target=Target(metric="ratio", op=">=", limit=START_RATE_MIN),
        ),
        result("queue.drain_jobs_per_s", run.jobs / run.drain_wall, "jobs/s", baseline=throughput),
    ]
    table = cpu_table(
        {
            "bounded drain": (run.cpu, run.drain_wall, run.jobs),
            "open pool": (run.open_cpu, run.open_wall, run.jobs),
        }
    )
    lines = [
        f"{run.jobs} jobs ({STEPS} steps x {STEP_MS} ms) on a simulator running every prompt "
        f"at once; the bounded pool has max_running {slots}.",
        "",
        f"- **queue.start_rate** = (N - K) / (t[N] - t[K]) = {fmt(value)} starts/s: the {run.jobs} "
        "jobs' starts at the simulator (GET /sim/stats `started_at`, each job's prompt id from "
        f"its status), sorted; the first K = {slots} found a slot freed by a blocker at once, "
        f"each of the other {run.jobs - slots} a slot given back by a job of the batch; divided "
        "by the time from the K-th start to the last. Before the drain, blockers held the K "
        f"slots while the jobs were submitted at once and all {run.jobs} were in line "
        f"({fmt(run.fill_s)} s from the first submit to the dispatcher's `waiting` = "
        f"{run.jobs}).",
        f"- **baseline**: the open pool's throughput = N / wall = {run.jobs} / "
        f"{fmt(run.open_wall)} s = {fmt(throughput)} jobs/s: the same jobs submitted at once "
        "to an unbounded pool of the same simulator, wall from the first submit to the last "
        "`JobClient.wait` returned (its prompts reached the simulator at "
        f"{fmt(open_starts)} starts/s, (N - 1) / (last start - first start)).",
        f"- queue.drain_jobs_per_s: N / (blockers cancelled -> last wait returned) = "
        f"{run.jobs} / {fmt(run.drain_wall)} s.",
        f"- a slot's cycle: K / rate = {fmt(cycle_ms)} ms, of which the prompt at the simulator "
        f"{fmt(prompt_ms)} ms (p50): {fmt(cycle_ms - prompt_ms)} ms per job from its prompt's "
        "end to the next prompt's start on that slot (the job's outputs stored and its follow "
        "ended, its release signalled, the dispatcher's workflow task, the next job's follow "
        "seeing the grant among the queue's holders (it waits in line itself; a job waiting by "
        "itself: the grant signalled, its workflow task, its follow dispatched), socket and "
        "POST /prompt).",
        f"- between two starts of the drain: p50 {fmt(_p(gaps, 50) * 1000)} ms, p99 "
        f"{fmt(_p(gaps, 99) * 1000)} ms, longest {fmt(longest * 1000)} ms (a stall of the "
        "dispatcher, a workflow task timed out say, shows here).",
        "",
        *_dispatcher_lines(run.dispatcher, run.jobs + slots, "this measurement, blockers too"),
        "",
        *_runs_table(run.dispatcher),
        "",
        "CPU per job and cores, by process (from /proc, over the drain and the open run):",
        "",
        *table,
    ]
    where: dict[str, list[str]] = {}
    if results[0].meets is False:
        where["queue.start_rate"] = [*lines, "", *profiled]
    sections = [Section(title="Queue 2: the start rate from a full queue", lines=lines)]
    return Outcome(results=results, sections=sections, where=where)


# -- 3 ----------------------------------------------------------------------------------------


def _letters(order: Sequence[str], tenants: Sequence[str], count: int = 60) -> str:
    mark = {t: chr(ord("A") + i) for i, t in enumerate(tenants)}
    return "".join(mark.get(t, "?") for t in order[:count])


def _fair(runs: dict[str, FairRun]) -> Outcome:
    results: list[Result] = []
    lines: list[str] = [
        f"Two tenants, each run on a bounded pool of its own: each tenant's jobs submitted at "
        "once, the first tenant's all in before the second's (one after the other), behind "
        "blockers holding every slot; once all waited, the blockers were cancelled. Each "
        f"tenant's share of every window of {WINDOW} consecutive starts (the simulator's "
        "`started_at` order, prompt ids mapped to jobs by each job's status) while both "
        "tenants had jobs waiting (from the first start to the earlier of the two tenants' "
        "last starts), against its weight's share; the deviation is |share - weight share| in "
        "percentage points of the window. Baseline: the same windows over the order the jobs "
        "were submitted in (first come, first served: what ComfyUI's own queue, or ours "
        "without tenants, would start them in).",
        "",
        "| run | tenants (weight) | jobs each | contested starts | windows | share low / high "
        "| weight share | max deviation (pts) | FIFO's (pts) | drain s | first starts |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    where: dict[str, list[str]] = {}
    for label, run in runs.items():
        measured = window_shares(run.order, run.weights)
        fifo = window_shares(run.arrival, run.weights)
        name = f"queue.fair_{label}_max_deviation"
        row = result(
            name,
            measured.max_deviation,
            "pts",
            baseline=fifo.max_deviation,
            target=Target(limit=FAIR_DEVIATION_MAX),
        )
        results.append(row)
        tenants = list(run.weights)
        first = tenants[0]
        lines.append(
            f"| {label} | {', '.join(f'{t} ({fmt(w)})' for t, w in run.weights.items())} | "
            f"{run.jobs} | {measured.contested} | {measured.windows} (of {measured.window}) | "
            f"{first}: {fmt(100 * measured.low[first])} / {fmt(100 * measured.high[first])} % | "
            f"{fmt(100 * measured.expected[first])} % | {fmt(measured.max_deviation)} | "
            f"{fmt(fifo.max_deviation)} | {fmt(run.drain_wall)} | "
            f"`{_letters(run.order, tenants)}` |"
        )
        if row.meets is False:
            w = measured.worst_window or 0
            where[name] = [
                f"Run {label}: the worst window starts at start {w} ({measured.worst_tenant} "
                f"off its share by {fmt(measured.max_deviation)} points): "
                f"`{_letters(run.order[w : w + measured.window], tenants, measured.window)}` "
                f"(A = {tenants[0]}, B = {tenants[1]}); the first starts: "
                f"`{_letters(run.order, tenants, 200)}`",
            ]
    lines += [
        "",
        "First starts: A = the first tenant to submit, B = the second.",
    ]
    sections = [Section(title="Queue 3: tenants' fair shares", lines=lines)]
    return Outcome(results=results, sections=sections, where=where)


# -- 4 ----------------------------------------------------------------------------------------


def _priority(slots: int, run: PriorityRun) -> Outcome:
    started = run.started_at
    urgent, control = run.urgent.job_id, run.control.job_id
    if urgent not in started or control not in started:
        raise ValueError("the priority run's jobs have no start at the simulator")
    between = starts_between(started, urgent, run.urgent.at)
    control_between = starts_between(started, control, run.control.at)
    freed_end = run.ended_at.get(run.freed.job_id)
    start = started[urgent]
    released, granted = run.released_at, run.granted_at
    handover = (start - released) * 1000 if released is not None else float("nan")

    def ms(later: float | None, earlier: float | None) -> str:
        return "-" if later is None or earlier is None else fmt((later - earlier) * 1000)

    name = "queue.priority_starts_between"
    results = [
        result(
            name,
            len(between),
            "jobs",
            baseline=len(control_between),
            target=Target(limit=PRIORITY_BETWEEN_MAX),
        ),
        result("queue.priority_slot_handover", handover, "ms"),
    ]
    lines = [
        f"{run.behind} jobs (priority 3) waited behind {slots} blockers holding every slot; a "
        "priority-1 job was submitted, then at once a priority-3 one; once both waited in "
        f"line (places {run.urgent_position} and {run.control_position} of "
        f"{run.behind + 2}), ONE blocker was cancelled: one slot released, the others still "
        "held until the next prompt started at the simulator, then the rest of the blockers "
        "went and all drained.",
        "",
        f"- **{name}** = the other jobs whose start at the simulator fell between the "
        f"priority-1 job's submission and its own start: {len(between)}; target "
        f"{PRIORITY_BETWEEN_MAX}: one slot was released in that time, and the job must take "
        "it (it starts at the next free slot).",
        f"- baseline: the priority-3 job submitted right after it: {len(control_between)} "
        "others started between its submission and its start (it waited its turn).",
        f"- the first job to start at the simulator after the cancel: {run.next_holder} "
        f"({'the priority-1 job' if run.next_holder == urgent else 'NOT the priority-1 job'}).",
        f"- queue.priority_slot_handover: the freed blocker's release signalled (its history) "
        f"-> the priority-1 job's prompt started at the simulator: {fmt(handover)} ms (release "
        f"-> grant received {ms(granted, released)} ms, grant -> prompt started "
        f"{ms(start, granted)} ms; '-': its follow waited in line and saw the grant among the "
        "queue's holders, which no history records). Before it, from the blocker's prompt "
        "ended (interrupted) to "
        f"its release: {ms(released, freed_end)} ms, its stop confirming the prompt gone; from "
        f"the cancel sent to the prompt ended {ms(freed_end, run.freed_at)} ms.",
    ]
    where: dict[str, list[str]] = {}
    if results[0].meets is False:
        where[name] = [
            *lines,
            "",
            "Started between (job, priority, s after the priority-1 job's submission):",
            *(
                f"- {j} priority {run.priority_of.get(j, '?')} +{fmt(started[j] - run.urgent.at)} s"
                for j in between[:20]
            ),
        ]
    began = run.timeline[0][0] if run.timeline else 0.0
    timeline = [
        "From the blocker's cancel to the priority-1 job's start (the two jobs' history events "
        "and the simulator's marks; an activity's start is written when it ends):",
        "",
        "| ms after the cancel | what |",
        "|---|---|",
        *(f"| {fmt((at - began) * 1000)} | {what} |" for at, what in run.timeline),
    ]
    if name in where:
        where[name] += ["", *timeline]
    sections = [
        Section(title="Queue 4: a priority-1 job behind a full queue", lines=lines),
        Section(title="Queue 4: the freed slot's handover", lines=timeline, console=False),
    ]
    return Outcome(results=results, sections=sections, where=where)


# -- 5 ----------------------------------------------------------------------------------------


def _mean_by_type(trips: Sequence[RoundTrips]) -> dict[str, float]:
    kinds = {k for t in trips for k in t.by_type}
    return {k: sum(t.by_type.get(k, 0) for t in trips) / len(trips) for k in kinds}


def _backlog(slots: int, run: BacklogRun, step_ms: int) -> Outcome:
    bounded, opened = run.bounded, run.open
    own = [t.events for t in bounded.own]
    open_own = sum(t.events for t in opened.own) / len(opened.own)
    # Given up: the dispatcher's events so far over every job submitted (a lower bound).
    per_job = events_per_job(own, run.dispatcher.trips.events, run.jobs)
    own_mean = sum(own) / len(own)
    share = run.dispatcher.trips.events / run.jobs
    results = [
        result(
            "queue.backlog_rss_mb",
            bounded.rss_peak / 1e6,
            "MB",
            baseline=opened.rss_peak / 1e6,
            target=Target(limit=RSS_MAX_MB),
        ),
        result("queue.backlog_events_per_job", per_job, "events", baseline=open_own),
        result(
            "queue.backlog_added_events_per_job",
            per_job - open_own,
            "events",
            target=Target(limit=ADDED_EVENTS_MAX),
        ),
        result(
            "queue.backlog_seconds",
            bounded.wall,
            "s",
            baseline=opened.wall,
            target=Target(metric="ratio", op="<=", limit=BACKLOG_RATIO_MAX),
        ),
    ]
    unfinished = (
        []
        if bounded.finished
        else [
            f"**The bounded backlog did not finish**: {bounded.ended} of {run.jobs} jobs had "
            f"ended when it was given up, {fmt(bounded.wall)} s after the first submit (it is "
            f"given 3x the open side's {fmt(opened.wall)} s + 120 s). Its figures are lower "
            "bounds: its time, and the dispatcher's events so far over every job submitted. "
            f"What the first jobs still running and the queue said: {bounded.stuck}",
            "",
        ]
    )
    b_types, o_types = _mean_by_type(bounded.own), _mean_by_type(opened.own)
    diff = sorted(
        ((k, b_types.get(k, 0.0) - o_types.get(k, 0.0)) for k in {*b_types, *o_types}),
        key=lambda kv: -abs(kv[1]),
    )
    d_types = run.dispatcher.trips.by_type
    events_lines = [
        *unfinished,
        f"History events per job: bounded {fmt(per_job)} = its own history {fmt(own_mean)} "
        f"(mean of {len(own)} jobs spread over the batch; min {min(own)}, max {max(own)}) + its "
        f"share of the dispatcher's {run.dispatcher.trips.events} events ({fmt(share)} per job, "
        f"{run.dispatcher.trips.runs} runs); open {fmt(open_own)} (mean of {len(opened.own)}): "
        f"{fmt(per_job - open_own)} more per job.",
        "",
        "The job's own history, bounded minus open, mean events per job by type:",
        "",
        "| event type | bounded | open | bounded - open |",
        "|---|---|---|---|",
        *(
            f"| {k} | {fmt(b_types.get(k, 0.0))} | {fmt(o_types.get(k, 0.0))} | {fmt(d)} |"
            for k, d in diff
            if abs(d) >= 0.005
        ),
        "",
        "The dispatcher's events per job by type:",
        "",
        "| event type | per job |",
        "|---|---|",
        *(f"| {k} | {fmt(v / run.jobs)} |" for k, v in d_types.items()),
        "",
        "The bounded job's own signals (mean per job): "
        + ", ".join(
            f"{k} {fmt(sum(t.signals.get(k, 0) for t in bounded.own) / len(bounded.own))}"
            for k in sorted({k for t in bounded.own for k in t.signals})
        ),
        "",
        *_runs_table(run.dispatcher),
    ]
    table = cpu_table(
        {
            "bounded": (bounded.cpu, bounded.wall, max(bounded.ended, 1)),
            "open": (opened.cpu, opened.wall, run.jobs),
        }
    )
    time_lines = [
        *unfinished,
        f"{run.jobs} jobs ({STEPS} steps x {step_ms} ms) submitted at once, first to the open "
        "pool, then to the bounded one; wall from the first submit to the last `JobClient.wait` "
        f"returned. The simulator runs {slots} prompts at once: the open pool's prompts wait in "
        f"its own queue (it held {opened.peak} at most), the bounded pool's in our queue (the "
        f"simulator held {bounded.peak} at most; the dispatcher's line was "
        f"{bounded.most_waiting} long at most, asked every 10 s).",
        "",
        f"- bounded {fmt(bounded.wall)} s ({fmt(bounded.ended / bounded.wall)} jobs/s, "
        f"{bounded.ended} ended), open {fmt(opened.wall)} s ({fmt(run.jobs / opened.wall)} "
        f"jobs/s): {fmt(bounded.wall / opened.wall)}x",
        f"- worker RSS: {fmt(run.rss_idle / 1e6)} MB after the runs before the backlog; each "
        f"side on a fresh worker process: open {fmt(opened.rss_before / 1e6)} MB before, peak "
        f"{fmt(opened.rss_peak / 1e6)} MB; bounded {fmt(bounded.rss_before / 1e6)} MB before, "
        f"peak {fmt(bounded.rss_peak / 1e6)} MB "
        f"(VmRSS every 0.25 s, {opened.rss_samples} and {bounded.rss_samples} samples); the "
        f"peak came {fmt(opened.rss_peak_at_s)} s and {fmt(bounded.rss_peak_at_s)} s after the "
        f"first submit, the submissions having taken {fmt(opened.submitted_in_s)} s and "
        f"{fmt(bounded.submitted_in_s)} s",
        "",
        *_dispatcher_lines(run.dispatcher, run.jobs, "the bounded backlog"),
        "",
        *_runs_table(run.dispatcher),
        "",
        "CPU per job (bounded: per job ended) and cores, by process:",
        "",
        *table,
    ]
    where: dict[str, list[str]] = {}
    if results[0].meets is False:
        where["queue.backlog_rss_mb"] = time_lines
    if results[2].meets is False:
        where["queue.backlog_added_events_per_job"] = events_lines
    if results[3].meets is False:
        where["queue.backlog_seconds"] = time_lines
    sections = [
        Section(title="Queue 5: a backlog, open and bounded", lines=time_lines),
        Section(title="Queue 5: history events per job", lines=events_lines),
    ]
    return Outcome(results=results, sections=sections, where=where)


# -- the bound --------------------------------------------------------------------------------


def _bound(slots: int, runs: Runs) -> Outcome:
    peaks: dict[str, int] = {}
    opened: dict[str, int] = {}
    if runs.rate is not None:
        peaks["start rate (bounded, blockers included)"] = runs.rate.peak
        opened["start rate (open)"] = runs.rate.open_peak
    for label, fair_run in runs.fair.items():
        peaks[f"fairness {label}"] = fair_run.peak
    if runs.priority is not None:
        peaks["priority"] = runs.priority.peak
    if runs.backlog is not None:
        peaks["backlog (bounded)"] = runs.backlog.bounded.peak
        opened[f"backlog (open; the simulator runs {slots} at once)"] = runs.backlog.open.peak
    if not peaks:
        return Outcome(results=[])
    name = "queue.peak_prompts"
    results = [
        result(
            name,
            max(peaks.values()),
            "prompts",
            baseline=runs.rate.open_peak if runs.rate is not None else None,
            target=Target(limit=slots),
        )
    ]
    lines = [
        f"The most prompts the simulator held at once (queued + running, its `peak_in_queue`, "
        f"reset before each run) in every bounded run, against max_running {slots}; baseline: "
        "the open pool's in the start-rate run.",
        "",
        "| run | peak |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in peaks.items()),
        *(f"| {k} | {v} |" for k, v in opened.items()),
    ]
    where = {name: lines} if results[0].meets is False else {}
    return Outcome(
        results=results,
        sections=[Section(title="Queue: the bound at the simulator", lines=lines)],
        where=where,
    )


BENCHMARK = Benchmark(name="queue", group=10, title="Our queue", run=run, timeout_s=3600.0)
