"""The job's check and its tenant's daily budget (activities/backend.py), without a server: a
tenant over budget holds the job before anything is asked of its pool's queue or submitted (by
a prepare, or by a follow that checks the request), and a budgeted job hears whose budget
counts it before its follow submits."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from activities import backend as backend_module
from activities.backend import Backend, Backends, JobActivities
from configuration.pools import PoolConfig
from configuration.settings import S3Settings
from tests.activities.test_backend_routing import GRAPH, RecordingBackend, follow_input
from workflows.activity_io import PrepareInput
from workflows.budgets import BudgetHold
from workflows.contracts import ProgressReport

STORAGE = S3Settings.from_env({}, bucket="artifacts")
RESETS = datetime(2026, 12, 8, tzinfo=UTC)


class Budgets:
    """`BudgetActivities.check`, scripted: `acme` is over its budget, `beta` within it."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str, str]] = []

    async def check(self, tenant: str, job_id: str, pool: str) -> tuple[str | None, Any]:
        self.asked.append((tenant, job_id, pool))
        if tenant == "acme":
            return "acme", BudgetHold(tenant="acme", pool=pool, resets_at=RESETS, reason="spent")
        if tenant == "beta":
            return "beta", None
        return None, None


def budgeted(max_running: int | None = None) -> tuple[JobActivities, RecordingBackend, Budgets]:
    comfy, budgets = RecordingBackend("comfyui"), Budgets()
    pools = {"local": PoolConfig(kind="comfyui", url="http://127.0.0.1:1", max_running=max_running)}
    by_kind: dict[str, Backend] = {"comfyui": comfy}
    asked: list[Any] = []

    async def ask_for_slot(pool: str, request: Any) -> Any:
        asked.append(request)
        raise AssertionError("a held job asks its pool's queue nothing")

    jobs = JobActivities(
        Backends(pools, "local", by_kind),
        None,
        STORAGE,
        ask_for_slot=ask_for_slot,
        check_budget=budgets.check,
    )
    return jobs, comfy, budgets


@pytest.fixture
def reports(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ProgressReport]]:
    sent: list[tuple[str, ProgressReport]] = []

    async def send_progress(job_id: str, report: ProgressReport, _log: Any) -> None:
        sent.append((job_id, report))

    monkeypatch.setattr(backend_module, "send_progress", send_progress)
    return sent


def check(tenant: str | None) -> PrepareInput:
    return PrepareInput(
        job_id="j",
        pool=None,
        graph=GRAPH,
        tenant=tenant,
        accepted_at=datetime.now(UTC) - timedelta(seconds=1),
    )


async def test_a_prepare_over_budget_holds_the_job_before_its_pools_queue() -> None:
    jobs, comfy, budgets = budgeted(max_running=2)
    prepared = await jobs.prepare_prompt(check("acme"))
    assert prepared.held is not None and prepared.held.resets_at == RESETS
    assert prepared.held.pool == "local" and prepared.budget == "acme"
    assert prepared.bound is None and not prepared.slot_asked
    # The graph was checked first: a bad job fails now, not after the reset.
    assert comfy.calls == [("prepare", "local")]
    assert budgets.asked == [("acme", "j", "local")]


async def test_a_follow_over_budget_submits_nothing(
    reports: list[tuple[str, ProgressReport]],
) -> None:
    jobs, comfy, _ = budgeted()
    req = follow_input(None).model_copy(update={"prepare": check("acme")})
    result = await jobs.follow_prompt(req)
    assert result.outcome == "held" and result.held is not None
    assert (result.pool, result.kind, result.budget) == ("local", "comfyui", "acme")
    assert comfy.calls == [("prepare", "local")], "followed nothing"
    assert reports == []


async def test_a_budgeted_follow_says_so_before_it_submits(
    reports: list[tuple[str, ProgressReport]],
) -> None:
    jobs, comfy, _ = budgeted()
    req = follow_input(None).model_copy(update={"prepare": check("beta")})
    result = await jobs.follow_prompt(req)
    assert result.outcome == "success" and result.budget == "beta"
    [(job_id, report)] = reports
    assert job_id == "j" and report.budget == "beta" and report.checkpoint is None
    assert comfy.calls == [("prepare", "local"), ("follow", "local")]


async def test_a_tenant_without_a_budget_is_told_nothing(
    reports: list[tuple[str, ProgressReport]],
) -> None:
    jobs, _, budgets = budgeted()
    req = follow_input(None).model_copy(update={"prepare": check(None)})
    result = await jobs.follow_prompt(req)
    assert result.outcome == "success" and result.budget is None
    assert reports == [] and budgets.asked == [("local", "j", "local")]
