"""A stand-in for the one thing `JobClient.start` asks of Temporal besides the start itself in
the unit tests that fake Temporal: the tenant's budget ledger (starter/budgets.py), which
these tenants have none of."""

from __future__ import annotations

from typing import Any

from temporalio.service import RPCError, RPCStatusCode


class NoWorkflow:
    async def query(self, *_args: Any, **_kwargs: Any) -> Any:
        raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")


class NoLedgers:
    """Mixed into a fake Temporal client: no workflow but the ones the fake answers for."""

    def get_workflow_handle(self, *_args: Any, **_kwargs: Any) -> NoWorkflow:
        return NoWorkflow()
