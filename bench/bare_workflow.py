"""The bare baseline's workflow and its no-op activity. Temporal's sandbox imports this module
for every run, so it imports nothing but temporalio (bench/bare.py serves it)."""

from __future__ import annotations

from datetime import timedelta

from temporalio import activity, workflow


@activity.defn(name="bench_noop")
async def noop() -> None:
    return None


@workflow.defn(name="BenchBare")
class BareWorkflow:
    @workflow.run
    async def run(self) -> None:
        await workflow.execute_activity(noop, start_to_close_timeout=timedelta(seconds=30))
