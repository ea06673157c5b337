"""`durable-comfy submit GRAPH.json`: start a job, optionally follow it to the end."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from starter.cli.common import EXIT_FAILED, echo_json, job_client, reported, run
from starter.cli.render import print_summary, status_json, stream_json, stream_progress
from starter.cli.ui import workflow_url
from starter.requests import request_from_files
from workflows.contracts import JobState


def submit(
    graph: Annotated[Path, typer.Argument(help="ComfyUI graph in API format (JSON).")],
    job_id: Annotated[
        str | None, typer.Option("--job-id", help="Your ID for the job (idempotency key).")
    ] = None,
    pool: Annotated[str | None, typer.Option(help="Worker pool to run on.")] = None,
    inputs: Annotated[
        list[str] | None,
        typer.Option("--input", help="NAME=PATH: a file a LoadImage node names. Repeatable."),
    ] = None,
    segments: Annotated[
        Path | None, typer.Option(help="JSON list of per-segment input overrides.")
    ] = None,
    watch: Annotated[
        bool, typer.Option("--watch", help="Follow the job to its end (keeps it attached).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JobStatus as JSON lines.")] = False,
) -> None:
    """Submit a graph. Without --watch the job is detached: it runs whoever is listening."""
    with reported():
        request = request_from_files(graph, inputs=inputs, segments_path=segments, pool=pool)

    async def go() -> int:
        async with job_client(with_store=True) as client:
            status = await client.submit(request, job_id=job_id, detached=not watch)
            if not watch:
                if as_json:
                    echo_json(status_json(status))
                else:
                    typer.echo(f"submitted {status.job_id} (detached: runs to its end)")
                    typer.echo(f"follow it: durable-comfy watch {status.job_id}")
                return 0
            if as_json:
                last = await stream_json(client.watch(status.job_id))
            else:
                console = Console(stderr=False)
                console.print(f"job [bold]{status.job_id}[/]  {workflow_url(status.job_id)}")
                last = await stream_progress(client.watch(status.job_id), console)
                if last is not None:
                    last = await client.result(status.job_id)
                    print_summary(last, console)
            return 0 if last is not None and last.state == JobState.COMPLETED else EXIT_FAILED

    code = run(go)
    raise typer.Exit(code)
