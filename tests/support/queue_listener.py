"""A stand-in for a waiting job, as the dispatcher (workflows/pool_queue.py) sees one: a
workflow that receives `admission` signals and counts them, and nothing else. Hundreds of
them fill a line cheaply, so a test can watch what the dispatcher sends to each."""

from __future__ import annotations

from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.admission import Admission
    from workflows.shared import SIGNAL_ADMISSION

LISTENER_WORKFLOW_TYPE = "QueueListener"


@workflow.defn(name=LISTENER_WORKFLOW_TYPE)
class QueueListener:
    def __init__(self) -> None:
        self._heard: list[Admission] = []
        self._done = False

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: self._done)

    @workflow.signal(name=SIGNAL_ADMISSION)
    def admission(self, payload: Any) -> None:
        self._heard.append(Admission.model_validate(payload))

    @workflow.signal(name="done")
    def done(self) -> None:
        self._done = True

    @workflow.query(name="heard")
    def heard(self) -> list[Admission]:
        return self._heard
