"""Health probes: a service counts as up only when it answers a real request, not when it forks."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx

Probe = Callable[[], Awaitable[None]]


class ProbeFailed(Exception):
    """The service did not (yet) answer as a healthy one would."""


async def http_get_ok(url: str, timeout_s: float = 2.0) -> None:
    try:
        # trust_env=False: a proxy from the environment must never see loopback probes.
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            response = await client.get(url)
    except httpx.HTTPError as exc:
        raise ProbeFailed(f"GET {url}: {exc!r}") from exc
    if response.status_code != 200:
        raise ProbeFailed(f"GET {url}: HTTP {response.status_code}")
