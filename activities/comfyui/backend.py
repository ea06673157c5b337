"""The `comfyui` kind of pool: a ComfyUI server reached over HTTP and WebSocket."""

from __future__ import annotations

from temporalio import activity

from activities.comfyui.activities import ComfyActivities
from activities.comfyui.follow import FollowActivities
from activities.comfyui.offload import OffloadActivities
from activities.comfyui.pools import ComfyPools
from activities.heartbeat_budget import HeartbeatBudget
from activities.live_progress import LiveProgress
from activities.storage import ArtifactStore
from workflows import activity_io


class ComfyBackend:
    """`activities.backend.Backend` for ComfyUI pools. `comfy` also serves the submit and
    teardown activities that runs started by older versions still schedule."""

    def __init__(
        self,
        pools: ComfyPools,
        store: ArtifactStore,
        budget: HeartbeatBudget,
        live: LiveProgress | None = None,
    ) -> None:
        self.comfy = ComfyActivities(pools, store)
        self._follow = FollowActivities(pools, store, budget, live)
        self._offload = OffloadActivities(pools, store)

    async def prepare(self, req: activity_io.PrepareInput, pool: str) -> activity_io.PreparedJob:
        return await self.comfy.prepare_prompt(req.model_copy(update={"pool": pool}))

    async def follow(self, req: activity_io.FollowInput) -> activity_io.FollowResult:
        """Follow the prompt to its end, then reconcile its outputs with `/history` in the same
        activity: one round trip to the workflow fewer than a separate offload."""
        attempt = self._follow.attempt(req)
        followed = await attempt.run(read_history=True)
        resume_point = activity_io.FollowHeartbeat(
            checkpoint=followed.checkpoint, artifacts=followed.artifacts
        )
        try:
            offloaded = await self._offload.offload_outputs(
                activity_io.OffloadInput(
                    job_id=req.job_id,
                    pool=req.pool,
                    prompt_id=req.prompt_id,
                    segment=req.segment,
                    run_tag=req.run_tag,
                    output=req.output,
                    stored=followed.artifacts,
                    server=attempt.server,
                ),
                # A retry after a failure here re-attaches from where the follow ended.
                beat=lambda: activity.heartbeat(resume_point.model_dump(mode="json")),
                # What the follow stored was confirmed as it was stored: not asked again.
                confirmed=attempt.uploader.confirmed,
                history=attempt.history,
            )
        finally:
            attempt.drop_history()
        return followed.model_copy(update={"artifacts": offloaded.artifacts})

    async def offload(self, req: activity_io.OffloadInput) -> activity_io.OffloadResult:
        return await self._offload.offload_outputs(req)

    async def stop(self, req: activity_io.StopInput) -> activity_io.StopCheck:
        return await self.comfy.stop_prompt(req)
