"""The `runpod` kind of pool: a RunPod serverless endpoint running ComfyUI (our handler in
endpoint/, or a stock worker-comfyui image).

    prepare   check the overrides, stage input files in the job's bucket folder
    follow    activities/runpod/follow.py: submit once, poll to the end, keep the outputs
    offload   outputs are stored by then (by the handler, or by follow for inline ones):
              verify them; after a failure, keep what the claim says was stored
    stop      cancel the RunPod job unless it has ended, read its state back and, with claims,
              wait for the handler to record what became of its prompt (stop_verdict.py)
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from datetime import UTC, datetime

import structlog

from activities.comfyui.graph import refuse_foreign_files, refuse_hostile_graph
from activities.errors import fatal, retryable
from activities.inputs import input_bytes
from activities.live_progress import LiveProgress
from activities.runpod import submissions
from activities.runpod.artifacts import key_problem
from activities.runpod.claims import claim_target, lease_running, read_claim
from activities.runpod.client import MAX_RUN_BYTES, RunPodClient
from activities.runpod.deliveries import other_delivery_costs
from activities.runpod.failures import from_runpod
from activities.runpod.follow import POLL_S, RunInputs, RunPodFollower, one_chunk
from activities.runpod.models import RunPodJob, RunPodState
from activities.runpod.nodes import registries_for
from activities.runpod.stop_verdict import StopAction, stop_verdict
from activities.storage import ArtifactStore
from configuration.pools import PoolConfig
from protocol.keys import content_type_for, job_folder, safe_component
from protocol.runpod.contract import (
    MAX_INPUT_FILE_BYTES,
    InputImage,
    StagedInput,
    inputs_folder,
)
from workflows import activity_io
from workflows.contracts import Artifact
from workflows.errors import GraphFormatError, RunPodError, RunPodJobGone
from workflows.graph import apply_overrides, load_node_files
from workflows.graph import sampler_steps as graph_sampler_steps
from workflows.shared import ErrorType

log = structlog.get_logger(__name__)

# A stock endpoint takes input files base64 in `/run` (4/3 of their size) beside the graph: keep
# room for both. Our handler fetches them from S3 instead, each up to ComfyUI's upload limit.
MAX_INLINE_RUN_BYTES = MAX_RUN_BYTES * 7 // 10


class RunPodBackend:
    """`activities.backend.Backend` for RunPod pools."""

    def __init__(
        self,
        pools: Mapping[str, PoolConfig],
        clients: Mapping[str, RunPodClient],
        store: ArtifactStore,
        *,
        poll_s: float = POLL_S,
        live: LiveProgress | None = None,
    ) -> None:
        self._pools = pools
        self._clients = clients
        self._store = store
        self._poll_s = poll_s
        self._live = live

    async def prepare(self, req: activity_io.PrepareInput, pool: str) -> activity_io.PreparedJob:
        """Check the graph (against the endpoint's node registry when one is known:
        activities/runpod/nodes.py) and stage the input files in the job's bucket folder, all
        before any RunPod job exists; ComfyUI's own validation on the worker refuses the rest
        before anything runs."""
        config = self._pools[pool]
        refuse_hostile_graph(req, pool, config)
        for index, overrides in enumerate(req.segments):
            try:
                apply_overrides(req.graph, overrides)
            except GraphFormatError as exc:
                raise fatal(ErrorType.INVALID_REQUEST, f"segment {index}: {exc}") from exc
        object_info = await registries_for(self._store).check(req.graph, pool, config)
        file_inputs = refuse_foreign_files(req, pool, config, object_info)
        by_reference = bool(self._pools[pool].claims)
        bucket = req.output.bucket or self._store.settings.bucket
        folder = inputs_folder(claim_target(req.output, bucket), req.job_id)
        staged: dict[str, str] = {}
        total = 0
        for _node, _input, name in load_node_files(req.graph, file_inputs):
            ref = req.inputs.get(name)
            if ref is None or name in staged:
                continue  # (undeclared names were refused above) already staged
            limit = MAX_INPUT_FILE_BYTES if by_reference else MAX_INLINE_RUN_BYTES
            data = await input_bytes(self._store, name, ref, limit=limit)
            total += len(data)
            if not by_reference and total > MAX_INLINE_RUN_BYTES:
                raise fatal(
                    ErrorType.INVALID_REQUEST,
                    f"the inputs add up to more than {MAX_INLINE_RUN_BYTES:,} bytes: pool {pool!r} "
                    "is a stock endpoint (claims: false), which takes input files only inside "
                    "RunPod's 10 MB /run body; send smaller inputs, or deploy durable-comfy's "
                    "handler (endpoint/) and set claims: true so they travel by reference",
                )
            key = f"{folder}/{safe_component(name)}"
            await self._store.upload_stream(
                key, one_chunk(data), content_type=content_type_for(name), bucket=bucket
            )
            staged[name] = key
        log.info("prepared", job_id=req.job_id, pool=pool, inputs=len(staged), bytes=total)
        return activity_io.PreparedJob(
            pool=pool,
            kind="runpod",
            graph=req.graph,
            sampler_steps=graph_sampler_steps(req.graph),
            nodes_total=len(req.graph),
            staged_inputs=staged,
        )

    async def follow(self, req: activity_io.FollowInput) -> activity_io.FollowResult:
        pool, client = self._pools[req.named_pool], self._clients[req.named_pool]
        inputs = RunInputs()
        if req.graph is not None:
            inputs = await (self._by_reference(req) if pool.claims else self._inline(req))
        follower = RunPodFollower(
            req, pool, client, self._store, inputs, poll_s=self._poll_s, live=self._live
        )
        # Every output of a successful follow is verified in S3 already (size and sha256, in
        # the job's folder): the workflow schedules no offload for it.
        return await follower.run()

    async def _inline(self, req: activity_io.FollowInput) -> RunInputs:
        """A stock endpoint: the files themselves, base64 in `input.images`."""
        bucket = req.output.bucket or self._store.settings.bucket
        images = []
        for name, key in req.staged_inputs.items():
            data = await self._store.read_bytes(key, limit=MAX_INLINE_RUN_BYTES, bucket=bucket)
            images.append(InputImage(name=name, image=base64.b64encode(data).decode()))
        return RunInputs(images=images)

    async def _by_reference(self, req: activity_io.FollowInput) -> RunInputs:
        """Our handler: where each file is and what it must hash to; it fetches them itself."""
        bucket = req.output.bucket or self._store.settings.bucket
        staged = []
        for name, key in req.staged_inputs.items():
            head = await self._store.head(key, bucket=bucket)
            if head is None or not head.sha256:
                raise fatal(
                    ErrorType.MISSING_INPUT,
                    f"input {name!r}: the copy staged at s3://{bucket}/{key} is gone",
                )
            staged.append(StagedInput(name=name, key=key, size=head.size, sha256=head.sha256))
        return RunInputs(staged=staged)

    async def offload(self, req: activity_io.OffloadInput) -> activity_io.OffloadResult:
        """Every output is in S3 by now: verify what the job holds, and after a failure add
        what the claim says the handler stored before it stopped."""
        kept = {a.key: a for a in req.stored}
        if req.partial and self._pools[req.named_pool].claims:
            target = claim_target(req.output, self._store.settings.bucket)
            claim = await read_claim(self._store, target, req.job_id, req.prompt_id)
            records = claim.outcome.images if claim is not None and claim.outcome else []
            for record in records:
                if record.key and record.size is not None and record.sha256:
                    kept.setdefault(
                        record.key,
                        Artifact(
                            key=record.key,
                            uri=f"s3://{target.bucket}/{record.key}",
                            size=record.size,
                            sha256=record.sha256,
                            content_type=record.content_type,
                            node_id=record.node_id or "output",
                            segment=req.segment,
                        ),
                    )
        verified = []
        folder = job_folder(req.output.prefix, req.job_id) + "/"
        for artifact in kept.values():
            bucket = artifact.uri.removeprefix("s3://").split("/", 1)[0]
            # The claim's records come from a worker: a key outside the job's folder (or not one
            # our handler could have built) is not even looked at.
            ours = artifact.key.startswith(folder) and key_problem(artifact.key) is None
            head = await self._store.head(artifact.key, bucket=bucket) if ours else None
            ok = (
                ours
                and head is not None
                and head.size == artifact.size
                and head.sha256 == artifact.sha256
            )
            if ok:
                verified.append(artifact)
            elif not req.partial:
                raise retryable(
                    ErrorType.STORAGE_ERROR,
                    f"{artifact.uri} is not stored as stated (size {artifact.size}, "
                    f"sha256 {artifact.sha256[:12]}...)",
                )
        return activity_io.OffloadResult(artifacts=sorted(verified, key=lambda a: a.key))

    async def stop(self, req: activity_io.StopInput) -> activity_io.StopCheck:
        """One check: cancel the RunPod job unless it ended, then say where its prompt is
        (`stop_verdict`: with claims, as the handler records it, never a lapsed lease)."""
        pool, client = self._pools[req.named_pool], self._clients[req.named_pool]
        now = datetime.now(UTC)
        target = claim_target(req.output, self._store.settings.bucket)
        claim = (
            await read_claim(self._store, target, req.job_id, req.prompt_id)
            if pool.claims
            else None
        )
        job_id = req.provider_job_id or (claim.holder if claim is not None else None)
        if job_id is None:
            # No RunPod job is known for the prompt: it never reached RunPod, as far as anyone
            # can tell (the workflow's settled pass decides what that means).
            return activity_io.StopCheck(at=now, position="gone", ended="unknown")
        try:
            job, action = await self._cancelled(client, job_id, pool)
            if (
                claim is not None
                and claim.holder != job.id
                and job.state is not None
                and job.state.terminal
                and (lease_running(claim) or claim.outcome is not None)
            ):
                # The job the workflow knows has ended, but another RunPod job holds the
                # submission now (a takeover the workflow has not heard of): that one runs, or
                # ran, the prompt, so it is the one to stop and to judge. (A holder that died
                # without an outcome is one the workflow has moved past already.)
                log.info("runpod_stop_follows_claim_holder", job_id=req.job_id, holder=claim.holder)
                job, holder_action = await self._cancelled(client, claim.holder, pool)
                action = holder_action if holder_action != "none" else action
        except RunPodJobGone:
            await submissions.ended(self._store, req.named_pool, req.job_id, req.prompt_id)
            return activity_io.StopCheck(
                at=now, position="gone", ended="unknown", message="unknown to RunPod"
            )
        except RunPodError as exc:
            error = from_runpod(exc, f"stopping RunPod job {job_id}")
            return activity_io.StopCheck(at=now, position="unreachable", message=error.message)
        if job.state is not None and job.state.terminal:
            # Nothing left for the orphan sweep to cancel (the handler may still be stopping
            # the prompt: that is the claim's business, not the sweep's).
            await submissions.ended(self._store, req.named_pool, req.job_id, req.prompt_id)
        verdict = stop_verdict(job, pool, claim, action, req.prompt_id, now)
        if pool.claims and verdict.position in ("gone", "stuck"):
            # The RunPod jobs the workflow may not know of (a `/run` whose answer was lost)
            # billed too: read once the stop has a verdict, not at every check.
            others = await other_delivery_costs(
                self._store,
                client,
                pool,
                target,
                job_id=req.job_id,
                submission=req.prompt_id,
                judged=job.id,
                claim=claim,
            )
            verdict = verdict.model_copy(update={"other_costs": others})
        return verdict

    async def _cancelled(
        self, client: RunPodClient, job_id: str, pool: PoolConfig
    ) -> tuple[RunPodJob, StopAction]:
        """The job's state, once cancelled unless it had ended, and what the cancel was: a
        stock handler never hears of it (it cannot stop its prompt), ours interrupts."""
        job, was = await client.cancelled_unless_ended(job_id)
        action: StopAction = "none"
        if was is RunPodState.IN_QUEUE:
            action = "dequeued"
        elif was is not None:
            action = "interrupt_sent" if pool.claims else "cancel_sent"
        return job, action
