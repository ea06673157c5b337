"""`durable-comfy submit GRAPH.json`: start a job, optionally follow it to the end; with
`--count N` or `--batch FILE.jsonl`, a batch of jobs (starter/cli/batches.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import structlog
import typer
from rich.console import Console
from rich.markup import escape

from configuration.processes import CliConfig
from starter.batches import checked_batch_id
from starter.cli import batches
from starter.cli.common import ExitCode, config_of, echo_json, fail, job_client, reported, run
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
from starter.errors import InvalidBatch
from starter.requests import request_from_files
from starter.staging import oversized_inputs, require_staging
from workflows.batches import MAX_BATCH_JOBS, BatchRequest, seed_inputs
from workflows.contracts import JobRequest

log = structlog.get_logger("durable_comfy.cli")


def submit(
    ctx: typer.Context,
    graph: Annotated[
        Path | None,
        typer.Argument(
            help="ComfyUI graph in API format (JSON); not with --batch.", show_default=False
        ),
    ] = None,
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
    count: Annotated[
        int | None,
        typer.Option(
            "--count",
            help="A batch of N jobs of GRAPH, its seeds varied: job i adds i to every literal "
            "`seed` and `noise_seed` (the other options apply to every job).",
            min=1,
            max=MAX_BATCH_JOBS,
        ),
    ] = None,
    batch_file: Annotated[
        Path | None,
        typer.Option(
            "--batch",
            help="A batch from a JSON Lines file: one job request per line (blank lines "
            "skipped; - reads stdin). Instead of GRAPH.",
        ),
    ] = None,
    batch_id: Annotated[
        str | None,
        typer.Option(
            "--batch-id",
            help="Your ID for the batch (idempotency key); its jobs are ID-0001, ID-0002, ...",
        ),
    ] = None,
    watch: Annotated[
        bool,
        typer.Option(
            "--watch",
            help="Follow the job to its end (keeps it attached); a batch: a line per change "
            "until every job has ended (its jobs stay detached).",
        ),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="JobStatus (a batch: BatchStatus) as JSON lines.")
    ] = False,
) -> None:
    """Submit a graph, or a batch of jobs (--count, --batch). Without --watch a job is
    detached: it runs whoever is listening; a batch's jobs always are."""
    config = config_of(ctx)
    with reported():
        _refuse_mixed_options(
            graph,
            job_id=job_id,
            count=count,
            batch_file=batch_file,
            batch_id=batch_id,
            per_request=[
                ("--pool", pool),
                ("--input", inputs),
                ("--segments", segments),
                ("--priority", priority),
                ("--start-by", start_by),
            ],
        )
        if job_id is not None:
            checked_job_id(job_id)
        if batch_id is not None:
            checked_batch_id(batch_id)
        batch: BatchRequest | list[JobRequest] | None = None
        if batch_file is not None:
            requests = batch = batches.read_batch_file(batch_file)
        elif graph is None:
            fail(
                "give the graph to submit (durable-comfy submit GRAPH.json), or a batch file "
                "(--batch FILE.jsonl)"
            )
        else:
            fields: dict[str, Any] = {} if priority is None else {"priority": priority}
            if start_by is not None:
                fields["policy"] = {"start_by_s": start_by}
            request = request_from_files(
                graph, inputs=inputs, segments_path=segments, pool=pool, **fields
            )
            requests = [request]
            if count is not None:
                batch = _counted(request, count, graph)
        # Refused here, before connecting, when a file needs staging and S3 is not configured.
        staging = any(oversized_inputs(each) for each in requests)
        can_stage = not staging or config.artifact_store_settings() is not None
        for each in requests:
            require_staging(each, can_stage=can_stage)
    if batch is not None:
        raise typer.Exit(
            batches.submit_batch(
                config, batch, batch_id, staging=staging, watch=watch, as_json=as_json
            )
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


def _refuse_mixed_options(
    graph: Path | None,
    *,
    job_id: str | None,
    count: int | None,
    batch_file: Path | None,
    batch_id: str | None,
    per_request: list[tuple[str, object]],
) -> None:
    """The options must make one job (GRAPH) or one batch (GRAPH --count N, or --batch FILE);
    anything else is refused before a file is read."""
    if batch_file is not None:
        if graph is not None:
            fail(
                f"give GRAPH or --batch, not both: {batch_file} already holds every job's "
                "request (graph included)",
                "a batch of GRAPH with its seeds varied: --count N",
            )
        if count is not None:
            fail("--count makes a batch of GRAPH; --batch reads the jobs from a file: use one")
        given = [option for option, value in per_request if value is not None]
        if given:
            fail(
                f"{', '.join(given)} with --batch: each line of {batch_file} is a whole job "
                "request; put it in the lines (pool, inputs, segments, priority, policy)"
            )
    batched = count is not None or batch_file is not None
    if batched and job_id is not None:
        fail(
            "--job-id names one job; a batch's ID is --batch-id (its jobs are ID-0001, ...)",
        )
    if not batched and batch_id is not None:
        fail(
            "--batch-id names a batch: add --count N (or --batch FILE.jsonl), or use --job-id "
            "for one job"
        )


def _counted(request: JobRequest, count: int, graph: Path) -> BatchRequest:
    # Said here in the command line's words (the model's names `overrides`, which it lacks).
    if not seed_inputs(request.graph):
        raise InvalidBatch(
            f"--count varies the graph's seeds, and {graph} has no literal `seed` or "
            "`noise_seed` input: its jobs would all be the same; give a --batch file with "
            "one request per job instead"
        )
    return BatchRequest(request=request, count=count)


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
