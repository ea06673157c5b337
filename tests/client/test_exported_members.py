"""The client library's public surface is what the package defines, and every part of it works.

The list is derived from the package (as httpx checks its own `__all__`), so a new public name
cannot slip in or out unnoticed; a stubbed-out body is caught by reading the source, and
`JobClient.cancel` is exercised against a job on the time-skipping server.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import textwrap
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import CancelledError
from temporalio.testing import WorkflowEnvironment

import starter
from starter import JobClient
from tests.support.workflow_fakes import GRAPH, FakeBackend, Script, job_worker
from workflows.contracts import JobPolicy, JobRequest, JobState, JobStatus
from workflows.shared import QUERY_STATUS

PROJECT_PACKAGES = ("starter", "workflows", "activities")


def defined_in_project(value: object) -> bool:
    module = getattr(value, "__module__", None) or ""
    return module.split(".")[0] in PROJECT_PACKAGES


def public_project_names(package: ModuleType) -> set[str]:
    return {
        name
        for name, value in vars(package).items()
        if not name.startswith("_")
        and not isinstance(value, ModuleType)
        and defined_in_project(value)
    }


def test_all_lists_exactly_the_public_names_the_package_defines() -> None:
    assert sorted(starter.__all__) == sorted(set(starter.__all__)), "no duplicates"
    assert set(starter.__all__) == public_project_names(starter)
    for name in starter.__all__:
        assert getattr(starter, name) is not None


def _is_stub(function: Callable[..., Any]) -> bool:
    """A body of nothing but a docstring, `pass`, `...` or `raise NotImplementedError`."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    definition = tree.body[0]
    assert isinstance(definition, ast.FunctionDef | ast.AsyncFunctionDef)
    body = list(definition.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    for statement in body:
        if isinstance(statement, ast.Pass):
            continue
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue
        if isinstance(statement, ast.Raise) and "NotImplementedError" in ast.unparse(statement):
            continue
        return False
    return True


def exported_callables() -> list[tuple[str, Callable[..., Any]]]:
    found: list[tuple[str, Callable[..., Any]]] = []
    for name in starter.__all__:
        value = getattr(starter, name)
        if inspect.isfunction(value):
            found.append((name, value))
        elif inspect.isclass(value) and value.__module__.startswith("starter"):
            for member, function in vars(value).items():
                if inspect.isfunction(function) and not member.startswith("__"):
                    found.append((f"{name}.{member}", function))
    return found


def test_no_exported_function_or_method_is_a_stub() -> None:
    callables = exported_callables()
    assert {"JobClient.cancel", "JobClient.submit", "load_graph"} <= {n for n, _ in callables}
    stubs = [name for name, function in callables if _is_stub(function)]
    assert stubs == []


def test_client_methods_cover_the_job_lifecycle() -> None:
    methods = {"submit", "status", "watch", "wait", "result", "cancel", "resume", "attach"}
    assert methods <= set(dir(starter.JobClient))


async def test_job_client_cancel_records_the_reason_and_cancels_in_temporal(
    env: WorkflowEnvironment,
) -> None:
    backend = FakeBackend(Script(block_in="follow_prompt"))
    async with job_worker(env.client, backend) as tq:
        client = JobClient(env.client, task_queue=tq)
        policy = JobPolicy(abandon_after_s=None, heartbeat_timeout_s=1)
        job = await client.submit(JobRequest(graph=GRAPH, policy=policy))
        await asyncio.wait_for(backend.blocked.wait(), 10)
        before = await client.cancel(job.job_id, "wrong seed")
        handle = env.client.get_workflow_handle(job.job_id)
        with pytest.raises(WorkflowFailureError) as ended:
            await handle.result()
        final = JobStatus.model_validate(await handle.query(QUERY_STATUS))
    assert before.job_id == job.job_id and not before.terminal
    assert isinstance(ended.value.cause, CancelledError), "Temporal's own cancel was requested"
    assert final.state == JobState.CANCELLED
    assert final.error is not None and final.error.message == "wrong seed"
