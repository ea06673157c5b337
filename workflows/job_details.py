"""The Temporal UI's "Current Details" of a job: its status at a glance, in Markdown.

Rendered from the status on every write (workflows/job_book.py sets them); they cost no history
event, so the UI stays as current as a `status` query.
"""

from __future__ import annotations

from datetime import datetime

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.contracts import JobState, JobStatus

# Characters Markdown gives a meaning to: escaped, so text from a backend (an error, a node's
# name) renders as text in the UI, never as a link, an image or markup.
_MARKDOWN = frozenset("\\`*_{}[]()<>#+!|~")
MAX_SHOWN_CHARS = 300


class CurrentDetails:
    """Renders one job's details; keeps the pace the ETA is read from."""

    def __init__(self) -> None:
        self._pace_from: tuple[datetime, float] | None = None

    def render(self, status: JobStatus) -> str:
        progress = status.progress
        head = f"**{status.state.value}** — {int(progress.fraction * 100)} %"
        if progress.total_steps:
            head += f" ({progress.step}/{progress.total_steps} {progress.unit}"
            head += f", segment {progress.segment + 1}/{progress.segments})"
        lines = [head]
        if status.state == JobState.WAITING and progress.queue_position is not None:
            lines.append(f"place {progress.queue_position} in the backend's queue")
        eta = self.eta_s(status)
        if eta is not None:
            lines.append(f"about {_duration(eta)} to go")
        if status.backend:
            where = f"pool `{status.backend.pool}`"
            if progress.node and status.state == JobState.RUNNING:
                where += f", node {plain(progress.node)}"
            lines.append(where)
        if status.reconnects:
            lines.append(f"{status.reconnects} reconnect(s)")
        if status.error:
            lines.append(f"error `{status.error.type}`: {plain(status.error.message)}")
        if status.decision and status.state == JobState.NEEDS_DECISION:
            lines.append(f"waiting for a decision: {plain(status.decision.reason)}")
            lines.extend(
                f"- `{choice}`: {what}" for choice, what in status.decision.options.items()
            )
        if status.artifacts:
            lines.append(f"{len(status.artifacts)} artifact(s) stored")
        if status.teardown.state != "PENDING":
            lines.append(f"teardown {status.teardown.state}: {plain(status.teardown.detail)}")
        return "  \n".join(lines)

    def eta_s(self, status: JobStatus) -> float | None:
        """From the pace since the first step was reported; None until there is one."""
        fraction = status.progress.fraction
        if status.state != JobState.RUNNING or fraction >= 1.0:
            return None
        if self._pace_from is None:
            if fraction > 0:
                self._pace_from = (workflow.now(), fraction)
            return None
        since, start = self._pace_from
        done = fraction - start
        if done < 0.02:
            return None
        elapsed = (workflow.now() - since).total_seconds()
        return elapsed / done * (1.0 - fraction)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def plain(text: str) -> str:
    """`text` as plain text inside Markdown: one line, escaped, at most MAX_SHOWN_CHARS."""
    cut = text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 1] + "…"
    return "".join("\\" + ch if ch in _MARKDOWN else ch if ch.isprintable() else " " for ch in cut)
