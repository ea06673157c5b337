"""What a delivery that takes a RunPod job's claim over redoes (endpoint/takeover.py), against the
real dev server, SeaweedFS and the RunPod simulator running our handler under the real `runpod`
loop: a worker lost after storing every output runs nothing again; one lost between its uploads
has only the missing output node run again. The silent holders are
tests/stack/test_runpod_fencing.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from starter import JobClient
from tests.support.cli import example
from tests.support.runpod_e2e import (
    assert_every_job_costed,
    finish,
    job,
    settled_ledger,
    submission_of,
)
from tests.support.runpod_sim import ENDPOINT_VENV_MISSING, RunpodSim, completed_executions
from workflows.contracts import JobState

pytestmark = pytest.mark.skipif(
    ENDPOINT_VENV_MISSING is not None, reason=str(ENDPOINT_VENV_MISSING)
)


def two_saves(steps: int, slow_steps: int = 60) -> dict[str, Any]:
    """The example graph, saved twice: a quick branch, then a slow one (its own sampler of
    `slow_steps`), so the first output is stored seconds before the second."""
    graph: dict[str, Any] = example(steps)
    graph["12"] = {
        "class_type": "KSampler",
        "inputs": graph["3"]["inputs"] | {"steps": slow_steps, "seed": 7},
    }
    graph["10"] = {"class_type": "VAEDecode", "inputs": {"samples": ["12", 0], "vae": ["4", 2]}}
    graph["11"] = {
        "class_type": "SaveImage",
        "inputs": {"images": ["10", 0], "filename_prefix": "second"},
    }
    return graph


async def test_a_worker_lost_after_storing_its_outputs_is_not_run_again(
    fenced: tuple[JobClient, RunpodSim],
) -> None:
    """Lost after its prompt succeeded and every output was stored: the job completes from
    what the claim and the bucket show, with one execution and no RunPod job more."""
    job_client, sim = fenced
    # At "uploading" the claim holds the prompt's end, and an update lists an output once the
    # claim holds it: the crash comes after both, however the uploads and the end interleave.
    await sim.faults(crash={"after_artifacts": 2, "in_stage": "uploading", "outcome": "stuck"})
    request = job(steps=10).model_copy(update={"graph": two_saves(10)})
    final = await finish(job_client, request)
    assert final.state == JobState.COMPLETED, final.error
    assert len(final.artifacts) == 2
    ledger = await settled_ledger(sim)
    runpod_jobs = {j.id for j in ledger.jobs_for(submission_of(final))}
    crashes = [e for w in ledger.workers for e in w.events_of("crash") if e.job_id in runpod_jobs]
    assert len(crashes) == 1, "the worker was lost at its uploading update"
    assert await completed_executions(sim, submission_of(final)) == 1
    assert len(ledger.jobs_for(submission_of(final))) == 1, "nothing submitted again"
    assert_every_job_costed(final, ledger)


async def test_a_worker_lost_between_its_uploads_has_only_the_missing_work_redone(
    fenced: tuple[JobClient, RunpodSim],
) -> None:
    """Lost after one of two outputs was stored: the new delivery runs only the output node
    whose file is missing, and the job has both outputs."""
    job_client, sim = fenced
    await sim.faults(crash={"after_artifacts": 1, "outcome": "stuck"})
    request = job(steps=10).model_copy(update={"graph": two_saves(10)})
    final = await finish(job_client, request)
    assert final.state == JobState.COMPLETED, final.error
    assert sorted(a.node_id for a in final.artifacts) == ["11", "9"]
    ledger = await settled_ledger(sim)
    assert len(ledger.jobs_for(submission_of(final))) == 2
    assert_every_job_costed(final, ledger)
