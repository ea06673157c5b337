"""One graph run on the worker's ComfyUI: wait for it, stage inputs, submit and follow, store
outputs as their nodes finish. A failure of our own that ends the run early takes the prompt off
ComfyUI before it propagates, so no GPU time is spent on a result nobody will collect; a cancel
(the platform stopped the job, or the claim was lost) only ends the run: whoever cancelled it
stops the prompt (`stop_subject`, endpoint/stopping.py), for as long as the job allows.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import structlog

from endpoint.comfy import forget_interrupted, stage_images, wait_for_comfy
from endpoint.job_files import JobFiles, with_fresh_outputs
from endpoint.outputs import OutputCollector, OutputSink
from endpoint.reporting import ProgressReporter
from endpoint.settings import EndpointSettings
from endpoint.staged_inputs import StagedInputs
from endpoint.stopping import StopSubject, stop_prompt
from protocol.comfyui.client import ComfyClient
from protocol.comfyui.events import is_out_of_memory
from protocol.comfyui.follower import PromptEnd, PromptFollower, Stage
from protocol.errors import ComfyError
from protocol.progress import ProgressTracker
from protocol.runpod.contract import ArtifactRecord, InputImage, ProgressStage

log = structlog.get_logger(__name__)

# How long a run that failed on our side keeps stopping its prompt before it gives up.
FAILED_STOP_S = 15.0


@dataclass(frozen=True)
class ExecutionResult:
    end: PromptEnd
    records: list[ArtifactRecord]
    # True when the prompt was already on ComfyUI (a restarted handler re-attached to it).
    attached: bool


class Recorded(Protocol):
    """Waits until the claim holds what was said of the run (endpoint/lease.py `caught_up`)."""

    async def __call__(self, *, at_once: bool = False) -> bool: ...


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
        on_ready: Callable[[], None] | None = None,
        on_prompt_end: Callable[[PromptEnd], None] | None = None,
        on_stored: Callable[[ArtifactRecord], None] | None = None,
        recorded: Recorded | None = None,
        prior: list[ArtifactRecord] | None = None,
        rerun_interrupted: bool = False,
    ) -> None:
        """`on_prompt_end`: the prompt ended (before the uploads it leaves are done);
        `on_stored`: an output is stored; `recorded`: waits until the claim holds what the
        two said (True) or can no longer (False): progress updates never get ahead of the
        claim, so a takeover after the last one redoes nothing it reported done; `prior`:
        outputs an earlier delivery stored, not stored again when this run finds them
        (endpoint/takeover.py); `rerun_interrupted`: a prompt of this ID that ComfyUI saw
        interrupted runs again rather than answer for this run (a takeover after a fence or a
        lost claim stopped it on this worker)."""
        self.rerun_interrupted = rerun_interrupted
        self.client = client
        self.settings = settings
        # Its outputs removed after the run, a repeated graph must not answer from the cache.
        graph = with_fresh_outputs(graph, prompt_id)
        self.graph = graph
        self.on_ready = on_ready
        self.on_prompt_end = on_prompt_end
        self.on_stored = on_stored
        self.recorded = recorded
        self._reports: set[asyncio.Task[None]] = set()
        self.images = images
        self.staged = staged
        self.prompt_id = prompt_id
        self.reporter = reporter
        # What the run puts in ComfyUI's folders; endpoint/job.py has it removed at the end.
        self.files = JobFiles(settings.comfy_folders)
        # How the prompt ended, once read from its history (before the uploads it leaves).
        self.end: PromptEnd | None = None
        self.collector = OutputCollector(
            client, sink, self._stored, run_tag=run_tag, prior=prior or ()
        )
        self.follower = PromptFollower(
            client,
            self,
            prompt_id=prompt_id,
            client_id=client_id,
            tracker=tracker,
            poll_s=settings.silence_check_s,
            graph=graph,
            extra_data=extra_data,
            # The handler rides out a ComfyUI restart itself (nobody else re-attaches), until
            # ComfyUI has been silent this long: then the worker is broken (`ComfyGone`).
            reconnect_for_s=settings.comfy_lost_after_s,
            log=log.bind(prompt_id=prompt_id),
        )

    def records(self) -> list[ArtifactRecord]:
        """Outputs stored so far."""
        return self.collector.records()

    @property
    def prompt_over(self) -> bool:
        """The prompt has ended on ComfyUI (as the follower saw it)."""
        return self.follower.ended is not None

    def stop_subject(self) -> StopSubject:
        """What a stop of this run's prompt needs to know, as of now."""
        follower = self.follower
        return StopSubject(
            prompt_id=self.prompt_id,
            maybe_queued=follower.maybe_queued,
            post_in_flight=follower.maybe_queued and not follower.submitted,
            current_node=lambda: follower.current_node,
            graph=self.graph,
        )

    async def stop_briefly(self, subject: StopSubject) -> None:
        """Stop the prompt for at most FAILED_STOP_S: a run that failed on our side, or whose
        claim another delivery took over, has nobody waiting for the stop's verdict."""
        await stop_prompt(
            self.client,
            subject,
            horizon_s=FAILED_STOP_S,
            since=time.monotonic(),
            started_at=datetime.now(UTC),
            worker_id=self.settings.worker_id,
            comfy_pid=self.settings.comfy_pid,
        )

    def cancel_outputs(self) -> None:
        """Stop storing outputs now (uploads in flight abort); the records stay as they are."""
        self.collector.cancel_now()

    async def run(self) -> ExecutionResult:
        try:
            await wait_for_comfy(
                self.client,
                pid=self.settings.comfy_pid,
                timeout_s=self.settings.comfy_start_timeout_s,
                on_waiting=lambda: self.stage_changed("starting"),
            )
            await self.files.locate()
            if self.rerun_interrupted:
                await forget_interrupted(self.client, self.prompt_id)
            if self.on_ready is not None:
                self.on_ready()
            await stage_images(self.client, self.images, self.files)
            if self.staged is not None:
                await self.staged.stage(self.client, self.files)
            end = self.end = await self.follower.run()
            if self.on_prompt_end is not None:
                self.on_prompt_end(end)
            if end.outcome == "error" and is_out_of_memory(end.error):
                await self._free_memory()
            # "uploading" says the prompt is over: with a claim, once the claim says so.
            self._report_once_recorded(lambda: self.stage_changed("uploading"))
            await self.collector.drain()
            if self.recorded is not None and await self.recorded(at_once=True):
                # The claim holds every output: their update goes out before the outcome.
                await asyncio.gather(*self._reports)
            failure = self.collector.failure()
            if failure is not None and end.outcome == "success":
                raise failure
            return ExecutionResult(end, self.collector.records(), self.follower.attached)
        except asyncio.CancelledError:
            # Whoever cancelled the run stops the prompt, for as long as it allows.
            await self.collector.cancel()
            raise
        except BaseException:
            # Failed on our side: the prompt must not run on for nobody.
            subject = self.stop_subject()
            self.collector.cancel_now()
            try:
                if subject.maybe_queued and self.follower.ended is None:
                    await self.stop_briefly(subject)
            finally:
                # Uploads end here, before the job's HTTP client closes.
                await self.collector.cancel()
            raise

    async def _free_memory(self) -> None:
        """After an OOM ComfyUI unloads models itself; /free also drops its caches."""
        try:
            await self.client.free(unload_models=True, free_memory=True)
        except ComfyError as exc:
            log.warning("free_failed", error=str(exc))

    # --- the follower's listener: progress to RunPod, outputs to the sink ---------------------

    async def submitted(self) -> None:
        pass  # the follower's own flags (maybe_queued, submitted) are what a stop reads

    async def stage(self, stage: Stage, position: int | None) -> None:
        self.stage_changed(stage, position)

    def stage_changed(self, stage: ProgressStage, position: int | None = None) -> None:
        if self.reporter is not None:
            self.reporter.set_stage(stage, position)

    async def node(self, node: str) -> None:
        if self.reporter is not None:
            self.reporter.set_node(node)

    async def moved(self) -> None:
        if self.reporter is not None:
            self.reporter.moved()

    async def executed(self, node: str, output: dict[str, Any]) -> None:
        await self.moved()
        self.files.list_outputs({node: output})
        self.collector.add({node: output})

    async def outputs(self, outputs: dict[str, Any]) -> None:
        self.files.list_outputs(outputs)
        self.collector.add(outputs)

    def beat(self) -> None:
        pass  # the platform hears of the job through progress updates, not a heartbeat

    def check(self) -> None:
        failure = self.collector.failure()
        if failure is not None:
            raise failure

    def _stored(self, record: ArtifactRecord) -> None:
        self.files.mark_stored(record.subfolder, record.filename)
        if self.on_stored is not None:
            self.on_stored(record)
        reporter = self.reporter
        if reporter is not None:
            self._report_once_recorded(lambda: reporter.add_artifact(record))

    def _report_once_recorded(self, report: Callable[[], None]) -> None:
        """Progress never gets ahead of the claim: with one, `report` waits until the claim
        holds what it says (and is dropped if renewal ends first)."""
        if self.recorded is None:
            report()
            return
        task = asyncio.create_task(_once_recorded(self.recorded, report), name="report")
        # Held until done: the event loop keeps only a weak reference to a task.
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)


async def _once_recorded(recorded: Recorded, report: Callable[[], None]) -> None:
    if await recorded():
        report()
