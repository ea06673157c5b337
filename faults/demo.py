"""`make demo-chaos`: the demo's job, with its worker `kill -9`ed mid-job and its socket cut once.

On the local stack `make demo` starts (temporal-dev.yaml; `--config PATH`, `make demo-chaos
CONFIG=PATH`, another stack file, else $DURABLE_COMFY_CONFIG as for the demo), with a worker
process of its own on a task queue of its own (so that no other worker can quietly finish the job):

1. the ComfyUI simulator is told to cut the job's WebSocket once, early in sampling;
2. the job is submitted (attached; this process keeps it alive) and its timeline is printed live:
   time, state, step, reconnects, and what was done to it;
3. once the sampler is well past the cut, the worker gets SIGKILL, and a new one is started;
4. the job must finish COMPLETED with its prompt submitted exactly once (`/sim/stats`), its
   artifact checked against the sha256 through a presigned URL.

Exit code 0 only then. The detached demo worker is stopped first and started again at the end, so
`make down` finds the stack as `make demo` leaves it.

The faults are inject.py's and the timeline recorder, worker process and simulator controls the
chaos tests' own harness: one implementation of "kill a worker and watch what the job does",
shown here, asserted on in tests/stack/test_chaos.py and run at random by `make soak`.
"""

from __future__ import annotations

import asyncio
import shlex
import sys
from pathlib import Path

import httpx
from rich.console import Console

from devstack.config import DEFAULT_CONFIG_PATH
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
from devstack.models import RunningStack
from devstack.services import StackPaths
from devstack.worker_process import ensure_worker, stop_worker
from faults.graphs import SAMPLER_NODE, fresh_seed
from faults.inject import ArmedComfyFault, ComfyFaults, crash_worker
from faults.sim import SimControl, StepWatcher
from faults.timeline import Timeline
from faults.wait import ChaosTimeout
from faults.worker_proc import KillableWorker
from starter.cli.render import print_summary
from starter.requests import request_from_files
from workflows.contracts import JobPolicy, JobState, JobStatus, ReconnectPolicy

TASK_QUEUE = "durable-comfy-chaos-demo"
STEPS = 80  # 8 s of sampling at the default 100 ms per simulated step
CUT_AFTER_EVENTS = 30  # the simulator cuts the job's socket around step 8
KILL_AT_STEP = 35  # well after the cut, well before the end
JOB_DEADLINE_S = 180.0

# Short enough that a dead worker is noticed in seconds (a demo, not production defaults).
POLICY = JobPolicy(
    heartbeat_timeout_s=3.0,
    reconnect=ReconnectPolicy(base_delay_s=0.5, max_delay_s=3.0, horizon_s=120.0),
    abandon_after_s=60.0,
    progress_interval_s=0.3,
)


class Outcome:
    def __init__(self, final: JobStatus, submissions: int, prompt_id: str | None) -> None:
        self.final = final
        self.submissions = submissions
        self.prompt_id = prompt_id

    @property
    def ok(self) -> bool:
        return self.final.state == JobState.COMPLETED and self.submissions == 1


async def watch_socket_cut(cut: ArmedComfyFault, timeline: Timeline) -> None:
    """Put the simulator's own "I cut it" on the timeline, at the moment it says so."""
    await cut.wait_fired(timeout_s=JOB_DEADLINE_S)
    timeline.mark("ComfyUI socket cut by the simulator (fault)")


async def run_demo(console: Console, config_file: Path) -> Outcome:
    """`config_file` is absolute: it is what the workers are told to read."""
    started = await start_demo_stack(console, config_file)
    config, base_dir, stack = started.config, started.base_dir, started.running
    stopped = await stop_worker(config, base_dir)
    if stopped is not None:
        console.print(
            f"  stopped the detached demo worker (pid {stopped}); it comes back at the end"
        )

    paths = StackPaths.of(config, base_dir)
    env = {**stack.worker_env(), "DURABLE_COMFY_TASK_QUEUE": TASK_QUEUE}
    worker = KillableWorker(env, paths.logs / "chaos-demo-worker.log", name="chaos-demo worker")
    try:
        await worker.start()
        print_worker(console, worker.pid, worker.log_file)
        return await _run_job(console, stack, worker, paths)
    finally:
        await worker.terminate()
        detached = await ensure_worker(config, base_dir, stack.worker_env())
        down = "make down"
        if config_file != DEFAULT_CONFIG_PATH.resolve():
            down += f" CONFIG={shlex.quote(str(config_file))}"
        console.print(
            f"\nThe stack and the detached demo worker (pid {detached.pid}) are still running; "
            f"stop them with [bold]{down}[/].",
            soft_wrap=True,
        )


async def _run_job(
    console: Console, stack: RunningStack, worker: KillableWorker, paths: StackPaths
) -> Outcome:
    sim_url = stack.comfyui_url
    request = request_from_files(EXAMPLE)
    request.graph[SAMPLER_NODE]["inputs"]["steps"] = STEPS
    # A seed of its own: an unchanged graph would be answered from the simulator's cache.
    request.graph[SAMPLER_NODE]["inputs"]["seed"] = fresh_seed()
    # The comfyui pool by name: the stack's default pool is the RunPod simulator, and the
    # faults armed here are the ComfyUI simulator's.
    request = request.model_copy(update={"policy": POLICY, "pool": "comfyui"})
    async with (
        httpx.AsyncClient(trust_env=False) as http,
        stack_job_client(stack, TASK_QUEUE) as client,
        StepWatcher(sim_url) as steps,
    ):
        sim = SimControl(sim_url, http)
        await sim.reset()
        sim_faults = ComfyFaults(sim_url, http, paths.log_file("comfyui_sim"))
        socket_cut = await sim_faults.cut_socket(after_events=CUT_AFTER_EVENTS)
        submitted = await client.submit(request)
        job_id = submitted.job_id
        console.print(f"\n[bold]Job[/] {job_id} submitted ({EXAMPLE}, {STEPS} steps)")
        console.print(f"Temporal UI: {workflow_link(stack, job_id)}\n")
        console.print("[bold]Timeline[/]  (time, state, step, reconnects; --- what was done)")
        async with Timeline(client, job_id, keepalive_s=5.0) as timeline:
            timeline.on_entry(
                lambda entry: console.print(entry.render(), highlight=False, soft_wrap=True)
            )
            timeline.mark(f"simulator armed: cut the job's socket after {CUT_AFTER_EVENTS} events")
            cut = asyncio.create_task(watch_socket_cut(socket_cut, timeline))
            try:
                prompt_id = await steps.wait_step(KILL_AT_STEP, node=SAMPLER_NODE, timeout_s=60)
                killed = f"worker killed (kill -9) at sampler step >= {KILL_AT_STEP}"
                await crash_worker(worker, on_killed=lambda: timeline.mark(killed))
                timeline.mark(f"worker restarted (pid {worker.pid})")
                await timeline.wait_terminal(timeout_s=JOB_DEADLINE_S)
            finally:
                cut.cancel()
        final = await client.result(job_id)
        stats = await sim.stats()
    submissions = stats.prompts.get(prompt_id, 0)
    console.print()
    print_summary(final, console, workflow_link(stack, job_id))
    cut_seen = "yes" if socket_cut.fired() else "no"
    console.print(
        f"  prompt {prompt_id}: submitted {submissions} time(s) to ComfyUI (/sim/stats), "
        f"{final.reconnects} reconnect(s), socket cut: {cut_seen}"
    )
    await check_artifacts(console, final)
    return Outcome(final, submissions, prompt_id)


def main() -> None:
    config_file = (
        parse_config_path(
            "python -m faults.demo",
            "The demo's job with its worker killed mid-job and its socket cut.",
        )
        .expanduser()
        .resolve()
    )
    if not config_file.is_file():
        sys.exit(f"error: config file {config_file} not found")
    console = demo_console()
    try:
        outcome = asyncio.run(run_demo(console, config_file))
    except ChaosTimeout as exc:
        console.print(f"[red]the job did not finish in time[/]: {exc}")
        sys.exit(1)
    if outcome.ok:
        console.print("\n[green]Survived[/]: COMPLETED, and the prompt ran exactly once.")
        return
    console.print(
        f"\n[red]Not survived[/]: state {outcome.final.state.value}, "
        f"{outcome.submissions} submission(s) of the prompt."
    )
    sys.exit(1)


if __name__ == "__main__":
    main()
