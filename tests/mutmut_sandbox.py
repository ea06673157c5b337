"""A pytest plugin for `make mutate` only: mutmut's trampolines work inside the workflow sandbox.

mutmut wraps every mutated function in a trampoline that reads `MUTANT_UNDER_TEST` from
os.environ; re-imported inside Temporal's sandbox that read is (rightly) refused and every
workflow task fails. Passing `mutmut` through makes the trampoline the host's. The workflow
code under test is unchanged; `make test` never loads this plugin.
"""

from __future__ import annotations

import inspect

from temporalio.worker import Replayer, Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner


def _pass_mutmut_through(owner: type[Worker] | type[Replayer]) -> None:
    runner = inspect.signature(owner).parameters["workflow_runner"].default
    assert isinstance(runner, SandboxedWorkflowRunner)
    restrictions = runner.restrictions.with_passthrough_modules("mutmut")
    object.__setattr__(runner, "restrictions", restrictions)


_pass_mutmut_through(Worker)
_pass_mutmut_through(Replayer)
