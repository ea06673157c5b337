"""Group 6, history: how many events a long single-segment job writes.

A job of `history_steps` sampler steps (5,000 by default) on the `comfyui_timed` pool (a real
time per step, so progress is real), watched as the CLI watches it. Reported: the events in its
history (all runs; target <= 150) against a 10-step job on the same pool (the floor, without
much progress to report), and the longest time the watching client saw no new step while the
sampler was stepping (target: progress seen at least once a second).
"""

from __future__ import annotations

import itertools
import time

from bench.histories import job_history, round_trips
from bench.jobs import DEFAULT_POLL_S, Seen, completed, prompt_id_of, request, watch
from bench.outcome import Benchmark, BenchOptions, Outcome, Section
from bench.results import Target, fmt, result
from bench.sim import progress_times
from bench.stack import TIMED_POOL, BenchContext
from configuration.settings import WorkerSettings

EVENTS_MAX = 150
GAP_MAX_S = 1.0
SMALL_STEPS = 10


def longest_gap(seen: list[Seen], first_step_at: float, last_step_at: float) -> float:
    """The longest wait, from the sampler's first step to its last, between two moments the
    client saw the step grow (the start counts as one moment)."""
    moments = [first_step_at]
    step = 0
    for status in seen:
        if status.step > step:
            step = status.step
            moments.append(max(status.at, first_step_at))
    moments.append(max(last_step_at, moments[-1]))
    return max(b - a for a, b in itertools.pairwise(moments))


async def run(ctx: BenchContext, options: BenchOptions) -> Outcome:
    jobs, _ = ctx.job_client()
    small = await jobs.submit(request(SMALL_STEPS, TIMED_POOL))
    completed(await jobs.wait(small.job_id))
    small_trips = round_trips(await job_history(ctx.temporal, small.job_id))

    started = time.time()
    big = await jobs.submit(request(options.history_steps, TIMED_POOL))
    seen, final = await watch(jobs, big.job_id)
    seconds = time.time() - started
    trips = round_trips(await job_history(ctx.temporal, big.job_id))
    steps = await progress_times(ctx.http, ctx.timed.url, prompt_id_of(final))
    gap = longest_gap(seen, steps[0].at, steps[-1].at) if steps else float("nan")
    sampling_s = steps[-1].at - steps[0].at if steps else float("nan")
    progress_signals = trips.signals.get("progress", 0)

    results = [
        result(
            "history.events",
            trips.events,
            "events",
            baseline=small_trips.events,
            target=Target(limit=EVENTS_MAX),
        ),
        result(
            "history.longest_unseen_progress",
            gap,
            "s",
            baseline=None,
            target=Target(limit=GAP_MAX_S),
        ),
    ]
    sections = [
        Section(
            title=f"History: the {options.history_steps}-step job",
            lines=[
                f"{options.history_steps} steps at {ctx.timed.step_delay_ms} ms each on the "
                f"simulator: sampling took {fmt(sampling_s)} s, the job {fmt(seconds)} s from "
                f"submit to the watcher's last status; the watcher was handed {len(seen)} "
                "statuses.",
                *trips.lines(),
                f"- baseline, the same job with {SMALL_STEPS} steps: {small_trips.events} events",
            ],
        )
    ]
    per_signal = (trips.events - small_trips.events) / max(1, progress_signals)
    where = [
        f"{trips.events} events against {small_trips.events} for a {SMALL_STEPS}-step job: "
        f"{progress_signals} `progress` signals over {fmt(sampling_s)} s of sampling "
        f"({fmt(progress_signals / sampling_s if sampling_s else 0)} per s), each about "
        f"{fmt(per_signal)} events (the signal, and the workflow task it wakes: scheduled, "
        "started, completed), plus any search-attribute upserts it makes. The follow "
        "activity signals on milestones only (first report, stage changes, artifacts, each "
        "tenth of the steps, the end): more than about 14 means more stages or artifacts, "
        "or a tenth per `progress_interval_s`.",
        "Events by type: "
        + ", ".join(f"{kind} x{count}" for kind, count in trips.by_type.items())
        + ".",
    ]
    throttle = WorkerSettings.model_fields["heartbeat_throttle_s"].default
    gap_where = [
        f"The client polls every {fmt(DEFAULT_POLL_S)} s and reads the step from the follow "
        "activity's heartbeat in the workflow's description, which the worker sends at most "
        f"every `heartbeat_throttle_s` ({fmt(throttle)} s by default; the workflow itself "
        f"hears {progress_signals} `progress` signals in {fmt(sampling_s)} s of sampling): "
        f"longest {fmt(gap)} s. A gap past the throttle plus a poll is the machine's load "
        "(a late heartbeat, a slow describe) or a heartbeat that was not sent.",
    ]
    return Outcome(
        results=results,
        sections=sections,
        where={"history.events": where, "history.longest_unseen_progress": gap_where},
    )


BENCHMARK = Benchmark(name="history", group=6, title="History", run=run)
