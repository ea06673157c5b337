"""A running job's latest step, from the follow activity's heartbeat.

The job's own status (its `status` query) hears of progress only on milestones: the follow
activity signals the workflow at stage changes, each stored artifact and each whole tenth of the
steps, because each signal costs history events. Every step in between is in the activity's
heartbeat (a `FollowHeartbeat`, whose checkpoint holds the step), which the server keeps with
the pending activity and returns in the workflow's description at no history cost. The worker
sends it at most every `WorkerSettings.heartbeat_throttle_s` (0.4 s by default).

`overlaid` lays that checkpoint over the queried status when it belongs to the job's current
submission (same segment, prompt id and client id) and is newer: never backwards, so a stale
heartbeat (an earlier attempt's, an earlier submission's) changes nothing. The heartbeat also
says where the backend has the prompt (queued, with its place, or running): a follow attempt
tells the workflow nothing in its first second (`activities.follow_common.QUIET_START_S`), so
a SUBMITTING job whose current heartbeat says so is shown WAITING or RUNNING meanwhile. A
heartbeat of a worker that pushes its steps (activities/live_progress.py) names where, and
`overlaid` passes that on (`JobStatus.live_progress`) for a gateway to subscribe to.

A status read before the job's first submission (QUEUED or PREPARING, no checkpoint yet: the
answer of `JobClient.submit`, say) takes the heartbeat of a follow of that job as the
workflow's own status will once it has scheduled the follow: SUBMITTING at the heartbeat's
prompt, then its stage and step as above.
"""

from __future__ import annotations

from collections.abc import Iterable

from temporalio.client import WorkflowExecutionDescription

from workflows.activity_io import FollowHeartbeat
from workflows.contracts import Checkpoint, JobState, JobStatus
from workflows.shared import ACTIVITY_FOLLOW

# The states in which a follow activity runs (and heartbeats): worth a describe per poll.
FOLLOW_STATES = frozenset({JobState.SUBMITTING, JobState.WAITING, JobState.RUNNING})
# The states in which the status's own checkpoint may be ahead of its progress (a failed
# attempt's last heartbeat, recovered by the workflow before it re-attaches).
_CHECKPOINT_STATES = FOLLOW_STATES | {JobState.RECONNECTING}
# The states of a job whose status may predate its first submission.
_BEFORE_SUBMISSION = frozenset({JobState.QUEUED, JobState.PREPARING, JobState.SUBMITTING})


async def follow_heartbeats(description: WorkflowExecutionDescription) -> list[FollowHeartbeat]:
    """The heartbeats of the workflow's pending follow activities (normally one), as the
    server last got them; those that cannot be read are left out."""
    beats: list[FollowHeartbeat] = []
    for pending in description.raw_description.pending_activities:
        if pending.activity_type.name != ACTIVITY_FOLLOW:
            continue
        payloads = list(pending.heartbeat_details.payloads)
        if not payloads:
            continue
        try:
            details = await description.data_converter.decode(payloads)
        except Exception:  # advisory: an unreadable heartbeat is no heartbeat
            continue
        beat = FollowHeartbeat.from_details(details)
        if beat is not None:
            beats.append(beat)
    return beats


def follow_just_ended(status: JobStatus, description: WorkflowExecutionDescription) -> bool:
    """Whether the follow the job's status (a query) names may have ended before the describe
    after it: no follow activity is left on the record. Asked again, the job answers with what
    it read of the follow's end (a failed attempt's last checkpoint): a query waits for the
    workflow task under way, and one that already ran has taken the end in. Whether a task is
    pending does not tell the two apart from a backoff between attempts: the task may have
    started and finished between the query and the describe (seen under load, the status
    going back from step 3 to the bare SUBMITTING), so a backoff costs a second query."""
    raw = description.raw_description
    return status.state in FOLLOW_STATES and not any(
        p.activity_type.name == ACTIVITY_FOLLOW for p in raw.pending_activities
    )


def overlaid(status: JobStatus, heartbeats: Iterable[FollowHeartbeat] = ()) -> JobStatus:
    """`status` with the furthest checkpoint of its current submission laid over its progress:
    the heartbeats', or its own (ahead of its progress after a failed attempt). Unchanged when
    none is ahead, or the job is not following a prompt."""
    if status.checkpoint is None:
        heartbeats = list(heartbeats)
        status = _submitted(status, heartbeats)
    if status.state not in _CHECKPOINT_STATES or status.checkpoint is None:
        return status
    candidates = [status.checkpoint]
    if status.state in FOLLOW_STATES:
        heartbeats = list(heartbeats)
        status = _staged(status, heartbeats)
        status = _pushed_from(status, heartbeats)
        candidates += [beat.checkpoint for beat in heartbeats]
    best: Checkpoint | None = None
    for checkpoint in candidates:
        if _of_submission(status, checkpoint) and _ahead(status, checkpoint, best):
            best = checkpoint
    if best is None:
        return status
    progress = status.progress
    total = best.total_steps or progress.total_steps
    within = min(1.0, best.step / total) if total else 0.0
    moved = progress.model_copy(
        update={
            "step": best.step,
            "total_steps": total,
            "fraction": min(1.0, (progress.segment + within) / max(1, progress.segments)),
        }
    )
    update: dict[str, object] = {"progress": moved, "checkpoint": best}
    if best.updated_at is not None and (
        status.updated_at is None or best.updated_at > status.updated_at
    ):
        update["updated_at"] = best.updated_at
    return status.model_copy(update=update)


def carried_forward(status: JobStatus, earlier: JobStatus) -> JobStatus:
    """`status` (the job's own, read later) with the step `earlier` showed, when that is of the
    same submission and further: a step seen in a heartbeat or a push is not taken back by a
    status the workflow wrote before it heard of it."""
    if earlier.checkpoint is None:
        return status
    return overlaid(status, [FollowHeartbeat(checkpoint=earlier.checkpoint)])


def heartbeat_status(status: JobStatus, heartbeats: Iterable[FollowHeartbeat]) -> JobStatus:
    """A status read from Temporal's record alone (`starter.execution.bare_status`: its state
    and percent, no checkpoint), taken to the job's follow heartbeat: SUBMITTING at its prompt
    and segment, with the outputs that segment stored, then its stage and step as `overlaid`
    lays them. What a watch shows while the job's own first answer is late. Unchanged without
    such a heartbeat, or when the record says the job is past following (STOPPING, ended)."""
    if status.checkpoint is not None or status.state not in _BEFORE_SUBMISSION | FOLLOW_STATES:
        return status
    beat = next(
        (
            beat
            for beat in reversed(list(heartbeats))
            if beat.checkpoint.job_id == status.job_id and beat.checkpoint.prompt_id is not None
        ),
        None,
    )
    if beat is None:
        return status
    segment = beat.checkpoint.segment
    # How many segments the job has is the job's to say: at least this one's.
    progress = status.progress.model_copy(
        update={"segment": segment, "segments": max(status.progress.segments, segment + 1)}
    )
    submitting = status.model_copy(
        update={
            "state": JobState.SUBMITTING,
            "progress": progress,
            "artifacts": list(beat.artifacts),
        }
    )
    return overlaid(submitting, [beat])


def _submitted(status: JobStatus, heartbeats: list[FollowHeartbeat]) -> JobStatus:
    """A status from before the job's first submission, SUBMITTING at the prompt of a follow
    of the same job and segment that heartbeats (the last such one); unchanged without one."""
    if status.state not in _BEFORE_SUBMISSION or status.checkpoint is not None:
        return status
    for beat in reversed(heartbeats):
        checkpoint = beat.checkpoint
        if (
            checkpoint.job_id == status.job_id
            and checkpoint.prompt_id is not None
            and checkpoint.segment == status.progress.segment
        ):
            return status.model_copy(
                update={"state": JobState.SUBMITTING, "checkpoint": checkpoint}
            )
    return status


def _staged(status: JobStatus, heartbeats: list[FollowHeartbeat]) -> JobStatus:
    """A SUBMITTING job whose current submission's heartbeat says the backend has the prompt:
    WAITING (at its place) or RUNNING, as the workflow's status will say once it hears."""
    if status.state != JobState.SUBMITTING:
        return status
    for beat in reversed(heartbeats):
        if beat.stage is None or not _of_submission(status, beat.checkpoint):
            continue
        state = JobState.WAITING if beat.stage == "queued" else JobState.RUNNING
        progress = status.progress.model_copy(update={"queue_position": beat.queue_position})
        return status.model_copy(update={"state": state, "progress": progress})
    return status


def _pushed_from(status: JobStatus, heartbeats: list[FollowHeartbeat]) -> JobStatus:
    """The live-progress address of the worker following the current submission, if it
    serves one (activities/live_progress.py)."""
    for beat in reversed(heartbeats):
        if beat.live is not None and _of_submission(status, beat.checkpoint):
            return status.model_copy(update={"live_progress": beat.live})
    return status


def _of_submission(status: JobStatus, checkpoint: Checkpoint) -> bool:
    """Of the prompt the job follows now: a resubmission keeps the prompt id but not the
    client id, and restarts from step 0."""
    current = status.checkpoint
    assert current is not None
    if checkpoint.segment != status.progress.segment or checkpoint.prompt_id is None:
        return False
    if checkpoint.prompt_id != current.prompt_id:
        return False
    return current.client_id is None or checkpoint.client_id == current.client_id


def _ahead(status: JobStatus, checkpoint: Checkpoint, best: Checkpoint | None) -> bool:
    """Further than the status's progress (and than `best`): more steps, or as many and newer
    (what else it carries, the outputs uploaded, may have moved)."""
    step = status.progress.step if best is None else best.step
    if checkpoint.step != step:
        return checkpoint.step > step
    reference = status.checkpoint if best is None else best
    assert reference is not None
    if checkpoint is reference:
        return False
    return (
        checkpoint.updated_at is not None
        and reference.updated_at is not None
        and checkpoint.updated_at > reference.updated_at
    )
