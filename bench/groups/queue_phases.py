"""The queue group's five measurements (bench/groups/queue.py renders them): each runs on the
rig's worker and simulators and hands back what it saw, nothing judged yet.

A full queue is made the same way each time: `max_running` blockers (long prompts) hold every
slot of the pool, the measured jobs are submitted at once and the pool's dispatcher is asked
(query `queue`) until all of them wait in its line; then the blockers are cancelled (their
prompts interrupted, their slots given back) and the line drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from temporalio.api.history.v1 import HistoryEvent

from bench.groups.queue_rig import (
    BACKLOG_BOUNDED,
    BACKLOG_OPEN,
    IDLE_BOUNDED,
    IDLE_OPEN,
    PRIORITY,
    RATE_BOUNDED,
    RATE_OPEN,
    Rig,
    Submitted,
    drain_timeout_s,
    ends_of,
    fill_timeout_s,
    job_request,
    starts_of,
    until,
)
from bench.histories import (
    RoundTrips,
    Step,
    critical_path,
    event_time,
    event_type,
    job_history,
    labels,
    round_trips,
)
from bench.jobs import BenchFailure, completed
from bench.load import CpuUse
from bench.outcome import BenchOptions
from bench.procs import RssSampler, rss_bytes
from bench.profile import profile_lines, record
from bench.queue_math import spread_sample
from workflows import shared

# Group 1 (overhead)'s job: 10 steps at step delay 0.
IDLE_STEPS = 10
# Jobs whose history is read in the backlog (spread over the batch: the first, the last, and
# evenly between), on each side.
HISTORY_SAMPLE = 200
# How often the backlog's dispatcher is asked how many wait (its largest line).
VIEW_EVERY_S = 10.0
# The bounded backlog is given this many times the open one's time (plus the margin): far past
# its target (1.1x), so a figure still comes out when it is much slower.
GIVE_UP_FACTOR = 3.0
GIVE_UP_MARGIN_S = 120.0


def _pids(rig: Rig, pool: str) -> dict[str, int | None]:
    return {
        "Temporal server": rig.ctx.temporal_pid,
        "S3 (SeaweedFS)": rig.ctx.s3_pid,
        "worker": rig.worker.pid,
        "simulator": rig.pool_sims[pool].record.pid,
    }


# -- 1. an idle bounded pool ------------------------------------------------------------------


@dataclass
class IdleRun:
    # kind ("bounded" | "open") -> each measured job: (job_id, submitted at, wait returned at)
    samples: dict[str, list[tuple[str, float, float]]] = field(default_factory=dict)
    paths: dict[str, list[list[Step]]] = field(default_factory=dict)
    trips: dict[str, list[RoundTrips]] = field(default_factory=dict)

    def ms(self, kind: str) -> list[float]:
        return [(ended - began) * 1000 for _, began, ended in self.samples[kind]]


async def idle(rig: Rig, options: BenchOptions) -> IdleRun:
    """One job at a time, bounded and open alternating (the first of each round swaps), on one
    simulator at step delay 0; every measured job's history read afterwards."""
    run = IdleRun(samples={"bounded": [], "open": []})
    pools = {"bounded": IDLE_BOUNDED, "open": IDLE_OPEN}
    for round_no in range(options.warmup + options.n):
        kinds = ("bounded", "open") if round_no % 2 == 0 else ("open", "bounded")
        for kind in kinds:
            began = time.time()
            status = await rig.jobs.submit(job_request(pools[kind], steps=IDLE_STEPS))
            completed(await rig.jobs.wait(status.job_id))
            ended = time.time()
            if round_no >= options.warmup:
                run.samples[kind].append((status.job_id, began, ended))
    for kind, samples in run.samples.items():
        run.paths[kind], run.trips[kind] = [], []
        for job_id, began, ended in samples:
            events = await job_history(rig.ctx.temporal, job_id)
            run.paths[kind].append(critical_path(events, began, [("client: wait returned", ended)]))
            run.trips[kind].append(round_trips(events))
    return run


# -- 2. the start rate from a full queue ------------------------------------------------------


@dataclass
class DispatcherRun:
    """One run of the dispatcher (it continues as new past `HISTORY_LIMIT` events)."""

    began: float  # epoch s: its first event
    ended: float  # its last event
    trips: RoundTrips
    signals_out: int  # `admission` signals sent (grants and places in line)
    last: str  # its last event's type (WORKFLOW_EXECUTION_CONTINUED_AS_NEW, ...)

    @property
    def faults(self) -> int:
        """Workflow tasks that timed out or failed."""
        types = self.trips.by_type
        return types.get("WORKFLOW_TASK_TIMED_OUT", 0) + types.get("WORKFLOW_TASK_FAILED", 0)


@dataclass
class Dispatcher:
    """The dispatcher's history over a measurement (every run of it)."""

    trips: RoundTrips
    task_ms: list[float]  # each workflow task, scheduled -> completed
    runs: list[DispatcherRun] = field(default_factory=list)  # oldest first


def _task_ms(events: list[HistoryEvent]) -> list[float]:
    scheduled: float | None = None
    out: list[float] = []
    for event in events:
        kind = event_type(event)
        if kind == "WORKFLOW_TASK_SCHEDULED":
            scheduled = event_time(event)
        elif kind == "WORKFLOW_TASK_COMPLETED" and scheduled is not None:
            out.append((event_time(event) - scheduled) * 1000)
            scheduled = None
    return out


async def dispatcher(rig: Rig, pool: str) -> Dispatcher:
    """Every run of the pool's dispatcher, newest back to its first."""
    runs: list[list[HistoryEvent]] = []
    run_id: str | None = None
    while True:
        handle = rig.ctx.temporal.get_workflow_handle(rig.queue_id(pool), run_id=run_id)
        events = list((await handle.fetch_history()).events)
        runs.insert(0, events)
        started = events[0].workflow_execution_started_event_attributes
        if not started.continued_execution_run_id:
            break
        run_id = started.continued_execution_run_id
    summaries = [
        DispatcherRun(
            began=event_time(run[0]),
            ended=event_time(run[-1]),
            trips=round_trips(run),
            signals_out=sum(
                1 for e in run if event_type(e) == "SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED"
            ),
            last=event_type(run[-1]),
        )
        for run in runs
    ]
    every = [e for run in runs for e in run]
    return Dispatcher(round_trips(every), _task_ms(every), summaries)


@dataclass
class RateRun:
    jobs: int
    open_wall: float  # first submit -> last job ended, the open pool
    open_starts: list[float]
    open_peak: int
    open_cpu: CpuUse
    fill_s: float  # first submit -> all waiting in line
    drain_wall: float  # blockers cancelled -> last job ended
    starts: list[float]  # the measured jobs' starts at the simulator
    prompt_s: list[float]  # each measured prompt's run at the simulator
    peak: int
    cpu: CpuUse
    dispatcher: Dispatcher


async def rate(rig: Rig, jobs: int) -> RateRun:
    """The same `jobs` jobs on the open pool (submitted at once, awaited), then on the bounded
    one from a full queue (blockers hold the slots until all wait, then are cancelled)."""
    if jobs <= rig.slots:
        raise BenchFailure(f"the start rate needs more jobs than slots ({jobs} <= {rig.slots})")
    await rig.reset(RATE_OPEN)
    open_cpu = CpuUse.start(_pids(rig, RATE_OPEN))
    began = time.perf_counter()
    submitted = await rig.submit([job_request(RATE_OPEN) for _ in range(jobs)])
    finals = await rig.wait([s.job_id for s in submitted], RATE_OPEN, drain_timeout_s(jobs))
    open_wall = time.perf_counter() - began
    open_cpu.stop()
    for status in finals.values():
        completed(status)
    open_stats = await rig.stats(RATE_OPEN)

    await rig.reset(RATE_BOUNDED)
    blockers = await rig.hold_slots(RATE_BOUNDED)
    began = time.perf_counter()
    submitted = await rig.submit([job_request(RATE_BOUNDED) for _ in range(jobs)])
    await rig.until_view(
        RATE_BOUNDED, lambda v: v.waiting >= jobs, fill_timeout_s(jobs), f"{jobs} waiting"
    )
    fill_s = time.perf_counter() - began
    cpu = CpuUse.start(_pids(rig, RATE_BOUNDED))
    freed = time.perf_counter()
    await rig.free_slots(blockers)
    bounded = await rig.wait([s.job_id for s in submitted], RATE_BOUNDED, drain_timeout_s(jobs))
    drain_wall = time.perf_counter() - freed
    cpu.stop()
    for status in bounded.values():
        completed(status)
    await rig.wait([b.job_id for b in blockers], RATE_BOUNDED, 120)
    stats = await rig.stats(RATE_BOUNDED)
    starts, ends = starts_of(stats, bounded), ends_of(stats, bounded)
    return RateRun(
        jobs=jobs,
        open_wall=open_wall,
        open_starts=list(starts_of(open_stats, finals).values()),
        open_peak=int(open_stats.get("peak_in_queue", 0)),
        open_cpu=open_cpu,
        fill_s=fill_s,
        drain_wall=drain_wall,
        starts=list(starts.values()),
        prompt_s=[ends[j] - starts[j] for j in starts if j in ends],
        peak=int(stats.get("peak_in_queue", 0)),
        cpu=cpu,
        dispatcher=await dispatcher(rig, RATE_BOUNDED),
    )


async def profile_drain(rig: Rig, jobs: int) -> list[str]:
    """py-spy on the worker while a full queue of `jobs` drains (unmeasured: after the
    measured runs, for a missed target's "where the time goes")."""
    blockers = await rig.hold_slots(RATE_BOUNDED)
    submitted = await rig.submit([job_request(RATE_BOUNDED) for _ in range(jobs)])
    await rig.until_view(
        RATE_BOUNDED, lambda v: v.waiting >= jobs, fill_timeout_s(jobs), "waiting (profile)"
    )
    out = rig.ctx.work_dir / "profiles" / "queue-worker.txt"
    recording = asyncio.create_task(record(rig.worker.pid, 8.0, out))
    await rig.free_slots(blockers)
    await rig.wait([s.job_id for s in submitted], RATE_BOUNDED, drain_timeout_s(jobs))
    await rig.wait([b.job_id for b in blockers], RATE_BOUNDED, 120)
    return profile_lines(
        await recording, f"the worker, first 8 s of an unmeasured drain of {jobs} jobs"
    )


# -- 3. tenants' fair shares ------------------------------------------------------------------


@dataclass
class FairRun:
    pool: str
    weights: dict[str, float]  # the tenants, in the order they submitted
    jobs: int  # each tenant's
    order: list[str]  # each start's tenant, in the simulator's start order
    arrival: list[str]  # each job's tenant, in the order they were submitted
    peak: int
    drain_wall: float


async def fair(rig: Rig, pool: str, weights: dict[str, float], jobs: int) -> FairRun:
    """Each tenant's `jobs` submitted one tenant after the other (the first tenant's all in,
    then the second's) behind blockers; once all wait, the blockers go and the line drains."""
    await rig.reset(pool)
    blockers = await rig.hold_slots(pool)
    submitted: list[Submitted] = []
    for tenant in weights:
        submitted += await rig.submit([job_request(pool, tenant=tenant) for _ in range(jobs)])
    total = len(submitted)
    await rig.until_view(pool, lambda v: v.waiting >= total, fill_timeout_s(total), "all waiting")
    freed = time.perf_counter()
    await rig.free_slots(blockers)
    finals = await rig.wait([s.job_id for s in submitted], pool, drain_timeout_s(total))
    drain_wall = time.perf_counter() - freed
    for status in finals.values():
        completed(status)
    await rig.wait([b.job_id for b in blockers], pool, 120)
    stats = await rig.stats(pool)
    starts = starts_of(stats, finals)
    tenant_of = {s.job_id: s.tenant for s in submitted}
    return FairRun(
        pool=pool,
        weights=weights,
        jobs=jobs,
        order=[tenant_of[j] for j in sorted(starts, key=lambda j: starts[j])],
        arrival=[s.tenant for s in sorted(submitted, key=lambda s: s.at)],
        peak=int(stats.get("peak_in_queue", 0)),
        drain_wall=drain_wall,
    )


# -- 4. a priority-1 job behind a full queue --------------------------------------------------


@dataclass
class PriorityRun:
    behind: int  # jobs waiting (priority 3) when the two were submitted
    urgent: Submitted  # priority 1
    control: Submitted  # priority 3, submitted right after it
    urgent_position: int | None  # its place in line as it waited (1 = next)
    control_position: int | None
    freed: Submitted  # the blocker whose slot was freed first
    freed_at: float  # epoch s: its cancel sent
    started_at: dict[str, float]  # job_id -> start at the simulator, every job of the run
    ended_at: dict[str, float]
    priority_of: dict[str, int]
    next_holder: str | None  # the first job to start at the simulator after the cancel
    peak: int
    # From the freed blocker's cancel to the priority-1 job's start: (epoch s, what), the two
    # jobs' history events and the simulator's marks.
    timeline: list[tuple[float, str]] = field(default_factory=list)
    released_at: float | None = None  # the freed blocker's release signalled (its history)
    granted_at: float | None = None  # the priority-1 job's grant received (its history)


async def priority(rig: Rig, behind: int) -> PriorityRun:
    """`behind` jobs wait (priority 3) behind blockers; a priority-1 job and then a priority-3
    one are submitted; once both wait, ONE blocker is cancelled (one slot released); once the
    next prompt has started at the simulator, the other blockers go and everything drains."""
    await rig.reset(PRIORITY)
    blockers = await rig.hold_slots(PRIORITY)
    waiting = await rig.submit([job_request(PRIORITY) for _ in range(behind)])
    await rig.until_view(
        PRIORITY, lambda v: v.waiting >= behind, fill_timeout_s(behind), f"{behind} waiting"
    )
    [urgent] = await rig.submit([job_request(PRIORITY, priority=1)])
    [control] = await rig.submit([job_request(PRIORITY, priority=3)])
    view = await rig.until_view(
        PRIORITY, lambda v: v.waiting >= behind + 2, 120, "the priority-1 and -3 jobs waiting"
    )
    position = {e.job_id: e.position for e in view.entries if e.state == "waiting"}
    freed_at = await rig.free_slots(blockers[:1])

    async def prompts_started() -> int:
        return len((await rig.stats(PRIORITY)).get("started_at", {}))

    # The freed slot is taken once one more prompt than the blockers' has started (the
    # simulator's word, not the dispatcher's: a query may be answered late, or the job may
    # have come and gone between two looks); the other blockers go after it.
    await until(prompts_started, lambda n: n > len(blockers), 300, "the freed slot's next start")
    await rig.free_slots(blockers[1:])
    everyone = [*waiting, urgent, control]
    finals = await rig.wait([s.job_id for s in everyone], PRIORITY, drain_timeout_s(behind))
    for status in finals.values():
        completed(status)
    finals |= await rig.wait([b.job_id for b in blockers], PRIORITY, 120)
    stats = await rig.stats(PRIORITY)
    started = starts_of(stats, finals)
    blocked = {b.job_id for b in blockers}
    after = sorted((at, j) for j, at in started.items() if j not in blocked and at > freed_at)
    run = PriorityRun(
        behind=behind,
        urgent=urgent,
        control=control,
        urgent_position=position.get(urgent.job_id),
        control_position=position.get(control.job_id),
        freed=blockers[0],
        freed_at=freed_at,
        started_at=started,
        ended_at=ends_of(stats, finals),
        priority_of={s.job_id: s.priority for s in everyone},
        next_holder=after[0][1] if after else None,
        peak=int(stats.get("peak_in_queue", 0)),
    )
    await _handover(rig, run)
    return run


async def _handover(rig: Rig, run: PriorityRun) -> None:
    """What happened between the blocker's cancel and the priority-1 job's start: the
    timeline, the blocker's release signalled (its first signal out after the cancel) and the
    priority-1 job's grant received (its last `admission` signal before its start)."""
    start = run.started_at.get(run.urgent.job_id)
    marks = [(run.freed_at, "client: the blocker's cancel sent")]
    if run.freed.job_id in run.ended_at:
        marks.append((run.ended_at[run.freed.job_id], "simulator: the blocker's prompt ended"))
    if start is not None:
        marks.append((start, "simulator: the priority-1 job's prompt started"))
    for who, job_id in (("blocker", run.freed.job_id), ("priority-1 job", run.urgent.job_id)):
        events = await job_history(rig.ctx.temporal, job_id)
        for event, label in zip(events, labels(events), strict=True):
            at = event_time(event)
            if at < run.freed_at:
                continue
            if who == "blocker" and run.released_at is None and label.startswith(SIGNAL_OUT):
                run.released_at = at
            if who != "blocker" and label == GRANT_IN and (start is None or at <= start):
                run.granted_at = at
            if start is None or at <= start + 1.0:
                marks.append((at, f"{who}: {label}"))
    run.timeline = sorted(marks)


SIGNAL_OUT = "SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED"
GRANT_IN = f"WORKFLOW_EXECUTION_SIGNALED {shared.SIGNAL_ADMISSION}"


# -- 5. a backlog -----------------------------------------------------------------------------


@dataclass
class BacklogSide:
    jobs: int
    ended: int  # how many had ended when the side ended (all, or fewer when given up)
    wall: float  # first submit -> last job ended (or -> given up)
    rss_before: int
    rss_peak: int
    rss_samples: int
    # When the peak came (s after the first submit, from the sample's index) and how many jobs
    # had been submitted by then: is the memory the submission burst's, or the line's?
    rss_peak_at_s: float
    submitted_in_s: float
    cpu: CpuUse
    peak: int  # the simulator's most prompts queued + running
    own: list[RoundTrips]  # the sampled jobs' own histories (of those that ended)
    most_waiting: int = 0  # the dispatcher's longest line seen (bounded side)
    stuck: str = ""  # given up: what the first jobs still running and the queue said

    @property
    def finished(self) -> bool:
        return self.ended == self.jobs


@dataclass
class BacklogRun:
    jobs: int
    rss_idle: int
    bounded: BacklogSide
    open: BacklogSide
    dispatcher: Dispatcher
    give_up_s: float  # how long the bounded side was given


async def _backlog_side(
    rig: Rig, pool: str, jobs: int, give_up_s: float, watch_line: bool
) -> BacklogSide:
    await rig.reset(pool)
    # Each side on a worker process of its own: its RSS is the backlog's, not the residue of
    # the runs before it (the open side's 2,000 follows grow the heap the bounded side would
    # inherit).
    await rig.fresh_worker()
    rss_before = rss_bytes(rig.worker.pid) or 0
    most = 0

    async def watch() -> None:
        nonlocal most
        while True:
            await asyncio.sleep(VIEW_EVERY_S)
            with contextlib.suppress(Exception):
                most = max(most, (await rig.view(pool)).waiting)

    watcher = asyncio.create_task(watch()) if watch_line else None
    try:
        async with RssSampler(rig.worker.pid) as rss:
            cpu = CpuUse.start(_pids(rig, pool))
            began = time.perf_counter()
            submitted = await rig.submit([job_request(pool) for _ in range(jobs)])
            submitted_in = time.perf_counter() - began
            ids = [s.job_id for s in submitted]
            finals = await rig.wait_some(ids, give_up_s)
            wall = time.perf_counter() - began
            cpu.stop()
            stuck = ""
            if len(finals) < jobs:
                left = [j for j in ids if j not in finals]
                stuck = await rig.stuck(pool, left)
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    for status in finals.values():
        completed(status)
    stats = await rig.stats(pool)
    own = [
        round_trips(await job_history(rig.ctx.temporal, job_id))
        for job_id in spread_sample([j for j in ids if j in finals], HISTORY_SAMPLE)
    ]
    return BacklogSide(
        jobs=jobs,
        ended=len(finals),
        wall=wall,
        rss_before=rss_before,
        rss_peak=rss.peak,
        rss_samples=len(rss.samples),
        rss_peak_at_s=rss.samples.index(rss.peak) * rss.interval_s if rss.samples else 0.0,
        submitted_in_s=submitted_in,
        cpu=cpu,
        peak=int(stats.get("peak_in_queue", 0)),
        own=own,
        most_waiting=most,
        stuck=stuck,
    )


async def backlog(rig: Rig, jobs: int) -> BacklogRun:
    """`jobs` jobs submitted at once to the open pool of a simulator running K prompts at once
    (its own queue holds the rest), then the same to the bounded pool of that simulator; the
    bounded side is given `GIVE_UP_FACTOR` times the open side's time (and a margin), and
    reports how far it got if that is not enough."""
    rss_idle = rss_bytes(rig.worker.pid) or 0
    limit = fill_timeout_s(jobs) + drain_timeout_s(jobs)
    opened = await _backlog_side(rig, BACKLOG_OPEN, jobs, limit, watch_line=False)
    if not opened.finished:
        raise BenchFailure(
            f"the open backlog: {opened.ended} of {jobs} ended in {opened.wall:.0f} s: "
            f"{opened.stuck}"
        )
    give_up = GIVE_UP_FACTOR * opened.wall + GIVE_UP_MARGIN_S
    bounded = await _backlog_side(rig, BACKLOG_BOUNDED, jobs, give_up, watch_line=True)
    queue = await dispatcher(rig, BACKLOG_BOUNDED)
    return BacklogRun(jobs, rss_idle, bounded, opened, queue, give_up)
