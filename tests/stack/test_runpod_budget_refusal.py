"""A tenant whose budget refuses rather than holds, end to end on the RunPod simulator (as
test_runpod_budgets.py, with a day of its own): once over, its next job is refused at submission
(`BudgetExceeded`, the CLI's exit 5), naming the reset, and the next day takes jobs again.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from configuration.tenants import TenantConfig
from devstack.models import RunningStack
from starter import BudgetExceeded, JobClient
from tests.support.cli import cli_env, run_cli
from tests.support.runpod_budgets import budgeted, of_tenant, until, usage
from tests.support.runpod_sim import ENDPOINT_VENV_MISSING, RunpodSim
from workflows.contracts import JobState

pytestmark = pytest.mark.skipif(
    ENDPOINT_VENV_MISSING is not None, reason=str(ENDPOINT_VENV_MISSING)
)

# A job of about 8 s passes the 5 s budget; the day leaves room for it and the CLI's checks.
STEPS = 400
DAY_S = 45.0
REFUSING = f"refuse-{uuid.uuid4().hex[:6]}"


@pytest_asyncio.fixture(loop_scope="session")
async def client_and_day(
    local_stack: RunningStack, runpod_sim: RunpodSim
) -> AsyncIterator[tuple[JobClient, float]]:
    tenants = {REFUSING: TenantConfig(gpu_seconds_per_day=5, over_budget="refuse")}
    async with budgeted(local_stack, runpod_sim, tenants, DAY_S) as client_and_day:
        yield client_and_day


async def test_a_tenant_that_refuses_over_budget_is_refused_at_submission(
    client_and_day: tuple[JobClient, float], local_stack: RunningStack, tmp_path: Path
) -> None:
    client, day_s = client_and_day
    sent = of_tenant(REFUSING, STEPS)
    first = await client.wait((await client.submit(sent)).job_id)
    assert first.state == JobState.COMPLETED, first.error
    day = await usage(client, REFUSING)
    assert day.over and day.over_budget == "refuse", day
    with pytest.raises(BudgetExceeded) as refused:
        await client.submit(of_tenant(REFUSING, steps=20), job_id=f"refused-{uuid.uuid4().hex}")
    assert refused.value.tenant == REFUSING
    assert refused.value.resets_at == day.resets_at
    assert "resets at" in str(refused.value) and "UTC" in str(refused.value)
    assert 0 < refused.value.retry_after_s <= day_s + 1
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
    await until(day.resets_at, after_s=1)
    after = await client.wait((await client.submit(of_tenant(REFUSING, steps=20))).job_id)
    assert after.state == JobState.COMPLETED, "the next day takes jobs again"
