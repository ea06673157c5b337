"""Showing a JobStatus to people (rich) or to scripts (one JSON object per line)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Literal

import structlog
import typer
from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from temporalio.client import WorkflowExecutionStatus

from starter.cli.common import echo_json
from starter.client import JobClient, SubmitOutcome
from starter.pollers import presence_changes
from starter.worker_wait import wait_line
from workflows.admission import place_in_line
from workflows.contracts import JobState, JobStatus

log = structlog.get_logger("durable_comfy.cli")


def status_json(status: JobStatus) -> str:
    return status.model_dump_json(exclude_none=True)


def submit_json(outcome: SubmitOutcome) -> str:
    """The job's status with one more field, `existed`: a JobStatus reader can drop it."""
    document = json.loads(status_json(outcome.status))
    document["existed"] = outcome.existed
    return json.dumps(document, separators=(",", ":"))


class Followed:
    """The job a command follows, so an interrupt can say what happens to it next."""

    def __init__(self, job_id: str | None = None) -> None:
        self.job_id = job_id
        self.status: JobStatus | None = None

    def seen(self, status: JobStatus) -> None:
        self.job_id, self.status = status.job_id, status

    def on_interrupt(self) -> str:
        status, job_id = self.status, self.job_id
        if job_id is None:
            return "the job (if any) keeps running server-side"
        if status is not None and status.terminal:
            return f"job {job_id} had already ended {status.state.value}"
        again = f"`durable-comfy watch {job_id}`"
        if status is None or status.abandon_after_s is None or status.detached:
            return f"job {job_id} keeps running server-side; follow it again with {again}"
        return (
            f"job {job_id} is attached: it will be ABANDONED (its prompt stopped) after "
            f"{status.abandon_after_s:g} s without a watcher unless watched again: {again}"
        )


class WorkerEvent(BaseModel):
    """A `--json` line that is not a JobStatus: whether a worker polls the job's task queue.

    `no_worker`: nobody polls it, so the job cannot move (the watch goes on); `worker_polling`:
    one does again (`workers`: their identities), after a `no_worker`."""

    event: Literal["no_worker", "worker_polling"]
    job_id: str
    task_queue: str
    workers: list[str] = []

    def human(self) -> str:
        queue = repr(self.task_queue)
        if self.event == "no_worker":
            return (
                f"no worker polls task queue {queue} (start one: durable-comfy worker); "
                "still watching"
            )
        return f"a worker polls task queue {queue} now ({', '.join(self.workers)}); going on"


@asynccontextmanager
async def worker_notices(
    client: JobClient, followed: Followed, as_json: bool
) -> AsyncIterator[None]:
    """While the body follows the job: say within seconds when no worker polls its task queue
    (a query would only time out, silently, after DURABLE_COMFY_QUERY_TIMEOUT_S), and again
    when one does. JSON lines with `as_json` (a `WorkerEvent`), one stderr line otherwise."""
    task = asyncio.create_task(_notices(client, followed, as_json))
    try:
        yield
    finally:
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task


async def _notices(client: JobClient, followed: Followed, as_json: bool) -> None:
    job_id = followed.job_id
    if job_id is None:
        return
    try:
        # The job's own task queue: a job found again by ID may have been started on another.
        description = await client.handle(job_id).describe()
    except Exception as exc:  # advisory: the watch itself reports a missing job or Temporal
        log.debug("worker_check_skipped", job_id=job_id, error=str(exc))
        return
    if description.status != WorkflowExecutionStatus.RUNNING:
        return
    task_queue = description.task_queue
    try:
        async for presence in presence_changes(client.temporal, task_queue):
            if followed.status is not None and followed.status.terminal:
                return
            event = WorkerEvent(
                event="worker_polling" if presence.polled else "no_worker",
                job_id=job_id,
                task_queue=task_queue,
                workers=presence.identities,
            )
            log.info(event.event, job_id=job_id, task_queue=task_queue)
            if as_json:
                echo_json(event.model_dump_json())
            else:
                typer.echo(event.human(), err=True)
    except Exception as exc:  # advisory: never the reason a watch fails
        log.debug("worker_check_failed", job_id=job_id, error=str(exc))


async def stream_json(
    statuses: AsyncIterator[JobStatus],
    followed: Followed | None = None,
    *,
    already_shown: JobStatus | None = None,
) -> JobStatus | None:
    """One line per change; `already_shown`: a status printed before (by submit), whose
    repeats (same seq, state and step) are skipped until something else is printed."""
    followed = followed or Followed()
    last: JobStatus | None = None
    async for status in statuses:
        followed.seen(status)
        last = status
        if already_shown is not None and not status.terminal and _same_line(status, already_shown):
            continue
        already_shown = None
        echo_json(status_json(status))
    return last


def _same_line(status: JobStatus, shown: JobStatus) -> bool:
    return (status.seq, status.state, status.progress.step) == (
        shown.seq,
        shown.state,
        shown.progress.step,
    )


async def stream_progress(
    statuses: AsyncIterator[JobStatus], console: Console, followed: Followed | None = None
) -> JobStatus | None:
    """A progress bar until the job ends; `followed` keeps the latest status for Ctrl-C."""
    followed = followed or Followed()
    # The first status comes before the bar: a job that does not exist draws nothing.
    first = await anext(statuses, None)
    if first is None:
        return None
    followed.seen(first)
    last = first
    columns = (
        TextColumn("[bold]{task.fields[state]:<14}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("job", total=1.0, state="", detail="")
        status: JobStatus | None = first
        while status is not None:
            followed.seen(status)
            last = status
            bar.update(
                task,
                completed=status.progress.fraction,
                state=status.state.value,
                detail=escape(_detail(status)),
            )
            status = await anext(statuses, None)
    return last


def _detail(status: JobStatus) -> str:
    progress = status.progress
    parts = []
    if status.worker_wait is not None:
        parts.append(wait_line(status.worker_wait))
    if progress.queue_position is not None:
        parts.append(f"#{progress.queue_position} in the backend's queue")
    if status.state == JobState.PENDING and status.admission is not None:
        parts.append(place_in_line(status.admission))
    if status.teardown.state == "STOPPING":
        parts.append("waiting for the prompt to stop")
    if progress.total_steps:
        parts.append(f"{progress.step}/{progress.total_steps} {progress.unit}")
    if progress.segments > 1:
        parts.append(f"segment {progress.segment + 1}/{progress.segments}")
    if status.artifacts:
        parts.append(f"{len(status.artifacts)} artifact(s)")
    if status.reconnects:
        parts.append(f"{status.reconnects} reconnect(s)")
    if status.state == JobState.NEEDS_DECISION:
        parts.append("needs a decision: durable-comfy status " + status.job_id)
    return "  ".join(parts)


_COLOURS: dict[str, str] = {JobState.COMPLETED: "green", JobState.NEEDS_DECISION: "yellow"}


def print_summary(status: JobStatus, console: Console, ui_url: str | None = None) -> None:
    """Everything a person needs to know about the job, one fact per line."""
    out = console.print
    colour = _COLOURS.get(status.state, "red" if status.terminal else "cyan")
    out(f"job [bold]{escape(status.job_id)}[/]: [{colour}]{status.state.value}[/]")
    for line in summary_lines(status):
        out(f"  {escape(line)}", soft_wrap=True)
    if ui_url:
        out(f"  Temporal UI: {ui_url}", soft_wrap=True)


def summary_lines(status: JobStatus) -> list[str]:
    lines = [_progress_line(status)]
    if status.worker_wait is not None:
        lines.append(wait_line(status.worker_wait))
    if status.error:
        lines.append(f"error {status.error.type}: {status.error.message}")
    if status.state == JobState.NEEDS_DECISION and status.decision is not None:
        lines.append(f"decision needed: {status.decision.reason}")
        for choice, effect in status.decision.options.items():
            lines.append(f"  durable-comfy {choice} {status.job_id}: {effect}")
    for artifact in status.artifacts:
        lines.append(f"{artifact.uri}  {artifact.size} bytes  sha256 {artifact.sha256}")
        if artifact.url:
            lines.append(f"  {artifact.url}")
    teardown = status.teardown
    if teardown.state != "PENDING":
        detail = f": {teardown.detail}" if teardown.detail else ""
        lines.append(f"teardown {teardown.state}{detail}")
    if status.reconnects:
        lines.append(f"{status.reconnects} reconnect(s)")
    if not status.terminal:
        if status.detached or status.abandon_after_s is None:
            lines.append("detached: runs to its end whoever is listening")
        else:
            lines.append(
                f"attached: abandoned after {status.abandon_after_s:g} s without a watcher"
            )
    return lines


def _progress_line(status: JobStatus) -> str:
    progress = status.progress
    parts = [f"progress {progress.fraction:.0%}"]
    if progress.total_steps:
        parts.append(f"{progress.step}/{progress.total_steps} {progress.unit}")
    if progress.segments > 1:
        parts.append(f"segment {progress.segment + 1}/{progress.segments}")
    if progress.node is not None and not status.terminal:
        parts.append(f"node {progress.node}")
    if status.state == JobState.WAITING and progress.queue_position is not None:
        parts.append(f"#{progress.queue_position} in the backend's queue")
    if status.state == JobState.PENDING and status.admission is not None:
        parts.append(place_in_line(status.admission))
    return ", ".join(parts)
