"""`cancel`, `resume` and `list`: acting on jobs by ID, and finding them."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from starter.cli.common import echo_json, job_client, run
from workflows.shared import SA_JOB_POOL, SA_JOB_PROGRESS, SA_JOB_STATE, WORKFLOW_TYPE

JobArg = Annotated[str, typer.Argument(help="The job ID.")]


def cancel(
    job_id: JobArg,
    reason: Annotated[str, typer.Option(help="Recorded in the job's status.")] = "cancelled "
    "from the CLI",
) -> None:
    """Cancel a job: its prompt is interrupted, finished artifacts are kept."""

    async def go() -> None:
        async with job_client() as client:
            await client.cancel(job_id, reason)
        typer.echo(f"cancel requested for {job_id}")

    run(go)


def resume(
    job_id: JobArg,
    resubmit: Annotated[
        bool, typer.Option("--resubmit", help="Run the prompt again instead of re-attaching.")
    ] = False,
) -> None:
    """Continue a job waiting in NEEDS_DECISION."""

    async def go() -> None:
        async with job_client() as client:
            await client.resume(job_id, resubmit=resubmit)
        typer.echo(f"resume sent to {job_id} (resubmit={resubmit})")

    run(go)


def list_jobs(
    state: Annotated[str | None, typer.Option(help="Only jobs in this state.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """Recent jobs, newest first, with their state as the Temporal UI shows it."""
    query = f"WorkflowType = '{WORKFLOW_TYPE}'"
    if state:
        if not state.isalpha():
            raise typer.BadParameter("a state is a word such as RUNNING or COMPLETED")
        query += f" AND {SA_JOB_STATE} = '{state.upper()}'"

    async def go() -> list[dict[str, object]]:
        rows: list[dict[str, object]] = []
        async with job_client() as client:
            async for execution in client.temporal.list_workflows(query, limit=limit):
                attributes = {k.name: v for k, v in execution.typed_search_attributes}
                rows.append(
                    {
                        "job_id": execution.id,
                        "state": attributes.get(SA_JOB_STATE),
                        "progress": attributes.get(SA_JOB_PROGRESS),
                        "pool": attributes.get(SA_JOB_POOL),
                        "started": execution.start_time.isoformat(),
                    }
                )
        return rows

    rows = run(go)
    if as_json:
        for row in rows:
            echo_json(json.dumps(row))
        return
    table = Table("job", "state", "progress %", "pool", "started")
    for row in rows:
        table.add_row(*(str(row[k] if row[k] is not None else "") for k in row))
    Console().print(table)
