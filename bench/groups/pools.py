"""Group 12, pools of many servers: spreading a batch over servers, and routing around a dead one.

A worker of its own (`python worker.py`, one process serving every pool below) on six
simulators of its own, each running one prompt at a time (`--parallel 1`, as ComfyUI does), at
`STEP_MS` (50 ms) a step. One worker serves both sides of each comparison so that they share
the same follow, offload and Temporal path on the same process (two workers on 2 cores would
compete for them); the sides run one after the other, never at once.

1. **Spread vs round-robin** on four simulators `pools_s1..s4`: `--pools-jobs` (24) jobs whose
   prompts run 1 to 5 s (20 to 100 steps of 50 ms, a fixed pseudo-random sequence,
   `job_steps`, the same list for both sides and every round), submitted at once:
   - **project**: all to one pool of the four servers (`{"kind": "comfyui", "urls": [...]}`):
     our queue gives each job the first server that frees (one job at a time per server);
   - **baseline**: the same jobs sent round-robin by the client to four single-server pools
     (`{"kind": "comfyui", "url": u_i}`, unbounded: each job waits in that server's own
     ComfyUI queue, as a client spreading by itself does).
   Each side: first submit -> the last job's `JobClient.wait` returned COMPLETED. The
   simulators' counters are reset before each side. `--pools-rounds` (3) rounds, the first
   side alternating; the figure is each side's median (`pools.spread_makespan_s`, target <=
   0.85x the round-robin's). Beside it, from the simulators' own start and end times: the
   gaps between one prompt's end and the next one's start on a server (`pools.handover_p50_s`:
   our queue's handover; ComfyUI's own queue has none) and, from the dispatcher's history,
   where a handover goes; and the arithmetic of the sequence (`first_free_makespan`,
   `round_robin_makespan`): what a dispatcher with no handover cost would give for the order
   the jobs really started in. Which of the two the job lengths favour decides how far below
   1 the ratio can go; that ideal ratio is printed with the measured one.
2. **Leaving an unhealthy server**, on a pool of two servers `pools_a`, `pools_b` (`urls`).
   In this design a job waits in our queue, not in a server's, and is never given a server
   its pool's health watch marked unhealthy: "waiting jobs leave a server that turned
   unhealthy" means the queue routes around it. Measured so: B is killed (SIGKILL by PID)
   while idle; the dispatcher's view (query `queue`, polled every `POLL_S`) is read until it
   shows B `unhealthy` (the dispatcher's own mark time is the server's `since`); then
   `HEALTH_JOBS` (4) jobs of one 50 ms step are submitted at once and wait in line for the one
   healthy server. `pools.unhealthy_route_s`: the dispatcher's unhealthy mark -> the last of
   those jobs started at A's simulator (every waiting job given the healthy server; target
   <= 5 s, the issue's "<= 5 s after its health check says so"; the jobs are one step long so
   the figure is the queue's, not the GPU's). Its baseline: the same jobs on a healthy pool of
   A alone (`urls: [A]`), submit -> last start, measured before the kill.
   `pools.unhealthy_detect_s`: kill -> the dispatcher's mark (the health watch's detection:
   `/queue` read every second, unhealthy after two failed reads; no target).
   `pools.jobs_given_unhealthy`: the jobs given B after the mark (target 0).
   Nothing is restarted: B stays dead until the group ends.

Everything the group started (the worker, the simulators) is stopped by PID when it ends, also
after a failure. A measurement that fails gets a section of its own (FAILED, with its error)
and the other still runs and reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import random
import signal
import statistics
import time
import traceback
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from temporalio.client import Client

from bench.histories import event_time, event_type, job_history
from bench.jobs import BenchFailure, prompt_id_of
from bench.load import CpuUse, cpu_table
from bench.outcome import Benchmark, BenchOptions, Outcome, Section
from bench.results import Result, Target, fmt, percentile, result
from bench.stack import BenchContext, Pool, SimProcess, extra_sim, extra_worker
from devstack.processes import terminate
from faults.graphs import sampler_graph
from starter import JobClient, JobRequest
from starter.errors import TemporalUnreachable
from workflows.admission import PoolQueueView, SlotRelease
from workflows.contracts import JobState, JobStatus
from workflows.shared import SIGNAL_SLOT_RELEASE, pool_queue_id

SERVERS = 4
FARM = "pools_farm"  # the project's side: one pool of the four servers
ROUND_ROBIN = tuple(f"pools_rr_{n}" for n in range(1, SERVERS + 1))  # the baseline's pools
PAIR = "pools_pair"  # measurement 2: servers A and B
SOLO = "pools_solo"  # its baseline: A alone
STEP_MS = 50
MIN_STEPS, MAX_STEPS = 20, 100  # 1 to 5 s a prompt at STEP_MS
SEED = 0  # the job lengths' sequence (not picked for its figure: see `ideal_ratio`)
SPREAD_RATIO_MAX = 0.85
ROUTE_MAX_S = 5.0
HEALTH_JOBS = 4
HEALTH_STEPS = 1
POLL_S = 0.1  # how often the dispatcher's view is read for the unhealthy mark
DETECT_TIMEOUT_S = 30.0
SUBMIT_ATTEMPTS = 5
SETTLE_S = 1.0  # after a side ended: the worker's last work for it (offloads, releases)

T = TypeVar("T")


# -- pure arithmetic (tests/tooling/test_bench_pools.py) --------------------------------------


def job_steps(n: int, seed: int = SEED) -> list[int]:
    """The jobs' sampler steps: `n` whole numbers from MIN_STEPS to MAX_STEPS, the same list
    for the same `n` and `seed` on every run and machine (random.Random is stable by seed)."""
    rng = random.Random(seed)
    return [rng.randint(MIN_STEPS, MAX_STEPS) for _ in range(n)]


def round_robin(n: int, servers: int) -> list[int]:
    """Job i -> server i mod `servers`: what the baseline's client does."""
    return [i % servers for i in range(n)]


def round_robin_makespan(lengths: Sequence[float], servers: int) -> float:
    """The busiest server's work when job i goes to server i mod `servers` and each server
    runs its own queue back to back (the baseline with no overhead)."""
    totals = [0.0] * servers
    for i, length in enumerate(lengths):
        totals[i % servers] += length
    return max(totals, default=0.0)


def first_free_makespan(lengths: Sequence[float], servers: int) -> float:
    """The end of the last job when each job, in this order, starts on the first server that
    frees, with no time between one job's end and the next one's start (the project's
    dispatcher with no handover cost; the order is the line's)."""
    free = [0.0] * servers
    for length in lengths:
        heapq.heappush(free, heapq.heappop(free) + length)
    return max(free, default=0.0)


def longest_first_makespan(lengths: Sequence[float], servers: int) -> float:
    """`first_free_makespan` with the longest jobs first (LPT): what a dispatcher that knew
    each job's length could do (within 4/3 of the best possible)."""
    return first_free_makespan(sorted(lengths, reverse=True), servers)


def lower_bound(lengths: Sequence[float], servers: int) -> float:
    """No dispatch ends sooner: the work spread perfectly evenly, or the longest job."""
    return max(sum(lengths) / servers, max(lengths, default=0.0))


def ideal_ratio(lengths: Sequence[float], servers: int) -> float:
    """first_free_makespan / round_robin_makespan for the same order: how far below 1 a
    dispatcher without any overhead could take the spread's ratio on these lengths."""
    rr = round_robin_makespan(lengths, servers)
    return first_free_makespan(lengths, servers) / rr if rr > 0 else float("nan")


@dataclass(frozen=True)
class Prompt:
    """One job's prompt at a simulator: its server and when it started and ended there."""

    job_id: str
    server: str
    started: float  # epoch seconds
    ended: float
    steps: int


def handover_gaps(prompts: Sequence[Prompt]) -> list[tuple[Prompt, Prompt, float]]:
    """Per server, each prompt with the one that ran before it and the time between that one's
    end and its start (the server idle while a job waited), in start order."""
    by_server: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_server.setdefault(prompt.server, []).append(prompt)
    gaps: list[tuple[Prompt, Prompt, float]] = []
    for runs in by_server.values():
        ordered = sorted(runs, key=lambda p: p.started)
        gaps += [(a, b, b.started - a.ended) for a, b in itertools.pairwise(ordered)]
    return sorted(gaps, key=lambda g: g[1].started)


def start_order_steps(prompts: Sequence[Prompt]) -> list[int]:
    """The jobs' steps in the order their prompts started (all servers): the line's order."""
    return [p.steps for p in sorted(prompts, key=lambda p: p.started)]


def release_grant_parts(
    gaps: Sequence[tuple[Prompt, Prompt, float]],
    released: dict[str, float],
    tasks_done: Sequence[float],
) -> list[tuple[float, float, float]]:
    """Each handover split at the dispatcher: (the previous prompt's end -> its job's `release`
    signal recorded, that signal -> the dispatcher's next workflow task completed (the grant),
    the grant -> the next prompt's start at the simulator: the waiting follow sees the grant
    and sends its prompt). Handovers whose release is not in `released` are left out."""
    done = sorted(tasks_done)
    parts: list[tuple[float, float, float]] = []
    for before, after, _ in gaps:
        signal_at = released.get(before.job_id)
        if signal_at is None:
            continue
        grant_at = next((t for t in done if t >= signal_at), None)
        if grant_at is None or grant_at > after.started:
            continue
        parts.append((signal_at - before.ended, grant_at - signal_at, after.started - grant_at))
    return parts


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# -- what a run saw ---------------------------------------------------------------------------


@dataclass
class SideRun:
    """One side of the spread measurement, once."""

    label: str
    jobs: int
    seconds: float = 0.0  # first submit -> the last wait returned COMPLETED
    submitted_s: float = 0.0  # first submit -> the last submit returned
    first_start_s: float = 0.0  # first submit -> the first prompt started at a simulator
    gpu_s: float = 0.0  # first submit -> the last prompt ended at a simulator
    prompts: list[Prompt] = field(default_factory=list)
    cpu: CpuUse | None = None
    # The project's side: the dispatcher's `release` signals (job id -> epoch seconds) and its
    # completed workflow tasks, for the handovers' parts.
    released: dict[str, float] = field(default_factory=dict)
    tasks_done: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def gaps(self) -> list[float]:
        return [g for _, _, g in handover_gaps(self.prompts)]


@dataclass
class HealthRun:
    jobs: int
    baseline_s: float = 0.0  # A alone: submit -> the last job started at A
    baseline_first_s: float = 0.0
    baseline_gaps: list[float] = field(default_factory=list)
    detect_s: float = 0.0  # kill -> the dispatcher's mark (`since`)
    seen_s: float = 0.0  # kill -> a client's query showed it
    route_s: float = 0.0  # the mark -> the last waiting job started at A
    submit_after_mark_s: float = 0.0  # the mark -> the first submit
    from_submit_s: float = 0.0  # first submit -> the last job started at A
    first_start_s: float = 0.0  # first submit -> the first job started at A
    gaps: list[float] = field(default_factory=list)
    on_unhealthy: int = 0
    servers: dict[str, str] = field(default_factory=dict)  # job id -> backend.server
    health_after: dict[str, str] = field(default_factory=dict)  # url -> health, at the end
    a_url: str = ""
    b_url: str = ""
    reason: str = ""  # what the health watch said of B


@dataclass
class Runs:
    steps: list[int]
    rounds: int
    project: list[SideRun] = field(default_factory=list)
    baseline: list[SideRun] = field(default_factory=list)
    health: HealthRun | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    failed: list[Section] = field(default_factory=list)

    async def measure(self, label: str, measurement: Coroutine[Any, Any, T]) -> T | None:
        """One measurement; one that fails is reported in a section of its own, and the other
        still runs."""
        began = time.monotonic()
        try:
            return await measurement
        except Exception as exc:  # the other measurement's figures are worth keeping
            traceback.print_exc()
            self.failed.append(Section(title=f"Pools {label}: FAILED", lines=[f"`{exc!r}`"[:6000]]))
            return None
        finally:
            self.seconds[label] = time.monotonic() - began


# -- the stack's side -------------------------------------------------------------------------


def _request(steps: int, pool: str) -> JobRequest:
    graph = sampler_graph(steps)
    graph["5"]["inputs"].update({"width": 64, "height": 64})  # a small output to offload
    return JobRequest(graph=graph, pool=pool)


async def _submit(jobs: JobClient, job_request: JobRequest, job_id: str, errors: list[str]) -> None:
    """`JobClient.submit` under our job ID, sent again while Temporal times out (idempotent)."""
    for attempt in range(SUBMIT_ATTEMPTS):
        try:
            await jobs.submit(job_request, job_id=job_id)
            return
        except TemporalUnreachable as exc:
            errors.append(f"a submit raised: {exc}")
            if attempt + 1 == SUBMIT_ATTEMPTS:
                raise
            await asyncio.sleep(1.0 * (attempt + 1))


async def _wait_all(
    jobs: JobClient, job_ids: Sequence[str], timeout_s: float, errors: list[str]
) -> dict[str, tuple[JobStatus, float]]:
    """job id -> (its final status, when `wait` returned it, epoch seconds); every job must
    have COMPLETED."""
    ended: dict[str, tuple[JobStatus, float]] = {}

    async def one(job_id: str) -> None:
        while job_id not in ended:
            try:
                status = await jobs.wait(job_id)
            except TemporalUnreachable as exc:
                errors.append(f"a wait raised: {exc}")
                continue
            ended[job_id] = (status, time.time())

    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(one(j) for j in job_ids))
    left = [j for j in job_ids if j not in ended]
    if left:
        states = []
        for job_id in left[:5]:
            with contextlib.suppress(Exception):
                status = await jobs.status(job_id)
                server = status.backend.server if status.backend else None
                states.append(f"{job_id}: {status.state.value} on {server}")
        raise BenchFailure(
            f"{len(left)} of {len(job_ids)} jobs had not ended after {timeout_s:.0f} s: {states}"
        )
    bad = {j: s.state.value for j, (s, _) in ended.items() if s.state != JobState.COMPLETED}
    if bad:
        errors_of = [f"{j}: {ended[j][0].error}" for j in list(bad)[:3]]
        raise BenchFailure(f"jobs did not complete: {bad} ({errors_of})")
    return ended


async def _reset(ctx: BenchContext, sims: Sequence[SimProcess]) -> None:
    for sim in sims:
        (await ctx.http.post(f"{sim.pool.url}/sim/reset", timeout=10)).raise_for_status()


async def _prompts(
    ctx: BenchContext,
    sims: Sequence[SimProcess],
    ended: dict[str, tuple[JobStatus, float]],
    steps_of: dict[str, int],
) -> list[Prompt]:
    """Each job's prompt as the simulator that ran it recorded it."""
    by_prompt = {prompt_id_of(status): job_id for job_id, (status, _) in ended.items()}
    prompts: list[Prompt] = []
    for sim in sims:
        response = await ctx.http.get(f"{sim.pool.url}/sim/stats", timeout=10)
        response.raise_for_status()
        stats = response.json()
        for prompt_id, started in stats["started_at"].items():
            job_id = by_prompt.get(prompt_id)
            if job_id is None:
                continue
            finished = stats["ended_at"].get(prompt_id, started)
            prompts.append(Prompt(job_id, sim.pool.url, started, finished, steps_of[job_id]))
    missing = len(ended) - len(prompts)
    if missing:
        raise BenchFailure(f"{missing} jobs' prompts were not found at any simulator")
    return prompts


async def _dispatcher_marks(
    temporal: Client, task_queue: str, pool: str, since: float
) -> tuple[dict[str, float], list[float]]:
    """From the pool's dispatcher history (every run): job id -> when its `release` signal was
    recorded, and when each workflow task completed, from `since` (epoch seconds) on."""
    events = await job_history(temporal, pool_queue_id(task_queue, pool))
    released: dict[str, float] = {}
    done: list[float] = []
    for event in events:
        at = event_time(event)
        if at < since:
            continue
        kind = event_type(event)
        if kind == "WORKFLOW_TASK_COMPLETED":
            done.append(at)
        elif kind == "WORKFLOW_EXECUTION_SIGNALED":
            attributes = event.workflow_execution_signaled_event_attributes
            if attributes.signal_name != SIGNAL_SLOT_RELEASE:
                continue
            with contextlib.suppress(Exception):  # an encrypted payload: no split
                [release] = await temporal.data_converter.decode(
                    list(attributes.input.payloads), [SlotRelease]
                )
                released.setdefault(SlotRelease.model_validate(release).job_id, at)
    return released, done


async def _side(
    ctx: BenchContext,
    jobs: JobClient,
    sims: Sequence[SimProcess],
    label: str,
    steps: Sequence[int],
    pool_of: Callable[[int], str],
    pids: dict[str, int | None],
    task_queue: str,
) -> SideRun:
    n = len(steps)
    run = SideRun(label=label, jobs=n)
    await _reset(ctx, sims)
    tag = uuid.uuid4().hex[:6]
    ids = [f"pools-{label}-{tag}-{i:03d}" for i in range(n)]
    steps_of = dict(zip(ids, steps, strict=True))
    requests = [_request(s, pool_of(i)) for i, s in enumerate(steps)]
    cpu = CpuUse.start(pids)
    began = time.time()
    await asyncio.gather(
        *(_submit(jobs, r, j, run.errors) for r, j in zip(requests, ids, strict=True))
    )
    run.submitted_s = time.time() - began
    timeout = 120 + 3 * sum(steps) * STEP_MS / 1000 / SERVERS
    ended = await _wait_all(jobs, ids, timeout, run.errors)
    run.seconds = max(at for _, at in ended.values()) - began
    cpu.stop()
    run.cpu = cpu
    run.prompts = await _prompts(ctx, sims, ended, steps_of)
    run.first_start_s = min(p.started for p in run.prompts) - began
    run.gpu_s = max(p.ended for p in run.prompts) - began
    if label == "project":
        with contextlib.suppress(Exception):  # the split is a detail; the figure stands
            run.released, run.tasks_done = await _dispatcher_marks(
                ctx.temporal, task_queue, FARM, began - 1
            )
    await asyncio.sleep(SETTLE_S)
    return run


async def _warm_up(jobs: JobClient, errors: list[str]) -> None:
    """A job on each pool, unmeasured: the dispatchers and their health watches started, the
    worker's and the simulators' first prompts out of the way."""
    ids: list[str] = []
    requests = [
        *(_request(HEALTH_STEPS, FARM) for _ in range(SERVERS)),
        *(_request(HEALTH_STEPS, pool) for pool in ROUND_ROBIN),
        *(_request(HEALTH_STEPS, PAIR) for _ in range(2)),
        _request(HEALTH_STEPS, SOLO),
    ]
    for job_request in requests:
        job_id = f"pools-warm-{uuid.uuid4().hex[:8]}"
        ids.append(job_id)
        await _submit(jobs, job_request, job_id, errors)
    await _wait_all(jobs, ids, 120, errors)


async def _spread(
    ctx: BenchContext,
    jobs: JobClient,
    sims: Sequence[SimProcess],
    runs: Runs,
    pids: dict[str, int | None],
    task_queue: str,
) -> None:
    steps = runs.steps
    for round_no in range(runs.rounds):
        sides: list[tuple[str, Callable[[int], str]]] = [
            ("project", lambda _i: FARM),
            ("baseline", lambda i: ROUND_ROBIN[i % SERVERS]),
        ]
        if round_no % 2:
            sides.reverse()
        for label, pool_of in sides:
            print(f"bench: pools: round {round_no + 1}, {label}", flush=True)
            side = await _side(ctx, jobs, sims, label, steps, pool_of, pids, task_queue)
            (runs.project if label == "project" else runs.baseline).append(side)


async def _view(jobs: JobClient, pool: str) -> PoolQueueView:
    return await jobs.pool_queue(pool)


async def _started_at(ctx: BenchContext, sim: SimProcess, prompt_ids: Sequence[str]) -> list[float]:
    stats = (await ctx.http.get(f"{sim.pool.url}/sim/stats", timeout=10)).json()
    return sorted(stats["started_at"][p] for p in prompt_ids if p in stats["started_at"])


async def _health(
    ctx: BenchContext, jobs: JobClient, a: SimProcess, b: SimProcess, n: int
) -> HealthRun:
    run = HealthRun(jobs=n, a_url=a.pool.url, b_url=b.pool.url)
    errors: list[str] = []
    view = await _view(jobs, PAIR)
    health = {s.url: s.health for s in view.servers}
    if health != {a.pool.url: "healthy", b.pool.url: "healthy"}:
        raise BenchFailure(f"the pair's servers are not both healthy before the kill: {health}")

    # The baseline: the same jobs on a healthy pool of A alone.
    await _reset(ctx, [a])
    ids = [f"pools-solo-{uuid.uuid4().hex[:8]}" for _ in range(n)]
    began = time.time()
    await asyncio.gather(*(_submit(jobs, _request(HEALTH_STEPS, SOLO), j, errors) for j in ids))
    ended = await _wait_all(jobs, ids, 120, errors)
    starts = await _started_at(ctx, a, [prompt_id_of(s) for s, _ in ended.values()])
    run.baseline_s = starts[-1] - began
    run.baseline_first_s = starts[0] - began
    steps_of = dict.fromkeys(ids, HEALTH_STEPS)
    run.baseline_gaps = [g for _, _, g in handover_gaps(await _prompts(ctx, [a], ended, steps_of))]
    await asyncio.sleep(SETTLE_S)

    # B dies while idle; the dispatcher's view is read until it says so.
    await _reset(ctx, [a])
    killed = time.time()
    await terminate(b.record, sig=signal.SIGKILL, grace_s=5)
    mark: float | None = None
    deadline = time.monotonic() + DETECT_TIMEOUT_S
    while mark is None:
        with contextlib.suppress(Exception):  # a query timing out under load: asked again
            view = await _view(jobs, PAIR)
            server = next((s for s in view.servers if s.url == b.pool.url), None)
            if server is not None and server.health == "unhealthy":
                run.seen_s = time.time() - killed
                mark = server.since.timestamp() if server.since else time.time()
                run.reason = server.last_error or ""
                break
        if time.monotonic() > deadline:
            raise BenchFailure(f"B not marked unhealthy {DETECT_TIMEOUT_S:.0f} s after its kill")
        await asyncio.sleep(POLL_S)
    run.detect_s = mark - killed

    # The waiting jobs: in line for the one healthy server.
    ids = [f"pools-pair-{uuid.uuid4().hex[:8]}" for _ in range(n)]
    began = time.time()
    run.submit_after_mark_s = began - mark
    await asyncio.gather(*(_submit(jobs, _request(HEALTH_STEPS, PAIR), j, errors) for j in ids))
    ended = await _wait_all(jobs, ids, 120, errors)
    run.servers = {
        j: (s.backend.server if s.backend and s.backend.server else "?")
        for j, (s, _) in ended.items()
    }
    run.on_unhealthy = sum(1 for server in run.servers.values() if server != a.pool.url)
    starts = await _started_at(ctx, a, [prompt_id_of(s) for s, _ in ended.values()])
    if len(starts) != n:
        raise BenchFailure(f"{n - len(starts)} waiting jobs did not start at A: {run.servers}")
    run.route_s = starts[-1] - mark
    run.from_submit_s = starts[-1] - began
    run.first_start_s = starts[0] - began
    steps_of = dict.fromkeys(ids, HEALTH_STEPS)
    run.gaps = [g for _, _, g in handover_gaps(await _prompts(ctx, [a], ended, steps_of))]
    view = await _view(jobs, PAIR)
    run.health_after = {s.url: s.health for s in view.servers}
    return run


# -- the group --------------------------------------------------------------------------------


def _pool_settings(farm: Sequence[SimProcess], a: SimProcess, b: SimProcess) -> dict[str, Any]:
    urls = [sim.pool.url for sim in farm]
    settings: dict[str, Any] = {FARM: {"kind": "comfyui", "urls": urls}}
    for name, url in zip(ROUND_ROBIN, urls, strict=True):
        settings[name] = {"kind": "comfyui", "url": url}
    settings[PAIR] = {"kind": "comfyui", "urls": [a.pool.url, b.pool.url]}
    settings[SOLO] = {"kind": "comfyui", "urls": [a.pool.url]}
    return settings


async def run(ctx: BenchContext, options: BenchOptions) -> Outcome:
    runs = Runs(steps=job_steps(options.pools_jobs), rounds=options.pools_rounds)
    async with contextlib.AsyncExitStack() as stack:
        farm = [
            await stack.enter_async_context(
                extra_sim(ctx, f"pools_s{n}", step_delay_ms=STEP_MS, parallel=1)
            )
            for n in range(1, SERVERS + 1)
        ]
        a = await stack.enter_async_context(
            extra_sim(ctx, "pools_a", step_delay_ms=STEP_MS, parallel=1)
        )
        b = await stack.enter_async_context(
            extra_sim(ctx, "pools_b", step_delay_ms=STEP_MS, parallel=1)
        )
        worker = await stack.enter_async_context(
            extra_worker(
                ctx,
                "pools",
                [Pool(FARM, farm[0].pool.url, STEP_MS)],
                pool_settings=_pool_settings(farm, a, b),
            )
        )
        jobs, _ = ctx.job_client(worker.task_queue)
        pids: dict[str, int | None] = {
            "Temporal server": ctx.temporal_pid,
            "S3 (SeaweedFS)": ctx.s3_pid,
            "worker": worker.pid,
            **{f"simulator {n}": sim.record.pid for n, sim in enumerate(farm, 1)},
        }
        warm_errors: list[str] = []
        await runs.measure("warm-up", _warm_up(jobs, warm_errors))
        await runs.measure(
            "1 (spread vs round-robin)",
            _spread(ctx, jobs, farm, runs, pids, worker.task_queue),
        )
        runs.health = await runs.measure(
            "2 (an unhealthy server)", _health(ctx, jobs, a, b, HEALTH_JOBS)
        )
    return _outcome(runs)


# -- the report -------------------------------------------------------------------------------


def _outcome(runs: Runs) -> Outcome:
    results: list[Result] = []
    sections: list[Section] = []
    where: dict[str, list[str]] = {}
    part = _spread_outcome(runs)
    results += part.results
    sections += part.sections
    where |= part.where
    part = _health_outcome(runs.health)
    results += part.results
    sections += part.sections
    where |= part.where
    sections += runs.failed
    sections.append(
        Section(
            title="Pools: time per measurement",
            lines=[
                "| measurement | s |",
                "|---|---|",
                *(f"| {label} | {fmt(s)} |" for label, s in runs.seconds.items()),
            ],
        )
    )
    return Outcome(results=results, sections=sections, where=where)


def _ms(values: Sequence[float], p: float) -> str:
    return fmt(1000 * percentile(values, p)) if values else "-"


def _spread_outcome(runs: Runs) -> Outcome:
    if not runs.project or not runs.baseline:
        return Outcome(results=[])
    n = len(runs.steps)
    project = median([r.seconds for r in runs.project])
    baseline = median([r.seconds for r in runs.baseline])
    project_gaps = [g for r in runs.project for g in r.gaps]
    baseline_gaps = [g for r in runs.baseline for g in r.gaps]
    step_s = STEP_MS / 1000
    work = sum(runs.steps) * step_s
    rr = round_robin_makespan(runs.steps, SERVERS)
    in_order = first_free_makespan(runs.steps, SERVERS)
    # Each project round's line: its jobs in the order they started (submitted at once, they
    # joined the line in whatever order their asks arrived), against the baseline's sequence.
    observed = [first_free_makespan(start_order_steps(r.prompts), SERVERS) for r in runs.project]
    best = longest_first_makespan(runs.steps, SERVERS)
    floor = lower_bound(runs.steps, SERVERS)
    results = [
        result(
            "pools.spread_makespan_s",
            project,
            "s",
            baseline=baseline,
            target=Target(metric="ratio", op="<=", limit=SPREAD_RATIO_MAX),
        ),
        result(
            "pools.handover_p50_ms",
            1000 * median(project_gaps),
            "ms",
            baseline=1000 * median(baseline_gaps),
        ),
    ]
    rows = []
    for side in sorted([*runs.project, *runs.baseline], key=lambda r: r.label):
        if side.label == "project":
            ideal = first_free_makespan(start_order_steps(side.prompts), SERVERS) * step_s
        else:
            ideal = rr * step_s
        rows.append(
            f"| {side.label} | {fmt(side.seconds)} | {fmt(ideal)} | "
            f"{fmt(side.seconds - ideal)} | {fmt(side.submitted_s)} | "
            f"{fmt(side.first_start_s)} | {fmt(side.gpu_s)} | "
            f"{fmt(side.seconds - side.gpu_s)} | {_ms(side.gaps, 50)} / {_ms(side.gaps, 95)} | "
            f"{fmt(sum(side.gaps))} | {len({p.server for p in side.prompts})} |"
        )
    arithmetic = [
        f"- The arithmetic of these lengths (seconds of prompts; no overhead): round-robin "
        f"{fmt(rr * step_s)}; first free, in submission order {fmt(in_order * step_s)} "
        f"(ratio {fmt(ideal_ratio(runs.steps, SERVERS))}), in the order each project "
        f"round's jobs started {', '.join(fmt(o * step_s) for o in observed)} (ratio "
        f"{', '.join(fmt(o / rr) for o in observed)}); longest first (a dispatcher that knew "
        f"the lengths) {fmt(best * step_s)} (ratio {fmt(best / rr)}); no dispatch below "
        f"{fmt(floor * step_s)} (ratio {fmt(floor / rr)}, the work spread perfectly evenly).",
    ]
    lines = [
        f"{n} jobs of {min(runs.steps)} to {max(runs.steps)} steps x {STEP_MS} ms "
        f"({fmt(min(runs.steps) * step_s)} to {fmt(max(runs.steps) * step_s)} s, "
        f"{fmt(work)} s of work in all, {fmt(work / SERVERS)} s per server if evenly spread; "
        f"seed {SEED}), submitted at once, on {SERVERS} simulators each running one prompt "
        f"at a time; {runs.rounds} round(s), each side's median taken. Project: one pool of "
        f"the {SERVERS} servers (`urls`); baseline: round-robin over {SERVERS} single-server "
        "pools (each server's own queue).",
        "",
        f"- project (median): **{fmt(project)} s**; baseline (median): **{fmt(baseline)} s**; "
        f"ratio {fmt(project / baseline)} (target <= {fmt(SPREAD_RATIO_MAX)}).",
        *arithmetic,
        "",
        "| side | first submit -> last COMPLETED s | its ideal s | over the ideal s | "
        "submits s | -> first start s | -> last prompt ended s | last end -> last COMPLETED s "
        "| handover p50 / p95 ms | handovers s (sum) | servers used |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "A handover is the time a server stood idle between one job's prompt ending and the "
        "next one's starting (simulator times); the baseline's prompts wait in ComfyUI's own "
        "queue, so its handovers are the simulator's alone. A project round's ideal is "
        "`first_free_makespan` of its jobs in the order they started; the baseline's, "
        "`round_robin_makespan`: what each would take with no overhead at all.",
    ]
    errors = [e for r in [*runs.project, *runs.baseline] for e in r.errors]
    if errors:
        lines += ["", f"Calls sent again ({len(errors)}): " + "; ".join(errors[:5])]
    sections = [Section(title="Pools: spread vs round-robin", lines=lines)]
    split = _handover_split(runs.project)
    sections.append(Section(title="Pools: where a handover goes (project)", lines=split))
    cpu_phases = {
        f"{side.label} (round 1)": (side.cpu, side.seconds, side.jobs)
        for side in runs.project[:1] + runs.baseline[:1]
        if side.cpu is not None
    }
    if cpu_phases:
        sections.append(
            Section(title="Pools: CPU per job (first round)", lines=cpu_table(cpu_phases))
        )
    project_sum = median([sum(r.gaps) for r in runs.project])
    over = median(
        [
            r.seconds - first_free_makespan(start_order_steps(r.prompts), SERVERS) * step_s
            for r in runs.project
        ]
    )
    where = {
        "pools.spread_makespan_s": [
            *arithmetic,
            f"- The project's rounds took {fmt(over)} s (median) over the ideal of their own "
            f"line order: handovers, each server idle {_ms(project_gaps, 50)} ms (p50) between "
            f"one job's end and the next one's start ({fmt(project_sum)} s summed over the "
            f"{SERVERS} servers per round, median; {_ms(baseline_gaps, 50)} ms in the "
            "baseline, ComfyUI's own queue), the first grants and the last job's end.",
            "",
            *split,
        ]
    }
    return Outcome(results=results, sections=sections, where=where)


def _handover_split(project: Sequence[SideRun]) -> list[str]:
    parts = [
        part
        for side in project
        for part in release_grant_parts(handover_gaps(side.prompts), side.released, side.tasks_done)
    ]
    if not parts:
        return ["(the dispatcher's history gave no split of the handovers)"]
    names = (
        "prompt end -> its job's `release` signal at the dispatcher (the follow sees the end)",
        "`release` -> the dispatcher's workflow task completed (the grant)",
        "the grant -> the next prompt started (the waiting follow sees it, sends its prompt)",
    )
    lines = ["| part of a handover | p50 ms | p95 ms | max ms |", "|---|---|---|---|"]
    for index, name in enumerate(names):
        values = [p[index] for p in parts]
        lines.append(
            f"| {name} | {_ms(values, 50)} | {_ms(values, 95)} | {fmt(1000 * max(values))} |"
        )
    lines.append(f"\n{len(parts)} handovers, from the dispatcher's history and the simulators.")
    return lines


def _health_outcome(run: HealthRun | None) -> Outcome:
    if run is None:
        return Outcome(results=[])
    results = [
        result(
            "pools.unhealthy_route_s",
            run.route_s,
            "s",
            baseline=run.baseline_s,
            target=Target(metric="value", op="<=", limit=ROUTE_MAX_S),
        ),
        result("pools.unhealthy_detect_s", run.detect_s, "s"),
        result(
            "pools.jobs_given_unhealthy",
            float(run.on_unhealthy),
            "jobs",
            target=Target(metric="value", op="<=", limit=0),
        ),
    ]
    servers = sorted(set(run.servers.values()))
    lines = [
        f"A pool of two servers (`urls`: A {run.a_url}, B {run.b_url}), one prompt at a time "
        f"each. B killed (SIGKILL) while idle; {run.jobs} jobs of {HEALTH_STEPS} step x "
        f"{STEP_MS} ms submitted at once once the dispatcher's view said B unhealthy.",
        "",
        f"- kill -> the dispatcher's mark (B's `since`): **{fmt(run.detect_s)} s** (the health "
        "watch reads `/queue` every second and marks a server after two failed reads); "
        f"kill -> a client's query saw it: {fmt(run.seen_s)} s (polled every "
        f"{fmt(POLL_S * 1000)} ms). The watch's reason: {run.reason or '-'}.",
        f"- the mark -> every waiting job started on A: **{fmt(run.route_s)} s** (target <= "
        f"{fmt(ROUTE_MAX_S)} s): the mark -> the first submit {fmt(run.submit_after_mark_s)} s "
        f"(the client's poll, the query), the first submit -> the first start "
        f"{fmt(run.first_start_s)} s, -> the last start {fmt(run.from_submit_s)} s; handovers "
        f"at A p50 {_ms(run.gaps, 50)} ms, max {_ms(run.gaps, 100)} ms.",
        f"- baseline, the same jobs on a healthy pool of A alone: first submit -> last start "
        f"{fmt(run.baseline_s)} s (-> first start {fmt(run.baseline_first_s)} s; handovers p50 "
        f"{_ms(run.baseline_gaps, 50)} ms); from the first submit the unhealthy pool took "
        f"{fmt(run.from_submit_s)} s.",
        f"- the waiting jobs ran on: {', '.join(servers)}; given B: {run.on_unhealthy}. "
        f"The pair's servers at the end: {run.health_after}.",
    ]
    where = {
        "pools.unhealthy_route_s": lines[2:5],
        "pools.jobs_given_unhealthy": lines[5:6],
    }
    return Outcome(
        results=results,
        sections=[Section(title="Pools: leaving an unhealthy server", lines=lines)],
        where=where,
    )


BENCHMARK = Benchmark(
    name="pools", group=12, title="Pools of many servers", run=run, timeout_s=900.0
)
