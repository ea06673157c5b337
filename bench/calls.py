"""Counting and timing the Temporal calls a client makes, by a client interceptor.

A `JobClient` built on `counted_client(...)` records every call it sends (start, query,
signal, describe, update, history fetch), so a benchmark can say what one `submit + wait` or one
`watch` costs in calls, and how long each took, without touching the client library.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from temporalio.client import (
    CancelWorkflowInput,
    Client,
    DescribeWorkflowInput,
    FetchWorkflowHistoryEventsInput,
    Interceptor,
    OutboundInterceptor,
    QueryWorkflowInput,
    SignalWorkflowInput,
    StartWorkflowInput,
    StartWorkflowUpdateInput,
    WorkflowExecutionDescription,
    WorkflowHandle,
    WorkflowHistoryEventAsyncIterator,
    WorkflowUpdateHandle,
)


def task_id() -> int:
    """The running asyncio task's identity (0 outside one)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return 0
    return 0 if task is None else id(task)


@dataclass(frozen=True)
class Call:
    method: str
    started: float  # time.time(), comparable with the server's event times on one machine
    ended: float
    # The asyncio task that made it (`task_id()`; 0 outside one): whose call it was when many
    # callers share one client.
    task: int = 0

    @property
    def seconds(self) -> float:
        return self.ended - self.started


@dataclass
class CallLog:
    calls: list[Call] = field(default_factory=list)

    def between(self, start: float, end: float) -> list[Call]:
        return [c for c in self.calls if start <= c.started <= end]

    def by_method(self, calls: list[Call] | None = None) -> Counter[str]:
        return Counter(c.method for c in (self.calls if calls is None else calls))

    def clear(self) -> None:
        self.calls.clear()


class _Recording(OutboundInterceptor):
    def __init__(self, next: OutboundInterceptor, log: CallLog) -> None:
        super().__init__(next)
        self._log = log

    def _add(self, method: str, started: float) -> None:
        self._log.calls.append(Call(method, started, time.time(), task_id()))

    async def start_workflow(self, input: StartWorkflowInput) -> WorkflowHandle[Any, Any]:
        started = time.time()
        try:
            return await super().start_workflow(input)
        finally:
            self._add("start_workflow", started)

    async def query_workflow(self, input: QueryWorkflowInput) -> Any:
        started = time.time()
        try:
            return await super().query_workflow(input)
        finally:
            self._add(f"query:{input.query}", started)

    async def signal_workflow(self, input: SignalWorkflowInput) -> None:
        started = time.time()
        try:
            await super().signal_workflow(input)
        finally:
            self._add(f"signal:{input.signal}", started)

    async def describe_workflow(self, input: DescribeWorkflowInput) -> WorkflowExecutionDescription:
        started = time.time()
        try:
            return await super().describe_workflow(input)
        finally:
            self._add("describe_workflow", started)

    async def start_workflow_update(
        self, input: StartWorkflowUpdateInput
    ) -> WorkflowUpdateHandle[Any]:
        started = time.time()
        try:
            return await super().start_workflow_update(input)
        finally:
            self._add(f"update:{input.update}", started)

    async def cancel_workflow(self, input: CancelWorkflowInput) -> None:
        started = time.time()
        try:
            await super().cancel_workflow(input)
        finally:
            self._add("cancel_workflow", started)

    def fetch_workflow_history_events(
        self, input: FetchWorkflowHistoryEventsInput
    ) -> WorkflowHistoryEventAsyncIterator:
        # The RPCs happen as the iterator is read (`result()` long-polls in it): counted as one
        # call here, timed by whoever reads it.
        now = time.time()
        self._log.calls.append(Call("fetch_history", now, now, task_id()))
        return super().fetch_workflow_history_events(input)


class _CallInterceptor(Interceptor):
    def __init__(self, log: CallLog) -> None:
        self._log = log

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        return _Recording(next, self._log)


def counted_client(client: Client) -> tuple[Client, CallLog]:
    """A client on the same connection whose calls are recorded in the returned log."""
    log = CallLog()
    config = client.config()
    config["interceptors"] = [*config.get("interceptors", []), _CallInterceptor(log)]
    return Client(**config), log
