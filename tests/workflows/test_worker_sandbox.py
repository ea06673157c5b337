"""The worker's workflow sandbox (worker.workflow_runner): `workflows` passed through.

The default sandbox imports the workflow's module afresh for every workflow run; the worker's
passes the whole `workflows` package through, which must change nothing a job does: every
recorded history replays under it exactly as under the default sandbox
(tests/workflows/test_replay_histories.py), and the sandbox's restrictions stay the default ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer
from temporalio.worker.workflow_sandbox import SandboxRestrictions
from temporalio.worker.workflow_sandbox._importer import Importer
from temporalio.worker.workflow_sandbox._restrictions import RestrictionContext

from worker import workflow_runner
from workflows.inference_job import InferenceJob

HISTORIES = Path(__file__).parent / "histories"
RECORDED = sorted(path.stem for path in HISTORIES.glob("*.json"))


def test_the_workflows_package_is_passed_through_and_nothing_else_changes() -> None:
    restrictions = workflow_runner().restrictions
    default = SandboxRestrictions.default
    assert restrictions.passthrough_modules == default.passthrough_modules | {"workflows"}
    assert restrictions.invalid_modules == default.invalid_modules
    assert restrictions.invalid_module_members == default.invalid_module_members
    assert not restrictions.passthrough_all_modules
    importer = Importer(
        restrictions, RestrictionContext(), workflow_module_name=InferenceJob.__module__
    )
    # The workflow's own module too: not imported again for each run.
    assert importer.module_configured_passthrough(InferenceJob.__module__)
    assert importer.module_configured_passthrough("workflows.job_book")
    assert not importer.module_configured_passthrough("activities.storage")


@pytest.mark.parametrize("name", RECORDED)
async def test_recorded_history_replays_in_the_workers_sandbox(name: str) -> None:
    history = WorkflowHistory.from_json(
        f"recorded-{name}", (HISTORIES / f"{name}.json").read_text()
    )
    replayer = Replayer(
        workflows=[InferenceJob],
        data_converter=pydantic_data_converter,
        workflow_runner=workflow_runner(),
    )
    await replayer.replay_workflow(history)
