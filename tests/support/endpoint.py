"""Helpers for the endpoint/ tests: a private SeaweedFS, a gate in front of it (a storage outage
on demand), settings and inputs for the handler's job logic, and a fake of the SDK's
`progress_update`. Plain functions and context managers; the test modules make their own
fixtures from them. Nothing here imports `runpod`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import boto3
import httpx
from botocore.config import Config
from pydantic import SecretStr

from devstack.free_ports import free_port
from devstack.seaweed import load_credentials
from devstack.services import StackPaths
from devstack.stack import start_service, stop_service
from endpoint.claims import ClaimStore, fresh_claim
from endpoint.errors import ClaimConflict
from endpoint.s3 import S3
from endpoint.settings import BucketSettings, EndpointSettings
from protocol.runpod.contract import Claim, ProgressUpdate, S3Target, claim_key
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


def bucket_env(bucket: Bucket) -> dict[str, str]:
    """The handler's bucket variables, as the endpoint's environment has them."""
    s = bucket.settings
    return {
        "BUCKET_ENDPOINT_URL": s.endpoint_url,
        "BUCKET_ACCESS_KEY_ID": s.access_key_id.get_secret_value(),
        "BUCKET_SECRET_ACCESS_KEY": s.secret_access_key.get_secret_value(),
        "BUCKET_REGION": s.region or "",
    }


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
        # A failing test fails within a minute, not the production five.
        "bucket_retry_s": 60.0,
        # No watchdog reads it here: a test that wants one names its own file.
        "fence_file": None,
    }
    return EndpointSettings.model_validate(values | overrides)


class Gate:
    """A loopback TCP relay in front of a server that can be shut (new connections refused,
    open ones cut) and opened again on the same port: a storage outage on demand, the way a
    restarted SeaweedFS looks to its clients, without the restart's seconds of start-up."""

    def __init__(self, target_url: str) -> None:
        parts = urlsplit(target_url)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # Bytes relayed towards the server, and when to shut by itself (see shut_after).
        self.upstream_bytes = 0
        self.shut_at_bytes: int | None = None
        self.shut_by_itself = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.StreamWriter] = set()
        self._relays: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> Gate:
        await self.open()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.shut()

    @property
    def is_open(self) -> bool:
        return self._server is not None

    async def open(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(
                self._relay, "127.0.0.1", self.port, reuse_address=True
            )

    async def shut(self) -> None:
        server, self._server = self._server, None
        for writer in list(self._links):
            writer.transport.abort()
        self._links.clear()
        if server is not None:
            server.close()
            await server.wait_closed()

    def shut_after(self, more_bytes: int) -> asyncio.Event:
        """Shut once `more_bytes` more have gone towards the server (a cut mid-request)."""
        self.shut_by_itself.clear()
        self.shut_at_bytes = self.upstream_bytes + more_bytes
        return self.shut_by_itself

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        # Held while it runs: asyncio keeps no strong reference to a connection's task, and one
        # whose only pending read is on the server side (held weakly by its protocol) would be
        # collected, its connection left open and silent (a request that hangs, a transport
        # never closed).
        task = asyncio.current_task()
        if task is not None:
            self._relays.add(task)
            task.add_done_callback(self._relays.discard)
        if not self.is_open:  # accepted as the gate shut: it must not live on
            client_w.transport.abort()
            return
        # Held from the start: a shut while the server side is being reached cuts it too.
        self._links.add(client_w)
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            self._links.discard(client_w)
            client_w.transport.abort()
            return
        if client_w not in self._links or not self.is_open:  # shut meanwhile
            self._links.discard(client_w)
            server_w.transport.abort()
            client_w.transport.abort()
            return
        self._links.add(server_w)
        try:
            await asyncio.gather(
                self._pipe(client_r, server_w, upstream=True),
                self._pipe(server_r, client_w, upstream=False),
            )
        finally:
            for writer in (client_w, server_w):
                self._links.discard(writer)
                writer.transport.abort()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(64 * 1024):
                if upstream:
                    self.upstream_bytes += len(data)
                    if self.shut_at_bytes is not None and self.upstream_bytes >= self.shut_at_bytes:
                        self.shut_at_bytes = None
                        self.shut_by_itself.set()
                        await self.shut()
                        return
                writer.write(data)
                await writer.drain()
        writer.transport.abort()  # one side ended: so does the other (no half-open HTTP)


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


async def read_claim(bucket: Bucket, block: dict[str, Any]) -> Claim | None:
    """The claim of an orchestrated input's submission, as the bucket holds it."""
    key = claim_key(S3Target.model_validate(block["output"]), block["job_id"], block["submission"])
    stored = await ClaimStore(S3(bucket.settings), bucket.name).read(key)
    return stored.claim if stored is not None else None


async def take_over(bucket: Bucket, key: str, holder: str, worker_id: str) -> Claim:
    """Write the claim as another delivery that took it over would (as after a lapsed lease),
    whatever the holder writes meanwhile: its renewals and news race our conditional write,
    which is tried again on the claim as it then is."""
    store = ClaimStore(S3(bucket.settings), bucket.name)
    while True:
        current = await store.read(key)
        assert current is not None
        taker = current.claim.model_copy(update={"holder": holder, "worker_id": worker_id})
        try:
            return (await store.replace(key, fresh_claim(taker, 60), current.etag)).claim
        except ClaimConflict:
            continue


async def until(check: Any, within: float = 15.0, interval: float = 0.05) -> Any:
    """The first truthy answer of `check` (a function, sync or async), polled every
    `interval`; AssertionError after `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {within}s")
