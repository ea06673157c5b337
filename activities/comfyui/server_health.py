"""The health watch of a pool of many ComfyUI servers, run for its dispatcher.

The pool's dispatcher (workflows/pool_queue.py) is the one place every worker's jobs get their
server from, so it is where a server's health must be known: one watch per pool, on a shared
cadence (not a look per job), whose answer is written to the dispatcher's history once, when
something changed. The activity reads each server's `/queue` every `CHECK_EVERY_S`, heartbeats,
and returns as soon as a server's health differs from what the dispatcher knows: unhealthy after
`FAILS_TO_MARK` failed reads in a row (one refused connection during a restart is not a dead
server), healthy again after one good read. It also returns after `WATCH_FOR_S` with what it
sees, so a pool's changed settings reach the next watch.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from temporalio import activity

from activities.comfyui.pools import ComfyPools
from protocol.errors import ComfyError
from workflows.admission import ServerWatch
from workflows.shared import ACTIVITY_WATCH_SERVERS

log = structlog.get_logger(__name__)

CHECK_EVERY_S = 1.0
# Each read's own limit: a server that accepts the connection and then hangs is as dead.
CHECK_TIMEOUT_S = 3.0
FAILS_TO_MARK = 2
WATCH_FOR_S = 600.0


class ServerHealthActivities:
    def __init__(self, pools: ComfyPools, *, check_every_s: float = CHECK_EVERY_S) -> None:
        self._pools = pools
        self._every_s = check_every_s

    @activity.defn(name=ACTIVITY_WATCH_SERVERS)
    async def watch_pool_servers(self, watch: ServerWatch) -> dict[str, str | None]:
        """Every watched server's health (None: healthy; else why not), once any differs from
        `watch.unhealthy`, or after `WATCH_FOR_S`."""
        config = self._pools.config(self._pools.resolve(watch.pool))
        # Only the pool's own servers, as this worker's settings name them.
        servers = [s for s in watch.servers if s in config.servers]
        failures = dict.fromkeys(servers, 0)
        seen: dict[str, str | None] = {s: watch.unhealthy.get(s) for s in servers}
        until = time.monotonic() + WATCH_FOR_S
        while True:
            errors = await asyncio.gather(*(self._check(watch.pool, s) for s in servers))
            for server, error in zip(servers, errors, strict=True):
                if error is None:
                    failures[server] = 0
                    seen[server] = None
                else:
                    failures[server] += 1
                    if failures[server] >= FAILS_TO_MARK or server in watch.unhealthy:
                        seen[server] = error
            changed = [s for s in servers if (seen[s] is None) != (s not in watch.unhealthy)]
            if changed or time.monotonic() >= until:
                for server in changed:
                    log.warning(
                        "pool_server_health",
                        pool=watch.pool,
                        server=server,
                        healthy=seen[server] is None,
                        reason=seen[server],
                    )
                return seen
            activity.heartbeat()
            await asyncio.sleep(self._every_s)

    async def _check(self, pool: str, server: str) -> str | None:
        """None when the server answered `/queue` in time; else what went wrong."""
        client = self._pools.client(pool, server)
        try:
            await asyncio.wait_for(client.queue(), timeout=CHECK_TIMEOUT_S)
        except TimeoutError:
            return f"no answer to GET /queue within {CHECK_TIMEOUT_S:.0f} s"
        except ComfyError as exc:
            return f"GET /queue: {exc}"
        return None
