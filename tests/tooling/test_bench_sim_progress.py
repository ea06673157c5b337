"""The ComfyUI simulator's GET /sim/progress (what `make bench` times client latency from):
one entry per `progress` event of a prompt's latest run, with the time it was sent; bounded."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from devstack.comfy_sim import SimSettings, create_app
from devstack.comfy_sim.state import PROGRESS_LOG_PROMPTS, SimStats
from faults.graphs import sampler_graph


async def test_progress_lists_each_step_with_when_it_was_sent(tmp_path: Path) -> None:
    settings = SimSettings(
        output_dir=tmp_path / "output", input_dir=tmp_path / "input", step_delay_ms=1
    )
    async with TestClient(TestServer(create_app(settings))) as client:
        before = time.time()
        response = await client.post(
            "/prompt", json={"prompt": sampler_graph(5), "client_id": uuid.uuid4().hex}
        )
        prompt_id = (await response.json())["prompt_id"]
        for _ in range(200):
            history = await (await client.get(f"/history/{prompt_id}")).json()
            if history:
                break
            await asyncio.sleep(0.02)
        body = await (await client.get("/sim/progress", params={"prompt_id": prompt_id})).json()
        unknown = await (await client.get("/sim/progress", params={"prompt_id": "nope"})).json()

    events = body["events"]
    assert body["prompt_id"] == prompt_id
    assert [(e["node"], e["value"], e["max"]) for e in events] == [("3", v, 5) for v in range(1, 6)]
    times = [e["at"] for e in events]
    assert before <= times[0] and times == sorted(times) and times[-1] <= time.time()
    assert unknown == {"prompt_id": "nope", "events": []}


def test_only_the_latest_prompts_are_kept_and_a_rerun_starts_afresh() -> None:
    stats = SimStats()
    for number in range(PROGRESS_LOG_PROMPTS + 5):
        stats.progress_started(f"p{number}")
        stats.record_progress(f"p{number}", "3", 1, 2)
    assert len(stats.progress) == PROGRESS_LOG_PROMPTS
    assert "p0" not in stats.progress and f"p{PROGRESS_LOG_PROMPTS + 4}" in stats.progress
    stats.progress_started("p10")
    assert stats.progress["p10"] == []
    stats.record_progress("never-started", "3", 1, 2)  # a prompt the log does not know: ignored
    assert "never-started" not in stats.progress
    assert "progress" not in stats.as_json(ws_open=0)  # /sim/stats is unchanged
