"""Batches: `submit --count N` / `submit --batch FILE.jsonl` (called from submit.py), and the
`batch` group: `status`, `watch`, `cancel` and `result` of a batch by its ID."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Annotated, Final

import structlog
import typer
from pydantic import ValidationError

from configuration.processes import CliConfig
from starter.batches import BatchSubmitted, checked_batch_id
from starter.cli.common import ExitCode, config_of, echo_json, fail, job_client, problems, run
from starter.client import JobClient
from starter.errors import InputFileError, InvalidBatch, InvalidOverride
from starter.requests import check_segment_overrides
from workflows.batches import (
    MAX_BATCH_JOBS,
    BatchJob,
    BatchRequest,
    BatchResults,
    BatchStatus,
)
from workflows.contracts import JobRequest, JobState

log = structlog.get_logger("durable_comfy.cli")

app = typer.Typer(
    help="Batches: many jobs under one ID, followed, cancelled and collected at once."
)

BatchArg = Annotated[str, typer.Argument(help="The batch ID (`submit --count/--batch` prints it).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="BatchStatus as JSON.")]

# The batch's own query and one list call each time: once a second keeps a thousand-job batch's
# watch at two calls a second, and a line per change is not a progress bar.
WATCH_INTERVAL_S: Final = 1.0
# `--batch -`: the requests come from stdin (a script's pipe).
STDIN: Final = "-"


# -- reading a batch file -----------------------------------------------------------------------


def read_batch_file(path: Path) -> list[JobRequest]:
    """One JobRequest per line (blank lines skipped); the first line that is not one is refused
    with its number, before anything is sent."""
    name = "stdin" if str(path) == STDIN else str(path)
    try:
        text = sys.stdin.read() if str(path) == STDIN else path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputFileError(f"batch file not found: {name}") from None
    except IsADirectoryError:
        raise InputFileError(
            f"{name} is a directory: give a JSON Lines file, one job request per line"
        ) from None
    except UnicodeDecodeError:
        raise InputFileError(
            f"{name} is not a text file: give a JSON Lines file, one job request per line"
        ) from None
    except OSError as exc:
        raise InputFileError(f"batch file {name}: {exc.strerror or exc}") from None
    return parse_batch_lines(text.splitlines(), name)


def parse_batch_lines(lines: Iterable[str], name: str = "batch file") -> list[JobRequest]:
    requests: list[JobRequest] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if len(requests) == MAX_BATCH_JOBS:
            raise InvalidBatch(
                f"{name}: line {number} is request {MAX_BATCH_JOBS + 1:,}, and a batch holds at "
                f"most {MAX_BATCH_JOBS:,}: split the file into several batches"
            )
        requests.append(_line_request(line, number, name))
    if not requests:
        raise InvalidBatch(f"{name} holds no request: give one job request (JSON) per line")
    return requests


def _line_request(line: str, number: int, name: str) -> JobRequest:
    where = f"{name}, line {number}"
    try:
        document = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidBatch(
            f"{where} is not JSON ({exc.msg} at column {exc.colno}): each line is one job "
            "request, a JSON object on one line"
        ) from None
    except RecursionError:
        raise InvalidBatch(f"{where}: its JSON is nested too deeply") from None
    if not isinstance(document, dict):
        raise InvalidBatch(
            f"{where} is a JSON {type(document).__name__}, not a job request: each line is "
            'one object, {"graph": {...}, ...}'
        )
    try:
        request = JobRequest.model_validate(document)
        # The client checks these too, but by the job's place in the batch; a line's number
        # is what a person finds in the file.
        check_segment_overrides(request.graph, request.segments)
    except ValidationError as exc:
        raise InvalidBatch(f"{where}: {problems(exc)}") from None
    except InvalidOverride as exc:
        raise InvalidBatch(f"{where}: {exc}") from None
    return request


def new_batch_id() -> str:
    """The ID a batch gets when none is given: chosen here rather than by the client, so an
    interrupted submit can name the batch it may have half-started."""
    return f"batch-{uuid.uuid4().hex[:16]}"


# -- showing a batch ----------------------------------------------------------------------------


def batch_json(status: BatchStatus) -> str:
    # Nulls kept: a job's `state: null` says "not seen running yet", and a script reads it.
    return status.model_dump_json()


def submitted_json(submitted: BatchSubmitted) -> str:
    """The batch's status with `existed` and `started`: a BatchStatus reader can drop them (as
    a job's submit line is a JobStatus plus `existed`)."""
    document = json.loads(batch_json(submitted.status))
    document["existed"] = submitted.existed
    document["started"] = submitted.started
    return json.dumps(document, separators=(",", ":"))


def every_job_completed(status: BatchStatus | None) -> bool:
    return (
        status is not None
        and status.total > 0
        and status.counts.get(JobState.COMPLETED.value, 0) == status.total
    )


def batch_code(status: BatchStatus | None) -> ExitCode:
    """As for one job: 0 once every job COMPLETED, 1 when the batch ended otherwise (or the watch
    ended without its end)."""
    return ExitCode.OK if every_job_completed(status) else ExitCode.JOB_NOT_COMPLETED


def counts_text(status: BatchStatus) -> str:
    """Jobs by state, most first; jobs not seen running yet (not started, or their end on its
    way) are counted apart."""
    parts = [f"{state} {n}" for state, n in sorted(status.counts.items(), key=lambda kv: -kv[1])]
    unseen = status.total - sum(status.counts.values())
    if unseen > 0:
        parts.append(f"{unseen} not started")
    return ", ".join(parts) or "no jobs"


def watch_line(status: BatchStatus, now: datetime) -> str:
    return (
        f"{now:%H:%M:%S}  {status.state!s:<10}  {status.ended}/{status.total} ended  "
        f"{status.progress:.0%}  {counts_text(status)}"
    )


def ended_line(status: BatchStatus) -> str:
    done = status.counts.get(JobState.COMPLETED.value, 0)
    return (
        f"batch {status.batch_id} ended {status.state}: {done} of {status.total} jobs COMPLETED; "
        f"their artifacts: durable-comfy batch result {status.batch_id}"
    )


def status_lines(status: BatchStatus) -> list[str]:
    """Everything a person needs to know about the batch, then its jobs as a table."""
    lines = [
        f"batch {status.batch_id}: {status.state}",
        f"  {status.total} jobs, {status.ended} ended: {counts_text(status)}",
        f"  progress {status.progress:.0%}",
    ]
    if status.cost.gpu_s or status.cost.usd is not None:
        usd = "" if status.cost.usd is None else f" (${status.cost.usd:.4f})"
        lines.append(f"  cost {status.cost.gpu_s:g} GPU s{usd}")
    lines.append(f"  {status.artifacts} artifact(s)")
    if status.cancel_reason:
        lines.append(f"  cancelled: {status.cancel_reason}")
    if status.webhook:
        lines.append(f"  webhook {status.webhook}")
    if status.ended_at is not None:
        lines.append(f"  ended {status.ended_at:%Y-%m-%d %H:%M:%S %Z}".rstrip())
    if status.jobs:
        lines.append("")
        lines.extend(jobs_table(status.jobs))
    return lines


def jobs_table(jobs: Sequence[BatchJob]) -> list[str]:
    """Plain aligned columns: a job ID is never cut or wrapped, whatever the terminal width."""
    header = ("job", "state", "progress %", "artifacts", "error")
    rows = [header]
    for job in jobs:
        error = f"{job.error.type}: {job.error.message}" if job.error else ""
        percent = "" if job.percent is None else str(job.percent)
        rows.append((job.job_id, str(job.state or "-"), percent, str(job.artifacts), error))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def result_lines(results: BatchResults, status: BatchStatus) -> list[str]:
    done = status.counts.get(JobState.COMPLETED.value, 0)
    lines = [f"batch {results.batch_id}: {results.state}, {done} of {status.total} jobs COMPLETED"]
    for end in results.ends:
        lines.append(f"{end.job_id}  {end.state}")
        if end.error is not None:
            lines.append(f"  error {end.error.type}: {end.error.message}")
        for artifact in end.artifacts:
            lines.append(f"  {artifact.uri}  {artifact.size} bytes  sha256 {artifact.sha256}")
            if artifact.url:
                lines.append(f"    {artifact.url}")
    return lines


class FollowedBatch:
    """The batch a command follows, so an interrupt can say what happens to it next."""

    def __init__(self, batch_id: str, submitting: bool = False) -> None:
        self.batch_id = batch_id
        self.status: BatchStatus | None = None
        # Until the client has said it started every job, Ctrl-C may leave some unstarted.
        self.submitting = submitting

    def on_interrupt(self) -> str:
        batch_id = self.batch_id
        if self.submitting:
            return (
                f"batch {batch_id} may be half-started: the same submit with --batch-id "
                f"{batch_id} starts only the jobs it lacks"
            )
        if self.status is not None and self.status.terminal:
            return f"batch {batch_id} had already ended {self.status.state}"
        return (
            f"batch {batch_id} keeps running server-side; follow it again with "
            f"`durable-comfy batch watch {batch_id}`"
        )


def _shown(status: BatchStatus) -> tuple[object, ...]:
    return (str(status.state), status.seq, tuple(sorted(status.counts.items())))


async def follow(
    client: JobClient,
    followed: FollowedBatch,
    as_json: bool,
    *,
    already_shown: BatchStatus | None = None,
) -> BatchStatus | None:
    """A line each time the batch changes, until it ends; `already_shown`: a status printed
    before (by submit), whose repeats are skipped."""
    last: BatchStatus | None = None
    updates: AsyncIterator[BatchStatus] = client.watch_batch(
        followed.batch_id, interval_s=WATCH_INTERVAL_S
    )
    async for status in updates:
        followed.status = last = status
        if already_shown is not None and not status.terminal:
            if _shown(status) == _shown(already_shown):
                continue
        already_shown = None
        if as_json:
            echo_json(batch_json(status))
        else:
            typer.echo(watch_line(status, datetime.now().astimezone()))
    if last is not None and not as_json:
        typer.echo(ended_line(last))
    return last


# -- submit --count / --batch -------------------------------------------------------------------


def submit_batch(
    config: CliConfig,
    batch: BatchRequest | list[JobRequest],
    batch_id: str | None,
    *,
    staging: bool,
    watch: bool,
    as_json: bool,
) -> int:
    """Submit the batch (already checked: nothing is refused here but by the server or the
    queue's room), print its ID or status, follow it with `watch`; the exit code."""
    followed = FollowedBatch(batch_id or new_batch_id(), submitting=True)

    async def go() -> int:
        async with job_client(config, with_store=staging) as client:
            # Always detached: a batch's watch reads the batch, not each job, so an attached job
            # would be abandoned while its batch is followed.
            submitted = await client.submit_batch(batch, batch_id=followed.batch_id)
            followed.submitting = False
            followed.status = submitted.status
            if submitted.existed:
                log.warning(
                    "batch_already_exists",
                    batch_id=submitted.batch_id,
                    state=str(submitted.status.state),
                    started=submitted.started,
                    detail="same jobs under this ID: only the jobs it lacked were started",
                )
            if as_json:
                echo_json(submitted_json(submitted))
            else:
                _say_submitted(submitted, watch)
            if not watch:
                return ExitCode.OK
            # In --json the submit line was that status; a person saw only the batch's ID.
            shown = submitted.status if as_json else None
            last = await follow(client, followed, as_json, already_shown=shown)
            return batch_code(last)

    return run(go, followed.on_interrupt)


def _say_submitted(submitted: BatchSubmitted, watch: bool) -> None:
    batch_id, state = submitted.batch_id, submitted.status.state
    jobs = submitted.job_ids
    span = jobs[0] if len(jobs) == 1 else f"{jobs[0]} to {jobs[-1]}"
    if submitted.existed:
        started = (
            f"started the {submitted.started} job(s) it lacked"
            if submitted.started
            else "nothing new was submitted"
        )
        typer.echo(f"batch {batch_id} already exists ({state}), with these same jobs: {started}")
    else:
        typer.echo(
            f"submitted batch {batch_id}: {len(jobs)} job(s), {span} (detached: they run to "
            "their end)"
        )
    if not watch:
        typer.echo(f"follow it: durable-comfy batch watch {batch_id}")


# -- the `batch` group --------------------------------------------------------------------------


@app.command("status")
def status(ctx: typer.Context, batch_id: BatchArg, as_json: JsonOpt = False) -> None:
    """The batch's state, its jobs by state, progress, cost and artifacts, and each job's state
    (exit 0 whatever its state; see `batch watch` to wait for its end)."""
    config = config_of(ctx)

    async def go() -> BatchStatus:
        checked_batch_id(batch_id)
        async with job_client(config) as client:
            return await client.batch_status(batch_id, jobs=True)

    current = run(go)
    if as_json:
        echo_json(batch_json(current))
        return
    for line in status_lines(current):
        typer.echo(line)


@app.command("watch")
def watch(ctx: typer.Context, batch_id: BatchArg, as_json: JsonOpt = False) -> None:
    """A line each time the batch changes, until every job has ended (exit 0 when every one
    COMPLETED, 1 otherwise)."""
    config = config_of(ctx)
    followed = FollowedBatch(batch_id)

    async def go() -> int:
        checked_batch_id(batch_id)
        async with job_client(config) as client:
            return batch_code(await follow(client, followed, as_json))

    raise typer.Exit(run(go, followed.on_interrupt))


@app.command("cancel")
def cancel(
    ctx: typer.Context,
    batch_id: BatchArg,
    reason: Annotated[
        str, typer.Option(help="Recorded in the batch's status and each job's.")
    ] = "batch cancelled from the CLI",
    as_json: JsonOpt = False,
) -> None:
    """Cancel every unfinished job of the batch: each prompt is stopped, finished artifacts are
    kept, and the batch ends CANCELLED once every job has ended."""
    config = config_of(ctx)

    async def go() -> tuple[BatchStatus, BatchStatus]:
        checked_batch_id(batch_id)
        async with job_client(config) as client:
            before = await client.batch_status(batch_id)
            if before.terminal:
                fail(
                    f"batch {batch_id!r} already ended {before.state} "
                    f"({counts_text(before)}); nothing to cancel",
                    code=ExitCode.CONFLICT,
                )
            return before, await client.cancel_batch(batch_id, reason)

    before, after = run(go)
    if as_json:
        echo_json(batch_json(after))
        return
    open_jobs = before.total - before.ended
    typer.echo(
        f"cancel requested for batch {batch_id} (was {before.state}, {open_jobs} job(s) "
        f"unfinished): each is stopped, finished outputs are kept; now {after.state}, it ends "
        "CANCELLED once every job has ended"
    )


@app.command("result")
def result(ctx: typer.Context, batch_id: BatchArg, as_json: JsonOpt = False) -> None:
    """Wait for the batch to end; print every job's state and artifacts with presigned URLs
    (exit 0 when every job COMPLETED, 1 otherwise)."""
    config = config_of(ctx)
    followed = FollowedBatch(batch_id)

    async def go() -> int:
        checked_batch_id(batch_id)
        async with job_client(config, with_store=True) as client:
            final = await client.wait_batch(batch_id, interval_s=WATCH_INTERVAL_S)
            followed.status = final
            results = await client.batch_results(batch_id)
        if as_json:
            echo_json(results.model_dump_json())
        else:
            for line in result_lines(results, final):
                typer.echo(line)
        return batch_code(final)

    raise typer.Exit(run(go, followed.on_interrupt))
