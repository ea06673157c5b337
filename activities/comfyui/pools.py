"""The ComfyUI pools this worker serves, and which of them must not get work now.

`ComfyPools` maps the pool names of the worker's settings to clients; requests never carry URLs.
`PoolHealth` marks the pools this worker must not send work to, and runs the checks that clear
the marks.

An unrecoverable device fault (illegal memory access, device-side assert) leaves a ComfyUI
process that answers HTTP but cannot run anything. Such a pool is marked unhealthy; submissions
to it first run a tiny model-free probe prompt and wait until one succeeds.

A prompt that outlived its job's teardown horizon still holds the pool's GPU: the pool is marked
busy until `/queue` no longer holds that prompt, so new work does not queue behind it unseen.
Both marks live in this worker process.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import structlog

from activities.errors import fatal
from configuration.pools import PoolConfig
from configuration.settings import WorkerSettings
from protocol.comfyui.client import ComfyClient
from protocol.errors import ComfyError
from workflows.shared import ErrorType

log = structlog.get_logger(__name__)

PROBE_GRAPH = {
    "1": {
        "class_type": "EmptyImage",
        "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": 0},
    },
    "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}},
}
PROBE_DEADLINE_S = 15.0


class PoolHealth:
    def __init__(self) -> None:
        self._unhealthy: dict[str, str] = {}
        self._busy: dict[str, dict[str, str]] = {}  # pool -> {prompt_id: job_id}

    def mark_busy(self, pool: str, prompt_id: str, job_id: str) -> None:
        log.warning("pool_busy", pool=pool, prompt_id=prompt_id, job_id=job_id)
        self._busy.setdefault(pool, {})[prompt_id] = job_id

    async def busy(self, pool: str, client: ComfyClient) -> str | None:
        """None when no stuck prompt holds the pool any more; otherwise which one does."""
        stuck = self._busy.get(pool)
        if not stuck:
            return None
        queue = await client.queue()
        held = {
            str(item[1])
            for key in ("queue_running", "queue_pending")
            for item in queue.get(key, [])
        }
        for prompt_id in [p for p in stuck if p not in held]:
            log.info("pool_no_longer_busy", pool=pool, prompt_id=prompt_id)
            del stuck[prompt_id]
        if not stuck:
            return None
        prompt_id, job_id = next(iter(stuck.items()))
        return (
            f"prompt {prompt_id} of job {job_id} is still running on it after its teardown horizon"
        )

    def mark_unhealthy(self, pool: str, reason: str) -> None:
        log.warning("pool_unhealthy", pool=pool, reason=reason)
        self._unhealthy[pool] = reason

    def reason(self, pool: str) -> str | None:
        return self._unhealthy.get(pool)

    async def probe(self, pool: str, client: ComfyClient) -> str | None:
        """None when the pool is (again) healthy; otherwise why not."""
        reason = self._unhealthy.get(pool)
        if reason is None:
            return None
        prompt_id = f"dc-probe-{uuid.uuid4()}"
        try:
            await client.post_prompt(PROBE_GRAPH, prompt_id=prompt_id, client_id=prompt_id)
            deadline = time.monotonic() + PROBE_DEADLINE_S
            while time.monotonic() < deadline:
                entry = await client.history(prompt_id)
                if entry is not None:
                    if entry.get("status", {}).get("status_str") == "success":
                        log.info("pool_healthy_again", pool=pool)
                        self._unhealthy.pop(pool, None)
                        return None
                    return f"{reason}; the health probe failed too"
                await asyncio.sleep(0.2)
        except ComfyError as exc:
            return f"{reason}; the health probe could not run: {exc}"
        return f"{reason}; the health probe did not finish in {PROBE_DEADLINE_S:.0f} s"


class ComfyPools:
    """Maps pool names from the worker's settings to clients; requests never carry URLs."""

    def __init__(self, settings: WorkerSettings, http: httpx.AsyncClient) -> None:
        self._settings = settings
        self._http = http
        self.health = PoolHealth()

    def resolve(self, pool: str | None) -> str:
        name = pool or self._settings.default_pool
        config = self._settings.pools.get(name)
        if config is None:
            known = ", ".join(sorted(self._settings.pools)) or "none"
            raise fatal(
                ErrorType.UNKNOWN_POOL,
                f"pool {name!r} is not configured on this worker (configured pools: {known})",
                pool=name,
            )
        if config.kind != "comfyui" or not config.url:
            raise fatal(
                ErrorType.UNKNOWN_POOL,
                f"pool {name!r} is of kind {config.kind!r}, which this worker cannot run yet",
                pool=name,
            )
        return name

    def config(self, pool: str) -> PoolConfig:
        """The settings of a pool `resolve` named."""
        return self._settings.pools[pool]

    def client(self, pool: str) -> ComfyClient:
        config = self._settings.pools[self.resolve(pool)]
        assert config.url is not None
        return ComfyClient(config.url, self._http)

    def clients(self) -> dict[str, ComfyClient]:
        """A client for every ComfyUI pool this worker serves."""
        return {
            name: ComfyClient(config.url, self._http)
            for name, config in self._settings.pools.items()
            if config.kind == "comfyui" and config.url
        }
