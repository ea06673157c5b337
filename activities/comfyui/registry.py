"""Each comfyui pool's node registry (`GET /object_info`), as this worker process last read it.

Every prepare checks its graph against the registry. A real ComfyUI with custom node packs
answers `/object_info` with a few MB that take it a while to build, and before this cache every
job paid that read on its critical path. The rule is the RunPod pools' (activities/runpod/
nodes.py): a read is used for a minute (`FRESH_S`) and read again at once when a graph names a
class it lacks, so a node pack installed since is seen by the next job. A minute-old registry can
only let through a graph whose class was removed since, and ComfyUI's own validation refuses that
at the POST. Prepares on a cold pool share one read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from activities.comfyui.graph import lacks_a_class, registry_problems

# How long a registry read is used before it is read again.
FRESH_S = 60.0


class RegistrySource(Protocol):
    """What is read of `ComfyClient`."""

    async def object_info(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class _Read:
    object_info: dict[str, Any]
    read_at: float  # monotonic


class PoolRegistries:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._reads: dict[str, _Read] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def check(
        self, pool: str, source: RegistrySource, graph: Mapping[str, Any]
    ) -> tuple[list[str], dict[str, Any]]:
        """What stops `graph` from running on `pool` (empty: nothing), and the registry that
        says so. A `ComfyError` from the read goes to the caller."""
        read, read_now = await self._read(pool, source, fresh=False)
        problems = registry_problems(graph, read.object_info)
        if problems and not read_now and lacks_a_class(graph, read.object_info):
            read, _ = await self._read(pool, source, fresh=True)
            problems = registry_problems(graph, read.object_info)
        return problems, read.object_info

    async def _read(self, pool: str, source: RegistrySource, *, fresh: bool) -> tuple[_Read, bool]:
        """The registry to check against, and whether it was read just now."""
        async with self._locks.setdefault(pool, asyncio.Lock()):
            cached = self._reads.get(pool)
            if cached is not None and not fresh and self._clock() - cached.read_at < FRESH_S:
                return cached, False
            read = _Read(await source.object_info(), self._clock())
            self._reads[pool] = read
            return read, True
