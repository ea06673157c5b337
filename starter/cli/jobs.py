"""`watch`, `status` and `result`: finding a job again by its ID."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from starter.cli.common import ExitCode, config_of, echo_json, job_client, run
from starter.cli.render import (
    Followed,
    print_summary,
    status_json,
    stream_json,
    stream_progress,
    worker_notices,
)
from starter.cli.ui import workflow_url
from starter.client import checked_job_id
from workflows.contracts import JobState, JobStatus

JobArg = Annotated[str, typer.Argument(help="The job ID.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="JobStatus as JSON.")]


def ended_code(last: JobStatus | None) -> ExitCode:
    if last is not None and last.state == JobState.COMPLETED:
        return ExitCode.OK
    return ExitCode.JOB_NOT_COMPLETED


def status(ctx: typer.Context, job_id: JobArg, as_json: JsonOpt = False) -> None:
    """The job's current status (exit 0 whatever its state; see `watch` to wait for its end)."""
    config = config_of(ctx)

    async def go() -> None:
        checked_job_id(job_id)
        async with job_client(config) as client:
            current = await client.status(job_id)
        if as_json:
            echo_json(status_json(current))
        else:
            print_summary(current, Console(), workflow_url(config.temporal, job_id))

    run(go)


def watch(ctx: typer.Context, job_id: JobArg, as_json: JsonOpt = False) -> None:
    """Follow a job until it ends (this keeps an attached job alive)."""
    config = config_of(ctx)
    followed = Followed(job_id)

    async def go() -> int:
        checked_job_id(job_id)
        async with job_client(config) as client, worker_notices(client, followed, as_json):
            if as_json:
                last = await stream_json(client.watch(job_id), followed)
            else:
                last = await stream_progress(client.watch(job_id), Console(), followed)
        return ended_code(last)

    raise typer.Exit(run(go, followed.on_interrupt))


def result(
    ctx: typer.Context,
    job_id: JobArg,
    download: Annotated[
        Path | None, typer.Option(help="Download the artifacts here (sha256 checked).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Wait for the job to end; print its artifacts with presigned URLs."""
    config = config_of(ctx)

    async def go() -> int:
        checked_job_id(job_id)
        async with job_client(config, with_store=True) as client:
            if download is not None:
                client.require_store()  # before waiting, not after
            final = await client.result(job_id)
            paths = await client.download(final, download) if download else []
        if as_json:
            echo_json(status_json(final))
        else:
            console = Console()
            print_summary(final, console, workflow_url(config.temporal, job_id))
            for path in paths:
                console.print(f"  downloaded {path}", soft_wrap=True)
        return ended_code(final)

    raise typer.Exit(run(go))
