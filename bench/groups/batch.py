"""Group 11, batches: what submitting and reading a batch of jobs costs a client.

A worker of its own (`python worker.py`) on two simulators of its own: `batch_fast` (one
1-step prompt at step delay 0, many at once: the GPU side takes no time, so what is measured is
the client, Temporal and the worker), an open pool; and `batch_slow` (prompts minutes long), a
pool bounded to one prompt at a time (`max_running: 1`): the others wait in our queue, as a
batch waits for one GPU. `--batch-jobs` (1,000, a batch's most) jobs in each phase; each
phase's jobs all end (or are cancelled) before the next begins.

1. **Submitting**, three ways, one after the other, on `batch_fast`:
   - the baseline: `JobClient.start` in a loop, one after another, from one client, as a
     script without batches does (the target is judged against it: the batch <= 0.5x its time);
   - the same starts 32 at a time (`asyncio.gather` behind a semaphore), a fairer baseline
     (the batch itself starts its jobs `starter.batches.STARTS_AT_ONCE` at a time);
   - `JobClient.submit_batch(BatchRequest(request=..., count=N))`: until it returns (the batch
     recorded; its workflow starts the jobs, so "all started" is measured apart: until the
     visibility store counts every job).
   Where the batch's time goes comes from the client's Temporal calls (bench/calls.py).
2. **Reading**, `JobClient.batch_status` `--batch-reads` (50) times:
   - **while running**: a batch of N jobs on `batch_slow` (one running, the others PENDING in
     its queue), read once all of them are in the queue (its dispatcher's view): the default
     read (one query of the batch's workflow, and its unfinished jobs counted by state in
     Temporal's visibility store), then with `jobs=True` (each unfinished job's state, from
     one list call); then the batch is cancelled (`cancel_batch`) and awaited. (Not in the
     simulator's own queue: cancelling 1,000 prompts waiting there did not end in 11 minutes
     on 2 cores, each stop's check reading the whole queue; RESULTS.md, 2026-12-07.)
   - **after all ended**: the batch of phase 1 (COMPLETED), at once, then `REPLAYED_READS`
     times each after a restart of the worker (its workflow cache empty, as for a batch read a
     while after it ended: a read that needs the worker then replays the batch's history).
   Each read alternates with one of the baseline: `JobClient.status` of one job of the same
   batch (a waiting job while running, an ended one after). Target: the batch's p50 <= 200 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from temporalio.api.history.v1 import HistoryEvent

from bench.calls import Call, CallLog, task_id
from bench.histories import event_time, event_type, job_history
from bench.jobs import SUBMIT_ATTEMPTS, BenchFailure, request
from bench.load import CpuUse, cpu_table
from bench.outcome import Benchmark, BenchOptions, Outcome, Section
from bench.results import Result, Target, fmt, percentile, result
from bench.stack import BenchContext, BenchWorker, SimProcess, extra_sim, extra_worker
from starter import BatchRequest, JobClient, JobRequest
from starter.batches import STARTS_AT_ONCE, BatchSubmitted
from starter.errors import TemporalUnreachable
from workflows.batches import BatchState, BatchStatus
from workflows.contracts import JobState, JobStatus
from workflows.shared import QUERY_BATCH_STATUS, SIGNAL_BATCH_JOB_ENDED

FAST_POOL, SLOW_POOL = "batch_fast", "batch_slow"
STEPS = 1  # a measured job's sampler steps, at step delay 0
# The slow pool's prompts: 600 steps of 1 s (10 minutes), one at a time: the first runs
# through the reads, the others wait in the pool's queue behind it.
SLOW_STEPS = 600
SLOW_STEP_MS = 1000
# The fast simulator runs this many prompts at once (each takes a few ms: it never holds many).
FAST_PARALLEL = 64
SUBMIT_RATIO_MAX = 0.5  # the batch's submit time against the sequential loop's
READ_P50_MAX_MS = 200.0
WARMUP_JOBS = 10
# Reads of the ended batch each after a worker restart (a replay each; a restart takes ~2 s).
REPLAYED_READS = 5
# `JobClient.wait`s in flight at once (long polls; the dev server refuses about a thousand).
WAIT_AT_ONCE = 300
# After a phase's jobs ended: the worker's and the server's last work for them settles.
SETTLE_S = 3.0

T = TypeVar("T")


def drain_timeout_s(jobs: int) -> float:
    """How long `jobs` may take to end (generous: 2 a second)."""
    return 180 + jobs / 2


@dataclass(frozen=True)
class Attempt:
    began: float
    ended: float
    error: str | None = None


@dataclass
class SubmitRun:
    """One way of submitting N jobs: how long until every job was started, and until every
    job had ended."""

    label: str
    jobs: int
    seconds: float = 0.0
    drained_s: float = 0.0  # first submit -> every job ended
    # First submit -> every job started (the loops: `seconds`; a batch whose workflow starts
    # its jobs: until Temporal's visibility store counts all of them).
    started_s: float = 0.0
    windows: list[Window] = field(default_factory=list)  # each start (the loops)
    # The batch: each `submit_batch` call's bounds (epoch seconds, as its calls are logged) and
    # what it raised (None: it answered; the last one did).
    attempts: list[Attempt] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    cpu: CpuUse | None = None
    # Calls that raised (a start, a submit_batch, a wait), each sent again as a careful client
    # does: what it said, and after how long.
    errors: list[str] = field(default_factory=list)
    # The batch: what its workflow's history says of its submission (lines), and its events
    # once every job ended (what a query of the closed workflow replays).
    history: list[str] = field(default_factory=list)
    history_events: int = 0

    @property
    def per_s(self) -> float:
        return self.jobs / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Reads:
    """Timed reads of one batch, each followed by one of the baseline (a job's status)."""

    batch: list[float] = field(default_factory=list)  # seconds
    single: list[float] = field(default_factory=list)
    queries: list[float] = field(default_factory=list)  # the batch query's own seconds, per read
    listed: list[int] = field(default_factory=list)  # jobs shown with a live state, per read
    counts: dict[str, int] = field(default_factory=dict)  # the last read's
    state: str = ""
    cpu: CpuUse | None = None
    wall: float = 0.0
    # Reads that raised (kept in the timings with the time they took): what they said.
    errors: list[str] = field(default_factory=list)

    def ms(self, which: str, p: float) -> float:
        values = self.batch if which == "batch" else self.single
        return percentile(values, p) * 1000 if values else float("nan")


@dataclass
class Runs:
    jobs: int
    reads: int
    submits: dict[str, SubmitRun] = field(default_factory=dict)
    running: Reads | None = None
    running_jobs: Reads | None = None  # batch_status(jobs=True): each unfinished job listed
    ended: Reads | None = None  # read at once
    replayed: Reads | None = None  # read after the worker restarted (its cache empty)
    # The slow batch: until all its prompts were at the simulator; its cancel until it ended.
    slow_submit_s: float = 0.0
    slow_ready_s: float = 0.0  # submitted -> every job in the pool's queue
    slow_cancel_s: float = 0.0
    slow_final: dict[str, int] = field(default_factory=dict)
    slow_attempts: list[Attempt] = field(default_factory=list)  # its submit_batch calls
    slow_calls: list[Call] = field(default_factory=list)
    slow_history: list[str] = field(default_factory=list)
    slow_errors: list[str] = field(default_factory=list)
    # The ended batch's workflow as Temporal's record says, just before its reads.
    ended_workflow: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    failed: list[Section] = field(default_factory=list)

    def all_reads(self) -> list[tuple[str, Reads]]:
        """(result key, reads) of each read measurement that ran."""
        return [
            (key, reads)
            for key, reads in (
                ("running", self.running),
                ("running_jobs", self.running_jobs),
                ("ended", self.ended),
                ("ended_replayed", self.replayed),
            )
            if reads is not None and reads.batch
        ]

    async def measure(self, label: str, measurement: Awaitable[T]) -> T | None:
        """One measurement; one that fails is reported in a section of its own, and the
        others still run."""
        began = time.monotonic()
        try:
            return await measurement
        except Exception as exc:  # the other measurements' figures are worth keeping
            traceback.print_exc()
            self.failed.append(Section(title=f"Batch {label}: FAILED", lines=[f"`{exc!r}`"[:6000]]))
            return None
        finally:
            self.seconds[label] = time.monotonic() - began


# -- pure arithmetic (tests/tooling/test_bench_batch.py) ---------------------------------------


def submit_parts(calls: Sequence[Call], began: float, ended: float) -> list[tuple[str, float]]:
    """Where one `submit_batch` call's time went, from its Temporal calls (epoch seconds):
    the client's own checks before its first call, the calls before the batch's workflow
    started (the pools' room), that start, the jobs' starts, the `submitted` signal, and the
    status it returns (the batch's query, then the rest: its unfinished jobs from the
    visibility store). The parts add up to `ended - began`; [] without the calls to tell."""
    ordered = sorted(calls, key=lambda c: c.started)
    starts = [c for c in ordered if c.method == "start_workflow"]
    signals = [c for c in ordered if c.method.startswith("signal:")]
    if len(starts) < 2 or not signals:
        return []
    batch_start, job_starts = starts[0], starts[1:]
    last_job = max(c.ended for c in job_starts)
    signal = signals[-1]
    first_call = ordered[0].started
    queries = [c for c in ordered if c.method.startswith("query:") and c.started >= signal.ended]
    queried = queries[0].ended if queries else signal.ended
    return [
        ("the client's checks of every job (staged, fingerprinted, encoded)", first_call - began),
        ("the pools' room asked (query `room`)", batch_start.started - first_call),
        ("the batch's workflow started", batch_start.ended - batch_start.started),
        (
            f"the {len(job_starts)} jobs started ({STARTS_AT_ONCE} at a time)",
            last_job - batch_start.ended,
        ),
        ("`submitted` signalled", signal.ended - last_job),
        ("the status it returns: the batch's query (its worker answers)", queried - signal.ended),
        (
            "the status it returns: the rest (its unfinished jobs from the visibility store)",
            ended - queried,
        ),
    ]


@dataclass(frozen=True)
class Window:
    """One single start: the task that made it and its bounds (epoch seconds)."""

    task: int
    started: float
    ended: float

    @property
    def seconds(self) -> float:
        return self.ended - self.started


def per_start_parts(
    calls: Sequence[Call], windows: Sequence[Window]
) -> list[tuple[str, float, float]]:
    """One single start's parts, p50 and p95 in ms: each Temporal call's own time by method,
    and the rest: each start's time less its own calls' (made by its task within its bounds),
    the client's own work and its waits in the client (a lock, the event loop)."""
    if not windows:
        return []
    rows: list[tuple[str, float, float]] = []
    by_method: dict[str, list[float]] = {}
    for call in calls:
        by_method.setdefault(call.method, []).append(call.seconds * 1000)
    for method, values in sorted(by_method.items()):
        per = len(values) / len(windows)
        rows.append((f"call {method} (x{per:.3g} per start)", *_p5095(values)))
    rest = [
        1000
        * (
            w.seconds
            - sum(
                c.seconds
                for c in calls
                if c.task == w.task and w.started <= c.started and c.ended <= w.ended
            )
        )
        for w in windows
    ]
    rows.append(
        ("outside its calls: the client's own work and its waits in the client", *_p5095(rest))
    )
    return rows


@dataclass(frozen=True)
class Mark:
    """One event of a batch's workflow history that says what it waited on: a signal (its
    name), or a workflow task (`at`: its start; `waited`: scheduled -> started; `ran`: started
    -> its outcome, None while in flight; `outcome`: completed, failed, timed out)."""

    kind: str  # "signal" | "task"
    at: float  # epoch seconds
    name: str = ""
    waited: float = 0.0
    ran: float | None = None
    outcome: str = ""


_TASK_ENDS = {
    "WORKFLOW_TASK_COMPLETED": ("completed", "workflow_task_completed_event_attributes"),
    "WORKFLOW_TASK_FAILED": ("failed", "workflow_task_failed_event_attributes"),
    "WORKFLOW_TASK_TIMED_OUT": ("timed out", "workflow_task_timed_out_event_attributes"),
}


def history_marks(events: Sequence[HistoryEvent]) -> list[Mark]:
    times = {event.event_id: event_time(event) for event in events}
    ends: dict[int, tuple[str, float]] = {}  # started event id -> (outcome, when)
    unstarted: list[Mark] = []  # tasks that timed out before a worker took them
    for event in events:
        kind = event_type(event)
        if kind in _TASK_ENDS:
            outcome, field_name = _TASK_ENDS[kind]
            attributes = getattr(event, field_name)
            if attributes.started_event_id:
                ends[attributes.started_event_id] = (outcome, event_time(event))
            else:
                at = event_time(event)
                waited = at - times.get(attributes.scheduled_event_id, at)
                unstarted.append(Mark("task", at, waited=waited, outcome="timed out unstarted"))
    marks: list[Mark] = []
    for event in events:
        kind = event_type(event)
        if kind == "WORKFLOW_EXECUTION_SIGNALED":
            name = event.workflow_execution_signaled_event_attributes.signal_name
            marks.append(Mark("signal", event_time(event), name))
        elif kind == "WORKFLOW_TASK_STARTED":
            scheduled = event.workflow_task_started_event_attributes.scheduled_event_id
            at = event_time(event)
            outcome, ended = ends.get(event.event_id, ("", at))
            marks.append(
                Mark(
                    "task",
                    at,
                    waited=at - times.get(scheduled, at),
                    ran=ended - at if outcome else None,
                    outcome=outcome,
                )
            )
    return sorted([*marks, *unstarted], key=lambda m: m.at)


@dataclass
class During:
    """What a batch's workflow received and ran in a window: signals by name, and its workflow
    tasks (started in it)."""

    signals: Counter[str]
    tasks: list[Mark]

    @property
    def task_waits(self) -> list[float]:
        return [m.waited for m in self.tasks]


def during(marks: Sequence[Mark], start: float, end: float) -> During:
    inside = [m for m in marks if start <= m.at <= end]
    return During(
        signals=Counter(m.name for m in inside if m.kind == "signal"),
        tasks=[m for m in inside if m.kind == "task"],
    )


def _spread_ms(values: Sequence[float]) -> str:
    return f"p50 {fmt(percentile(values, 50) * 1000)} ms, max {fmt(max(values) * 1000)} ms"


def during_text(what: str, seen: During) -> str:
    ended = seen.signals.get(SIGNAL_BATCH_JOB_ENDED, 0)
    tasks = seen.tasks
    if not tasks:
        text = "no workflow task"
    else:
        text = (
            f"{len(tasks)} workflow tasks: each waited for the worker {_spread_ms(seen.task_waits)}"
        )
        ran = [m.ran for m in tasks if m.ran is not None]
        if ran:
            text += f", ran on it {_spread_ms(ran)}"
        outcomes = Counter(m.outcome or "in flight" for m in tasks if m.outcome != "completed")
        if outcomes:
            text += "; " + ", ".join(f"{count} {name}" for name, count in sorted(outcomes.items()))
    return f"{what}: {ended} `{SIGNAL_BATCH_JOB_ENDED}` signals (jobs that had ended) and {text}"


def _p5095(values: Sequence[float]) -> tuple[float, float]:
    return percentile(values, 50), percentile(values, 95)


# -- the stack's side -------------------------------------------------------------------------


def _pids(ctx: BenchContext, worker: BenchWorker, sim: SimProcess) -> dict[str, int | None]:
    return {
        "Temporal server": ctx.temporal_pid,
        "S3 (SeaweedFS)": ctx.s3_pid,
        "worker": worker.pid,
        "simulator": sim.record.pid,
    }


async def _wait_all(jobs: JobClient, job_ids: Sequence[str], timeout_s: float) -> None:
    """Every job ended COMPLETED (`WAIT_AT_ONCE` awaited at a time; a wait that raised is
    sent again)."""
    gate = asyncio.Semaphore(WAIT_AT_ONCE)
    ended: dict[str, JobStatus] = {}

    async def one(job_id: str) -> None:
        async with gate:
            while job_id not in ended:
                with contextlib.suppress(TemporalUnreachable):
                    ended[job_id] = await jobs.wait(job_id)

    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(one(j) for j in job_ids))
    left = [j for j in job_ids if j not in ended]
    if left:
        raise BenchFailure(f"{len(left)} of {len(job_ids)} jobs had not ended after {timeout_s} s")
    bad = Counter(s.state.value for s in ended.values() if s.state != JobState.COMPLETED)
    if bad:
        raise BenchFailure(f"jobs did not complete: {dict(bad)}")


async def _wait_batch(
    jobs: JobClient, batch_id: str, timeout_s: float, errors: list[str]
) -> BatchStatus:
    """`wait_batch` until the batch ended; one that raised (a query the busy worker did not
    answer in time) is noted in `errors` and called again."""
    deadline = time.monotonic() + timeout_s
    while True:
        began = time.monotonic()
        try:
            async with asyncio.timeout(max(1.0, deadline - began)):
                return await jobs.wait_batch(batch_id, interval_s=1.0)
        except TemporalUnreachable as exc:
            errors.append(f"`wait_batch` raised after {fmt(time.monotonic() - began)} s: {exc}")
        except TimeoutError:
            raise BenchFailure(f"batch {batch_id} had not ended after {timeout_s:.0f} s") from None
        if time.monotonic() > deadline:
            raise BenchFailure(f"batch {batch_id} had not ended after {timeout_s:.0f} s")
        await asyncio.sleep(1.0)


async def _start(jobs: JobClient, job_request: JobRequest, errors: list[str]) -> str:
    """`JobClient.start` under a job ID of our own, sent again while Temporal times out."""
    job_id = f"bench-{uuid.uuid4().hex}"
    for attempt in range(SUBMIT_ATTEMPTS):
        began = time.monotonic()
        try:
            return (await jobs.start(job_request, job_id=job_id)).job_id
        except TemporalUnreachable as exc:
            errors.append(f"a start raised after {fmt(time.monotonic() - began)} s: {exc}")
            if attempt + 1 == SUBMIT_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


async def _submit_batch(
    jobs: JobClient, batch: BatchRequest, attempts: list[Attempt]
) -> BatchSubmitted:
    """`submit_batch` under a batch ID of our own, sent again while it raises (Temporal timed
    out), as a careful client does: the same batch again starts only what is missing. Each
    call's bounds go into `attempts`."""
    batch_id = f"bench-batch-{uuid.uuid4().hex[:16]}"
    for attempt in range(SUBMIT_ATTEMPTS):
        began = time.time()
        try:
            submitted = await jobs.submit_batch(batch, batch_id=batch_id)
            attempts.append(Attempt(began, time.time()))
            return submitted
        except TemporalUnreachable as exc:
            attempts.append(Attempt(began, time.time(), str(exc)))
            if attempt + 1 == SUBMIT_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def attempt_calls(calls: Sequence[Call], attempt: Attempt) -> list[Call]:
    return [c for c in calls if attempt.began <= c.started <= attempt.ended]


def attempts_text(attempts: Sequence[Attempt], calls: Sequence[Call]) -> list[str]:
    """Each `submit_batch` call's parts (markdown), the ones that raised first."""
    lines: list[str] = []
    for number, attempt in enumerate(attempts, 1):
        seconds = attempt.ended - attempt.began
        mine = attempt_calls(calls, attempt)
        outcome = f"raised: {attempt.error}" if attempt.error else "answered"
        by_method = ", ".join(
            f"{m} x{c}" for m, c in sorted(Counter(c.method for c in mine).items())
        )
        lines += [
            f"Call {number} of `submit_batch` ({fmt(seconds)} s, {outcome}; its calls: "
            f"{by_method}):",
            "",
            "| part | s | share |",
            "|---|---|---|",
            *(
                f"| {name} | {fmt(s)} | {fmt(100 * s / seconds)} % |"
                for name, s in submit_parts(mine, attempt.began, attempt.ended)
            ),
            "",
        ]
    return lines


async def _history_lines(
    ctx: BenchContext, batch_id: str, calls: Sequence[Call], attempts: Sequence[Attempt]
) -> tuple[list[str], int]:
    """What the batch's workflow received while each `submit_batch` call ran, and while the
    status query it ends with waited for an answer; and its history's events now."""
    try:
        events = await job_history(ctx.temporal, batch_id)
    except Exception as exc:  # a figure's explanation must not fail the figure
        return [f"- the batch's history could not be read: {exc!r}"], 0
    marks = history_marks(events)
    query = f"query:{QUERY_BATCH_STATUS}"
    lines: list[str] = []
    for number, attempt in enumerate(attempts, 1):
        seen = during(marks, attempt.began, attempt.ended)
        lines.append(f"- {during_text(f'while call {number} ran, the batch received', seen)}")
        asked = [c for c in attempt_calls(calls, attempt) if c.method == query]
        if asked:
            last = asked[0]  # the status it returns (a resubmission's jobs' own come later)
            seen = during(marks, last.started, last.ended)
            what = f"while its status query waited ({fmt(last.seconds)} s)"
            lines.append(f"- {during_text(what, seen)}")
    tasks = [m for m in marks if m.kind == "task"]
    outcomes = ", ".join(
        f"{count} {name}"
        for name, count in sorted(Counter(m.outcome or "in flight" for m in tasks).items())
    )
    ran = [m.ran for m in tasks if m.ran is not None]
    longest = f"; the longest ran {fmt(max(ran) * 1000)} ms on the worker" if ran else ""
    lines.append(
        f"- its history when read: {len(events)} events, {len(tasks)} workflow tasks "
        f"({outcomes}){longest}; its workflow {await _workflow_status(ctx, batch_id)}"
    )
    return lines, len(events)


async def _replayed_reads(
    jobs: JobClient,
    log: CallLog,
    worker: BenchWorker,
    batch_id: str,
    job_id: str,
    warm: tuple[str, str],
) -> Reads:
    """`REPLAYED_READS` rounds of: the worker restarted (its workflow cache empty), warmed by
    reading another ended batch and job (its first workflow of each type costs it more than a
    replay), then one timed batch read and one timed job read, each a replay of its history."""
    out = Reads()
    warm_batch, warm_job = warm
    for _ in range(REPLAYED_READS):
        await worker.killable.terminate()
        await worker.killable.start()
        await _timed(lambda: jobs.batch_status(warm_batch), out.errors)
        await _timed(lambda: jobs.status(warm_job), out.errors)
        await _read_pair(jobs, log, lambda: jobs.batch_status(batch_id), job_id, out)
    return out


async def _read_pair(
    jobs: JobClient,
    log: CallLog,
    read_batch: Callable[[], Awaitable[BatchStatus]],
    job_id: str,
    out: Reads,
) -> None:
    """One timed batch read (its query's own time from the client's calls) and one timed read
    of a job's status, the baseline, into `out`."""
    log.clear()
    seconds, status = await _timed(read_batch, out.errors)
    out.batch.append(seconds)
    query = f"query:{QUERY_BATCH_STATUS}"
    out.queries += [c.seconds for c in log.calls if c.method == query]
    if status is not None:
        out.listed.append(unfinished_shown(status))
        out.counts = dict(status.counts)
        out.state = str(status.state)
    seconds, _ = await _timed(lambda: jobs.status(job_id), out.errors)
    out.single.append(seconds)


async def _workflow_status(ctx: BenchContext, workflow_id: str) -> str:
    """RUNNING, COMPLETED, ... as Temporal's record says."""
    try:
        status = (await ctx.temporal.get_workflow_handle(workflow_id).describe()).status
    except Exception as exc:  # said instead of failing the figure it explains
        return f"(not described: {exc!r})"
    return status.name if status is not None else "(no status)"


async def _loop(
    jobs: JobClient, log: CallLog, label: str, n: int, at_once: int, pids: dict[str, int | None]
) -> SubmitRun:
    """N single starts from one client, `at_once` in flight (1: one after another)."""
    run = SubmitRun(label, n)
    gate = asyncio.Semaphore(at_once)
    ids: list[str] = []

    async def one() -> None:
        async with gate:
            began = time.time()
            ids.append(await _start(jobs, request(STEPS, FAST_POOL), run.errors))
            run.windows.append(Window(task_id(), began, time.time()))

    log.clear()
    run.cpu = CpuUse.start(pids)
    began = time.perf_counter()
    if at_once == 1:
        for _ in range(n):
            await one()
    else:
        await asyncio.gather(*(one() for _ in range(n)))
    run.seconds = time.perf_counter() - began
    run.cpu.stop()
    run.calls = list(log.calls)
    await _wait_all(jobs, ids, drain_timeout_s(n))
    run.drained_s = time.perf_counter() - began
    return run


async def _batch(
    ctx: BenchContext, jobs: JobClient, log: CallLog, n: int, pids: dict[str, int | None]
) -> tuple[SubmitRun, str, list[str]]:
    run = SubmitRun("batch", n)
    batch = BatchRequest(request=request(STEPS, FAST_POOL), count=n)
    log.clear()
    run.cpu = CpuUse.start(pids)
    began = time.perf_counter()
    submitted = await _submit_batch(jobs, batch, run.attempts)
    run.seconds = time.perf_counter() - began
    run.cpu.stop()
    run.calls = list(log.calls)
    if len(submitted.job_ids) != n:
        raise BenchFailure(f"the batch has {len(submitted.job_ids)} of {n} jobs")
    await _all_started(jobs, submitted.batch_id, n, drain_timeout_s(n))
    run.started_s = time.perf_counter() - began
    final = await _wait_batch(jobs, submitted.batch_id, drain_timeout_s(n), run.errors)
    run.drained_s = time.perf_counter() - began
    if final.state != BatchState.COMPLETED or final.counts.get("COMPLETED", 0) != n:
        raise BenchFailure(f"the batch ended {final.state} with {final.counts}")
    run.history, run.history_events = await _history_lines(
        ctx, submitted.batch_id, run.calls, run.attempts
    )
    return run, submitted.batch_id, submitted.job_ids


async def _all_started(jobs: JobClient, batch_id: str, n: int, timeout_s: float) -> None:
    """Until Temporal's visibility store counts the batch's `n` jobs (running or ended)."""
    query = f'WorkflowId STARTS_WITH "{batch_id}-"'
    async with asyncio.timeout(timeout_s):
        while True:
            if (await jobs.temporal.count_workflows(query)).count >= n:
                return
            await asyncio.sleep(0.1)


async def _timed(read: Callable[[], Awaitable[T]], errors: list[str]) -> tuple[float, T | None]:
    """One read's seconds, and its answer (None: it raised, said in `errors`)."""
    began = time.perf_counter()
    try:
        answer = await read()
    except TemporalUnreachable as exc:
        seconds = time.perf_counter() - began
        errors.append(f"a read raised after {fmt(seconds)} s: {exc}")
        return seconds, None
    return time.perf_counter() - began, answer


async def _reads(
    jobs: JobClient,
    log: CallLog,
    batch_id: str,
    job_id: str,
    reads: int,
    pids: dict[str, int | None] | None,
    *,
    each_job: bool = False,
) -> Reads:
    """`reads` batch reads (`each_job`: `batch_status(jobs=True)`, each unfinished job's state
    listed), each followed by one read of one job's status (the baseline). A read that raised
    keeps its time in the figures and is said in `errors`."""
    out = Reads()

    async def read_batch() -> BatchStatus:
        return await jobs.batch_status(batch_id, jobs=each_job)

    # One of each unmeasured: connections and caches warm.
    await _timed(read_batch, out.errors)
    await _timed(lambda: jobs.status(job_id), out.errors)
    out.cpu = CpuUse.start(pids) if pids is not None else None
    began = time.perf_counter()
    for _ in range(reads):
        await _read_pair(jobs, log, read_batch, job_id, out)
    out.wall = time.perf_counter() - began
    if out.cpu is not None:
        out.cpu.stop()
    return out


def unfinished_shown(status: BatchStatus) -> int:
    """How many of the batch's unfinished jobs its status shows a state of (counted or listed)."""
    return sum(status.counts.values()) - status.ended


async def _slow_reads(
    ctx: BenchContext,
    jobs: JobClient,
    log: CallLog,
    sim: SimProcess,
    runs: Runs,
    pids: dict[str, int | None],
) -> None:
    """A batch on the slow pool, read while its jobs wait (`runs.running`, then with each job
    listed, `runs.running_jobs`); then cancelled and awaited (what the cancel met is said in
    `runs.slow_errors`, and does not lose the reads)."""
    n = runs.jobs
    log.clear()
    began = time.perf_counter()
    batch = BatchRequest(request=request(SLOW_STEPS, SLOW_POOL), count=n)
    submitted = await _submit_batch(jobs, batch, runs.slow_attempts)
    runs.slow_submit_s = time.perf_counter() - began
    runs.slow_calls = list(log.calls)
    runs.slow_history, _ = await _history_lines(
        ctx, submitted.batch_id, runs.slow_calls, runs.slow_attempts
    )
    try:

        async def in_line() -> int:
            view = await jobs.pool_queue(SLOW_POOL)
            return view.waiting + view.running

        await _until(in_line, lambda got: got >= n, 120 + n / 5, f"{n} jobs in the pool's queue")
        runs.slow_ready_s = time.perf_counter() - began
        await asyncio.sleep(SETTLE_S)
        # A job in the middle of the batch: waiting in the pool's queue throughout.
        job_id = submitted.job_ids[n // 2]
        runs.running = await _reads(jobs, log, submitted.batch_id, job_id, runs.reads, pids)
        runs.running_jobs = await _reads(
            jobs, log, submitted.batch_id, job_id, runs.reads, pids, each_job=True
        )
    finally:
        cancelled = time.perf_counter()
        try:
            await _cancel_batch(jobs, submitted.batch_id, runs.slow_errors)
            final = await _wait_batch(
                jobs, submitted.batch_id, drain_timeout_s(n), runs.slow_errors
            )
            runs.slow_final = dict(final.counts)
        except Exception as exc:  # the reads are worth keeping; the next phase is told
            runs.slow_errors.append(f"the cancel did not end the batch: {exc!r}")
        runs.slow_cancel_s = time.perf_counter() - cancelled


async def _cancel_batch(jobs: JobClient, batch_id: str, errors: list[str]) -> None:
    for attempt in range(SUBMIT_ATTEMPTS):
        began = time.monotonic()
        try:
            await jobs.cancel_batch(batch_id, "bench: reads done")
            return
        except TemporalUnreachable as exc:
            errors.append(f"`cancel_batch` raised after {fmt(time.monotonic() - began)} s: {exc}")
            if attempt + 1 == SUBMIT_ATTEMPTS:
                raise


async def _until(
    probe: Callable[[], Awaitable[T]], accept: Callable[[T], bool], timeout_s: float, what: str
) -> T:
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while True:
        try:
            last = await probe()
        except Exception:  # not there yet (its queue's dispatcher not started), or busy
            if time.monotonic() > deadline:
                raise
        else:
            if accept(last):
                return last
        if time.monotonic() > deadline:
            raise BenchFailure(f"{what}: not seen in {timeout_s:.0f} s (last {last!r})")
        await asyncio.sleep(0.5)


async def _warm_up(jobs: JobClient) -> tuple[str, str]:
    """A few single jobs and a small batch, unmeasured: the worker's and the client's first
    calls, imports and connections out of the way. The small batch's ID and one of its jobs'
    (read after a worker restart, before the measured reads, to warm the new worker)."""
    errors: list[str] = []
    ids = [await _start(jobs, request(STEPS, FAST_POOL), errors) for _ in range(WARMUP_JOBS)]
    await _wait_all(jobs, ids, 120)
    batch = BatchRequest(request=request(STEPS, FAST_POOL), count=WARMUP_JOBS)
    submitted = await _submit_batch(jobs, batch, [])
    await _wait_batch(jobs, submitted.batch_id, 120, errors)
    await jobs.batch_status(submitted.batch_id)
    return submitted.batch_id, submitted.job_ids[0]


async def run(ctx: BenchContext, options: BenchOptions) -> Outcome:
    n = options.batch_jobs
    runs = Runs(jobs=n, reads=options.batch_reads)
    async with (
        extra_sim(ctx, FAST_POOL, step_delay_ms=0, parallel=FAST_PARALLEL) as fast,
        extra_sim(ctx, SLOW_POOL, step_delay_ms=SLOW_STEP_MS) as slow,
        extra_worker(
            ctx,
            "batch",
            [fast.pool],
            # The slow batch's follows all at once (each waiting in line in the pool's queue).
            max_concurrent_activities=max(1000, n + 100),
            pool_settings={
                FAST_POOL: {"kind": "comfyui", "url": fast.pool.url},
                SLOW_POOL: {"kind": "comfyui", "url": slow.pool.url, "max_running": 1},
            },
        ) as worker,
    ):
        jobs, log = ctx.job_client(worker.task_queue)
        fast_pids = _pids(ctx, worker, fast)
        warm = await runs.measure("warm-up", _warm_up(jobs))
        for label, at_once in (("sequential", 1), (f"{STARTS_AT_ONCE} at once", STARTS_AT_ONCE)):
            done = await runs.measure(
                f"submit ({label})", _loop(jobs, log, label, n, at_once, fast_pids)
            )
            if done is not None:
                runs.submits[label] = done
            await asyncio.sleep(SETTLE_S)
        batched = await runs.measure("submit (batch)", _batch(ctx, jobs, log, n, fast_pids))
        if batched is not None:
            runs.submits["batch"] = batched[0]
        await asyncio.sleep(SETTLE_S)
        await runs.measure(
            "read (while running)",
            _slow_reads(ctx, jobs, log, slow, runs, _pids(ctx, worker, slow)),
        )
        await asyncio.sleep(SETTLE_S)
        if batched is not None:
            _, batch_id, job_ids = batched
            runs.ended_workflow = await _workflow_status(ctx, batch_id)
            runs.ended = await runs.measure(
                "read (after all ended)",
                _reads(jobs, log, batch_id, job_ids[n // 2], runs.reads, fast_pids),
            )
            # As a batch read a while after it ended is: its worker's cache no longer holds it.
            if warm is not None:
                runs.replayed = await runs.measure(
                    "read (after all ended, each after a worker restart)",
                    _replayed_reads(jobs, log, worker, batch_id, job_ids[n // 2], warm),
                )
    return _outcome(runs)


# -- the report -------------------------------------------------------------------------------


def _outcome(runs: Runs) -> Outcome:
    results: list[Result] = []
    sections: list[Section] = []
    where: dict[str, list[str]] = {}
    part = _submitting(runs)
    results += part.results
    sections += part.sections
    where |= part.where
    part = _reading(runs)
    results += part.results
    sections += part.sections
    where |= part.where
    sections += runs.failed
    sections.append(
        Section(
            title="Batch: time per measurement",
            lines=[
                "| measurement | s |",
                "|---|---|",
                *(f"| {label} | {fmt(s)} |" for label, s in runs.seconds.items()),
            ],
        )
    )
    return Outcome(results=results, sections=sections, where=where)


def _submitting(runs: Runs) -> Outcome:
    n = runs.jobs
    sequential = runs.submits.get("sequential")
    concurrent = runs.submits.get(f"{STARTS_AT_ONCE} at once")
    batch = runs.submits.get("batch")
    results: list[Result] = []
    where: dict[str, list[str]] = {}
    if batch is None:
        return Outcome(results=[])
    results.append(
        result(
            "batch.submit_s",
            batch.seconds,
            "s",
            baseline=sequential.seconds if sequential else None,
            target=Target(metric="ratio", op="<=", limit=SUBMIT_RATIO_MAX),
        )
    )
    results.append(
        result(
            "batch.submit_s_vs_concurrent",
            batch.seconds,
            "s",
            baseline=concurrent.seconds if concurrent else None,
        )
    )
    rows = [r for r in (sequential, concurrent, batch) if r is not None]
    lines = [
        f"{n} jobs of {STEPS} step at step delay 0 (pool `{FAST_POOL}`, open, its simulator "
        f"running up to {FAST_PARALLEL} prompts at once), from one client (`JobClient`), three "
        "ways one after the other, each phase's jobs all ended before the next. Submitted: "
        "until every job was started (the batch: until `submit_batch` returned, the batch "
        "recorded: its workflow starts the jobs, and all started is when Temporal's visibility "
        "store counted every one); ended: until every job had ended (the loops: their "
        f"`JobClient.wait`s, {WAIT_AT_ONCE} at a time; the batch: `wait_batch`, read each "
        "second). The target (the batch <= "
        f"{fmt(SUBMIT_RATIO_MAX)}x) is judged against the sequential loop, what a client does "
        f"without batches; the {STARTS_AT_ONCE}-at-once loop is the fairer baseline (the batch "
        f"starts its jobs {STARTS_AT_ONCE} at a time too).",
        "",
        "| way | submitted s | starts/s | the batch against it | all started s | ended s "
        "| Temporal calls |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        calls = ", ".join(
            f"{m} x{c}" for m, c in sorted(Counter(c.method for c in r.calls).items())
        )
        against = "-" if r is batch else f"{fmt(batch.seconds / r.seconds)}x"
        started = r.started_s or r.seconds
        lines.append(
            f"| {r.label} | {fmt(r.seconds)} | {fmt(r.per_s)} | {against} | {fmt(started)} "
            f"| {fmt(r.drained_s)} | {calls} |"
        )
    for loop in (sequential, concurrent):
        if loop is None or not loop.windows:
            continue
        each = [w.seconds * 1000 for w in loop.windows]
        lines += [
            "",
            f"One start of the {loop.label} loop (`JobClient.start`), p50 "
            f"{fmt(percentile(each, 50))} ms, p95 {fmt(percentile(each, 95))} ms:",
            "",
            "| part | p50 ms | p95 ms |",
            "|---|---|---|",
            *(
                f"| {name} | {fmt(p50)} | {fmt(p95)} |"
                for name, p50, p95 in per_start_parts(loop.calls, loop.windows)
            ),
        ]
    breakdown: list[str] = []
    if batch.attempts:
        first = attempt_calls(batch.calls, batch.attempts[0])
        job_starts = [c.seconds * 1000 for c in first if c.method == "start_workflow"][1:]
        breakdown = [
            f"`submit_batch` of {n} jobs: {fmt(batch.seconds)} s in all, by its Temporal calls "
            "(a call that raised was sent again under the same batch ID, as a careful client "
            "does):",
            "",
            *attempts_text(batch.attempts, batch.calls),
        ]
        if job_starts:
            breakdown.append(
                f"- each job's `start_workflow` in call 1 ({STARTS_AT_ONCE} in flight): p50 "
                f"{fmt(percentile(job_starts, 50))} ms, p95 "
                f"{fmt(percentile(job_starts, 95))} ms: "
                f"{fmt(STARTS_AT_ONCE / (percentile(job_starts, 50) / 1000))} starts/s at most"
            )
        breakdown += batch.history
        if sequential is not None:
            seq_starts = [
                c.seconds * 1000 for c in sequential.calls if c.method == "start_workflow"
            ]
            if seq_starts:
                breakdown.append(
                    "- the sequential loop's `start_workflow`: p50 "
                    f"{fmt(percentile(seq_starts, 50))} ms, p95 "
                    f"{fmt(percentile(seq_starts, 95))} ms (one in flight)"
                )
    cpu_phases = {
        r.label: (r.cpu, r.seconds, r.jobs) for r in rows if r.cpu is not None and r.seconds > 0
    }
    cpu_lines = [
        "CPU while submitting (until every job was started; the jobs run meanwhile), per job "
        "submitted:",
        "",
        *cpu_table(cpu_phases),
    ]
    raised = [f"- {r.label}: {e}" for r in rows for e in r.errors[:10]]
    raised += [
        f"- batch: `submit_batch` call {i} raised after {fmt(a.ended - a.began)} s: {a.error}"
        for i, a in enumerate(batch.attempts, 1)
        if a.error
    ]
    if raised:
        lines += [
            "",
            "Calls that raised (each sent again under the same ID; the time counts):",
            *raised,
        ]
    lines += ["", *breakdown, "", *cpu_lines]
    if results[0].meets is False:
        where["batch.submit_s"] = [*breakdown, "", *cpu_lines]
    sections = [Section(title=f"Batch: submitting {n} jobs", lines=lines)]
    return Outcome(results=results, sections=sections, where=where)


def _reading(runs: Runs) -> Outcome:
    results: list[Result] = []
    where: dict[str, list[str]] = {}
    n = runs.jobs
    lines = [
        f"`JobClient.batch_status` of a batch of {n} jobs, {runs.reads} reads, each followed by "
        "the baseline: `JobClient.status` of one job of the same batch (while running: a job "
        "waiting in the pool's queue, a query and a describe; after: an ended job). A read "
        "that raised keeps the time it took in the figures.",
        "",
        f"- `running`: a batch on pool `{SLOW_POOL}` (bounded to one prompt at a time, "
        f"{SLOW_STEPS} x {SLOW_STEP_MS} ms each; the others PENDING in its queue), read once all "
        f"{n} jobs were in the queue (submit_batch {fmt(runs.slow_submit_s)} s, all in the "
        f"queue {fmt(runs.slow_ready_s)} s after it began): `batch_status(batch_id)`, the "
        "default read (the batch's query, and its unfinished jobs counted by state in "
        "Temporal's visibility store);",
        "- `running_jobs`: the same batch, `batch_status(batch_id, jobs=True)` (each unfinished "
        "job's state and percent, from one list call); then the batch was cancelled "
        f"(`cancel_batch`) and ended {fmt(runs.slow_cancel_s)} s later: {runs.slow_final};",
        "- `ended`: the batch of the submitting phase once all its jobs ended (its workflow "
        f"{runs.ended_workflow or '-'}), read at once;",
        f"- `ended_replayed`: the same, {REPLAYED_READS} reads, each after a restart of the "
        "worker (its workflow cache empty, as for a batch read a while after it ended) and a "
        "read of another batch and job to warm it: a read that needs the worker then replays "
        "the batch's history there.",
        "",
        "| read | state | batch p50 ms | p95 | min | max | its query p50 ms | job status p50 ms "
        "| p95 | unfinished shown | counts (last read) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, reads in runs.all_reads():
        b50, b95 = reads.ms("batch", 50), reads.ms("batch", 95)
        s50, s95 = reads.ms("single", 50), reads.ms("single", 95)
        # The target is the default read's; the one listing every job is shown beside it.
        target = None if key == "running_jobs" else Target(limit=READ_P50_MAX_MS)
        results += [
            result(f"batch.status_{key}_p50", b50, "ms", baseline=s50, target=target),
            result(f"batch.status_{key}_p95", b95, "ms", baseline=s95),
        ]
        q50 = percentile(reads.queries, 50) * 1000 if reads.queries else float("nan")
        listed = f"{min(reads.listed)}..{max(reads.listed)}" if reads.listed else "-"
        lines.append(
            f"| {key} | {reads.state} | {fmt(b50)} | {fmt(b95)} | {fmt(min(reads.batch) * 1000)} "
            f"| {fmt(max(reads.batch) * 1000)} | {fmt(q50)} | {fmt(s50)} | {fmt(s95)} | {listed} "
            f"| {reads.counts} |"
        )
        if target is not None and b50 > READ_P50_MAX_MS:
            if key == "running":
                text = (
                    f"the rest (its {n} unfinished jobs counted by state in the visibility store, "
                    f"one count call per state at once) about {fmt(b50 - q50)} ms"
                )
            else:
                text = f"the rest (its ended record read) about {fmt(b50 - q50)} ms"
            where[f"batch.status_{key}_p50"] = [
                f"Reads of the batch ({key}): p50 {fmt(b50)} ms, of which its workflow's query "
                f"p50 {fmt(q50)} ms and {text}; one job's status: p50 {fmt(s50)} ms.",
            ]
    if runs.slow_attempts:
        lines += [
            "",
            f"The slow batch's `submit_batch` ({fmt(runs.slow_submit_s)} s in all; its jobs "
            "begin meanwhile, each taking its place in the pool's queue), by its Temporal "
            "calls:",
            "",
            *attempts_text(runs.slow_attempts, runs.slow_calls),
            *runs.slow_history,
        ]
    raised = [
        *(f"- while running: {e}" for e in (runs.running.errors if runs.running else [])),
        *(f"- after all ended: {e}" for e in (runs.ended.errors if runs.ended else [])),
        *(f"- the slow batch: {e}" for e in runs.slow_errors),
    ]
    if raised:
        lines += ["", "Calls that raised (a read that raised keeps its time in the figures):"]
        lines += raised[:30]
    cpu_phases = {
        f"reads ({key})": (reads.cpu, reads.wall, len(reads.batch))
        for key, reads in runs.all_reads()
        if reads is not None and reads.cpu is not None and reads.wall > 0 and reads.batch
    }
    if cpu_phases:
        lines += [
            "",
            'CPU while reading, per pair of reads ("job" below: one batch read and one job read):',
            "",
            *cpu_table(cpu_phases),
        ]
        for name in where:
            where[name] += ["", *cpu_table(cpu_phases)]
    sections = [Section(title=f"Batch: reading a batch of {n} jobs", lines=lines)]
    return Outcome(results=results, sections=sections, where=where)


BENCHMARK = Benchmark(name="batch", group=11, title="Batches", run=run, timeout_s=1800.0)
