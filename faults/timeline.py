"""A timeline of one job under chaos: what its status said, and what we did to it, when.

A background task polls `JobClient.status` (the workflow's `status` query) and records an entry
whenever something a person would notice changes (state, step, segment, reconnects, prompt,
teardown, artifacts), plus the injected events ("worker killed", ...) and the stretches when the
status could not be read at all (no worker to answer the query, Temporal down). Tests assert on
the sequence; `make demo-chaos` prints it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from types import TracebackType
from typing import Literal, Self

from pydantic import BaseModel

from faults.wait import ChaosTimeout, until
from starter.client import JobClient
from workflows.contracts import JobState, JobStatus

EntryKind = Literal["status", "event", "unreachable"]


class TimelineEntry(BaseModel):
    t: float  # seconds since the recorder started
    kind: EntryKind
    state: JobState | None = None
    step: int = 0
    total_steps: int = 0
    segment: int = 0
    segments: int = 1
    reconnects: int = 0
    prompt_id: str | None = None
    teardown: str | None = None
    artifacts: int = 0
    note: str = ""

    @classmethod
    def of(cls, t: float, status: JobStatus) -> TimelineEntry:
        checkpoint = status.checkpoint
        return cls(
            t=t,
            kind="status",
            state=status.state,
            step=status.progress.step,
            total_steps=status.progress.total_steps,
            segment=status.progress.segment,
            segments=status.progress.segments,
            reconnects=status.reconnects,
            prompt_id=checkpoint.prompt_id if checkpoint is not None else None,
            teardown=status.teardown.state,
            artifacts=len(status.artifacts),
        )

    def signature(self) -> tuple[object, ...]:
        """What counts as "changed" between two polls."""
        return (
            self.state,
            self.step,
            self.segment,
            self.reconnects,
            self.prompt_id,
            self.teardown,
            self.artifacts,
        )

    def render(self) -> str:
        head = f"{self.t:7.2f}s  "
        if self.kind == "event":
            return head + f"--- {self.note}"
        if self.kind == "unreachable":
            return head + f"    (no answer to the status query: {self.note})"
        assert self.state is not None
        progress = f"step {self.step:>3}/{self.total_steps:<3}"
        if self.segments > 1:
            progress = f"segment {self.segment + 1}/{self.segments}  " + progress
        extra = f"  reconnects {self.reconnects}"
        if self.artifacts:
            extra += f"  artifacts {self.artifacts}"
        if self.state.terminal:
            extra += f"  teardown {self.teardown}"
        return head + f"    {self.state.value:<15} {progress}{extra}"


class Timeline:
    """Records one job's status in the background; use as `async with Timeline(...) as tl:`.

    `keepalive_s` sends `client_seen` like a watching client would; leave it None to play the
    client that went away (abandonment tests).
    """

    def __init__(
        self,
        client: JobClient,
        job_id: str,
        *,
        interval_s: float = 0.1,
        query_timeout_s: float = 3.0,
        keepalive_s: float | None = None,
    ) -> None:
        self.client = client
        self.job_id = job_id
        self.interval_s = interval_s
        self.query_timeout_s = query_timeout_s
        self.keepalive_s = keepalive_s
        self.entries: list[TimelineEntry] = []
        self.last: JobStatus | None = None
        self._t0 = time.monotonic()
        self._force_next = True
        self._task: asyncio.Task[None] | None = None
        self._listeners: list[Callable[[TimelineEntry], None]] = []

    # -- lifecycle --------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._t0 = time.monotonic()
        self._task = asyncio.create_task(self._run(), name=f"timeline-{self.job_id}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def on_entry(self, listener: Callable[[TimelineEntry], None]) -> None:
        """Called with every new entry (the demo prints them as they come)."""
        self._listeners.append(listener)

    # -- recording --------------------------------------------------------------------------

    def now(self) -> float:
        return round(time.monotonic() - self._t0, 3)

    def mark(self, note: str) -> TimelineEntry:
        """Record something the test did; the next readable status is recorded whatever it is."""
        entry = TimelineEntry(t=self.now(), kind="event", note=note)
        self._add(entry)
        self._force_next = True
        return entry

    def _add(self, entry: TimelineEntry) -> None:
        self.entries.append(entry)
        for listener in self._listeners:
            listener(entry)

    async def _run(self) -> None:
        last_seen = float("-inf")
        while True:
            try:
                status = await asyncio.wait_for(
                    self.client.status(self.job_id), timeout=self.query_timeout_s
                )
            except Exception as exc:  # no worker to answer, Temporal down, ...
                self._unreachable(exc)
            else:
                self._record(status)
                if status.terminal:
                    return
                due = time.monotonic() - last_seen >= (self.keepalive_s or 0.0)
                if self.keepalive_s is not None and not status.detached and due:
                    with contextlib.suppress(Exception):
                        await self.client.client_seen(self.job_id)
                    last_seen = time.monotonic()
            await asyncio.sleep(self.interval_s)

    def _record(self, status: JobStatus) -> None:
        self.last = status
        entry = TimelineEntry.of(self.now(), status)
        previous = self._last_status_entry()
        changed = previous is None or previous.signature() != entry.signature()
        if changed or self._force_next or self.entries[-1].kind == "unreachable":
            self._force_next = False
            self._add(entry)

    def _unreachable(self, exc: BaseException) -> None:
        if self.entries and self.entries[-1].kind == "unreachable":
            return  # one entry per outage, not one per poll
        reason = type(exc).__name__ if not str(exc) else f"{type(exc).__name__}: {exc}"
        self._add(TimelineEntry(t=self.now(), kind="unreachable", note=reason[:120]))

    def _last_status_entry(self) -> TimelineEntry | None:
        for entry in reversed(self.entries):
            if entry.kind == "status":
                return entry
        return None

    # -- reading ----------------------------------------------------------------------------

    def statuses(self) -> list[TimelineEntry]:
        return [e for e in self.entries if e.kind == "status"]

    def statuses_after(self, note: str) -> list[TimelineEntry]:
        """Status entries recorded after the (first) event whose note starts with `note`."""
        for index, entry in enumerate(self.entries):
            if entry.kind == "event" and entry.note.startswith(note):
                return [e for e in self.entries[index + 1 :] if e.kind == "status"]
        raise KeyError(f"no event {note!r} in the timeline")

    def step_regressions(self) -> list[tuple[TimelineEntry, TimelineEntry]]:
        """Consecutive statuses of one segment whose step went down: progress a client had
        already seen, taken back. Only a resubmission after ComfyUI lost the prompt may do that
        (the work really starts again); a re-attach must continue from the checkpoint."""
        statuses = self.statuses()
        return [
            (before, after)
            for before, after in itertools.pairwise(statuses)
            if after.segment == before.segment and after.step < before.step
        ]

    def states(self) -> list[JobState]:
        """The sequence of distinct states, in order."""
        out: list[JobState] = []
        for entry in self.statuses():
            if entry.state is not None and (not out or out[-1] != entry.state):
                out.append(entry.state)
        return out

    async def wait_for(
        self, predicate: Callable[[JobStatus], bool], *, timeout_s: float, what: str
    ) -> JobStatus:
        def holds() -> bool:
            return self.last is not None and predicate(self.last)

        try:
            await until(holds, timeout_s=timeout_s, what=what)
        except ChaosTimeout as exc:
            # What the job did meanwhile is the first thing one needs to see on a red run.
            raise ChaosTimeout(f"{exc}\ntimeline:\n{self.render()}") from None
        assert self.last is not None
        return self.last

    async def wait_terminal(self, *, timeout_s: float) -> JobStatus:
        return await self.wait_for(
            lambda s: s.terminal, timeout_s=timeout_s, what=f"job {self.job_id} ends"
        )

    def render(self) -> str:
        return "\n".join(entry.render() for entry in self.entries)
