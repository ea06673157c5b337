"""A local file too large for a job's request, end to end: the CLI stages it to S3, the job
carries a reference, the worker reads it and hands it to the ComfyUI simulator unchanged."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import httpx

from activities.comfyui.activities import upload_name
from devstack.models import RunningStack
from starter.cli.common import ExitCode
from starter.staging import staged_key
from tests.support.cli import RunningWorker, cli_env, json_lines, run_cli
from workflows.contracts import MAX_INLINE_INPUT_BYTES


async def test_a_local_file_over_the_inline_limit_reaches_the_simulator_byte_exact(
    worker: RunningWorker, local_stack: RunningStack, tmp_path: Path
) -> None:
    data = b"\x89PNG\r\n\x1a\n" + os.urandom(MAX_INLINE_INPUT_BYTES + 512 * 1024)
    (tmp_path / "big.png").write_bytes(data)
    graph = {
        "1": {"class_type": "LoadImage", "inputs": {"image": "big.png"}},
        "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "big"}},
    }
    (tmp_path / "graph.json").write_text(json.dumps(graph))
    submit = ("submit", str(tmp_path / "graph.json"), "--input", f"big.png={tmp_path / 'big.png'}")
    env = cli_env(local_stack, worker.task_queue)
    job_id = f"staging-{uuid.uuid4().hex[:12]}"

    code, out, err = await run_cli(*submit, "--job-id", job_id, "--watch", "--json", env=env)

    assert code == ExitCode.OK, err
    assert json_lines(out)[-1]["state"] == "COMPLETED"
    digest = hashlib.sha256(data).hexdigest()
    staged = await worker.store.head(staged_key("jobs", digest, "big.png"))
    assert staged is not None and (staged.size, staged.sha256) == (len(data), digest)
    async with httpx.AsyncClient(trust_env=False) as http:
        received = await http.get(
            f"{local_stack.comfyui_url}/view",
            params={"filename": upload_name(job_id, "big.png"), "type": "input"},
        )
    assert received.status_code == 200
    assert received.content == data, "ComfyUI got other bytes than the file"

    # Without the bucket's settings the client cannot stage it: refused before anything is sent.
    no_s3 = {k: v for k, v in env.items() if not k.startswith("AWS_")}
    no_s3.pop("DURABLE_COMFY_BUCKET", None)
    code, out, err = await run_cli(*submit, "--json", env=no_s3)
    assert (code, out) == (ExitCode.BAD_INPUT, "")
    assert f"input 'big.png' is {len(data):,} bytes" in err and "DURABLE_COMFY_BUCKET" in err
