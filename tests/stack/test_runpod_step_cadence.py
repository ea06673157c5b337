"""A running job on the `runpod` pool shows a new step at least once a second.

Our handler sends the platform a progress update every `report_interval_s` while the steps
move, and the follow reads `/status` every `status_poll_s`, start to start; a client watching
with the workers' live-progress key is pushed each read's step as the follow makes it. The
job's 300 steps take about 6 s at the simulator's 20 ms a step: the watcher's step must change
with no gap over a second between its first and its last step, and it must see most of the
reads (one step every 2-3 s before: the handler reported every 2 s).
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from pydantic import SecretStr
from temporalio.client import Client

from activities.runpod.follow import POLL_S
from devstack.free_ports import free_port
from devstack.models import RunningStack
from starter import JobClient
from tests.support.runpod_e2e import POOL, job, runpod_pool, serving
from tests.support.runpod_sim import RunpodSim
from workflows.contracts import JobState

pytestmark = pytest.mark.usefixtures("local_stack")

KEY = "cadence-" + uuid.uuid4().hex
STEPS = 300


@pytest_asyncio.fixture(loop_scope="session")
async def watching(local_stack: RunningStack, runpod_sim: RunpodSim) -> AsyncIterator[JobClient]:
    """A worker of ours with live progress on the simulator's endpoint, and a client holding
    its key (as the CLI and the gateway do with DURABLE_COMFY_LIVE_PROGRESS_KEY)."""
    pools = {POOL: runpod_pool(runpod_sim)}
    async with serving(
        local_stack, pools, live_progress_port=free_port(), live_progress_key=SecretStr(KEY)
    ) as (client, store):
        temporal: Client = client.temporal
        yield JobClient(
            temporal, task_queue=client.task_queue, store=store, live_progress_key=SecretStr(KEY)
        )


async def test_a_runpod_job_shows_a_new_step_at_least_once_a_second(
    watching: JobClient,
) -> None:
    started = await watching.submit(job(STEPS))
    changes: list[tuple[float, int]] = []  # (when the watcher saw it, the step)
    async for status in watching.watch(started.job_id):
        step = status.progress.step
        if status.state == JobState.RUNNING and (not changes or step != changes[-1][1]):
            changes.append((time.monotonic(), step))
    final = await watching.wait(started.job_id)
    assert final.state == JobState.COMPLETED, final.error

    running = [(at, step) for at, step in changes if 0 < step < STEPS]
    assert len(running) >= 3, changes
    sampling_s = running[-1][0] - running[0][0]
    gaps = [later[0] - earlier[0] for earlier, later in itertools.pairwise(running)]
    assert max(gaps) <= 1.0, f"a gap of {max(gaps):.2f} s between steps: {changes}"
    # Not one step per two seconds (the old reporting interval), but about one per read.
    assert len(running) >= sampling_s / (2 * POLL_S), (sampling_s, changes)
