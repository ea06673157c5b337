"""The workflow's tests. Unit tests run workflow code outside a worker, against `wf`, a fake
`temporalio.workflow` module that records the commands; the others run InferenceJob on the
time-skipping server (`env`, in tests/conftest.py) with stand-in activities
(tests/support/workflow_fakes.py)."""

from __future__ import annotations

import pytest

from tests.support.workflow_fakes import FakeWorkflow, install_fake_workflow


@pytest.fixture
def wf(monkeypatch: pytest.MonkeyPatch) -> FakeWorkflow:
    return install_fake_workflow(monkeypatch)
