"""An async generator handler: yields `chunks` chunks `{"n": i}` (or one of `big_bytes` bytes),
`gap_s` apart; the SDK posts each to job-stream, then `{"output": [...]}` to job-done
(`return_aggregate_stream`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import runpod  # type: ignore[import-not-found]


async def handler(job: dict[str, Any]) -> AsyncIterator[Any]:
    spec: dict[str, Any] = job["input"]
    if "big_bytes" in spec:
        yield {"blob": "x" * int(spec["big_bytes"])}
    for n in range(int(spec.get("chunks", 3))):
        await asyncio.sleep(float(spec.get("gap_s", 0.05)))
        yield {"n": n}


if __name__ == "__main__":
    runpod.serverless.start({"handler": handler, "return_aggregate_stream": True})
