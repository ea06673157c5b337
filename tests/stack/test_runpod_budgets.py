"""A tenant's daily budget end to end on the RunPod simulator: the real dev server, SeaweedFS,
our handler under the real `runpod` worker loop, and a worker of ours whose tenant has 30
GPU-seconds a day and whose budget day is about a minute long and begins with the test
(tests/support/runpod_budgets.py), so its reset comes within the test.

The tenant's jobs run until their spend passes 30 s, the next waits `PENDING`, held by the
budget, and runs after the reset; the ledger's spend is the sum of the jobs' executions on the
simulator's own ledger. (Refusing instead of holding: test_runpod_budget_refusal.py, a module of
its own so the two days run side by side.)
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
import pytest_asyncio

from configuration.tenants import TenantConfig
from devstack.models import RunningStack
from starter import JobClient
from starter.cli.render import summary_lines
from tests.support.runpod_budgets import (
    SLACK_S,
    billed,
    budgeted,
    of_tenant,
    state_of,
    usage,
)
from tests.support.runpod_e2e import settled_ledger
from tests.support.runpod_sim import ENDPOINT_VENV_MISSING, RunpodSim
from workflows.contracts import JobState, JobStatus

pytestmark = pytest.mark.skipif(
    ENDPOINT_VENV_MISSING is not None, reason=str(ENDPOINT_VENV_MISSING)
)

# Sampler steps at the simulator's 20 ms: about 16 s of execution each, so two pass 30 s.
STEPS = 800
# Two such jobs (a RunPod worker's start included) fit in a day with room to spare; the held
# job's wait for the reset is what is left of it.
DAY_S = 70.0
WAITING = f"wait-{uuid.uuid4().hex[:6]}"


@pytest_asyncio.fixture(loop_scope="session")
async def client_and_sim(
    local_stack: RunningStack, runpod_sim: RunpodSim
) -> AsyncIterator[tuple[JobClient, RunpodSim]]:
    tenants = {WAITING: TenantConfig(gpu_seconds_per_day=30)}
    async with budgeted(local_stack, runpod_sim, tenants, DAY_S) as (client, _day_s):
        yield client, runpod_sim


async def test_jobs_run_until_the_spend_passes_the_budget_then_wait_for_the_reset(
    client_and_sim: tuple[JobClient, RunpodSim],
) -> None:
    client, sim = client_and_sim
    ran: list[JobStatus] = []
    spent = 0.0
    while spent < 30.0:
        assert len(ran) < 4, "the budget should have been passed by now"
        final = await client.wait((await client.submit(of_tenant(WAITING, STEPS))).job_id)
        assert final.state == JobState.COMPLETED, final.error
        assert final.admission is None, "it never waited"
        assert final.gpu_s == pytest.approx(sum(c.execution_s for c in final.cost), abs=0.01)
        ran.append(final)
        spent = (await usage(client, WAITING)).gpu_s
    day = await usage(client, WAITING)
    assert day.over and day.jobs == len(ran), f"the jobs outlasted the {DAY_S} s day: {day}"
    assert day.gpu_s == pytest.approx(sum(s.gpu_s for s in ran), abs=0.01)
    ledger = await settled_ledger(sim)
    assert abs(day.gpu_s - billed(ledger, ran)) <= SLACK_S * len(ran), (day, ledger.jobs)

    # Over budget: the next job is checked, held PENDING until the reset, nothing submitted.
    held = await client.submit(of_tenant(WAITING, steps=20))
    pending = await state_of(client, held.job_id, JobState.PENDING, within_s=30)
    assert pending.admission is not None and pending.admission.held == "budget"
    assert pending.admission.resets_at == day.resets_at
    assert pending.checkpoint is None or pending.checkpoint.submitted_at is None
    assert "held: over budget until" in _shown(pending)
    assert day.resets_at is not None
    left = (day.resets_at - datetime.now(UTC)).total_seconds()
    final = await asyncio.wait_for(client.wait(held.job_id), left + 90)
    assert final.state == JobState.COMPLETED, final.error
    assert final.admission is None
    # It ran after the reset, and counts on the new day only.
    after = await usage(client, WAITING)
    # The same instant, but for the microsecond a day length of a fraction of a second (the
    # test's, so its day begins with it) may round either way; whole seconds, as the default
    # 86,400, are exact.
    assert after.day_started_at is not None and day.resets_at is not None
    assert abs((after.day_started_at - day.resets_at).total_seconds()) < 0.001
    assert after.jobs == 1 and after.gpu_s == pytest.approx(final.gpu_s, abs=0.01)
    ledger = await settled_ledger(sim)
    assert abs(after.gpu_s - billed(ledger, [final])) <= SLACK_S
    assert final.checkpoint is not None and final.checkpoint.submitted_at is not None
    assert final.checkpoint.submitted_at >= day.resets_at, "submitted after the reset"


def _shown(status: JobStatus) -> str:
    """The status as `durable-comfy status` prints it."""
    return "\n".join(summary_lines(status))
