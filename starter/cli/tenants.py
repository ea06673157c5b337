"""`durable-comfy tenants`: each tenant's spend today against its daily budget (docs/queue.md,
"Budgets"), from every budget ledger that runs."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

import typer

from starter.cli.common import config_of, echo_json, job_client, run
from workflows.admission import clock
from workflows.budgets import BudgetUsage


def tenants(
    ctx: typer.Context,
    tenant: Annotated[
        str | None, typer.Argument(help="Only this tenant (default: every tenant with a budget).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The readings as JSON.")] = False,
) -> None:
    """Each tenant's spend today (GPU-seconds, dollars, jobs counted) against its daily budget,
    whether it is over it, and when its budget resets: one line per tenant whose jobs were
    checked against a budget (its ledger)."""
    config = config_of(ctx)

    async def go() -> list[BudgetUsage]:
        async with job_client(config) as client:
            if tenant is None:
                return await client.every_usage()
            found = await client.tenant_usage(tenant)
            return [found] if found is not None else []

    usages = run(go)
    if as_json:
        echo_json("[" + ",".join(u.model_dump_json() for u in usages) + "]")
        return
    if not usages:
        who = f"tenant {tenant!r} has" if tenant else "no tenant has"
        typer.echo(f"{who} no budget ledger (no budget, or none of its jobs checked yet)")
        return
    for line in usage_lines(usages, datetime.now(UTC)):
        typer.echo(line)


def usage_lines(usages: list[BudgetUsage], now: datetime) -> list[str]:
    header = ("tenant", "gpu_s", "limit", "usd", "limit", "jobs", "state", "resets")
    rows = [header]
    for usage in usages:
        over = usage.over_at(now)
        rows.append(
            (
                usage.tenant,
                f"{usage.gpu_s:.1f}",
                _limit(usage.gpu_seconds_per_day, "{:g}"),
                f"{usage.usd:.4f}",
                _limit(usage.usd_per_day, "{:g}"),
                str(usage.jobs),
                f"over ({usage.over_budget})" if over else "within",
                clock(usage.resets_at) if usage.resets_at else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _limit(value: float | None, spec: str) -> str:
    return "-" if value is None else spec.format(value)
