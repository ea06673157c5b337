"""Group 7, client latency: from a progress event at the simulator to a client seeing it.

One job of `latency_steps` steps (500 by default) on the `comfyui_timed` pool, followed by
`JobClient.watch` at its default poll interval, while a plain socket of our own on the same
simulator receives the same steps (the baseline: what a client talking to ComfyUI directly
would see). The simulator says when it sent each step (GET /sim/progress), so for every step:

- **event → seen**: the first moment the watcher was handed a status with that step or a later
  one, minus when the simulator sent it (what a user waits for the step to show);
- **shown step's age**: for each status the watcher was handed, how old its step was;
- and the Temporal calls the watcher made per second (by a client interceptor).
"""

from __future__ import annotations

import time

from bench.jobs import DEFAULT_POLL_S, Seen, prompt_id_of, request, watch
from bench.outcome import Benchmark, BenchOptions, Outcome, Section
from bench.results import fmt, percentile, result
from bench.sim import ObserverSocket, SimProgress, progress_times
from bench.stack import TIMED_POOL, BenchContext
from configuration.settings import WorkerSettings

# The worker's default `max_heartbeat_throttle_interval` (DURABLE_COMFY_HEARTBEAT_THROTTLE_S).
THROTTLE_S = float(WorkerSettings.model_fields["heartbeat_throttle_s"].default)


def event_to_seen_ms(steps: list[SimProgress], seen: list[Seen]) -> list[float]:
    """Per simulator step: first time a status with that step or later was seen, minus when
    the step was sent (steps never seen, e.g. after the last status, are left out)."""
    lags: list[float] = []
    cursor = 0
    for step in steps:
        while cursor < len(seen) and seen[cursor].step < step.value:
            cursor += 1
        if cursor == len(seen):
            break
        lags.append((seen[cursor].at - step.at) * 1000)
    return lags


def shown_age_ms(steps: list[SimProgress], seen: list[Seen]) -> list[float]:
    sent = {int(s.value): s.at for s in steps}
    return [(s.at - sent[s.step]) * 1000 for s in seen if s.step in sent and s.step > 0]


async def run(ctx: BenchContext, options: BenchOptions) -> Outcome:
    jobs, log = ctx.job_client()
    async with ObserverSocket(ctx.timed.url) as observer:
        submitted = await jobs.submit(request(options.latency_steps, TIMED_POOL))
        log.clear()
        started = time.time()
        seen, final = await watch(jobs, submitted.job_id)
        ended = time.time()
    calls = log.between(started, ended)
    prompt_id = prompt_id_of(final)
    steps = await progress_times(ctx.http, ctx.timed.url, prompt_id)
    lags = event_to_seen_ms(steps, seen)
    ages = shown_age_ms(steps, seen)
    direct = [
        (observer.received[key] - s.at) * 1000
        for s in steps
        if (key := (prompt_id, s.node, int(s.value))) in observer.received
    ]
    calls_per_s = len(calls) / (ended - started)

    results = [
        result(
            "client_latency.event_to_seen_p50",
            percentile(lags, 50),
            "ms",
            baseline=percentile(direct, 50),
        ),
        result(
            "client_latency.event_to_seen_p95",
            percentile(lags, 95),
            "ms",
            baseline=percentile(direct, 95),
        ),
        result("client_latency.shown_step_age_p50", percentile(ages, 50), "ms"),
        result(
            "client_latency.temporal_calls_per_s",
            calls_per_s,
            "calls/s",
            baseline=1 / DEFAULT_POLL_S,
        ),
    ]
    by_method = ", ".join(f"{k} x{v}" for k, v in log.by_method(calls).items())
    sections = [
        Section(
            title="Client latency: one watched job",
            lines=[
                f"{options.latency_steps} steps at {ctx.timed.step_delay_ms} ms on the simulator "
                f"({fmt(steps[-1].at - steps[0].at)} s of sampling), watched at the default poll "
                f"interval ({fmt(DEFAULT_POLL_S)} s) for {fmt(ended - started)} s; the watcher "
                f"was handed {len(seen)} statuses, {len({s.step for s in seen})} distinct steps.",
                f"- event → seen: p50 {fmt(percentile(lags, 50))} ms, p95 "
                f"{fmt(percentile(lags, 95))} ms, max {fmt(max(lags))} ms over {len(lags)} steps",
                f"- the same steps on a socket of our own (direct): p50 "
                f"{fmt(percentile(direct, 50))} ms, p95 {fmt(percentile(direct, 95))} ms",
                f"- shown step's age when handed over: p50 {fmt(percentile(ages, 50))} ms, p95 "
                f"{fmt(percentile(ages, 95))} ms",
                f"- Temporal calls: {len(calls)} ({by_method}), {fmt(calls_per_s)} per s",
                "- why: the watcher reads the step from the follow activity's heartbeat (the "
                "workflow's description, each poll while a prompt is followed; the query only "
                "when the history grew), which the worker sends at most every "
                f"`heartbeat_throttle_s` ({fmt(THROTTLE_S)}"
                " s by default): the lag is about half the throttle plus half the poll interval "
                "on average, at most both (plus the calls' own time).",
            ],
        )
    ]
    return Outcome(results=results, sections=sections)


BENCHMARK = Benchmark(name="client_latency", group=7, title="Client latency", run=run)
