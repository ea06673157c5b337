"""`watch`, `status` and `result`: finding a job again by its ID."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from starter.cli.common import EXIT_FAILED, echo_json, job_client, run
from starter.cli.render import print_summary, status_json, stream_json, stream_progress
from starter.cli.ui import workflow_url
from workflows.contracts import JobState

JobArg = Annotated[str, typer.Argument(help="The job ID.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="JobStatus as JSON.")]


def status(job_id: JobArg, as_json: JsonOpt = False) -> None:
    """The job's current status."""

    async def go() -> None:
        async with job_client() as client:
            current = await client.status(job_id)
        if as_json:
            echo_json(status_json(current))
        else:
            print_summary(current, Console(), workflow_url(job_id))

    run(go)


def watch(job_id: JobArg, as_json: JsonOpt = False) -> None:
    """Follow a job until it ends (this keeps an attached job alive)."""

    async def go() -> int:
        async with job_client() as client:
            if as_json:
                last = await stream_json(client.watch(job_id))
            else:
                last = await stream_progress(client.watch(job_id), Console())
        return 0 if last is not None and last.state == JobState.COMPLETED else EXIT_FAILED

    raise typer.Exit(run(go))


def result(
    job_id: JobArg,
    download: Annotated[
        Path | None, typer.Option(help="Download the artifacts here (sha256 checked).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Wait for the job to end; print its artifacts with presigned URLs."""

    async def go() -> int:
        async with job_client(with_store=True) as client:
            final = await client.result(job_id)
            paths = await client.download(final, download) if download else []
        if as_json:
            echo_json(status_json(final))
        else:
            console = Console()
            print_summary(final, console, workflow_url(job_id))
            for path in paths:
                console.print(f"  downloaded {path}")
        return 0 if final.state == JobState.COMPLETED else EXIT_FAILED

    raise typer.Exit(run(go))
