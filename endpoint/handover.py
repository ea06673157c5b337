"""A prompt that succeeded on a handler that lost its claim's storage: its outputs handed over
in the job's answer, so the orchestrator completes the job instead of running the graph again.

A handler cut off from S3 (a network partition only it sees, or an outage) cannot renew its
claim, record the prompt's end or store its outputs. When its fence falls due
(endpoint/fencing.py) with the prompt already ended with `success`, nothing is left to stop: the
GPU work is done, and only the files are missing from the bucket. Fencing would answer
`PromptLost` and the submission would run again on another worker. Instead, while RunPod can
still be reached, the handler reads every output the prompt's history lists from its own
ComfyUI (`/view`, no S3) and answers with them base64-encoded beside what it had stored before
the cut: the orchestrator stores those itself (`activities/runpod/artifacts.py`, "inline") and
verifies the rest.

It is safe for the same reason a fence is: the orchestrator submits nothing again before the
claim's lease has run out by `fence_after_s`, and this answer comes at the fence, before the
lease's end. A hand-over that cannot be made (outputs past `MAX_BASE64_BYTES`, too large for a
RunPod result; an output refused or unreadable; not done in time) is no answer: the handler
fences as before.
"""

from __future__ import annotations

import asyncio
from typing import Any

from endpoint.execution import Execution
from endpoint.outputs import MAX_BASE64_BYTES, Base64Sink, OutputCollector
from protocol.comfyui.client import ComfyClient
from protocol.comfyui.history import outputs_of
from protocol.runpod.contract import ArtifactRecord


def succeeded(execution: Execution) -> bool:
    """The run's prompt ended on ComfyUI with `success`, as its history says."""
    return execution.end is not None and execution.end.outcome == "success"


async def inline_outputs(
    client: ComfyClient,
    execution: Execution,
    *,
    run_tag: str,
    within_s: float,
    log: Any,
    max_bytes: int = MAX_BASE64_BYTES,
) -> list[ArtifactRecord] | None:
    """Every output of the succeeded prompt: the records it stored already, and each other file
    base64-encoded from ComfyUI. None when that cannot be done within `within_s` (the caller
    fences instead)."""
    ended = execution.end
    if ended is None or ended.outcome != "success":
        return None
    stored = execution.records()

    def _ignore(_: ArtifactRecord) -> None:
        return None

    collector = OutputCollector(
        client, Base64Sink(max_bytes), _ignore, run_tag=run_tag, prior=stored
    )
    try:
        collector.add(outputs_of(ended.entry))
        async with asyncio.timeout(within_s):
            await collector.drain()
    except TimeoutError:
        log.warning("handover_not_made", reason="not done in time", within_s=round(within_s, 1))
        await collector.cancel()
        return None
    problem = collector.failure()
    if problem is not None:
        log.warning("handover_not_made", reason=str(problem))
        return None
    records = collector.records()
    log.warning(
        "handover_inline",
        outputs=len(records),
        inline=sum(1 for r in records if r.type == "base64"),
        stored=len(stored),
    )
    return records
