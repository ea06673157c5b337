"""What every backend's follow activity does alike: resume from its heartbeat, say which worker
follows, and send the workflow its `progress` signals on milestones only.

Fine-grained progress travels in the activity's heartbeats: every step goes into the
`FollowHeartbeat`'s checkpoint, which costs no history event, reaches the server at most every
`WorkerSettings.heartbeat_throttle_s` and is read by clients from the workflow's description
(`starter.progress`). A `progress` signal costs about four history events (the signal and the
workflow task it wakes), so one is sent only when the workflow must hear of it (`Milestones`).
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal

from temporalio import activity
from temporalio.exceptions import ApplicationError

from workflows.activity_io import FollowHeartbeat, FollowInput
from workflows.contracts import Checkpoint, ProgressReport
from workflows.shared import SIGNAL_PROGRESS

Stage = Literal["queued", "running", "uploading", "finished"]

# Progress milestones: each whole tenth of a prompt's steps (10 %, 20 %, ...).
TENTHS = 10


def tenth(step: int, total: int) -> int:
    """The whole tenths of `total` that `step` has reached (0-10; 0 while the total is unknown)."""
    if total <= 0:
        return 0
    return max(0, min(TENTHS, step * TENTHS // total))


# A follow attempt tells the workflow nothing in its first second: a prompt that ends within it
# costs the job no signal (each is about four history events and a workflow task on the
# server), and its stage and steps reach clients in the heartbeats meanwhile.
QUIET_START_S = 1.0


class Milestones:
    """When a follow attempt sends the workflow a `progress` signal.

    Due: the attempt's first report (the workflow learns who follows, and where the prompt
    is), a change of the prompt's stage on the backend (queued -> running), each stored
    artifact and the end (`force`), and each whole tenth of the steps, but a tenth no sooner
    than `min_interval_s` (the job's `progress_interval_s`) after the previous signal: a short
    job does not pay ten signals. Nothing is due during the attempt's quiet start
    (`QUIET_START_S`); what came up meanwhile is `held`, and due at the next call after it
    (the caller makes one when the quiet start ends). A tenth held back by the interval is due
    at the next call after the interval, and any forced signal carries the step it got to.
    Everything between milestones goes only into heartbeats.
    """

    def __init__(
        self,
        min_interval_s: float,
        *,
        quiet_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._quiet_until = clock() + (QUIET_START_S if quiet_s is None else quiet_s)
        self._stage: str | None = None
        self._tenth = -1
        self._at = -math.inf
        self.sent = 0
        self.held = False

    @property
    def quiet_left_s(self) -> float:
        return max(0.0, self._quiet_until - self._clock())

    def due(
        self, stage: str, step: int, total: int, *, force: bool = False, news: bool = False
    ) -> bool:
        """True when this report is a milestone; it is then counted as told.

        `news`: something else the workflow's status carries changed (a place in the queue):
        told like a tenth, no sooner than `min_interval_s` after the previous signal.
        """
        now = self._clock()
        if now < self._quiet_until:
            self.held = True
            return False
        reached = tenth(step, total)
        first = self.sent == 0
        rested = now - self._at >= self._min_interval_s
        crossed = (reached > self._tenth or news) and rested
        if not (first or force or stage != self._stage or crossed):
            return False
        self._stage = stage
        self._tenth = max(self._tenth, reached)
        self._at = now
        self.sent += 1
        self.held = False
        return True


def restore_checkpoint(heartbeat: FollowHeartbeat | None, req: FollowInput) -> Checkpoint:
    """Where to resume: this activity's own last heartbeat, else the workflow's checkpoint,
    each only if it is of this very prompt; else the start."""
    if heartbeat is not None and heartbeat.checkpoint.prompt_id == req.prompt_id:
        return heartbeat.checkpoint
    if req.checkpoint is not None and req.checkpoint.prompt_id == req.prompt_id:
        return req.checkpoint
    return Checkpoint(
        job_id=req.job_id,
        segment=req.segment,
        prompt_id=req.prompt_id,
        client_id=req.client_id,
        updated_at=datetime.now(UTC),
    )


def with_resume_point(
    error: ApplicationError, resume_point: Callable[[], FollowHeartbeat]
) -> ApplicationError:
    """A retryable failure carries the attempt's heartbeat, so the workflow re-attaches from its
    checkpoint; a Retry-After the failure was given (`next_retry_delay`) stays with it."""
    if error.non_retryable:
        return error
    return ApplicationError(
        error.message,
        resume_point().model_dump(mode="json"),
        type=error.type,
        non_retryable=False,
        next_retry_delay=error.next_retry_delay,
    )


def worker_identity() -> str:
    """The worker process following the prompt, as Temporal knows it (`pid@host`)."""
    try:
        identity = getattr(activity.client(), "identity", None)
    except RuntimeError:  # no client (e.g. an ActivityEnvironment)
        identity = None
    return identity if isinstance(identity, str) and identity else process_identity()


def process_identity() -> str:
    return f"{os.getpid()}@{socket.gethostname()}"


async def send_progress(job_id: str, report: ProgressReport, log: Any) -> None:
    """Progress is advisory: a signal that cannot be sent never fails the job."""
    try:
        handle = activity.client().get_workflow_handle(job_id)
        await handle.signal(SIGNAL_PROGRESS, report)
    except Exception as exc:
        log.warning("progress_signal_failed", error=str(exc))
