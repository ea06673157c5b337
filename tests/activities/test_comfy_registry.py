"""A comfyui pool's node registry is read once a minute, not once a job: again at once when a
graph names a class it lacks, and once for all the prepares that wait on a cold pool."""

from __future__ import annotations

import asyncio
from typing import Any

from activities.comfyui.registry import FRESH_S, PoolRegistries

EMPTY_IMAGE = {"input": {"required": {"width": ["INT", {}]}}, "output": ["IMAGE"]}
PREVIEW = {"input": {"required": {"images": ["IMAGE"]}}, "output": [], "output_node": True}
FRESH = {"input": {"required": {}}, "output": [], "output_node": True}
PREVIEW_NODE = {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}}
GRAPH = {"1": {"class_type": "EmptyImage", "inputs": {"width": 8}}, "2": PREVIEW_NODE}
NEW_NODE_GRAPH = {"1": {"class_type": "FreshlyInstalled", "inputs": {}}}


class Comfy:
    """`/object_info` answering the classes installed at the moment of each read."""

    def __init__(self) -> None:
        self.installed: dict[str, Any] = {"EmptyImage": EMPTY_IMAGE, "PreviewImage": PREVIEW}
        self.reads = 0

    async def object_info(self) -> dict[str, Any]:
        self.reads += 1
        await asyncio.sleep(0.01)  # a read takes a while: prepares arriving meanwhile wait
        return dict(self.installed)


async def test_jobs_within_a_minute_share_one_read_and_a_later_one_reads_again() -> None:
    comfy, now = Comfy(), [1000.0]
    registries = PoolRegistries(clock=lambda: now[0])
    for _ in range(5):
        problems, object_info = await registries.check("gpu", comfy, GRAPH)
        assert problems == [] and "EmptyImage" in object_info
    assert comfy.reads == 1
    now[0] += FRESH_S + 1
    await registries.check("gpu", comfy, GRAPH)
    assert comfy.reads == 2
    await registries.check("other-pool", comfy, GRAPH)
    assert comfy.reads == 3, "each pool has its own registry"


async def test_a_class_installed_since_the_read_is_seen_at_once() -> None:
    comfy = Comfy()
    registries = PoolRegistries()
    await registries.check("gpu", comfy, GRAPH)
    comfy.installed["FreshlyInstalled"] = FRESH
    problems, _ = await registries.check("gpu", comfy, NEW_NODE_GRAPH)
    assert problems == [] and comfy.reads == 2


async def test_a_class_still_missing_is_refused_after_one_more_read() -> None:
    comfy = Comfy()
    registries = PoolRegistries()
    await registries.check("gpu", comfy, GRAPH)
    problems, _ = await registries.check("gpu", comfy, NEW_NODE_GRAPH)
    assert len(problems) == 1 and "'FreshlyInstalled' is not installed" in problems[0]
    assert comfy.reads == 2
    # A graph whose only problem is an input, not a class, reads nothing more.
    problems, _ = await registries.check(
        "gpu", comfy, {"1": {"class_type": "EmptyImage", "inputs": {}}, "2": PREVIEW_NODE}
    )
    assert problems and comfy.reads == 2


async def test_prepares_on_a_cold_pool_share_one_read() -> None:
    comfy = Comfy()
    registries = PoolRegistries()
    results = await asyncio.gather(*(registries.check("gpu", comfy, GRAPH) for _ in range(20)))
    assert all(problems == [] for problems, _ in results)
    assert comfy.reads == 1
