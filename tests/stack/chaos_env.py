"""The chaos tests' own stack and per-test case (tests/stack/test_chaos*.py): real faults injected
into the real stack while a job runs.

The stack is a module's own (its services get killed; the session's `local_stack` must not), so
each chaos file starts one: two files, so that `--dist loadfile` can run them side by side.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from activities.storage import ArtifactStore
from faults.harness import ChaosCase, ChaosStack, SimControl, StepWatcher, Timeline, with_step_delay
from starter.connection import connect_temporal
from tests.conftest import StackConfigFactory
from workflows.contracts import JobStatus

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
