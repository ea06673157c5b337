"""An async handler that does what its input says, to drive the simulator through each path:

sleep_s      run this long (asyncio.sleep, so a job-stop cancels it)
steps        send this many progress updates, evenly over sleep_s
output       the result (default {"ok": true, "job_id": ...})
empty        return {} (the SDK then posts no output at all)
error        return {"error": ...} (a FAILED job)
raise        raise RuntimeError(...) (the SDK reports the exception)
refresh      add refresh_worker: the platform replaces the worker after the job
env          names of environment variables to return under output.env
exit         os._exit(code) halfway (a worker that dies by itself)
marker_dir   write <job_id>.started (with the worker id) on start and <job_id>.cancelled
             when the SDK cancels the handler (job-stop)
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import runpod  # type: ignore[import-not-found]


def _mark(job: dict[str, Any], suffix: str) -> None:
    folder = job["input"].get("marker_dir")
    if folder:
        worker = os.environ.get("RUNPOD_POD_ID", "")
        (Path(folder) / f"{job['id']}.{suffix}").write_text(worker)


async def handler(job: dict[str, Any]) -> Any:
    spec: dict[str, Any] = job["input"]
    _mark(job, "started")
    steps = int(spec.get("steps", 0))
    sleep_s = float(spec.get("sleep_s", 0))
    try:
        if "exit" in spec:
            await asyncio.sleep(sleep_s / 2)
            os._exit(int(spec["exit"]))
        for step in range(1, steps + 1):
            await asyncio.sleep(sleep_s / steps)
            runpod.serverless.progress_update(job, {"step": step, "total": steps})
        if not steps:
            await asyncio.sleep(sleep_s)
    except asyncio.CancelledError:
        _mark(job, "cancelled")
        raise
    if "raise" in spec:
        raise RuntimeError(spec["raise"])
    if spec.get("empty"):
        return {}
    result: dict[str, Any] = dict(spec.get("output") or {"ok": True, "job_id": job["id"]})
    if "env" in spec:
        result["env"] = {name: os.environ.get(name) for name in spec["env"]}
    if "error" in spec:
        result["error"] = spec["error"]
    if spec.get("refresh"):
        result["refresh_worker"] = True
    # Progress updates go out from threads; let the last one land before the result.
    await asyncio.sleep(0.05 if steps else 0)
    return result


if __name__ == "__main__":
    runpod.serverless.start({"handler": handler})
