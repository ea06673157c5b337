"""Tenants' daily budgets end to end on the RunPod simulator: the real dev server, SeaweedFS, our
handler under the real `runpod` worker loop, and a worker of ours whose tenants have budgets
and whose budget day is short (`DURABLE_COMFY_BUDGET_DAY_S`), so a reset comes within the test.

A tenant with 30 GPU-seconds a day: its jobs run until their spend passes 30 s, the next waits
`PENDING`, held by the budget, and runs after the reset; the ledger's spend is the sum of the
jobs' executions on the simulator's own ledger. A tenant whose settings refuse: its next job is
refused at submission (`BudgetExceeded`), naming the reset.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import pytest_asyncio

from configuration.tenants import TenantConfig
from devstack.models import RunningStack
from devstack.runpod_sim import Ledger
from starter import BudgetExceeded, JobClient
from starter.cli.render import summary_lines
from tests.support.cli import cli_env, run_cli
from tests.support.runpod_e2e import POOL, job, runpod_pool, serving, settled_ledger
from tests.support.runpod_sim import ENDPOINT_VENV_MISSING, RunpodSim
from workflows.budgets import BudgetUsage, day_of
from workflows.contracts import JobRequest, JobState, JobStatus
from workflows.shared import ledger_id

pytestmark = pytest.mark.skipif(
    ENDPOINT_VENV_MISSING is not None, reason=str(ENDPOINT_VENV_MISSING)
)

# Long enough for two jobs of ~15 s each (a RunPod worker's cold start included) inside one
# budget day, short enough that the held job's wait for the reset is a test's wait.
DAY_S = 90.0
# Sampler steps at the simulator's 20 ms: about 20 s of execution each (two pass 30 s).
STEPS = 1000
WAITING = f"wait-{uuid.uuid4().hex[:6]}"
REFUSING = f"refuse-{uuid.uuid4().hex[:6]}"
TENANTS = {
    WAITING: TenantConfig(gpu_seconds_per_day=30),
    REFUSING: TenantConfig(gpu_seconds_per_day=5, over_budget="refuse"),
}
# What a RunPod job's `executionTime` and the simulator's billing may differ by (clock reads).
SLACK_S = 1.0


@pytest_asyncio.fixture(loop_scope="session")
async def budgeted(
    local_stack: RunningStack, runpod_sim: RunpodSim
) -> AsyncIterator[tuple[JobClient, RunpodSim]]:
    pool = runpod_pool(runpod_sim)
    async with serving(local_stack, {POOL: pool}, tenants=TENANTS, budget_day_s=DAY_S) as (
        client,
        _store,
    ):
        yield client, runpod_sim
        for tenant in TENANTS:
            handle = client.temporal.get_workflow_handle(ledger_id(tenant))
            try:
                await handle.terminate("test over")
            except Exception:
                pass


def of_tenant(tenant: str, steps: int = STEPS) -> JobRequest:
    """A job of `tenant`, its seed its own (ComfyUI serves a graph it ran before from its cache,
    in no time)."""
    request = job(steps=steps, progress_interval_s=1.0)
    graph = request.graph
    graph["3"]["inputs"]["seed"] = uuid.uuid4().int % 2**48
    return request.model_copy(update={"labels": {"tenant": tenant}, "graph": graph})


async def a_fresh_day(needed_s: float) -> None:
    """Wait, if the budget day now has less than `needed_s` left, for the next one."""
    now = datetime.now(UTC)
    _start, end = day_of(now, DAY_S)
    if (end - now).total_seconds() < needed_s:
        await asyncio.sleep((end - now).total_seconds() + 0.5)


async def usage(client: JobClient, tenant: str) -> BudgetUsage:
    found = await client.tenant_usage(tenant)
    assert found is not None, f"no ledger for {tenant}"
    return found


def billed(ledger: Ledger, statuses: list[JobStatus]) -> float:
    """What the simulator billed for the jobs' RunPod jobs (every delivery's execution)."""
    ours = {cost.provider_job_id for status in statuses for cost in status.cost}
    return sum(provider_job.billed_s for provider_job in ledger.jobs if provider_job.id in ours)


async def state_of(client: JobClient, job_id: str, *states: JobState, within_s: float) -> JobStatus:
    async with asyncio.timeout(within_s):
        while True:
            status = await client.status(job_id)
            if status.state in states:
                return status
            assert not status.terminal, status.model_dump_json(indent=1)
            await asyncio.sleep(0.25)


async def test_jobs_run_until_the_spend_passes_the_budget_then_wait_for_the_reset(
    budgeted: tuple[JobClient, RunpodSim],
) -> None:
    client, sim = budgeted
    await a_fresh_day(DAY_S * 0.75)
    ran: list[JobStatus] = []
    spent = 0.0
    while spent < 30.0:
        assert len(ran) < 4, "the budget should have been passed by now"
        final = await client.wait((await client.submit(of_tenant(WAITING))).job_id)
        assert final.state == JobState.COMPLETED, final.error
        assert final.admission is None, "it never waited"
        assert final.gpu_s == pytest.approx(sum(c.execution_s for c in final.cost), abs=0.01)
        ran.append(final)
        spent = (await usage(client, WAITING)).gpu_s
    day = await usage(client, WAITING)
    assert day.over and day.jobs == len(ran)
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
    assert after.day_started_at == day.resets_at
    assert after.jobs == 1 and after.gpu_s == pytest.approx(final.gpu_s, abs=0.01)
    ledger = await settled_ledger(sim)
    assert abs(after.gpu_s - billed(ledger, [final])) <= SLACK_S
    assert final.checkpoint is not None and final.checkpoint.submitted_at is not None
    assert final.checkpoint.submitted_at >= day.resets_at, "submitted after the reset"


def _shown(status: JobStatus) -> str:
    """The status as `durable-comfy status` prints it."""
    return "\n".join(summary_lines(status))


async def test_a_tenant_that_refuses_over_budget_is_refused_at_submission(
    budgeted: tuple[JobClient, RunpodSim], local_stack: RunningStack, tmp_path: Path
) -> None:
    client, _sim = budgeted
    await a_fresh_day(45.0)
    sent = of_tenant(REFUSING, steps=400)
    first = await client.wait((await client.submit(sent)).job_id)
    assert first.state == JobState.COMPLETED, first.error
    day = await usage(client, REFUSING)
    assert day.over and day.over_budget == "refuse", day
    with pytest.raises(BudgetExceeded) as refused:
        await client.submit(of_tenant(REFUSING, steps=20), job_id=f"refused-{uuid.uuid4().hex}")
    assert refused.value.tenant == REFUSING
    assert refused.value.resets_at == day.resets_at
    assert "resets at" in str(refused.value) and "UTC" in str(refused.value)
    assert 0 < refused.value.retry_after_s <= DAY_S + 1
    # Every budgeted tenant's ledger is found, and the CLI shows it over (and refuses too).
    assert REFUSING in [u.tenant for u in await client.every_usage()]
    env = cli_env(local_stack, client.task_queue)
    code, out, err = await run_cli("tenants", env=env)
    assert code == 0, err
    [line] = [line for line in out.splitlines() if line.startswith(REFUSING)]
    assert "over (refuse)" in line, out
    code, out, err = await run_cli("tenants", REFUSING, "--json", env=env)
    assert code == 0 and json.loads(out)[0]["over"] is True, (out, err)
    # A batch of the tenant's (a JobRequest a line, its label naming the tenant): exit 5.
    path = tmp_path / "batch.jsonl"
    path.write_text(of_tenant(REFUSING, steps=20).model_dump_json() + "\n")
    code, out, err = await run_cli("submit", "--batch", str(path), env=env)
    assert code == 5 and "budget exceeded" in err, (code, out, err)
    # The same job sent again under its ID is answered, never refused.
    again = await client.start(sent, job_id=first.job_id)
    assert again.existed
    assert day.resets_at is not None
    await asyncio.sleep(max((day.resets_at - datetime.now(UTC)).total_seconds(), 0) + 1)
    after = await client.wait((await client.submit(of_tenant(REFUSING, steps=20))).job_id)
    assert after.state == JobState.COMPLETED, "the next day takes jobs again"
