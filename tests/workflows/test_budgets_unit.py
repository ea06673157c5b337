"""A tenant's budget day without Temporal: its boundaries, the spend it counts (once per job),
when it is over, and a job's hold until the reset (workflows/budgets.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio import workflow

from configuration.tenants import TenantConfig, budget_limits
from tests.support.workflow_fakes import FakeWorkflow
from workflows.admission import Admission, place_in_line
from workflows.budget_ledger import LedgerMetrics
from workflows.budgets import (
    MAX_COUNTED,
    BudgetDay,
    BudgetHold,
    BudgetLimits,
    BudgetUsage,
    LedgerState,
    Spent,
    day_of,
    hold_of,
    over_limit,
)
from workflows.contracts import Checkpoint, JobCost, JobState, JobStatus
from workflows.job_book import BookCarry, JobBook

NOON = datetime(2026, 3, 4, 12, 0, tzinfo=UTC)


def limits(**fields: object) -> BudgetLimits:
    return BudgetLimits.model_validate({"tenant": "acme", "gpu_seconds_per_day": 30.0} | fields)


def test_a_day_of_86400_seconds_begins_at_midnight_utc() -> None:
    start, end = day_of(NOON, 86400)
    assert start == datetime(2026, 3, 4, tzinfo=UTC)
    assert end == datetime(2026, 3, 5, tzinfo=UTC)
    # The boundary itself begins the next day.
    assert day_of(end, 86400) == (end, end + timedelta(days=1))
    assert day_of(end - timedelta(microseconds=1), 86400) == (start, end)


def test_a_short_day_is_counted_from_the_epoch_in_its_own_steps() -> None:
    start, end = day_of(NOON + timedelta(seconds=7), 20)
    assert (end - start).total_seconds() == 20
    assert start <= NOON + timedelta(seconds=7) < end
    assert int(start.timestamp()) % 20 == 0


def test_spend_adds_up_once_per_job_until_the_reset() -> None:
    day = BudgetDay(LedgerState(limits=limits()), NOON)
    assert day.resets_at == datetime(2026, 3, 5, tzinfo=UTC)
    assert day.spend(Spent(job_id="a", gpu_s=12.5, usd=0.005))
    assert day.spend(Spent(job_id="b", gpu_s=10.25))
    assert not day.spend(Spent(job_id="a", gpu_s=12.5, usd=0.005)), "a repeat counts nothing"
    usage = day.usage(NOON)
    assert (usage.gpu_s, usage.usd, usage.jobs, usage.over) == (22.75, 0.005, 2, False)
    assert day.spend(Spent(job_id="c", gpu_s=8.0))
    usage = day.usage(NOON)
    assert usage.over and usage.gpu_s == 30.75
    assert "30.8 of its 30 GPU-seconds" in usage.reason
    assert usage.over_at(NOON) and not usage.over_at(day.resets_at)
    # The next day: nothing spent; a late repeat of yesterday's job is still not counted.
    assert not day.roll(NOON + timedelta(hours=11))
    assert day.roll(day.resets_at)
    assert (day.state.gpu_s, day.state.usd, day.state.jobs) == (0.0, 0.0, 0)
    assert not day.spend(Spent(job_id="c", gpu_s=8.0))
    assert day.usage(day.resets_at).resets_at == datetime(2026, 3, 6, tzinfo=UTC)


def test_a_ledger_asleep_for_days_starts_the_day_it_wakes_in() -> None:
    day = BudgetDay(LedgerState(limits=limits(), day_started_at=NOON - timedelta(days=3)), NOON)
    assert day.state.day_started_at == datetime(2026, 3, 4, tzinfo=UTC)


def test_limits_latest_wins_and_a_new_day_length_keeps_todays_spend() -> None:
    day = BudgetDay(LedgerState(limits=limits()), NOON)
    day.spend(Spent(job_id="a", gpu_s=40))
    assert not day.told(limits(), NOON)
    assert day.told(limits(gpu_seconds_per_day=100.0), NOON)
    assert not day.usage(NOON).over
    assert day.told(limits(gpu_seconds_per_day=100.0, day_s=20.0), NOON)
    assert day.resets_at == NOON + timedelta(seconds=20)
    assert day.state.gpu_s == 40


def test_usd_limit_and_both() -> None:
    both = limits(usd_per_day=1.0)
    assert over_limit(29.0, 0.5, both) is None
    assert over_limit(29.0, 1.0, both) == "tenant 'acme' has spent $1.0000 of its $1 today"
    assert "and" in (over_limit(31.0, 2.0, both) or "")
    assert over_limit(1e9, 0.0, limits(gpu_seconds_per_day=None)) is None


def test_the_counted_ids_are_bounded() -> None:
    day = BudgetDay(LedgerState(limits=limits(gpu_seconds_per_day=1e9)), NOON)
    for index in range(MAX_COUNTED + 5):
        day.spend(Spent(job_id=f"j{index}", gpu_s=1))
    assert len(day.state.counted) == MAX_COUNTED
    assert day.state.jobs == MAX_COUNTED + 5


def test_a_hold_is_judged_by_the_checking_workers_limits_until_the_reset() -> None:
    resets = NOON + timedelta(hours=12)
    usage = BudgetUsage(tenant="acme", gpu_s=31.0, resets_at=resets, gpu_seconds_per_day=100)
    hold = hold_of(usage, limits(), NOON, "gpu")
    assert hold is not None and hold.resets_at == resets
    assert hold.reason.endswith("its budget resets at 00:00 UTC")
    assert hold_of(usage, limits(gpu_seconds_per_day=100.0), NOON, "gpu") is None
    assert hold_of(usage, limits(), resets, "gpu") is None, "a reading of a day that is over"
    # Checked again after the reset, within a small share of a short day.
    short = hold.model_copy(update={"day_s": 20.0})
    assert short.recheck_in_s(resets - timedelta(seconds=5), 0.0) == pytest.approx(5.0, abs=0.01)
    assert short.recheck_in_s(resets - timedelta(seconds=5), 0.99) <= 6.0
    assert hold.recheck_in_s(resets, 0.99) <= 30.0


def test_tenant_settings_give_the_ledgers_limits() -> None:
    tenants = {
        "acme": TenantConfig(gpu_seconds_per_day=30, over_budget="refuse"),
        "default": TenantConfig(usd_per_day=2.5),
        "free": TenantConfig(weight=2),
    }
    acme = budget_limits(tenants, "acme", 20.0)
    assert acme is not None
    assert (acme.gpu_seconds_per_day, acme.over_budget, acme.day_s) == (30, "refuse", 20.0)
    other = budget_limits(tenants, "someone", 86400)
    assert other is not None and (other.tenant, other.usd_per_day) == ("someone", 2.5)
    assert budget_limits(tenants, "free", 86400) is None
    with pytest.raises(ValueError):
        TenantConfig(gpu_seconds_per_day=0)
    with pytest.raises(ValueError):
        TenantConfig.model_validate({"over_budget": "kill"})


def test_a_held_job_says_until_when() -> None:
    held = Admission(pool="gpu", held="budget", resets_at=datetime(2026, 3, 5, tzinfo=UTC))
    assert place_in_line(held) == "held: over budget until 00:00 UTC"
    short = held.model_copy(update={"resets_at": datetime(2026, 3, 5, 0, 0, 20, tzinfo=UTC)})
    assert place_in_line(short) == "held: over budget until 00:00:20 UTC"


# -- the job's side: its GPU-seconds, whose budget counts it, its hold ------------------------


def test_a_jobs_gpu_seconds_are_runpods_execution_and_comfyuis_measured_run(
    wf: FakeWorkflow,
) -> None:
    book = JobBook(JobStatus(job_id="j"))
    # RunPod: each provider job's execution (every delivery's); the idle tail is in dollars only.
    book.add_cost(JobCost(provider_job_id="rp-1", execution_s=12.0, billed_after_end_s=5.0))
    book.add_cost(
        JobCost(
            provider_job_id="rp-2", execution_s=3.5, billed_after_end_s=2.0, usd_per_second=0.001
        )
    )
    assert (book.status.gpu_s, book.status.usd) == (15.5, 0.0055)
    # A later reading of the same provider job replaces the earlier one.
    book.add_cost(JobCost(provider_job_id="rp-1", execution_s=12.5, billed_after_end_s=5.0))
    assert book.status.gpu_s == 16.0
    # ComfyUI: each submission's run as its follows measured it, the furthest reading kept.
    checkpoint = Checkpoint(job_id="j", prompt_id="p", client_id="c1", ran_s=2.0)
    book.set_checkpoint(checkpoint)
    book.set_checkpoint(checkpoint.model_copy(update={"ran_s": 1.0}))
    assert book.status.gpu_s == 18.0
    book.set_checkpoint(checkpoint.model_copy(update={"client_id": "c2", "ran_s": 4.0}))
    assert book.status.gpu_s == 22.0
    # Carried across continue-as-new.
    carried = JobBook(book.status, [], book.carry())
    carried.set_checkpoint(checkpoint.model_copy(update={"ran_s": 3.0}))
    assert carried.status.gpu_s == 23.0


def test_the_checks_word_and_a_hold(wf: FakeWorkflow) -> None:
    book = JobBook(JobStatus(job_id="j", state=JobState.SUBMITTING))
    book.client_id = "c"
    book.report({"attempt_client_id": "c", "budget": "acme"})
    assert book.budget == "acme" and book.status.state == "SUBMITTING", "no prompt yet"
    book.budgeted(None)
    assert book.budget == "acme"
    resets = datetime(2026, 1, 2, tzinfo=UTC)
    book.held_by_budget(BudgetHold(tenant="acme", pool="gpu", resets_at=resets))
    assert book.status.state == "PENDING"
    admission = book.status.admission
    assert admission is not None and (admission.held, admission.resets_at) == ("budget", resets)
    assert "held: over budget until 00:00 UTC" in wf.details[-1]
    book.budget_reset()
    assert book.status.admission is None and book.budget_hold is None
    assert BookCarry.model_validate(book.carry().model_dump()).budget == "acme"


class Gauges:
    """A workflow meter that keeps each gauge's last value, by name and tenant."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, str], float] = {}

    def _gauge(self, name: str, *_args: object) -> Any:
        values = self.values

        class Gauge:
            def set(self, value: float, labels: dict[str, str]) -> None:
                values[(name, labels["tenant"])] = value

        return Gauge()

    create_gauge = create_gauge_float = _gauge


def test_the_ledgers_gauges_show_the_tenants_spend(monkeypatch: pytest.MonkeyPatch) -> None:
    meter = Gauges()
    monkeypatch.setattr(workflow, "metric_meter", lambda: meter)
    day = BudgetDay(LedgerState(limits=limits()), NOON)
    day.spend(Spent(job_id="a", gpu_s=31.5, usd=0.02))
    LedgerMetrics().show(day.usage(NOON))
    assert meter.values == {
        ("durable_comfy_budget_gpu_seconds", "acme"): 31.5,
        ("durable_comfy_budget_usd", "acme"): 0.02,
        ("durable_comfy_budget_gpu_seconds_limit", "acme"): 30.0,
        ("durable_comfy_budget_over", "acme"): 1,
    }
