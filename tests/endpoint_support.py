"""Helpers for the endpoint/ tests: a private SeaweedFS, settings and inputs for the handler's
job logic, and a fake of the SDK's `progress_update`. Plain functions and context managers; the
test modules make their own fixtures from them. Nothing here imports `runpod`.
"""

from __future__ import annotations

import contextlib
import hashlib
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import httpx
from botocore.config import Config
from pydantic import SecretStr

from devstack.seaweed import load_credentials
from devstack.services import StackPaths
from devstack.stack import start_service, stop_service
from endpoint.contract import ProgressUpdate
from endpoint.settings import BucketSettings, EndpointSettings
from tests.conftest import make_stack_config


@dataclass(frozen=True)
class Bucket:
    """A running SeaweedFS S3 and its bucket, as the handler's environment would name them."""

    settings: BucketSettings
    name: str

    def client(self) -> Any:
        s = self.settings
        return boto3.session.Session().client(
            "s3",
            endpoint_url=s.endpoint_url,
            region_name=s.region,
            aws_access_key_id=s.access_key_id.get_secret_value(),
            aws_secret_access_key=s.secret_access_key.get_secret_value(),
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
        )

    def read(self, key: str) -> tuple[bytes, dict[str, Any]]:
        resp = self.client().get_object(Bucket=self.name, Key=key)
        return resp["Body"].read(), resp


@contextlib.asynccontextmanager
async def seaweedfs(workdir: Path) -> AsyncIterator[Bucket]:
    """`weed mini` through devstack's own service code, on free ports; killed by PID after."""
    config = make_stack_config(workdir / "state")
    try:
        await start_service(config, workdir, "s3")
        creds = load_credentials(StackPaths.of(config, workdir).s3_credentials)
        assert creds is not None
        settings = BucketSettings(
            endpoint_url=config.s3.endpoint_url,
            access_key_id=SecretStr(creds.access_key_id),
            secret_access_key=creds.secret_access_key,
            region=config.s3.region,
        )
        yield Bucket(settings, config.s3.bucket)
    finally:
        # SIGKILL: the data does not matter and a clean stop of weed takes seconds.
        await stop_service(config, workdir, "s3", signal.SIGKILL)


def endpoint_settings(
    comfy_url: str, bucket: Bucket | None, *, default_bucket: bool = False, **overrides: Any
) -> EndpointSettings:
    bucket_settings = None
    if bucket is not None:
        update = {"default_bucket": bucket.name} if default_bucket else {}
        bucket_settings = bucket.settings.model_copy(update=update)
    values: dict[str, Any] = {
        "comfy_url": comfy_url,
        "bucket": bucket_settings,
        "worker_id": "worker-a",
        "silence_check_s": 1.0,
        "comfy_start_timeout_s": 10.0,
    }
    return EndpointSettings.model_validate(values | overrides)


def orchestrated_input(
    graph: dict[str, Any], bucket: str, *, submission: str | None = None, **fields: Any
) -> dict[str, Any]:
    """A job input with the orchestrator's block; `fields` override the block's own."""
    block: dict[str, Any] = {
        "job_id": f"job-{uuid.uuid4().hex[:8]}",
        "submission": submission or f"sub-{uuid.uuid4().hex[:12]}",
        "segment": 0,
        "prompt_id": str(uuid.uuid4()),
        "client_id": uuid.uuid4().hex,
        "output": {"bucket": bucket, "prefix": "jobs"},
        "progress_interval_s": 0.2,
        "lease_s": 6.0,
    }
    return {"workflow": graph, "durable_comfy": block | fields}


@dataclass
class Progress:
    """Stands in for `runpod.serverless.progress_update(job, update)`."""

    updates: list[ProgressUpdate] = field(default_factory=list)

    def __call__(self, update: dict[str, Any]) -> None:
        self.updates.append(ProgressUpdate.model_validate(update))

    def stages(self) -> list[str]:
        return [u.stage for u in self.updates]


async def sim_get(url: str, path: str) -> Any:
    async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
        return (await http.get(url + path)).raise_for_status().json()


async def sim_post(url: str, path: str, body: Any) -> Any:
    async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
        response = (await http.post(url + path, json=body)).raise_for_status()
        return response.json() if response.content else None


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
