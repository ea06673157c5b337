"""One graph run on the worker's ComfyUI: wait for it, stage inputs, submit and follow, store
outputs as their nodes finish. Whatever ends the run early (a cancel from the platform, a lost
claim, a failure) takes the prompt off ComfyUI before it propagates, so no GPU time is spent on
a result nobody will collect.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import structlog

from activities.comfyui.client import ComfyClient, ComfyError
from activities.comfyui.events import is_out_of_memory
from activities.progress import ProgressTracker
from endpoint.comfy import stage_images, stop_prompt, wait_for_comfy
from endpoint.contract import ArtifactRecord, InputImage, ProgressStage
from endpoint.follow import PromptEnd, PromptFollower, Stage
from endpoint.outputs import OutputCollector, OutputSink
from endpoint.reporting import ProgressReporter
from endpoint.settings import EndpointSettings
from endpoint.staged_inputs import StagedInputs

log = structlog.get_logger(__name__)

# Bounds on clean-up work that runs while the job is being torn down.
STOP_BUDGET_S = 15.0


@dataclass(frozen=True)
class ExecutionResult:
    end: PromptEnd
    records: list[ArtifactRecord]
    # True when the prompt was already on ComfyUI (a restarted handler re-attached to it).
    attached: bool


class Execution:
    def __init__(
        self,
        client: ComfyClient,
        settings: EndpointSettings,
        *,
        graph: dict[str, Any],
        images: list[InputImage],
        prompt_id: str,
        client_id: str,
        extra_data: dict[str, Any],
        sink: OutputSink,
        tracker: ProgressTracker,
        reporter: ProgressReporter | None,
        staged: StagedInputs | None = None,
        run_tag: str = "",
    ) -> None:
        self.client = client
        self.settings = settings
        self.images = images
        self.staged = staged
        self.prompt_id = prompt_id
        self.reporter = reporter
        self.collector = OutputCollector(client, sink, self._stored, run_tag=run_tag)
        self.follower = PromptFollower(
            client,
            prompt_id=prompt_id,
            client_id=client_id,
            graph=graph,
            extra_data=extra_data,
            tracker=tracker,
            listener=self,
            poll_s=settings.silence_check_s,
            lost_after_s=settings.comfy_lost_after_s,
        )

    def records(self) -> list[ArtifactRecord]:
        """Outputs stored so far."""
        return self.collector.records()

    async def run(self) -> ExecutionResult:
        try:
            await wait_for_comfy(
                self.client,
                pid=self.settings.comfy_pid,
                timeout_s=self.settings.comfy_start_timeout_s,
                on_waiting=lambda: self.stage_changed("starting"),
            )
            await stage_images(self.client, self.images)
            if self.staged is not None:
                await self.staged.stage(self.client)
            end = await self.follower.run()
            if end.outcome == "error" and is_out_of_memory(end.error):
                await self._free_memory()
            self.stage_changed("uploading")
            await self.collector.drain()
            failure = self.collector.failure()
            if failure is not None and end.outcome == "success":
                raise failure
            return ExecutionResult(end, self.collector.records(), self.follower.attached)
        except BaseException:
            # Cancelled by the platform, the claim lost, or failed: the prompt must not run on.
            if self.follower.submitted and self.follower.ended is None:
                await settle(stop_prompt(self.client, self.prompt_id), STOP_BUDGET_S)
            await settle(self.collector.cancel(), STOP_BUDGET_S)
            raise

    async def _free_memory(self) -> None:
        """After an OOM ComfyUI unloads models itself; /free also drops its caches."""
        try:
            await self.client.free(unload_models=True, free_memory=True)
        except ComfyError as exc:
            log.warning("free_failed", error=str(exc))

    # --- the follower's Listener ------------------------------------------------------------

    def stage(self, stage: Stage, position: int | None) -> None:
        self.stage_changed(stage, position)

    def stage_changed(self, stage: ProgressStage, position: int | None = None) -> None:
        if self.reporter is not None:
            self.reporter.set_stage(stage, position)

    def node(self, node: str | None) -> None:
        if self.reporter is not None:
            self.reporter.set_node(node)

    def moved(self) -> None:
        if self.reporter is not None:
            self.reporter.moved()

    def outputs(self, outputs: dict[str, Any]) -> None:
        self.collector.add(outputs)

    def check(self) -> None:
        failure = self.collector.failure()
        if failure is not None:
            raise failure

    def _stored(self, record: ArtifactRecord) -> None:
        if self.reporter is not None:
            self.reporter.add_artifact(record)


async def settle(work: Awaitable[Any], timeout_s: float) -> None:
    """Run clean-up to its end (bounded by `timeout_s`), even while our task is being
    cancelled; failures are logged, not raised, so they never mask the original error."""
    task = asyncio.ensure_future(asyncio.wait_for(work, timeout_s))
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            # Cancelled again: the clean-up goes on by itself.
            log.warning("cleanup_left_running")
        raise
    except Exception as exc:
        log.warning("cleanup_failed", error=f"{type(exc).__name__}: {exc}")
