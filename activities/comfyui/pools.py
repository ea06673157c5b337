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

from activities.errors import fatal, retryable
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
    """Maps pool names from the worker's settings to clients; requests never carry URLs.

    A pool of many servers (`urls`) has a client per server: a job's activities name the server
    its queue gave it (`Checkpoint.server`, `FollowInput.server`), and only one of the pool's
    own servers is ever asked."""

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
        if config.kind != "comfyui" or not config.servers:
            raise fatal(
                ErrorType.UNKNOWN_POOL,
                f"pool {name!r} is of kind {config.kind!r}, which this worker cannot run yet",
                pool=name,
            )
        return name

    def config(self, pool: str) -> PoolConfig:
        """The settings of a pool `resolve` named."""
        return self._settings.pools[pool]

    def client(self, pool: str, server: str | None = None) -> ComfyClient:
        """The client of the pool's server: `server` on a pool whose queue picks servers (one
        of its own: a name from elsewhere is refused), else its one server."""
        config = self._settings.pools[self.resolve(pool)]
        if not config.assigns_servers:
            return ComfyClient(config.servers[0], self._http)
        if server is None:
            # The grant names the server; a follow that could not read it asks again.
            raise retryable(
                ErrorType.BACKEND_UNAVAILABLE,
                f"pool {pool!r} has many servers and the job's grant named none yet",
            )
        if server not in config.servers:
            raise fatal(
                ErrorType.UNKNOWN_POOL,
                f"server {server} is not one of pool {pool!r}'s servers on this worker "
                f"({', '.join(config.servers)})",
                pool=pool,
            )
        return ComfyClient(server, self._http)

    def health_key(self, pool: str, client: ComfyClient) -> str:
        """What this process's health marks are kept under: the pool, or on a pool of many
        servers the server (one wedged server is not the pool)."""
        return f"{pool} {client.base_url}" if self.config(pool).assigns_servers else pool

    def clients_of(self, pool: str) -> list[ComfyClient]:
        """A client for each of the pool's servers, in the order its settings name them."""
        config = self._settings.pools[self.resolve(pool)]
        return [ComfyClient(url, self._http) for url in config.servers]

    def clients(self) -> dict[str, list[ComfyClient]]:
        """The clients of every ComfyUI pool this worker serves, a list per pool."""
        return {
            name: [ComfyClient(url, self._http) for url in config.servers]
            for name, config in self._settings.pools.items()
            if config.kind == "comfyui" and config.servers
        }


async def find_prompt(
    clients: list[ComfyClient], prompt_id: str
) -> tuple[ComfyClient | None, list[str]]:
    """Which of a pool's servers holds `prompt_id` (in its queue or its history), for a job
    whose server was never heard of (a follow that sent the prompt and died before any report):
    the server found, and the servers that could not be asked (while any could not, "on none"
    is not known)."""

    async def holds(client: ComfyClient) -> bool:
        place = await client.queue_place(prompt_id)
        return place.where is not None or await client.history(prompt_id) is not None

    answers = await asyncio.gather(*(holds(c) for c in clients), return_exceptions=True)
    unreachable: list[str] = []
    for client, answer in zip(clients, answers, strict=True):
        if isinstance(answer, ComfyError):
            unreachable.append(client.base_url)
        elif isinstance(answer, BaseException):
            raise answer
        elif answer:
            return client, []
    return None, unreachable


async def locate_prompt(clients: list[ComfyClient], prompt_id: str) -> ComfyClient | None:
    """The server holding `prompt_id`, or None (not found on any that answered)."""
    found, _unreachable = await find_prompt(clients, prompt_id)
    return found
