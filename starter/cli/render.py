"""Showing a JobStatus to people (rich) or to scripts (one JSON object per line)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from starter.cli.common import echo_json
from workflows.contracts import JobStatus


def status_json(status: JobStatus) -> str:
    return status.model_dump_json(exclude_none=True)


async def stream_json(statuses: AsyncIterator[JobStatus]) -> JobStatus | None:
    last: JobStatus | None = None
    async for status in statuses:
        echo_json(status_json(status))
        last = status
    return last


async def stream_progress(statuses: AsyncIterator[JobStatus], console: Console) -> JobStatus | None:
    last: JobStatus | None = None
    columns = (
        TextColumn("[bold]{task.fields[state]:<13}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("job", total=1.0, state="QUEUED", detail="")
        async for status in statuses:
            last = status
            bar.update(
                task,
                completed=status.progress.fraction,
                state=status.state.value,
                detail=_detail(status),
            )
    return last


def _detail(status: JobStatus) -> str:
    progress = status.progress
    parts = []
    if progress.queue_position is not None:
        parts.append(f"#{progress.queue_position} in the backend's queue")
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
    return "  ".join(parts)


def print_summary(status: JobStatus, console: Console, ui_url: str | None = None) -> None:
    colour = "green" if status.state.value == "COMPLETED" else "red"
    console.print(f"job [bold]{status.job_id}[/]: [{colour}]{status.state.value}[/]")
    if status.error:
        console.print(f"  error [bold]{status.error.type}[/]: {status.error.message}")
    for artifact in status.artifacts:
        console.print(f"  {artifact.uri}  {artifact.size} bytes  sha256 {artifact.sha256}")
        if artifact.url:
            console.print(f"    {artifact.url}", soft_wrap=True)
    if status.teardown.state != "PENDING":
        console.print(f"  teardown {status.teardown.state}: {status.teardown.detail}")
    if ui_url:
        console.print(f"  Temporal UI: {ui_url}", soft_wrap=True)
