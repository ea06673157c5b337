"""Progress updates to the platform (`runpod.serverless.progress_update`), at a bounded rate.

While a job is IN_PROGRESS, RunPod's `/status` shows the latest update as its `output`: that is
the orchestrator's checkpoint (step/total, node, artifacts stored so far). Updates go out on every
stage change and every stored artifact, and otherwise at most once per `progress_interval_s`
while the step count moves (`ProgressTracker.should_signal`). With a claim, a stored artifact and
the "uploading" stage are reported once the claim holds them (endpoint/execution.py): no update
says more is done than a delivery taking the claim over would find. Every update is cumulative and
numbered (`seq`), so one that arrives late is recognisable and loses nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import structlog

from protocol.progress import ProgressTracker
from protocol.runpod.contract import (
    MAX_UPDATE_BYTES,
    ArtifactRecord,
    ProgressStage,
    ProgressUpdate,
)

log = structlog.get_logger(__name__)

ProgressSink = Callable[[dict[str, Any]], None]


class ProgressReporter:
    def __init__(
        self,
        send: ProgressSink,
        tracker: ProgressTracker,
        *,
        submission: str,
        prompt_id: str,
        worker_id: str,
    ) -> None:
        self._send = send
        self.tracker = tracker
        self._base = {"submission": submission, "prompt_id": prompt_id, "worker_id": worker_id}
        self.stage: ProgressStage = "starting"
        self.queue_position: int | None = None
        self.node: str | None = None
        self.artifacts: list[ArtifactRecord] = []
        self.seq = 0

    def set_stage(self, stage: ProgressStage, position: int | None = None) -> None:
        if (stage, position) == (self.stage, self.queue_position) and self.seq > 0:
            return
        self.stage, self.queue_position = stage, position
        self._emit(force=True)

    def set_node(self, node: str | None) -> None:
        self.node = node
        self._emit(force=False)

    def moved(self) -> None:
        """The tracker advanced: tell the platform when the rate allows."""
        self._emit(force=False)

    def keepalive(self) -> None:
        """An update whether or not anything moved: the orchestrator's sign that this
        delivery's handler lives while nothing else says so (no claim written yet)."""
        self._emit(force=True)

    def add_artifact(self, record: ArtifactRecord) -> None:
        self.artifacts.append(record)
        self._emit(force=True)

    def update(self) -> ProgressUpdate:
        return ProgressUpdate(
            **self._base,
            stage=self.stage,
            queue_position=self.queue_position if self.stage == "queued" else None,
            step=self.tracker.step,
            total_steps=self.tracker.total,
            node=self.node,
            nodes_done=list(self.tracker.nodes_done),
            node_steps=dict(self.tracker.node_steps),
            artifacts=list(self.artifacts),
            seq=self.seq,
            at=datetime.now(UTC),
        )

    def _emit(self, *, force: bool) -> None:
        if not self.tracker.should_signal(force=force):
            return
        self.seq += 1
        payload = _bounded(self.update().model_dump(mode="json"))
        try:
            self._send(payload)
        except Exception as exc:  # progress is advisory: never fail the job over it
            log.warning("progress_update_failed", error=str(exc))


def _bounded(payload: dict[str, Any]) -> dict[str, Any]:
    """Drop the oldest artifact records until the update fits the SDK's size limit; the
    job's output and the claim carry them all. Sizes are measured once per record (ASCII JSON,
    never shorter than what the SDK sends)."""
    artifacts: list[Any] = payload["artifacts"]
    size = len(json.dumps(payload))
    if size <= MAX_UPDATE_BYTES:
        return payload
    sizes = [len(json.dumps(a)) + 2 for a in artifacts]  # ", " between items
    dropped = 0
    while dropped < len(artifacts) and size > MAX_UPDATE_BYTES:
        size -= sizes[dropped]
        dropped += 1
    payload["artifacts"] = artifacts[dropped:]
    payload["artifacts_omitted"] += dropped
    return payload
