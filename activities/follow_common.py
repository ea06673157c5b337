"""What every backend's follow activity does alike: resume from its heartbeat, say which worker
follows, and send the workflow its `progress` signals."""

from __future__ import annotations

import os
import socket
from datetime import UTC, datetime
from typing import Any

from temporalio import activity

from workflows.activity_io import FollowHeartbeat, FollowInput
from workflows.contracts import Checkpoint, ProgressReport
from workflows.shared import SIGNAL_PROGRESS


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
