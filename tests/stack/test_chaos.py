"""Chaos: real faults injected into the real stack while a job runs.

Workers are `python worker.py` subprocesses that get `kill -9`ed; the Temporal dev server and
the ComfyUI simulator are killed and restarted by PID; the simulator cuts, stalls or poisons the
job's socket on request: each fault is faults/inject.py's, as in `make soak` and `make
demo-chaos`. Every test then checks what the job's owner cares about: the job ends in the right
state, the GPU work ran once (or was stopped), and nothing was left behind.

The stack is this module's own (its services get killed; the session's `local_stack` must not).
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from temporalio.client import WorkflowExecutionStatus

from activities.storage import ArtifactStore
from faults.graphs import (
    EARLY_SAVE_NODE,
    SAMPLER_NODE,
    SAVE_NODE,
    chaos_policy,
    sampler_graph,
    seed_segments,
    two_output_graph,
)
from faults.harness import (
    ORPHAN_SWEEP_S,
    ChaosCase,
    ChaosStack,
    SimControl,
    StepWatcher,
    Timeline,
    with_step_delay,
)
from faults.inject import crash_worker
from starter.connection import connect_temporal
from tests.conftest import StackConfigFactory, free_port
from workflows.contracts import JobRequest, JobState, JobStatus
from workflows.shared import ErrorType

# One simulated sampler step. Long enough that a fault lands mid-sampling, short enough that a
# 40-step prompt takes 4 s.
STEP_DELAY_MS = 100
HEARTBEAT_S = 2.0
JOB_DEADLINE_S = 90.0  # generous for a loaded 2-core CI machine; a healthy run takes ~10 s


class ChaosEnv:
    """Module-wide: the stack, one S3 client, the simulator's controls (one HTTP client)."""

    def __init__(self, stack: ChaosStack, store: ArtifactStore, sim: SimControl) -> None:
        self.stack = stack
        self.store = store
        self.sim = sim


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def chaos_env(stack_config_factory: StackConfigFactory) -> AsyncIterator[ChaosEnv]:
    config = with_step_delay(stack_config_factory("chaos"), STEP_DELAY_MS)
    stack = await ChaosStack.start(config, Path(config.state_dir).parent)
    try:
        async with (
            httpx.AsyncClient(trust_env=False) as http,
            ArtifactStore(stack.s3_settings()) as store,
        ):
            yield ChaosEnv(stack, store, SimControl(stack.sim_url, http))
    finally:
        await stack.stop()


@pytest_asyncio.fixture(loop_scope="session")
async def case(
    chaos_env: ChaosEnv, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[ChaosCase]:
    """A fresh task queue, workers, client and step watcher; everything stopped afterwards."""
    stack = chaos_env.stack
    await stack.ensure_up()  # an earlier test may have failed with a service down
    await chaos_env.sim.reset()
    # A client per test: one that lived through an earlier test's Temporal restart must not
    # decide whether this test passes.
    temporal = await connect_temporal(stack.running.temporal_address, stack.running.namespace)
    name = request.node.name.removeprefix("test_").split("[")[0].replace("_", "-")[:24]
    async with StepWatcher(stack.sim_url) as watcher:
        chaos = ChaosCase(
            stack, temporal, chaos_env.store, chaos_env.sim, watcher, tmp_path, name=name
        )
        try:
            yield chaos
        finally:
            leftovers = await chaos.cleanup()
            # Captured output: pytest shows it only when the test failed, which is when it helps.
            print(chaos.report())
    assert leftovers == [], f"worker processes still running after the test: {leftovers}"


def explain(final: JobStatus, timeline: Timeline) -> str:
    return f"final: {final.model_dump_json(indent=1)}\ntimeline:\n{timeline.render()}"


# -- (a) worker kill -9 ------------------------------------------------------------------------


async def test_worker_sigkill_mid_sampling_resumes_from_checkpoint(case: ChaosCase) -> None:
    steps = 40
    worker = await case.workers.start()
    job_id = await case.submit(JobRequest(graph=sampler_graph(steps), policy=chaos_policy()))
    async with case.timeline(job_id) as timeline:
        prompt_id = await case.watcher.wait_step(10, node=SAMPLER_NODE)
        await crash_worker(worker, on_killed=lambda: timeline.mark("worker killed (SIGKILL)"))
        timeline.mark("worker restarted")
        final = await timeline.wait_terminal(timeout_s=JOB_DEADLINE_S)

    assert final.state == JobState.COMPLETED, explain(final, timeline)
    stats = await case.sim.stats()
    assert stats.prompts == {prompt_id: 1}, "the prompt must be submitted exactly once"
    assert stats.executions == {prompt_id: 1}
    after = timeline.statuses_after("worker killed")
    assert after, explain(final, timeline)
    # The workflow resumed from its checkpoint: what the first answer after the kill says is
    # where it was, never a fresh start.
    assert after[0].step > 0 or after[0].state == JobState.COMPLETED, explain(final, timeline)
    assert all(entry.step > 0 for entry in after), explain(final, timeline)
    assert not timeline.step_regressions(), explain(final, timeline)
    assert final.progress.step == steps and final.progress.fraction == 1.0
    assert final.checkpoint is not None and final.checkpoint.prompt_id == prompt_id
    assert final.artifacts and all(a.node_id == SAVE_NODE for a in final.artifacts)
    # The replacement worker is the one that finished it.
    assert job_id in worker.log_text(since_start=True)
    await case.assert_nothing_left(job_id)


# -- (b) Temporal dev server kill -9 -----------------------------------------------------------


async def test_temporal_server_killed_and_restarted_mid_job(case: ChaosCase) -> None:
    worker = await case.workers.start()
    job_id = await case.submit(JobRequest(graph=sampler_graph(60), policy=chaos_policy()))
    async with case.timeline(job_id) as timeline:
        prompt_id = await case.watcher.wait_step(10, node=SAMPLER_NODE)
        await case.stack.services.kill("temporal")
        timeline.mark("temporal server killed (SIGKILL)")
        # Down for longer than the heartbeat timeout (the dev server is back in ~0.3 s
        # otherwise): the prompt runs on while every heartbeat and signal fails.
        down_at = case.watcher.step(prompt_id, SAMPLER_NODE)
        await case.watcher.wait_step(down_at + 25, node=SAMPLER_NODE)
        await case.stack.services.start("temporal")
        timeline.mark("temporal server restarted on the same db")
        final = await timeline.wait_terminal(timeout_s=JOB_DEADLINE_S + 30)

    assert final.state == JobState.COMPLETED, explain(final, timeline)
    assert (await case.sim.stats()).prompts == {prompt_id: 1}
    # Nobody restarted the worker: it found the server again by itself.
    assert worker.alive and len(worker.pids) == 1
    # The re-attach after the outage continues from the checkpoint, never from step 0.
    assert not timeline.step_regressions(), explain(final, timeline)
    await case.assert_nothing_left(job_id)


# -- (c) the job's WebSocket dropped, or stalled ------------------------------------------------


async def test_websocket_dropped_mid_job_reattaches_without_resubmitting(case: ChaosCase) -> None:
    await case.workers.start()
    # ~2 events per step (progress_state + progress): cut at about step 10 of 40.
    cut = await case.sim_faults.cut_socket(after_events=20)
    job_id = await case.submit(JobRequest(graph=sampler_graph(40), policy=chaos_policy()))
    async with case.timeline(job_id) as timeline:
        final = await timeline.wait_terminal(timeout_s=JOB_DEADLINE_S)

    assert final.state == JobState.COMPLETED, explain(final, timeline)
    stats = await case.sim.stats()
    assert final.checkpoint is not None and final.checkpoint.prompt_id is not None
    assert stats.prompts == {final.checkpoint.prompt_id: 1}, "no resubmission after a lost socket"
    assert cut.fired(), "the simulator never cut the socket"
    assert final.reconnects >= 1, explain(final, timeline)
    assert stats.ws_connections >= 2 + 1, "the job re-attached on a new socket"  # + observer
    assert not timeline.step_regressions(), explain(final, timeline)
    await case.assert_nothing_left(job_id)


async def test_websocket_stalled_longer_than_heartbeat_timeout(case: ChaosCase) -> None:
    await case.workers.start()
    # Silent for longer than the heartbeat timeout while the prompt runs on: a live prompt
    # behind a quiet socket is not a failure, and must never be submitted again.
    stall = await case.sim_faults.stall_socket(for_s=HEARTBEAT_S + 3.0, after_events=10)
    policy = chaos_policy(heartbeat_timeout_s=HEARTBEAT_S)
    job_id = await case.submit(JobRequest(graph=sampler_graph(80), policy=policy))
    async with case.timeline(job_id) as timeline:
        final = await timeline.wait_terminal(timeout_s=JOB_DEADLINE_S)

    assert final.state == JobState.COMPLETED, explain(final, timeline)
    assert stall.fired(), "the simulator never stalled the socket"
    assert final.checkpoint is not None and final.checkpoint.prompt_id is not None
    stats = await case.sim.stats()
    assert stats.prompts == {final.checkpoint.prompt_id: 1}, "no resubmission after a stall"
    assert stats.executions == {final.checkpoint.prompt_id: 1}
    assert not timeline.step_regressions(), explain(final, timeline)
    await case.assert_nothing_left(job_id)


# -- (d) ComfyUI restarted: history lost --------------------------------------------------------


async def test_comfyui_restart_loses_prompt_and_it_is_resubmitted_once(case: ChaosCase) -> None:
    await case.workers.start()
    job_id = await case.submit(JobRequest(graph=sampler_graph(40), policy=chaos_policy()))
    async with case.timeline(job_id) as timeline:
        first = await case.watcher.wait_step(10, node=SAMPLER_NODE)
        await case.stack.services.restart(
            "comfyui_sim",
            on_killed=lambda: timeline.mark(
                "comfyui simulator killed (SIGKILL): queue and history lost"
            ),
        )
        timeline.mark("comfyui simulator restarted")
        final = await timeline.wait_terminal(timeout_s=JOB_DEADLINE_S)

    assert final.state == JobState.COMPLETED, explain(final, timeline)
    assert final.checkpoint is not None and final.checkpoint.prompt_id is not None
    # The restarted simulator's counters start at zero: exactly one submission reached it.
    stats = await case.sim.stats()
    assert stats.prompts == {final.checkpoint.prompt_id: 1}, (first, stats, timeline.render())
    assert stats.executed == {final.checkpoint.prompt_id: "success"}
    assert final.artifacts, explain(final, timeline)
    await case.assert_nothing_left(job_id)


# -- (e) out of memory --------------------------------------------------------------------------


async def test_out_of_memory_fails_typed_and_frees_the_backend(case: ChaosCase) -> None:
    await case.workers.start()
    await case.sim_faults.out_of_memory()
    job_id = await case.submit(JobRequest(graph=sampler_graph(20), policy=chaos_policy()))
    async with case.timeline(job_id) as timeline:
        final = await timeline.wait_terminal(timeout_s=JOB_DEADLINE_S)

    assert final.state == JobState.FAILED, explain(final, timeline)
    assert final.error is not None and final.error.type == ErrorType.OUT_OF_MEMORY, final.error
    stats = await case.sim.stats()
    assert stats.frees >= 1, "POST /free must be sent so the next job gets its memory back"
    assert len(stats.prompts) == 1 and list(stats.prompts.values()) == [1], "an OOM is not retried"
    assert final.teardown.state == "CONFIRMED", final.teardown
    await case.assert_nothing_left(job_id)


# -- (f) abandonment ----------------------------------------------------------------------------


async def test_attached_job_without_client_contact_is_abandoned(case: ChaosCase) -> None:
    abandon_after_s = 3.0
    await case.workers.start()
    request = JobRequest(
        graph=sampler_graph(300), policy=chaos_policy(abandon_after_s=abandon_after_s)
    )
    # Attached, and then nobody watches: queries are not contact, only client_seen/attach are.
    job_id = await case.submit(request, detached=False)
    async with case.timeline(job_id, keepalive_s=None) as timeline:
        prompt_id = await case.watcher.wait_step(1, node=SAMPLER_NODE)
        final = await timeline.wait_terminal(timeout_s=abandon_after_s + 30)

    assert final.state == JobState.ABANDONED, explain(final, timeline)
    stats = await case.sim.stats()
    assert prompt_id in stats.interrupts and prompt_id in stats.interrupted, stats
    assert stats.executed.get(prompt_id) == "interrupted", stats
    assert final.teardown.state == "CONFIRMED", final.teardown
    assert final.teardown.at is not None
    # Not before the deadline: abandonment is a deliberate decision after `abandon_after_s`.
    assert final.created_at is not None and final.updated_at is not None
    assert (final.updated_at - final.created_at).total_seconds() >= abandon_after_s
    await case.assert_nothing_left(job_id)


# -- (g) cancel ---------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["cancel_signal", "temporal_cancel"])
async def test_cancel_mid_job_interrupts_and_keeps_finished_artifacts(
    case: ChaosCase, how: str
) -> None:
    await case.workers.start()
    request = JobRequest(graph=two_output_graph(300), policy=chaos_policy())
    job_id = await case.submit(request)
    async with case.timeline(job_id) as timeline:
        prompt_id = await case.watcher.wait_step(5, node=SAMPLER_NODE)
        # The early output ran first (ComfyUI runs ready output nodes first) and is finished on
        # the backend; whether its `executed` event reached the job's socket or not (it may
        # finish before the socket is open) is the job's business, not the test's.
        assert case.watcher.step(prompt_id, EARLY_SAVE_NODE) >= 1, case.watcher.steps
        if how == "cancel_signal":
            await case.client.cancel(job_id, "chaos test: changed my mind")
        else:
            await case.client.handle(job_id).cancel()
        timeline.mark(f"cancelled ({how})")
        final = await timeline.wait_terminal(timeout_s=30)

    assert final.state == JobState.CANCELLED, explain(final, timeline)
    stats = await case.sim.stats()
    assert prompt_id in stats.interrupted, stats
    assert stats.prompts == {prompt_id: 1}
    assert final.teardown.state == "CONFIRMED", final.teardown
    kept = [a for a in final.artifacts if a.node_id == EARLY_SAVE_NODE]
    assert len(kept) == 1, f"the finished output must be kept: {explain(final, timeline)}"
    stored = await case.store.head(kept[0].key)
    assert stored is not None, f"{kept[0].uri} is not in S3"
    assert stored.size == kept[0].size > 0 and stored.sha256 == kept[0].sha256
    # The sampler branch never finished, so it has nothing to keep.
    assert not [a for a in final.artifacts if a.node_id == SAVE_NODE], final.artifacts
    await case.assert_nothing_left(job_id)


# -- (h) segments -------------------------------------------------------------------------------


async def test_segmented_job_with_worker_killed_in_segment_two(case: ChaosCase) -> None:
    steps = 30
    worker = await case.workers.start()
    request = JobRequest(
        graph=sampler_graph(steps), segments=seed_segments(3), policy=chaos_policy()
    )
    job_id = await case.submit(request)
    async with case.timeline(job_id) as timeline:
        first = await case.watcher.wait_step(steps, node=SAMPLER_NODE)
        second = await case.watcher.wait_step(8, node=SAMPLER_NODE, exclude={first})
        await crash_worker(
            worker, on_killed=lambda: timeline.mark("worker killed (SIGKILL) in segment 2")
        )
        timeline.mark("worker restarted")
        final = await timeline.wait_terminal(timeout_s=JOB_DEADLINE_S)

    assert final.state == JobState.COMPLETED, explain(final, timeline)
    stats = await case.sim.stats()
    assert len(stats.prompts) == 3, stats.prompts
    assert set(stats.prompts.values()) == {1}, "no segment's prompt is submitted twice"
    assert stats.prompts.get(first) == 1 and stats.executions.get(first) == 1, "segment 1 reused"
    assert stats.prompts.get(second) == 1
    assert sorted({a.segment for a in final.artifacts}) == [0, 1, 2], final.artifacts
    after = timeline.statuses_after("worker killed")
    assert all(entry.segment >= 1 for entry in after), explain(final, timeline)
    assert not timeline.step_regressions(), explain(final, timeline)
    assert final.progress.segment == 2 and final.progress.fraction == 1.0
    await case.assert_nothing_left(job_id)


# -- (i) a stop during a node that ignores interrupts ----------------------------------------------

# Longer than the old teardown's whole retry budget (~9 s): the prompt runs on that long after
# the first interrupt, as a real node without a progress hook (a model load, a big decode) does.
STUBBORN_S = 12.0


@pytest.mark.parametrize("how", ["cancel", "abandon", "deadline"])
async def test_stop_during_a_node_that_ignores_interrupts_ends_only_when_the_prompt_is_gone(
    case: ChaosCase, how: str
) -> None:
    await case.workers.start()
    await case.sim_faults.ignore_interrupts(for_s=STUBBORN_S)
    policy = chaos_policy(
        abandon_after_s=3.0 if how == "abandon" else None,
        execution_timeout_s=6.0 if how == "deadline" else 300.0,
    )
    request = JobRequest(graph=sampler_graph(600), policy=policy)
    job_id = await case.submit(request, detached=how != "abandon")
    async with case.timeline(job_id, keepalive_s=None) as timeline:
        prompt_id = await case.watcher.wait_step(3, node=SAMPLER_NODE)
        if how == "cancel":
            await case.client.cancel(job_id, "chaos test: stop during a stubborn node")
            timeline.mark("cancelled")
        await timeline.wait_for(
            lambda s: s.state == JobState.STOPPING, timeout_s=15, what="the job is stopping"
        )
        final = await timeline.wait_terminal(timeout_s=STUBBORN_S + 40)
        queue_at_end = await case.sim.queue()

    expected = {"cancel": JobState.CANCELLED, "abandon": JobState.ABANDONED}
    assert final.state == expected.get(how, JobState.FAILED), explain(final, timeline)
    if how == "deadline":
        assert final.error is not None and final.error.type == ErrorType.TIMEOUT
    # The simulator's own word: the prompt was interrupted, and gone before the job ended.
    assert prompt_id not in queue_at_end.running + queue_at_end.pending, queue_at_end
    stats = await case.sim.stats()
    assert stats.executed.get(prompt_id) == "interrupted", stats
    assert final.updated_at is not None
    assert stats.ended_at[prompt_id] <= final.updated_at.timestamp(), (stats, final.updated_at)
    assert final.teardown.state == "CONFIRMED", final.teardown
    actions = [step.action for step in final.teardown.steps]
    assert actions == ["interrupt_sent", "interrupted"], final.teardown
    sent, landed = final.teardown.steps
    assert landed.node == SAMPLER_NODE
    assert (landed.at - sent.at).total_seconds() >= STUBBORN_S - 1.0, final.teardown
    assert final.teardown.checks >= 3, final.teardown
    await case.assert_nothing_left(job_id)


async def test_stop_past_the_teardown_horizon_fails_the_teardown_and_holds_the_pool(
    case: ChaosCase,
) -> None:
    await case.workers.start()
    await case.sim_faults.ignore_interrupts(for_s=STUBBORN_S)
    policy = chaos_policy().model_copy(update={"teardown_horizon_s": 3.0})
    job_id = await case.submit(JobRequest(graph=sampler_graph(600), policy=policy))
    async with case.timeline(job_id) as timeline:
        prompt_id = await case.watcher.wait_step(3, node=SAMPLER_NODE)
        await case.client.cancel(job_id, "chaos test: a stop that cannot finish in time")
        timeline.mark("cancelled")
        final = await timeline.wait_terminal(timeout_s=30)

    assert final.state == JobState.CANCELLED, explain(final, timeline)
    assert final.teardown.state == "FAILED", final.teardown
    assert final.backend is not None
    assert prompt_id in final.teardown.detail and repr(final.backend.pool) in final.teardown.detail
    assert final.teardown.steps[-1].action == "still_running", final.teardown
    assert prompt_id in (await case.sim.queue()).running, "the stubborn prompt still runs"

    # The pool takes no new work while the stuck prompt holds its GPU; then it does.
    second = await case.submit(JobRequest(graph=sampler_graph(5), policy=chaos_policy()))
    async with case.timeline(second) as later:
        held = await later.wait_for(
            lambda s: s.error is not None and "busy" in s.error.message,
            timeout_s=20,
            what="the second job is held off the busy pool",
        )
        assert held.state == JobState.SUBMITTING, explain(held, later)
        assert held.error is not None and prompt_id in held.error.message
        assert (await case.sim.queue()).pending == [], "nothing queued behind the stuck prompt"
        done = await later.wait_terminal(timeout_s=STUBBORN_S + 40)

    assert done.state == JobState.COMPLETED, explain(done, later)
    assert done.checkpoint is not None and done.checkpoint.prompt_id is not None
    stats = await case.sim.stats()
    assert stats.executed.get(prompt_id) == "interrupted"
    assert stats.prompts[done.checkpoint.prompt_id] == 1
    await case.assert_nothing_left(second)


# -- (j) terminate: the orphan sweep -------------------------------------------------------------


async def test_terminate_mid_job_leaves_an_orphan_that_the_sweep_stops(case: ChaosCase) -> None:
    worker = await case.workers.start()
    job_id = await case.submit(JobRequest(graph=sampler_graph(600), policy=chaos_policy()))
    prompt_id = await case.watcher.wait_step(5, node=SAMPLER_NODE)
    # What `temporal workflow terminate` does: no teardown runs, the prompt keeps running.
    await case.client.handle(job_id).terminate(reason="chaos test: terminated from outside")
    started = time.monotonic()
    queue = await case.sim.wait_idle(timeout_s=ORPHAN_SWEEP_S * 1.25 + 10)
    took = time.monotonic() - started
    assert queue.empty
    stats = await case.sim.stats()
    assert stats.executed.get(prompt_id) == "interrupted", stats
    assert took <= ORPHAN_SWEEP_S * 1.25 + 5, f"swept after {took:.1f} s"
    assert "orphan_swept" in worker.log_text() and prompt_id in worker.log_text()
    assert await case.workflow_status(job_id) == WorkflowExecutionStatus.TERMINATED
    status = await case.client.status(job_id)
    assert status.state == JobState.TERMINATED, status


# -- (k) metrics ---------------------------------------------------------------------------------


async def test_worker_serves_sdk_and_job_metrics_on_its_prometheus_port(case: ChaosCase) -> None:
    port = free_port()
    case.workers.env["DURABLE_COMFY_METRICS_PORT"] = str(port)
    await case.workers.start()
    done = await case.submit(JobRequest(graph=sampler_graph(5), policy=chaos_policy()))
    async with case.timeline(done) as timeline:
        final = await timeline.wait_terminal(timeout_s=JOB_DEADLINE_S)
    assert final.state == JobState.COMPLETED, explain(final, timeline)
    assert final.checkpoint is not None and final.checkpoint.prompt_id is not None
    orphaned = await case.submit(JobRequest(graph=sampler_graph(600), policy=chaos_policy()))
    await case.watcher.wait_step(3, node=SAMPLER_NODE, exclude={final.checkpoint.prompt_id})
    await case.client.handle(orphaned).terminate(reason="chaos test: an orphan for the metric")
    await case.sim.wait_idle(timeout_s=ORPHAN_SWEEP_S * 1.25 + 10)

    async with httpx.AsyncClient(trust_env=False) as http:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    assert re.search(r'^durable_comfy_jobs_ended\{[^}]*state="COMPLETED"[^}]*\} 1$', text, re.M)
    assert re.search(r"^durable_comfy_bytes_offloaded\{[^}]*\} [1-9]", text, re.M), text[-2000:]
    assert re.search(r'^durable_comfy_orphans_swept\{[^}]*action="interrupted"', text, re.M)
    assert re.search(r"^durable_comfy_teardown_seconds_count\{", text, re.M)
    assert "temporal_workflow_completed" in text, "the SDK's own metrics are on the same endpoint"
