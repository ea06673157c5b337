"""`pool queue` and `pool release`: a bounded pool's queue (docs/queue.md)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

import typer

from starter.cli.common import ExitCode, config_of, echo_json, fail, job_client, run
from starter.errors import NoPoolQueue
from workflows.admission import PoolQueueView

app = typer.Typer(help="A bounded pool's queue: who runs, who waits, and settling a slot.")

PoolArg = Annotated[str, typer.Argument(help="The pool's name, as the worker's settings have it.")]


@app.command("queue")
def queue(
    ctx: typer.Context,
    pool: PoolArg,
    as_json: Annotated[bool, typer.Option("--json", help="The whole queue as JSON.")] = False,
) -> None:
    """Every job that holds a slot of POOL or waits for one, waiting ones in the order they
    will start (position, tenant, priority, age)."""
    config = config_of(ctx)

    async def go() -> PoolQueueView:
        async with job_client(config) as client:
            try:
                return await client.pool_queue(pool)
            except NoPoolQueue:
                fail(
                    f"pool {pool!r} has no queue: it is not bounded (max_running), or no job "
                    "has asked for one of its slots yet",
                    code=ExitCode.BAD_INPUT,
                )

    view = run(go)
    if as_json:
        echo_json(view.model_dump_json())
        return
    for line in queue_lines(view, datetime.now(UTC)):
        typer.echo(line)


@app.command("release")
def release(
    ctx: typer.Context,
    pool: PoolArg,
    job_id: Annotated[str, typer.Argument(help="The job whose slot to settle.")],
) -> None:
    """Settle JOB's slot of POOL: for a job whose teardown stayed UNCONFIRMED or FAILED, once
    you know its prompt no longer runs (the slot goes to the next job at once)."""
    config = config_of(ctx)

    async def go() -> bool:
        async with job_client(config) as client:
            try:
                return await client.release_slot(pool, job_id)
            except NoPoolQueue:
                fail(f"pool {pool!r} has no queue", code=ExitCode.BAD_INPUT)

    if not run(go):
        fail(f"{job_id} holds no slot of pool {pool!r} and is not in its line")
    typer.echo(f"released {job_id}'s slot of pool {pool}")


def queue_lines(view: PoolQueueView, now: datetime) -> list[str]:
    bound = "unbounded" if view.max_running is None else f"max_running {view.max_running}"
    lines = [f"pool {view.pool}: {view.running} running, {view.waiting} waiting ({bound})"]
    header = ("position", "job", "tenant", "priority", "state", "age")
    rows = [header]
    for entry in view.entries:
        age = max((now - entry.since).total_seconds(), 0.0)
        rows.append(
            (
                "" if entry.position is None else str(entry.position),
                entry.job_id,
                entry.tenant,
                str(entry.priority),
                entry.state,
                f"{age:.0f}s",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return lines
