"""`cancel`, `resume` and `list`: acting on jobs by ID, and finding them."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Annotated

import typer

from starter.cli.common import ExitCode, config_of, echo_json, fail, job_client, run
from starter.cli.render import status_json
from starter.client import JobClient, checked_job_id
from workflows.contracts import JobState, JobStatus
from workflows.shared import SA_JOB_POOL, SA_JOB_PROGRESS, SA_JOB_STATE, WORKFLOW_TYPE

JobArg = Annotated[str, typer.Argument(help="The job ID.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="JobStatus as JSON.")]


def cancel(
    ctx: typer.Context,
    job_id: JobArg,
    reason: Annotated[str, typer.Option(help="Recorded in the job's status.")] = "cancelled "
    "from the CLI",
    as_json: JsonOpt = False,
) -> None:
    """Cancel a job: its prompt is interrupted, finished artifacts are kept."""
    _act(
        ctx,
        job_id,
        as_json,
        lambda client: client.cancel(job_id, reason),
        lambda before: (
            f"cancel requested for {job_id} (was {before.state.value}): its prompt is "
            "stopped, finished outputs are kept, it ends CANCELLED"
        ),
    )


def resume(
    ctx: typer.Context,
    job_id: JobArg,
    resubmit: Annotated[
        bool, typer.Option("--resubmit", help="Run the prompt again instead of re-attaching.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Continue a job waiting in NEEDS_DECISION."""
    how = "resubmitted" if resubmit else "re-attached"
    _act(
        ctx,
        job_id,
        as_json,
        lambda client: client.resume(job_id, resubmit=resubmit),
        lambda after: f"{job_id} {how}: now {after.state.value}",
    )


def _act(
    ctx: typer.Context,
    job_id: str,
    as_json: bool,
    act: Callable[[JobClient], Awaitable[JobStatus]],
    said: Callable[[JobStatus], str],
) -> None:
    """Act on one job, then show the status it answered: as JSON, or as the line `said` writes."""
    config = config_of(ctx)

    async def go() -> None:
        checked_job_id(job_id)
        async with job_client(config) as client:
            answer = await act(client)
        if as_json:
            echo_json(status_json(answer))
        else:
            typer.echo(said(answer))

    run(go)


def parse_state(value: str) -> JobState:
    """A state by name, any case; anything else is refused with the list of valid ones."""
    try:
        return JobState(value.upper())
    except ValueError:
        valid = ", ".join(state.value for state in JobState)
        fail(f"--state {value!r} is not a job state; use one of: {valid}", code=ExitCode.BAD_INPUT)


def list_jobs(
    ctx: typer.Context,
    state: Annotated[str | None, typer.Option(help="Only jobs in this state.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """Recent jobs, newest first, with their state as the Temporal UI shows it."""
    config = config_of(ctx)
    query = f"WorkflowType = '{WORKFLOW_TYPE}'"
    if state is not None:
        query += f" AND {SA_JOB_STATE} = '{parse_state(state).value}'"

    async def go() -> list[dict[str, str | int | None]]:
        rows: list[dict[str, str | int | None]] = []
        async with job_client(config) as client:
            # The SDK's errors as the client's (a namespace the server lacks says how to fix it).
            with client.translated_errors():
                async for execution in client.temporal.list_workflows(query, limit=limit):
                    attributes = {k.name: v for k, v in execution.typed_search_attributes}
                    rows.append(
                        {
                            "job_id": execution.id,
                            "state": _text_or_none(attributes.get(SA_JOB_STATE)),
                            "progress": _int_or_none(attributes.get(SA_JOB_PROGRESS)),
                            "pool": _text_or_none(attributes.get(SA_JOB_POOL)),
                            "started": execution.start_time.isoformat(),
                        }
                    )
        return rows

    rows = run(go)
    if as_json:
        for row in rows:
            echo_json(json.dumps(row))
        return
    for line in table_lines(rows):
        typer.echo(line)


def table_lines(rows: list[dict[str, str | int | None]]) -> list[str]:
    """Plain aligned columns: a job ID is never cut or wrapped, whatever the terminal width."""
    header = {"job_id": "job", "state": "state", "progress": "progress %", "pool": "pool"}
    header["started"] = "started"
    cells = [header] + [{k: "" if v is None else str(v) for k, v in row.items()} for row in rows]
    widths = {key: max(len(str(cell[key])) for cell in cells) for key in header}
    return ["  ".join(str(cell[k]).ljust(widths[k]) for k in header).rstrip() for cell in cells]


def _text_or_none(value: object) -> str | None:
    return None if value is None else str(value)


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) else None
