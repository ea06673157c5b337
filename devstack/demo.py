"""`make demo`: the local stack, a worker, and one real job from examples/txt2img.json.

Starts what is not running (Temporal dev server, SeaweedFS, the ComfyUI simulator, the RunPod
simulator, a worker), submits the example graph as an attached job on the worker's default pool
(the `runpod` pool of temporal-dev.yaml: the RunPod simulator, whose workers run our handler in
endpoint/ under the real `runpod` worker loop), shows its progress, then prints the job ID, the
Temporal UI link and the artifact's presigned URL after checking the downloaded bytes against the
sha256. On a runpod pool it also prints the RunPod job id, the job's cost (`JobStatus.cost`) and
what the simulator's ledger (GET /sim/ledger) billed: one RunPod job for the submission, and no
worker billed past the idle timeout after its last job (it waits for idle workers to stop).
The stack keeps running afterwards so the job can be looked at; `make down` stops it.

`--config PATH` (`make demo CONFIG=PATH`) runs it on another stack file, e.g. a copy of
temporal-dev.yaml with every port moved; without it, $DURABLE_COMFY_CONFIG, else temporal-dev.yaml.
Exit code 0 only when the job COMPLETED, its artifact matched its sha256, and the ledger checks
passed.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.markup import escape

from devstack.config import (
    DEFAULT_CONFIG_PATH,
    PoolConfig,
    RunpodSimSection,
    StackConfig,
)
from devstack.demo_support import (
    EXAMPLE,
    check_artifacts,
    demo_console,
    parse_config_path,
    print_worker,
    stack_job_client,
    start_demo_stack,
    workflow_link,
)
from devstack.runpod_sim import Ledger
from devstack.services import endpoint_venv_missing
from devstack.worker_process import ensure_worker
from starter.cli.render import print_summary, stream_progress
from starter.requests import request_from_files
from workflows.contracts import JobState, JobStatus

# The simulator's platform timer ticks every 50 ms: a worker is stopped within a tick of its
# idle timeout, so the check allows that much and a little more.
IDLE_SLACK_S = 0.5
# How long past the idle timeout to wait for the job's workers to stop.
IDLE_WAIT_EXTRA_S = 5.0


class DemoFailed(Exception):
    """The demo ran, but what it must show did not hold."""


def default_pool(config: StackConfig) -> tuple[str, PoolConfig]:
    name = config.worker.default_pool
    pool = config.worker.pools.get(name)
    if pool is None:
        raise DemoFailed(f"the stack file's worker.default_pool {name!r} is not one of its pools")
    return name, pool


def on_the_simulator(pool: PoolConfig, sim: RunpodSimSection) -> bool:
    return pool.kind == "runpod" and pool.url == sim.api_url


async def demo(console: Console, config_file: Path) -> JobStatus:
    """`config_file` is absolute: it is what the worker is told to read (DURABLE_COMFY_CONFIG)."""
    started = await start_demo_stack(console, config_file)
    stack = started.running
    sim = started.config.runpod_sim
    pool_name, pool = default_pool(started.config)
    if pool.kind == "runpod" and (missing := endpoint_venv_missing()) is not None:
        raise DemoFailed(f"the RunPod simulator's workers cannot start: {missing}")
    worker = await ensure_worker(started.config, started.base_dir, stack.worker_env())
    print_worker(console, worker.pid, worker.log_file)
    if worker.restarted:
        console.print("  (the detached worker was running with other settings: replaced)")
    where = pool.url if pool.kind == "comfyui" else f"{pool.url}, endpoint {pool.endpoint_id}"
    console.print(f"  {'pool':<12} {pool_name} ({pool.kind}: {where})", soft_wrap=True)

    async with stack_job_client(stack, started.config.worker.task_queue) as client:
        request = request_from_files(EXAMPLE)
        submitted = await client.submit(request)
        console.print(f"\n[bold]Job[/] {submitted.job_id} submitted ({EXAMPLE})")
        console.print(f"Temporal UI: {workflow_link(stack, submitted.job_id)}\n", soft_wrap=True)
        await stream_progress(client.watch(submitted.job_id), console)
        final = await client.result(submitted.job_id)
    console.print()
    print_summary(final, console, workflow_link(stack, final.job_id))
    await check_artifacts(console, final)
    if final.backend is not None and final.backend.pool != pool_name:
        raise DemoFailed(f"the job ran on pool {final.backend.pool!r}, not on {pool_name!r}")
    if final.backend is not None and final.backend.kind == "runpod":
        print_runpod(console, final)
        # A job that did not complete is reported as such (main prints its status).
        if final.state == JobState.COMPLETED and on_the_simulator(pool, sim):
            await check_ledger(console, sim, final)
    down = f".venv/bin/durable-comfy dev down --config {shlex.quote(str(config_file))}"
    console.print(
        f"\nThe stack is still running (state in {stack.state_dir}). Stop it with `{down}`"
        + (" or [bold]make down[/]." if config_file == DEFAULT_CONFIG_PATH.resolve() else "."),
        soft_wrap=True,
    )
    console.print(
        f"Try: `. {shlex.quote(str(stack.env_file))} && .venv/bin/durable-comfy status "
        f"{final.job_id}`  or the Temporal UI at {stack.temporal_ui}",
        soft_wrap=True,
    )
    return final


def print_runpod(console: Console, final: JobStatus) -> None:
    """The RunPod job id and the job's cost block, as JobStatus has them."""
    checkpoint = final.checkpoint
    job_id = checkpoint.provider_job_id if checkpoint is not None else None
    if job_id is None and final.cost:
        job_id = final.cost[-1].provider_job_id
    submission = checkpoint.prompt_id if checkpoint is not None else None
    console.print(
        f"\n[bold]RunPod job[/] {job_id}  (submission token {submission})", soft_wrap=True
    )
    console.print("[bold]Cost[/] (JobStatus.cost)")
    if not final.cost:
        console.print("  (none recorded)")
    for cost in final.cost:
        console.print(f"  RunPod job {cost.provider_job_id}")
        console.print(f"    queue delay        {cost.queue_s:7.2f} s")
        console.print(f"    execution          {cost.execution_s:7.2f} s")
        console.print(
            f"    billed after end   {cost.billed_after_end_s:7.2f} s"
            "  (the endpoint's idle timeout)"
        )
        if cost.usd_per_second is not None and cost.usd_estimate is not None:
            console.print(
                f"    estimate          ${cost.usd_estimate:.6f}  "
                f"({cost.billed_s:.2f} s at ${cost.usd_per_second:g}/s)"
            )


async def fetch_ledger(sim: RunpodSimSection) -> Ledger:
    async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
        answer = await http.get(f"{sim.base_url}/sim/ledger")
    answer.raise_for_status()
    return Ledger.model_validate(answer.json())


async def check_ledger(console: Console, sim: RunpodSimSection, final: JobStatus) -> None:
    """What the simulator billed for this job: one RunPod job for its submission, and each
    worker that ran it stopped within the idle timeout of its last job (waited for)."""
    submission = final.checkpoint.prompt_id if final.checkpoint else None
    if submission is None:
        raise DemoFailed("the job has no submission token (checkpoint.prompt_id)")
    wait_s = sim.idle_timeout_s + IDLE_WAIT_EXTRA_S
    console.print(
        f"[bold]Ledger[/] (GET {sim.base_url}/sim/ledger; waiting up to {wait_s:g} s for the"
        " job's workers to go idle and stop)",
        soft_wrap=True,
    )
    deadline = time.monotonic() + wait_s
    while True:
        ledger = await fetch_ledger(sim)
        jobs = ledger.jobs_for(submission)
        workers = [
            ledger.worker(worker_id)
            for worker_id in sorted({d.worker_id for job in jobs for d in job.deliveries})
        ]
        if all(w.exited_at is not None for w in workers) or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.5)

    problems: list[str] = []
    console.print(f"  jobs for submission {submission}: {len(jobs)}", soft_wrap=True)
    if len(jobs) != 1:
        problems.append(f"{len(jobs)} RunPod jobs for one submission, not one")
    for job in jobs:
        deliveries = ", ".join(
            f"{d.worker_id} {d.outcome or 'running'} ({d.billed_s:.2f} s)" for d in job.deliveries
        )
        console.print(
            f"    {job.id} {job.status}, billed {job.billed_s:.2f} s; deliveries: {deliveries}",
            soft_wrap=True,
        )
    limit = ledger.idle_timeout_s + IDLE_SLACK_S
    for w in workers:
        after = w.billed_after_last_job_s
        state = f"stopped ({w.stop_reason})" if w.exited_at is not None else f"still {w.state}"
        console.print(
            f"  worker {w.id}: billed {w.billed_s:.2f} s (cold start {w.cold_start_s:g} s), "
            f"{'-' if after is None else f'{after:.2f}'} s after its last job"
            f" (idle timeout {ledger.idle_timeout_s:g} s), {state}",
            soft_wrap=True,
        )
        if w.exited_at is None:
            problems.append(f"worker {w.id} is still {w.state} after {wait_s:g} s")
        if after is not None and after > limit:
            problems.append(f"worker {w.id} billed {after:.2f} s after its last job (> {limit:g})")
    if problems:
        raise DemoFailed("ledger: " + "; ".join(problems))
    console.print(
        "  [green]ledger: one RunPod job for the submission; no worker billed past the idle"
        " timeout[/]",
        soft_wrap=True,
    )


def main() -> None:
    config_file = (
        parse_config_path("python -m devstack.demo", "Run one example job on the local stack.")
        .expanduser()
        .resolve()
    )
    if not config_file.is_file():
        sys.exit(f"error: config file {config_file} not found")
    console = demo_console()
    try:
        final = asyncio.run(demo(console, config_file))
    except DemoFailed as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        sys.exit(1)
    if final.state != JobState.COMPLETED:
        console.print(json.dumps(final.model_dump(mode="json"), indent=2))
        sys.exit(1)


if __name__ == "__main__":
    main()
