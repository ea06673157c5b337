"""`durable-comfy submit GRAPH.json`: start a job, optionally follow it to the end."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import structlog
import typer
from rich.console import Console
from rich.markup import escape

from configuration.processes import CliConfig
from starter.cli.common import ExitCode, config_of, echo_json, job_client, reported, run
from starter.cli.jobs import ended_code
from starter.cli.render import (
    Followed,
    print_summary,
    stream_json,
    stream_progress,
    submit_json,
    worker_notices,
)
from starter.cli.ui import workflow_url
from starter.client import SubmitOutcome, checked_job_id
from starter.requests import request_from_files
from starter.staging import oversized_inputs, require_staging

log = structlog.get_logger("durable_comfy.cli")


def submit(
    ctx: typer.Context,
    graph: Annotated[Path, typer.Argument(help="ComfyUI graph in API format (JSON).")],
    job_id: Annotated[
        str | None, typer.Option("--job-id", help="Your ID for the job (idempotency key).")
    ] = None,
    pool: Annotated[str | None, typer.Option(help="Worker pool to run on.")] = None,
    inputs: Annotated[
        list[str] | None,
        typer.Option(
            "--input",
            help="NAME=PATH (sent inline up to 1 MiB; a larger file is uploaded to the "
            "bucket's _staged/ folder and sent by reference), NAME=s3://BUCKET/KEY or "
            "NAME=https://URL (fetched by the worker): a file a LoadImage node names. "
            "Repeatable.",
        ),
    ] = None,
    segments: Annotated[
        Path | None, typer.Option(help="JSON list of per-segment input overrides.")
    ] = None,
    priority: Annotated[
        int | None,
        typer.Option(
            help="1 (first) to 5 (last), default 3: on a bounded pool a better priority "
            "starts before any worse one waiting (your tenant's max_priority may forbid 1).",
            min=1,
            max=5,
        ),
    ] = None,
    start_by: Annotated[
        float | None,
        typer.Option(
            "--start-by",
            help="Seconds from now: if its prompt has not begun to run on a GPU by then "
            "(waiting in our queue or the provider's), it is withdrawn and ends EXPIRED.",
            min=0.001,
        ),
    ] = None,
    watch: Annotated[
        bool, typer.Option("--watch", help="Follow the job to its end (keeps it attached).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JobStatus as JSON lines.")] = False,
) -> None:
    """Submit a graph. Without --watch the job is detached: it runs whoever is listening."""
    config = config_of(ctx)
    with reported():
        if job_id is not None:
            checked_job_id(job_id)
        fields: dict[str, Any] = {} if priority is None else {"priority": priority}
        if start_by is not None:
            fields["policy"] = {"start_by_s": start_by}
        request = request_from_files(
            graph, inputs=inputs, segments_path=segments, pool=pool, **fields
        )
        # Refused here, before connecting, when a file needs staging and S3 is not configured.
        staging = bool(oversized_inputs(request))
        require_staging(
            request, can_stage=not staging or config.artifact_store_settings() is not None
        )
    followed = Followed(job_id)

    async def go() -> int:
        # Presigned URLs only matter to the human summary at the end of --watch; files over
        # the inline limit are uploaded by the client before the job starts.
        with_store = staging or (watch and not as_json)
        async with job_client(config, with_store=with_store) as client:
            outcome = await client.start(request, job_id=job_id, detached=not watch)
            followed.seen(outcome.status)
            if outcome.existed:
                log.warning(
                    "job_already_exists",
                    job_id=outcome.job_id,
                    state=outcome.status.state.value,
                    detail="same request under this ID: nothing new was submitted",
                )
            if as_json:
                echo_json(submit_json(outcome))
            else:
                _say_submitted(config, outcome, watch)
            if not watch:
                return ExitCode.OK
            updates = client.watch(outcome.job_id, since=outcome.status)
            if as_json:
                async with worker_notices(client, followed, as_json=True):
                    last = await stream_json(updates, followed, already_shown=outcome.status)
                return ended_code(last)
            console = Console()
            async with worker_notices(client, followed, as_json=False):
                last = await stream_progress(updates, console, followed)
            if last is not None:
                last = await client.result(outcome.job_id)
                print_summary(last, console)
            return ended_code(last)

    raise typer.Exit(run(go, followed.on_interrupt))


def _say_submitted(config: CliConfig, outcome: SubmitOutcome, watch: bool) -> None:
    console = Console()
    job_id, state = escape(outcome.job_id), outcome.status.state.value
    if outcome.existed:
        console.print(
            f"job [bold]{job_id}[/] already exists ({state}), with this same request: "
            "nothing new was submitted"
        )
    elif not watch:
        console.print(f"submitted [bold]{job_id}[/] (detached: runs to its end)")
    if watch:
        console.print(
            f"job [bold]{job_id}[/]  {workflow_url(config.temporal, outcome.job_id)}",
            soft_wrap=True,
        )
    else:
        console.print(f"follow it: durable-comfy watch {job_id}")
