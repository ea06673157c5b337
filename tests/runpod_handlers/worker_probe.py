"""An async handler that looks at its worker from the inside, for the simulator's worker faults
(freeze, partition) and its watchdog; each key of the input is a step, run in this order:

env          names of environment variables to return under output.env
prompt       {"graph", "prompt_id"}: queue it on the worker's ComfyUI (COMFY_URL), send a
             progress update, and wait until its history has it (output.prompt: its status)
s3_probe     {"seconds", "every_s"}: GET $BUCKET_ENDPOINT_URL/probe/<worker id> every every_s
             for seconds (1 s timeout each); output.probes: [{"at": epoch, "ok": bool}]
sleep_s      then sleep this long, with `steps` progress updates spread over it

Blocking calls run in threads, so a job-stop (CancelledError) still reaches the handler.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from typing import Any

import runpod  # type: ignore[import-not-found]

# Local servers only: a proxy from the environment must not get in between.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str, timeout_s: float) -> bytes:
    with _OPENER.open(url, timeout=timeout_s) as response:
        body: bytes = response.read()
        return body


def _post_json(url: str, body: Any, timeout_s: float) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with _OPENER.open(request, timeout=timeout_s) as response:
        return json.loads(response.read())


async def _run_prompt(job: dict[str, Any], spec: dict[str, Any]) -> Any:
    comfy = os.environ["COMFY_URL"]
    prompt_id = spec["prompt_id"]
    body = {"prompt": spec["graph"], "prompt_id": prompt_id, "client_id": "worker-probe"}
    await asyncio.to_thread(_post_json, f"{comfy}/prompt", body, 10)
    # A fault armed `after_progress: 1` fires once the prompt is on ComfyUI.
    runpod.serverless.progress_update(job, {"prompt": "queued"})
    while True:
        history = json.loads(await asyncio.to_thread(_get, f"{comfy}/history/{prompt_id}", 10))
        if prompt_id in history:
            return history[prompt_id].get("status")
        await asyncio.sleep(0.05)


async def _probe_s3(job: dict[str, Any], spec: dict[str, Any]) -> list[dict[str, Any]]:
    url = f"{os.environ['BUCKET_ENDPOINT_URL']}/probe/{os.environ.get('RUNPOD_POD_ID', '')}"
    probes: list[dict[str, Any]] = []
    deadline = time.time() + float(spec["seconds"])
    while time.time() < deadline:
        at = time.time()
        try:
            await asyncio.to_thread(_get, url, 1.0)
            ok, error = True, ""
        except Exception as exc:  # refused, reset, timed out: S3 is out of reach
            ok, error = False, type(exc).__name__
        probes.append({"at": at, "ok": ok, "error": error})
        runpod.serverless.progress_update(job, {"probes": len(probes), "ok": ok})
        await asyncio.sleep(max(0.0, at + float(spec.get("every_s", 0.2)) - time.time()))
    return probes


async def handler(job: dict[str, Any]) -> Any:
    spec: dict[str, Any] = job["input"]
    result: dict[str, Any] = {"worker": os.environ.get("RUNPOD_POD_ID"), "pid": os.getpid()}
    if "env" in spec:
        result["env"] = {name: os.environ.get(name) for name in spec["env"]}
    if "prompt" in spec:
        result["prompt"] = await _run_prompt(job, spec["prompt"])
    if "s3_probe" in spec:
        result["probes"] = await _probe_s3(job, spec["s3_probe"])
    steps = int(spec.get("steps", 0))
    sleep_s = float(spec.get("sleep_s", 0))
    for step in range(1, steps + 1):
        await asyncio.sleep(sleep_s / steps)
        runpod.serverless.progress_update(job, {"step": step, "total": steps})
    if not steps:
        await asyncio.sleep(sleep_s)
    # Progress updates go out from threads; let the last one land before the result.
    await asyncio.sleep(0.05)
    return result


if __name__ == "__main__":
    runpod.serverless.start({"handler": handler})
