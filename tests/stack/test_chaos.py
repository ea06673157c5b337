"""Chaos: real faults injected into the real stack while a job runs, on the job's path (a worker,
Temporal, the socket, ComfyUI, memory); the stops are tests/stack/test_chaos_stops.py.

Workers are `python worker.py` subprocesses that get `kill -9`ed; the Temporal dev server and
the ComfyUI simulator are killed and restarted by PID; the simulator cuts, stalls or poisons the
job's socket on request: each fault is faults/inject.py's, as in `make soak` and `make
demo-chaos`. Every test then checks what the job's owner cares about: the job ends in the right
state, the GPU work ran once (or was stopped), and nothing was left behind.

The stack is this module's own (its services get killed; the session's `local_stack` must not).
"""

from __future__ import annotations

from faults.graphs import (
    SAMPLER_NODE,
    SAVE_NODE,
    chaos_policy,
    sampler_graph,
    seed_segments,
)
from faults.harness import (
    ChaosCase,
)
from faults.inject import crash_worker
from tests.stack.chaos_env import HEARTBEAT_S, JOB_DEADLINE_S, explain
from workflows.contracts import JobRequest, JobState
from workflows.shared import ErrorType

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
