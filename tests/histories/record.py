"""Record the committed replay histories: `python -m tests.histories.record`.

Runs InferenceJob on the time-skipping server with the stand-in activities through its endings
(completed, cancelled, abandoned, reconnected; from v3 also stopped_slowly and lost) and
writes each history as JSON beside this file.
Never overwrite a recording: after a `workflow.patched()` change, record a new set with a
suffix (`python -m tests.histories.record -v2`) so both the old and the new paths replay.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from temporalio.client import WorkflowFailureError, WorkflowHandle

from tests.workflow_fakes import (
    GRAPH,
    FakeBackend,
    Script,
    job_worker,
    start_job,
    start_time_skipping,
)
from workflows.contracts import CancelRequest, JobPolicy, JobRequest, JobStatus
from workflows.shared import SIGNAL_CANCEL, ErrorType

HERE = Path(__file__).parent
Scenario = tuple[
    Script, dict[str, Any], Callable[[WorkflowHandle[Any, JobStatus]], Awaitable[None]] | None
]


async def cancel_soon(handle: WorkflowHandle[Any, JobStatus]) -> None:
    await asyncio.sleep(0.5)
    await handle.signal(SIGNAL_CANCEL, CancelRequest(reason="recorded cancel"))


SCENARIOS: dict[str, Scenario] = {
    "completed": (Script(), {"abandon_after_s": None}, None),
    "cancelled": (
        Script(follow_failures=[ErrorType.CONNECTION_LOST] * 20),
        {"abandon_after_s": None, "reconnect": {"base_delay_s": 30, "max_delay_s": 30}},
        cancel_soon,
    ),
    "abandoned": (
        Script(follow_failures=[ErrorType.CONNECTION_LOST] * 20),
        {"abandon_after_s": 120, "reconnect": {"base_delay_s": 50, "max_delay_s": 50}},
        None,
    ),
    "reconnected": (
        Script(follow_failures=[ErrorType.CONNECTION_LOST] * 3),
        {"abandon_after_s": None},
        None,
    ),
    # v3 on: a stop confirmed over several checks, and a prompt the backend lost.
    "stopped_slowly": (
        Script(block_in="follow_prompt", stop_running_checks=3),
        {"abandon_after_s": None},
        cancel_soon,
    ),
    "lost": (
        Script(follow_failures=[ErrorType.PROMPT_LOST]),
        {"abandon_after_s": None},
        None,
    ),
}


async def record(suffix: str = "") -> None:
    env = await start_time_skipping()
    try:
        for name, (script, policy, action) in SCENARIOS.items():
            backend = FakeBackend(script)
            async with job_worker(env.client, backend) as task_queue:
                request = JobRequest(
                    graph=GRAPH,
                    policy=JobPolicy.model_validate({"heartbeat_timeout_s": 1} | policy),
                )
                handle = await start_job(env.client, task_queue, request)
                if action is not None:
                    await action(handle)
                try:
                    await handle.result()
                except WorkflowFailureError:
                    pass
                history = await handle.fetch_history()
            path = HERE / f"{name}{suffix}.json"
            path.write_text(json.dumps(json.loads(history.to_json()), indent=1) + "\n")
            print(f"wrote {path} ({len(history.events)} events)")
    finally:
        await env.shutdown()


if __name__ == "__main__":
    # `record.py -v2` writes completed-v2.json ...: keep older recordings, they guard the
    # unpatched paths that jobs started before a `workflow.patched()` change still take.
    asyncio.run(record(sys.argv[1] if len(sys.argv) > 1 else ""))
