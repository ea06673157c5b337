"""A stock runpod-workers/worker-comfyui endpoint, as far as its clients can tell: the graph runs
on the worker's ComfyUI, no progress is sent, and the result is worker-comfyui 5.x's
`{"images": [{"filename", "type": "base64", "data"}]}` (no bucket is configured).

It is our handler's stock path (endpoint/job.py `StockJob`) with the orchestrator's
`durable_comfy` block dropped, so a durable-comfy `runpod` pool with `claims: false` meets what
it would meet on a stock endpoint. Run by the RunPod simulator in the endpoint's venv, for the
tests that must run without the stock handler itself; the real one (from the fixture folder,
under runpod 1.7.x) runs under worker_comfyui.py beside this file
(tests/stack/test_runpod_stock.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# Run as a script: the repository root (for `endpoint.*`) is not on sys.path by itself.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import runpod  # type: ignore[import-not-found,unused-ignore]  # noqa: E402

from endpoint.job import run_job  # noqa: E402
from endpoint.settings import EndpointSettings  # noqa: E402

# What worker-comfyui 5.x puts in each of `output.images`.
STOCK_FIELDS = ("filename", "type", "data")


async def handler(job: dict[str, Any]) -> dict[str, Any]:
    job_input = dict(job.get("input") or {})
    job_input.pop("durable_comfy", None)
    result = await run_job({"id": job.get("id"), "input": job_input}, EndpointSettings.from_env())
    images = result.get("images")
    if isinstance(images, list):
        result["images"] = [
            {name: image[name] for name in STOCK_FIELDS if name in image} for image in images
        ]
    return result


if __name__ == "__main__":
    runpod.serverless.start({"handler": handler})
