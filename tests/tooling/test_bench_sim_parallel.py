"""The ComfyUI simulator's parallel mode (`--parallel N`, for `make bench`'s throughput and scale
groups: N prompts at once stand for N GPU workers) and its `--progress-log-prompts`; the default
stays ComfyUI's one prompt at a time. Orders of events only, no timing."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from devstack.comfy_sim import SimSettings, create_app
from devstack.comfy_sim.__main__ import parse_args
from devstack.comfy_sim.state import PROGRESS_LOG_PROMPTS, SimStats
from faults.graphs import sampler_graph


def _settings(tmp_path: Path, **values: Any) -> SimSettings:
    return SimSettings(
        output_dir=tmp_path / "output", input_dir=tmp_path / "input", step_delay_ms=20, **values
    )


async def _submit(client: TestClient[Any, Any], steps: int) -> str:
    response = await client.post(
        "/prompt", json={"prompt": sampler_graph(steps), "client_id": uuid.uuid4().hex}
    )
    assert response.status == 200
    prompt_id: str = (await response.json())["prompt_id"]
    return prompt_id


async def _finished(client: TestClient[Any, Any], prompt_ids: list[str]) -> dict[str, Any]:
    for _ in range(1000):
        stats: dict[str, Any] = await (await client.get("/sim/stats")).json()
        if all(p in stats["ended_at"] for p in prompt_ids):
            return stats
        await asyncio.sleep(0.02)
    raise AssertionError(f"prompts not finished: {prompt_ids}")


async def _run_three(settings: SimSettings) -> tuple[list[str], dict[str, Any]]:
    async with TestClient(TestServer(create_app(settings))) as client:
        prompt_ids = [await _submit(client, 10) for _ in range(3)]
        stats = await _finished(client, prompt_ids)
        queue = await (await client.get("/queue")).json()
    assert queue == {"queue_running": [], "queue_pending": []}
    return prompt_ids, stats


async def test_parallel_mode_runs_queued_prompts_at_once(tmp_path: Path) -> None:
    prompt_ids, stats = await _run_three(_settings(tmp_path, parallel=3))
    first_end = min(stats["ended_at"][p] for p in prompt_ids)
    assert all(stats["started_at"][p] < first_end for p in prompt_ids)
    assert all(stats["executed"][p] == "success" for p in prompt_ids)


async def test_default_runs_one_prompt_at_a_time_in_order(tmp_path: Path) -> None:
    assert SimSettings().parallel == 1
    prompt_ids, stats = await _run_three(_settings(tmp_path))
    for earlier, later in itertools.pairwise(prompt_ids):
        assert stats["ended_at"][earlier] <= stats["started_at"][later]


async def test_an_interrupt_names_one_prompt_of_several_running(tmp_path: Path) -> None:
    settings = _settings(tmp_path, parallel=2)
    async with TestClient(TestServer(create_app(settings))) as client:
        keep, stop = await _submit(client, 40), await _submit(client, 40)
        for _ in range(500):
            queue = await (await client.get("/queue")).json()
            if len(queue["queue_running"]) == 2:
                break
            await asyncio.sleep(0.01)
        await client.post("/interrupt", json={"prompt_id": stop})
        stats = await _finished(client, [keep, stop])
    assert stats["executed"] == {keep: "success", stop: "interrupted"}
    assert stats["interrupted"] == [stop]


def test_cli_flags_and_progress_log_size() -> None:
    settings = parse_args(["--parallel", "50", "--progress-log-prompts", "1000"])
    assert (settings.parallel, settings.progress_log_prompts) == (50, 1000)
    assert (parse_args([]).parallel, parse_args([]).progress_log_prompts) == (
        1,
        PROGRESS_LOG_PROMPTS,
    )
    stats = SimStats(progress_log_prompts=3)
    for number in range(5):
        stats.progress_started(f"p{number}")
    assert list(stats.progress) == ["p2", "p3", "p4"]
    stats.reset()  # /sim/reset clears the counters, not the setting
    assert stats.progress_log_prompts == 3 and stats.progress == {}
