"""The RunPod jobs a submission had, as the markers its deliveries left say
(`contract.deliveries_folder`), and what those the workflow may not know of cost.

A `/run` whose answer was lost makes a RunPod job the orchestrator never heard of; it ran (at
least to find the submission claimed by another delivery) and billed. Its marker is how it gets
into the job's cost: on success (`RunPodFollower`) and when the job is stopped (here).
"""

from __future__ import annotations

import structlog

from activities.runpod.client import RunPodClient
from activities.runpod.cost import job_cost
from activities.storage import ArtifactStore
from configuration.pools import PoolConfig
from protocol.runpod.contract import Claim, S3Target, deliveries_folder
from workflows.contracts import JobCost
from workflows.errors import RunPodError, RunPodJobGone, StorageError

log = structlog.get_logger()


async def delivery_ids(
    store: ArtifactStore, target: S3Target, job_id: str, submission: str
) -> list[str]:
    """The RunPod job ids of every delivery of `submission` that reached its claim."""
    folder = deliveries_folder(target, job_id, submission) + "/"
    keys = await store.list_keys(folder, bucket=target.bucket)
    return [key.rsplit("/", 1)[-1] for key in keys]


async def other_delivery_costs(
    store: ArtifactStore,
    client: RunPodClient,
    pool: PoolConfig,
    target: S3Target,
    *,
    job_id: str,
    submission: str,
    judged: str,
    claim: Claim | None,
) -> list[JobCost]:
    """When the job is stopped: what each delivery of `submission` other than RunPod job
    `judged` (the one the stop judged) cost, each cancelled first if it still runs (the job is
    being stopped: none of them is to go on). A folder that cannot be listed, or a job RunPod
    does not answer for, leaves the cost as it is, said so in the log or in the entry."""
    try:
        ids = await delivery_ids(store, target, job_id, submission)
    except StorageError as exc:
        log.warning("runpod_deliveries_unlisted", job_id=job_id, error=str(exc))
        return []
    costs: list[JobCost] = []
    for runpod_job_id in ids:
        if runpod_job_id == judged:
            continue
        try:
            job, was = await client.cancelled_unless_ended(runpod_job_id)
        except RunPodJobGone:
            continue  # RunPod no longer keeps it: nothing to read
        except RunPodError as exc:
            log.warning(
                "runpod_delivery_cost_unread",
                job_id=job_id,
                runpod_job_id=runpod_job_id,
                error=str(exc),
            )
            costs.append(
                JobCost(
                    provider_job_id=runpod_job_id,
                    usd_per_second=pool.usd_per_second,
                    lower_bound=True,
                    note="RunPod did not say what this job billed when the job was stopped",
                )
            )
            continue
        cost = job_cost(job, pool, claim=claim)
        if was is None:
            # It ended before this stop: what became of it is the follow's word (`crashed`,
            # `ran_nothing`, ...), kept by the workflow when this reading says nothing.
            cost = cost.model_copy(update={"outcome": None})
        costs.append(cost)
    return costs
