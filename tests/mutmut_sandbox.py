"""A pytest plugin for `make mutate` only: mutmut's trampolines work inside the workflow sandbox.

mutmut wraps every mutated function in a trampoline that reads `MUTANT_UNDER_TEST` from
os.environ; re-imported inside Temporal's sandbox that read is (rightly) refused and every
workflow task fails. Passing `mutmut` through makes the trampoline the host's. Each mutant runs
in a forked child, which gets a Temporal runtime of its own. The workflow code under test is
unchanged; `make test` never loads this plugin.

Two more things keep a mutant's run short. mutmut hands pytest a mutant's tests in set order,
so a workflow test may run before the unit test that kills the mutant in a millisecond: here
the tests run fastest first (by mutmut's own timings). And a mutant that raises inside workflow
code fails the workflow *task*, which Temporal retries forever, so its test would wait for
mutmut's timeout: here any exception fails the workflow at once, and the test with it.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from pathlib import Path

import pytest
from temporalio.runtime import Runtime, TelemetryConfig
from temporalio.worker import Replayer, Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner


def _pass_mutmut_through(owner: type[Worker] | type[Replayer]) -> None:
    runner = inspect.signature(owner).parameters["workflow_runner"].default
    assert isinstance(runner, SandboxedWorkflowRunner)
    restrictions = runner.restrictions.with_passthrough_modules("mutmut")
    object.__setattr__(runner, "restrictions", restrictions)


def _fail_workflows_on_any_exception() -> None:
    failing = inspect.signature(Worker).parameters["workflow_failure_exception_types"].default
    assert isinstance(failing, list)
    if Exception not in failing:  # the module may be imported again in the same process
        failing.append(Exception)


_pass_mutmut_through(Worker)
_pass_mutmut_through(Replayer)
_fail_workflows_on_any_exception()


# mutmut runs the clean tests in its own process, then forks a child per mutant. A Temporal
# runtime (behind every client, worker and replayer) does not work across a fork, so a child
# gets its own; the parent's is kept referenced, never dropped in a process without its threads.
_parent_pid = os.getpid()
_inherited: list[Runtime] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.getpid() != _parent_pid and not _inherited:
        _inherited.append(Runtime.default())
        Runtime.set_default(Runtime(telemetry=TelemetryConfig()), error_if_already_set=False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    stats = Path("mutmut-stats.json")  # mutmut runs the tests from inside mutants/
    if not stats.exists():
        return
    durations: dict[str, float] = json.loads(stats.read_text())["duration_by_test"]
    items.sort(key=lambda item: durations.get(item.nodeid, math.inf))
