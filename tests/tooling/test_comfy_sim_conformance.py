"""ComfyUI protocol conformance (docs/comfyui-protocol.md).

Runs against the simulator (`python -m devstack.comfy_sim`, started per module) by default, or
against a real ComfyUI when COMFYUI_URL is set: then simulator-only checks (/sim/*, Sim* nodes,
KSampler without a checkpoint, injected faults) are skipped and only model-free nodes are used.
Point it only at a dedicated, idle ComfyUI: the tests read its queue and interrupt its prompts.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httpx
import pytest
from aiohttp.test_utils import TestClient, TestServer

from devstack.comfy_sim import SimSettings, create_app
from devstack.comfy_sim.__main__ import parse_args
from devstack.real_comfyui import RealComfyUI
from protocol.comfyui.client import ComfyClient
from protocol.comfyui.whereabouts import whereabouts
from tests.conftest import free_port
from tests.support.comfy_sim import (
    HOOKLESS_EXTRA,
    PRIMITIVES,
    PROMPT_SCOPED,
    REJECTIONS,
    STRING_CONCATENATE,
    ComfyAPI,
    Event,
    EventReader,
    Target,
    basic_graph,
    choices,
    empty_node,
    finished,
    hookless_graph,
    ksampler_graph,
    make_png,
    new_id,
    png_size,
    poll,
    run_simulator,
    save_node,
    slow_graph,
    summary,
)

REAL_URL = os.environ.get("COMFYUI_URL")
# `make test-real-comfyui`: a real ComfyUI installed there, started by this module.
REAL_DIR = os.environ.get("REAL_COMFYUI_DIR")
sim_only = pytest.mark.skipif(
    bool(REAL_URL or REAL_DIR), reason="simulator only (/sim, Sim nodes, faults)"
)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    if REAL_URL:
        yield Target(REAL_URL.rstrip("/"), is_sim=False)
        return
    if REAL_DIR:
        real = RealComfyUI(Path(REAL_DIR), free_port())
        real.start()
        try:
            yield Target(real.url, is_sim=False)
        finally:
            real.stop()
        return
    with run_simulator(tmp_path_factory.mktemp("comfy_sim")) as url:
        yield Target(url, is_sim=True)


@pytest.fixture
async def comfy(target: Target) -> AsyncIterator[ComfyAPI]:
    async with aiohttp.ClientSession() as http:
        api = ComfyAPI(target, http)
        yield api
        if target.is_sim:
            await api.sim("/sim/reset", {})  # no fault outlives its test


def prefix() -> str:
    return f"conformance/{new_id()[:12]}"


async def view(comfy: ComfyAPI, item: dict[str, Any]) -> tuple[int, bytes, str]:
    params = {k: item[k] for k in ("filename", "subfolder", "type")}
    async with comfy.http.get(comfy.target.url + "/view", params=params) as response:
        return response.status, await response.read(), response.content_type


# Every route our handler and orchestrator (protocol/comfyui/client.py) and the stock
# worker-comfyui 5.8.5 handler call, with a minimal request and what ComfyUI 0.8.0 answers it
# (status, content type), plain and under /api. "ours" / "stock": who calls it.
ROUTES_USED: list[tuple[str, str, dict[str, Any], int, str, str]] = [
    ("GET", "/", {}, 200, "text/html", "stock: readiness probe before each job"),
    ("HEAD", "/", {}, 200, "text/html", "a GET route also answers HEAD"),
    ("GET", "/system_stats", {}, 200, "application/json", "ours: readiness, liveness"),
    ("HEAD", "/system_stats", {}, 200, "application/json", "a GET route also answers HEAD"),
    ("GET", "/object_info", {}, 200, "application/json", "ours, stock: node registry, models"),
    ("POST", "/prompt", {"json": {}}, 400, "application/json", "ours, stock: queue a graph"),
    ("GET", "/queue", {}, 200, "application/json", "ours: where a prompt is"),
    ("POST", "/queue", {"json": {"delete": ["x"]}}, 200, "application/octet-stream",
     "ours: dequeue a pending prompt"),
    ("GET", "/history/x", {}, 200, "application/json", "ours, stock: a prompt's outputs"),
    ("POST", "/interrupt", {"json": {"prompt_id": "x"}}, 200, "application/octet-stream",
     "ours: prompt-scoped interrupt"),
    ("POST", "/free", {"json": {"unload_models": False, "free_memory": False}}, 200,
     "application/octet-stream", "ours: free memory after an OOM"),
    ("POST", "/upload/image", {"data": {"overwrite": "true"}}, 400, "application/octet-stream",
     "ours, stock: input images (no image part: refused)"),
    ("GET", "/view?filename=missing.png&subfolder=&type=output", {}, 404,
     "application/octet-stream", "ours, stock: output bytes"),
    ("GET", "/ws?clientId=x", {}, 400, "text/plain", "ours, stock: events (no upgrade: refused)"),
    ("POST", "/system_stats", {}, 405, "text/plain", "a route answers only its own methods"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("method", "path", "request_args", "status", "content_type"),
    [(m, p, a, s, c) for m, p, a, s, c, _ in ROUTES_USED],
    ids=[f"{m} {p.split('?')[0]} ({who.split(':')[0]})" for m, p, _, _, _, who in ROUTES_USED],
)
async def test_every_route_our_clients_use_answers_as_comfyui_does(
    comfy: ComfyAPI,
    method: str,
    path: str,
    request_args: dict[str, Any],
    status: int,
    content_type: str,
) -> None:
    for route in (path, "/api" + path):
        async with comfy.http.request(method, comfy.target.url + route, **request_args) as answer:
            await answer.read()
            assert (answer.status, answer.content_type) == (status, content_type), route
    async with comfy.http.get(comfy.target.url + "/api/jobs/x") as answer:
        assert (answer.status, answer.content_type) == (404, "application/json")  # ours


async def test_the_front_page_is_served_uncached(comfy: ComfyAPI) -> None:
    """The stock handler waits for `GET /` to answer 200 before its first job."""
    for path in ("/", "/api/"):
        async with comfy.http.get(comfy.target.url + path) as answer:
            page = await answer.read()
            assert answer.status == 200 and answer.content_type == "text/html", path
            assert page.lower().startswith(b"<!doctype html"), page[:40]
            assert answer.headers["Cache-Control"] == "no-cache"
            assert answer.headers["Pragma"] == "no-cache" and answer.headers["Expires"] == "0"


async def test_system_stats_and_api_aliases(comfy: ComfyAPI) -> None:
    status, stats = await comfy.call("GET", "/system_stats")
    assert status == 200
    assert {"os", "ram_total", "ram_free", "comfyui_version", "python_version", "argv"} <= set(
        stats["system"]
    )
    assert {"name", "type", "index", "vram_total", "vram_free"} <= set(stats["devices"][0])
    if comfy.target.is_sim:
        assert "simulator" in stats["system"]["comfyui_version"]
    for path in ("/system_stats", "/queue", "/object_info/SaveImage", "/prompt"):
        plain, alias = await comfy.call("GET", path), await comfy.call("GET", "/api" + path)
        assert plain[0] == alias[0] == 200
        assert set(plain[1]) == set(alias[1])


async def test_object_info_describes_the_registry(comfy: ComfyAPI) -> None:
    status, info = await comfy.call("GET", "/object_info")
    assert status == 200
    for name in ("EmptyImage", "ImageBlur", "ImageInvert", "ImageScale", "SaveImage",
                 "PreviewImage", "LoadImage", "KSampler", "CheckpointLoaderSimple"):  # fmt: skip
        assert name in info, name
        assert {"input", "output", "output_node", "name", "display_name", "category"} <= set(
            info[name]
        )
    empty = info["EmptyImage"]["input"]["required"]
    assert [empty[k][0] for k in ("width", "height", "batch_size", "color")] == ["INT"] * 4
    assert info["SaveImage"]["output_node"] is True
    assert info["SaveImage"]["input"]["required"]["images"][0] == "IMAGE"
    assert info["ImageBlur"]["output_node"] is False and info["ImageBlur"]["output"] == ["IMAGE"]
    assert "nearest-exact" in choices(info["ImageScale"]["input"]["required"]["upscale_method"])
    assert info["CheckpointLoaderSimple"]["output"] == ["MODEL", "CLIP", "VAE"]
    ksampler = info["KSampler"]["input"]["required"]
    assert ksampler["steps"][0] == "INT" and "euler" in choices(ksampler["sampler_name"])
    assert list((await comfy.call("GET", "/object_info/ImageInvert"))[1]) == ["ImageInvert"]
    assert await comfy.call("GET", "/object_info/NoSuchNode") == (200, {})


async def test_object_info_lists_the_primitives_exactly(comfy: ComfyAPI) -> None:
    info = (await comfy.call("GET", "/object_info"))[1]
    for name, expected in PRIMITIVES.items():
        assert info[name] == expected, name
    one = await comfy.call("GET", "/object_info/PrimitiveString")
    assert one == (200, {"PrimitiveString": PRIMITIVES["PrimitiveString"]})


async def test_string_concatenate_is_described_exactly_and_joins_a_save_prefix(
    comfy: ComfyAPI,
) -> None:
    assert await comfy.call("GET", "/object_info/StringConcatenate") == (
        200,
        {"StringConcatenate": STRING_CONCATENATE},
    )
    out = prefix()
    folder, name = out.rsplit("/", 1)
    graph = basic_graph(out, 16, 16)
    graph["3"]["inputs"]["filename_prefix"] = ["4", 0]
    graph["4"] = {
        "class_type": "StringConcatenate",
        "inputs": {"string_a": folder, "string_b": name, "delimiter": "/"},
    }
    run = await comfy.run(graph)
    image = {"filename": f"{name}_00001_.png", "subfolder": folder, "type": "output"}
    assert run.entry["status"]["status_str"] == "success"
    assert run.entry["outputs"] == {"3": {"images": [image]}}


async def test_primitive_links_feed_save_image_prefix_and_sizes(comfy: ComfyAPI) -> None:
    out = prefix()
    graph = basic_graph(out, 64, 24)
    graph["3"]["inputs"]["filename_prefix"] = ["4", 0]  # a link, not a literal prefix
    graph["4"] = {"class_type": "PrimitiveString", "inputs": {"value": out}}
    graph["5"] = {"class_type": "PrimitiveInt", "inputs": {"value": 40}}
    graph["1"]["inputs"]["width"] = ["5", 0]
    run = await comfy.run(graph)
    name = out.rsplit("/", 1)[1]
    image = {"filename": f"{name}_00001_.png", "subfolder": "conformance", "type": "output"}
    executed = [e["data"] for e in run.events if e["type"] == "executed"]
    assert [(e["node"], e["output"]) for e in executed] == [("3", {"images": [image]})]
    assert run.entry["status"]["status_str"] == "success"
    assert run.entry["outputs"] == {"3": {"images": [image]}}
    status, data, _ = await view(comfy, image)
    assert status == 200 and png_size(data) == (40, 24)


async def test_success_event_order_and_history_timing(comfy: ComfyAPI) -> None:
    if comfy.target.is_sim:
        # Widen the gap between execution_success and the history write to make it observable.
        await comfy.sim("/sim/faults", {"history_delay_ms": 300})
    client_id, out = new_id(), prefix()
    async with comfy.socket(client_id) as reader:
        assert reader.greeting is not None and reader.greeting["type"] == "status"
        assert reader.greeting["data"]["sid"] == client_id
        assert "queue_remaining" in reader.greeting["data"]["status"]["exec_info"]
        prompt_id = new_id()
        assert await comfy.submit(basic_graph(out), client_id=client_id, prompt_id=prompt_id) == (
            prompt_id
        )
        await reader.until(lambda e: e["type"] == "execution_success", 10)
        history_at_success = await comfy.history(prompt_id)
        await reader.until(finished(prompt_id), 10)
    events = reader.seen[1:]
    assert summary(events) == [
        ("execution_start", None),
        ("execution_cached", None),
        ("executing", "1"),
        ("executing", "2"),
        ("executing", "3"),
        ("executed", "3"),
        ("execution_success", None),
        ("executing", None),
    ]
    types = [e["type"] for e in events]
    assert types[0] == "status" and events[0]["data"]["status"]["exec_info"]["queue_remaining"] >= 1
    assert "status" in types[types.index("execution_success") : -1]  # queue count after the run
    by_type = {e["type"]: e["data"] for e in events}
    assert by_type["execution_cached"]["nodes"] == []
    assert by_type["execution_start"]["prompt_id"] == prompt_id
    assert isinstance(by_type["execution_success"]["timestamp"], int)
    assert not [e for e in events if e["type"] == "progress"]  # no progress bar in these nodes
    image = by_type["executed"]["output"]["images"][0]
    name = out.rsplit("/", 1)[1]
    assert image == {"filename": f"{name}_00001_.png", "subfolder": "conformance", "type": "output"}
    if comfy.target.is_sim:
        assert history_at_success == {}
    entry = (await comfy.history(prompt_id))[prompt_id]
    assert entry["status"]["status_str"] == "success" and entry["status"]["completed"] is True
    messages = [event for event, _ in entry["status"]["messages"]]
    assert messages == ["execution_start", "execution_cached", "execution_success"]
    assert entry["outputs"]["3"]["images"] == [image]
    assert entry["prompt"][1] == prompt_id and entry["prompt"][4] == ["3"]
    assert entry["prompt"][3]["client_id"] == client_id
    assert entry["meta"]["3"]["node_id"] == "3"


async def test_png_is_valid_sized_and_counted(comfy: ComfyAPI) -> None:
    out = prefix()
    names = []
    for color in (0x102030, 0x405060):  # different pixels: no cache hit, a second file
        graph = basic_graph(out, 40, 24, color)
        scale = {"image": ["1", 0], "width": 80, "height": 0, "upscale_method": "nearest-exact"}
        graph["2"] = {"class_type": "ImageScale", "inputs": scale | {"crop": "disabled"}}
        run = await comfy.run(graph)
        item = run.entry["outputs"]["3"]["images"][0]
        status, data, content_type = await view(comfy, item)
        assert status == 200 and content_type == "image/png"
        assert png_size(data) == (80, 48)
        names.append(item["filename"])
    base = out.rsplit("/", 1)[1]
    assert names == [f"{base}_00001_.png", f"{base}_00002_.png"]


async def test_identical_resubmission_is_served_from_cache(comfy: ComfyAPI) -> None:
    graph = basic_graph(prefix(), color=0x0A0B0C)
    first = await comfy.run(graph)
    second = await comfy.run(graph)
    cached = next(e for e in second.events if e["type"] == "execution_cached")
    assert sorted(cached["data"]["nodes"]) == ["1", "2", "3"]
    assert ("executing", "1") not in summary(second.events)
    assert second.entry["outputs"] == first.entry["outputs"]


async def test_cached_prompt_without_a_client_has_empty_history_outputs(comfy: ComfyAPI) -> None:
    # ComfyUI copies a cached node's output into the history only for a prompt with a client.
    graph = basic_graph(prefix(), 16, 16)
    first = await comfy.wait_history(await comfy.submit(graph))
    second = await comfy.wait_history(await comfy.submit(graph))
    assert len(first["outputs"]["3"]["images"]) == 1
    assert second["status"]["status_str"] == "success" and second["outputs"] == {}
    cached = dict(second["status"]["messages"])["execution_cached"]
    assert sorted(cached["nodes"]) == ["1", "2", "3"]


@sim_only
async def test_ksampler_reports_one_progress_event_per_step(comfy: ComfyAPI) -> None:
    extra = {"sim": {"step_delay_ms": 1}}
    run = await comfy.run(ksampler_graph(prefix(), steps=7, seed=42), extra_data=extra)
    progress = [e["data"] for e in run.events if e["type"] == "progress"]
    assert [p["value"] for p in progress] == list(range(1, 8))
    assert {(p["max"], p["node"], p["prompt_id"]) for p in progress} == {(7, "5", run.prompt_id)}
    status, data, _ = await view(comfy, run.entry["outputs"]["7"]["images"][0])
    assert status == 200 and png_size(data) == (256, 192)


async def test_events_go_only_to_the_prompts_client(comfy: ComfyAPI) -> None:
    async with comfy.socket(new_id()) as bystander:
        run = await comfy.run(basic_graph(prefix()))
        leaked = [e for e in bystander.seen + await bystander.quiet(0.2)]
    assert run.events
    assert not [e for e in leaked if e["type"] in PROMPT_SCOPED], summary(leaked)


async def test_second_socket_with_same_id_takes_over(comfy: ComfyAPI) -> None:
    client_id = new_id()
    async with comfy.socket(client_id) as old, comfy.socket(client_id) as new:
        prompt_id = await comfy.submit(basic_graph(prefix()), client_id=client_id)
        await new.until(finished(prompt_id))
        assert not [e for e in old.seen + await old.quiet(0.2) if e["type"] in PROMPT_SCOPED]
        await old.ws.close()
        await old.quiet(0.2)
        # ComfyUI quirk: closing the superseded socket unregisters the ID for the new one too.
        prompt_id = await comfy.submit(basic_graph(prefix()), client_id=client_id)
        await comfy.wait_history(prompt_id)
        assert not [e for e in await new.quiet(0.2) if e["type"] in PROMPT_SCOPED]


async def test_nothing_is_replayed_on_reconnect(comfy: ComfyAPI) -> None:
    client_id = new_id()
    prompt_id = await comfy.submit(basic_graph(prefix()), client_id=client_id)
    await comfy.wait_history(prompt_id)
    async with comfy.socket(client_id) as reader:
        assert reader.greeting is not None and reader.greeting["type"] == "status"
        assert not [e for e in await reader.quiet(0.3) if e["type"] in PROMPT_SCOPED]


@sim_only
async def test_reconnect_mid_node_announces_the_current_node(comfy: ComfyAPI) -> None:
    client_id = new_id()
    prompt_id = await comfy.submit(slow_graph(prefix(), True, 0.6), client_id=client_id)

    async def running() -> bool:
        queue = (await comfy.call("GET", "/queue"))[1]
        return any(item[1] == prompt_id for item in queue["queue_running"])

    await poll(running)
    async with comfy.socket(client_id) as reader:
        first = await reader.next(2)
        assert first == {"type": "executing", "data": {"node": "2"}}
        await reader.until(finished(prompt_id))


async def test_our_prompt_id_is_kept_and_duplicates_run_twice(comfy: ComfyAPI) -> None:
    client_id, prompt_id = new_id(), new_id()
    graph = basic_graph(prefix())
    async with comfy.socket(client_id) as reader:
        answers = [await comfy.post_prompt(graph, client_id=client_id, prompt_id=prompt_id)
                   for _ in range(2)]  # fmt: skip
        await reader.until(finished(prompt_id))
        await reader.until(finished(prompt_id))
    assert [a[0] for a in answers] == [200, 200]
    assert [a[1]["prompt_id"] for a in answers] == [prompt_id, prompt_id]
    assert answers[0][1]["number"] != answers[1][1]["number"]
    assert answers[0][1]["node_errors"] == {}
    starts = [e for e in reader.seen if e["type"] == "execution_start"]
    assert [e["data"]["prompt_id"] for e in starts] == [prompt_id, prompt_id]
    if comfy.target.is_sim:
        stats = await comfy.sim("/sim/stats")
        assert stats["prompts"][prompt_id] == 2 and stats["executions"][prompt_id] == 2


async def test_rejections_have_comfyui_shapes_and_queue_nothing(comfy: ComfyAPI) -> None:
    client_id = new_id()
    ids = []
    async with comfy.socket(client_id) as reader:
        for case, graph, kind, node, node_kind in REJECTIONS:
            prompt_id = new_id()
            ids.append(prompt_id)
            body: dict[str, Any] = {"client_id": client_id, "prompt_id": prompt_id}
            if graph is not None:
                body["prompt"] = graph
            status, answer = await comfy.call("POST", "/prompt", json=body)
            assert status == 400, (case, answer)
            assert set(answer) == {"error", "node_errors"}, case
            assert set(answer["error"]) == {"type", "message", "details", "extra_info"}, case
            assert answer["error"]["type"] == kind, (case, answer)
            if node is not None:
                entry = answer["node_errors"][node]
                assert entry["class_type"] == graph[node]["class_type"]
                assert entry["dependent_outputs"] and entry["errors"][0]["type"] == node_kind
                assert set(entry["errors"][0]) == {"type", "message", "details", "extra_info"}
        traffic = reader.seen[1:] + await reader.quiet(0.3)
    assert traffic == [], summary(traffic)  # a 400 sends nothing on the socket
    unknown = await comfy.call("POST", "/prompt", json={"prompt": REJECTIONS[1][1]})
    assert unknown[1]["error"] == {
        "type": "invalid_prompt",
        "message": "Cannot execute because node NoSuchNode does not exist.",
        "details": "Node ID '#1'",
        "extra_info": {},
    }
    assert unknown[1]["node_errors"] == {}
    queue = (await comfy.call("GET", "/queue"))[1]
    queued = {item[1] for item in queue["queue_running"] + queue["queue_pending"]}
    for prompt_id in ids:
        assert prompt_id not in queued and await comfy.history(prompt_id) == {}
    if comfy.target.is_sim:
        stats = await comfy.sim("/sim/stats")
        assert not set(ids) & set(stats["prompts"])
        cycle = (await comfy.call("POST", "/prompt", json={"prompt": REJECTIONS[-1][1]}))[1]
        assert {e["type"] for e in cycle["node_errors"]["1"]["errors"]} == {"dependency_cycle"}


async def test_a_failed_validation_body_is_comfyuis_own(comfy: ComfyAPI) -> None:
    """The whole 400 body as ComfyUI 0.8.0 sends it (the stock handler formats its
    `error.message` and each `node_errors` entry into its own error text)."""
    graph = {"1": empty_node(width=-5), "2": save_node(["1", 0])}
    status, answer = await comfy.post_prompt(graph)
    assert status == 400
    assert answer == {
        "error": {
            "type": "prompt_outputs_failed_validation",
            "message": "Prompt outputs failed validation",
            "details": "",
            "extra_info": {},
        },
        "node_errors": {
            "1": {
                "errors": [
                    {
                        "type": "value_smaller_than_min",
                        "message": "Value -5 smaller than min of 1",
                        "details": "width",
                        "extra_info": {
                            "input_name": "width",
                            "input_config": [
                                "INT",
                                {"default": 512, "min": 1, "max": 16384, "step": 1},
                            ],
                            "received_value": -5,
                        },
                    }
                ],
                "dependent_outputs": ["2"],
                "class_type": "EmptyImage",
            }
        },
    }


async def test_two_save_nodes_may_write_the_same_file_name(comfy: ComfyAPI) -> None:
    """Prefixes `.../a/out` and `.../b/out`: ComfyUI counts per folder, so both outputs are
    `out_00001_.png`, told apart only by their subfolder (what a stock endpoint's result drops)."""
    base = prefix()
    graph = basic_graph(f"{base}/a/out", color=0x112233)
    graph["4"] = {"class_type": "ImageInvert", "inputs": {"image": ["2", 0]}}
    graph["5"] = {"class_type": "SaveImage",
                  "inputs": {"images": ["4", 0], "filename_prefix": f"{base}/b/out"}}  # fmt: skip
    run = await comfy.run(graph)

    def saved(folder: str) -> dict[str, Any]:
        item = {"filename": "out_00001_.png", "subfolder": f"{base}/{folder}", "type": "output"}
        return {"images": [item]}

    assert run.entry["outputs"] == {"3": saved("a"), "5": saved("b")}
    first = await view(comfy, run.entry["outputs"]["3"]["images"][0])
    second = await view(comfy, run.entry["outputs"]["5"]["images"][0])
    assert first[0] == second[0] == 200 and first[1] != second[1]


async def test_a_bad_output_does_not_stop_the_good_one(comfy: ComfyAPI) -> None:
    graph = basic_graph(prefix())
    graph["4"] = save_node(["99", 0])
    status, answer = await comfy.post_prompt(graph)
    assert status == 200 and answer["node_errors"]["4"]["dependent_outputs"] == ["4"]
    entry = await comfy.wait_history(answer["prompt_id"])
    assert entry["prompt"][4] == ["3"] and set(entry["outputs"]) == {"3"}


async def test_queue_delete_and_clear_touch_pending_only(comfy: ComfyAPI) -> None:
    client_id = new_id()
    async with comfy.socket(client_id) as reader:
        slow = await comfy.submit(slow_graph(prefix(), comfy.target.is_sim), client_id=client_id)
        await reader.until(lambda e: e["type"] == "execution_start")
        later = [await comfy.submit(basic_graph(prefix()), client_id=client_id) for _ in range(3)]
        queue = (await comfy.call("GET", "/queue"))[1]
        running = queue["queue_running"][0]
        assert len(running) == 5 and running[1] == slow and running[3]["client_id"] == client_id
        assert running[4] == ["3"]
        assert [item[1] for item in queue["queue_pending"]] == later
        assert (await comfy.call("POST", "/queue", json={"delete": [later[0], slow]}))[0] == 200
        queue = (await comfy.call("GET", "/queue"))[1]
        assert [item[1] for item in queue["queue_pending"]] == later[1:]
        # Our client reads the empty 200 as the answer it is (it once raised reading it as JSON).
        async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
            await ComfyClient(comfy.target.url, http).delete_pending(later[1])
        queue = (await comfy.call("GET", "/queue"))[1]
        assert [item[1] for item in queue["queue_pending"]] == later[2:]
        assert queue["queue_running"][0][1] == slow
        assert (await comfy.call("POST", "/queue", json={"clear": True}))[0] == 200
        assert (await comfy.call("GET", "/queue"))[1]["queue_pending"] == []
        await comfy.call("POST", "/interrupt", json={"prompt_id": slow})
        await reader.until(finished(slow), 30)
        await reader.quiet(0.2)
    started = {e["data"]["prompt_id"] for e in reader.seen if e["type"] == "execution_start"}
    assert started == {slow}
    for prompt_id in later:
        assert await comfy.history(prompt_id) == {}


async def test_unknown_history_is_an_empty_object(comfy: ComfyAPI) -> None:
    assert await comfy.call("GET", f"/history/{new_id()}") == (200, {})
    assert await comfy.call("GET", f"/api/history/{new_id()}") == (200, {})
    status, everything = await comfy.call("GET", "/history?max_items=1")
    assert status == 200 and len(everything) <= 1


async def test_interrupt_is_prompt_scoped_and_cooperative(comfy: ComfyAPI) -> None:
    client_id, is_sim = new_id(), comfy.target.is_sim
    async with comfy.socket(client_id) as reader:
        spared = await comfy.submit(slow_graph(prefix(), is_sim, 0.4), client_id=client_id)
        await reader.until(lambda e: e["type"] == "executing" and e["data"]["node"] == "2")
        assert (await comfy.call("POST", "/interrupt", json={"prompt_id": new_id()}))[0] == 200
        await reader.until(finished(spared), 30)
        hit = await comfy.submit(slow_graph(prefix(), is_sim, 0.4), client_id=client_id)
        await reader.until(lambda e: e["type"] == "executing" and e["data"]["node"] == "2")
        # ComfyUI looks at the flag once more after announcing a node, before running it: an
        # interrupt that arrives in that instant stops node 2 itself. Let the node start.
        await asyncio.sleep(0.1 if is_sim else 0.5)
        assert (await comfy.call("POST", "/interrupt", json={"prompt_id": hit}))[0] == 200
        events = await reader.until(finished(hit), 30)
    assert (await comfy.history(spared))[spared]["status"]["status_str"] == "success"
    interrupted = [e["data"] for e in events if e["type"] == "execution_interrupted"]
    assert len(interrupted) == 1
    # Cooperative: the slow node finishes, the interrupt lands at the next node boundary.
    assert interrupted[0]["node_id"] == "3" and interrupted[0]["node_type"] == "SaveImage"
    # ComfyUI builds `executed` from a set: the order is undefined.
    assert set(interrupted[0]["executed"]) == {"1", "2"} and interrupted[0]["prompt_id"] == hit
    entry = (await comfy.history(hit))[hit]
    assert entry["status"]["status_str"] == "error" and entry["status"]["completed"] is False
    assert entry["status"]["messages"][-1][0] == "execution_interrupted"
    if is_sim:
        stats = await comfy.sim("/sim/stats")
        assert hit in stats["interrupted"] and spared not in stats["interrupted"]
        assert stats["executed"][hit] == "interrupted"


async def test_interrupt_during_a_node_without_progress_hook_lands_at_its_end(
    comfy: ComfyAPI,
) -> None:
    """ImageBlur has no progress hook: an interrupt sent while it runs waits for the blur to
    finish and lands at the next node boundary (ImageInvert), which never runs."""
    client_id = new_id()
    async with comfy.socket(client_id) as reader:
        prompt_id = await comfy.submit(
            hookless_graph(prefix()), client_id=client_id, extra_data=HOOKLESS_EXTRA
        )
        await reader.until(lambda e: e["type"] == "executing" and e["data"]["node"] == "2", 30)
        # Let the blur get going, so the interrupt cannot beat it to its own start check.
        await asyncio.sleep(0.2)
        assert (await comfy.call("POST", "/interrupt", json={"prompt_id": prompt_id}))[0] == 200
        sent = time.monotonic()
        queue = (await comfy.call("GET", "/queue"))[1]
        assert [item[1] for item in queue["queue_running"]] == [prompt_id]
        tail = await reader.until(lambda e: e["type"] == "execution_interrupted", 30)
        landed = time.monotonic()
        tail += await reader.until(finished(prompt_id), 10)
        ended = time.time()
    assert landed - sent >= 0.5, landed - sent  # the blur ran on after the request
    assert summary(tail) == [
        ("executing", "3"),
        ("execution_interrupted", None),
        ("executing", None),
    ]
    interrupted: Event = next(e["data"] for e in tail if e["type"] == "execution_interrupted")
    assert interrupted["node_id"] == "3" and interrupted["node_type"] == "ImageInvert"
    assert set(interrupted["executed"]) == {"1", "2"}
    entry = (await comfy.history(prompt_id))[prompt_id]
    assert entry["status"]["status_str"] == "error" and entry["outputs"] == {}
    assert entry["status"]["messages"][-1][0] == "execution_interrupted"
    if comfy.target.is_sim:
        stats = await comfy.sim("/sim/stats")
        assert stats["executed"][prompt_id] == "interrupted"
        # Gone from the running queue before the end marker reached the client.
        assert stats["started_at"][prompt_id] < stats["ended_at"][prompt_id] <= ended


async def test_free_requires_a_body(comfy: ComfyAPI) -> None:
    before = (await comfy.sim("/sim/stats"))["frees"] if comfy.target.is_sim else 0
    assert (await comfy.call("POST", "/free"))[0] == 500
    body = {"unload_models": False, "free_memory": False}
    assert (await comfy.call("POST", "/free", json=body))[0] == 200
    if comfy.target.is_sim:
        assert (await comfy.sim("/sim/stats"))["frees"] == before + 1


async def test_view_checks_paths(comfy: ComfyAPI) -> None:
    run = await comfy.run(basic_graph(prefix()))
    item = run.entry["outputs"]["3"]["images"][0]
    status, data, content_type = await view(comfy, item)
    assert status == 200 and content_type == "image/png" and png_size(data)

    async def status_of(**params: str) -> int:
        async with comfy.http.get(comfy.target.url + "/view", params=params) as response:
            return response.status

    assert await status_of(filename="../secret.png", type="output") == 400
    assert await status_of(filename="/etc/passwd", type="output") == 400
    assert await status_of(filename="x.png", type="bogus") == 400
    assert await status_of(filename=item["filename"], subfolder="../..", type="output") == 403
    assert await status_of(filename=f"missing-{new_id()}.png", type="output") == 404
    async with comfy.http.get(comfy.target.url + "/api/view", params=item) as response:
        assert response.status == 200


async def test_upload_image_then_load_it(comfy: ComfyAPI) -> None:
    name = f"upload-{new_id()[:10]}.png"
    first, other = make_png(20, 10, (200, 10, 10)), make_png(30, 12, (10, 200, 10))

    async def upload(data: bytes, **fields: str) -> Any:
        form = aiohttp.FormData()
        form.add_field("image", data, filename=name, content_type="image/png")
        for key, value in fields.items():
            form.add_field(key, value)
        status, answer = await comfy.call("POST", "/upload/image", data=form)
        assert status == 200, answer
        return answer

    assert await upload(first) == {"name": name, "subfolder": "", "type": "input"}
    assert (await upload(first))["name"] == name  # same bytes: recognised as the same file
    renamed = (await upload(other))["name"]
    assert renamed == name.replace(".png", " (1).png")
    assert (await upload(other, overwrite="true"))["name"] == name
    status, data, _ = await view(comfy, {"filename": name, "subfolder": "", "type": "input"})
    assert status == 200 and data == other
    graph = {"1": {"class_type": "LoadImage", "inputs": {"image": renamed}},
             "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0],
                                                         "filename_prefix": prefix()}}}  # fmt: skip
    run = await comfy.run(graph)
    status, data, _ = await view(comfy, run.entry["outputs"]["2"]["images"][0])
    assert status == 200 and png_size(data) == (30, 12)


async def test_upload_image_as_the_stock_handler_sends_it(comfy: ComfyAPI) -> None:
    """worker-comfyui posts `image` (a file part, image/png) and `overwrite` ("true", a plain
    part); a subfolder is answered back, an upload without an image part is refused."""
    name = f"stock-{new_id()[:10]}.png"
    data = make_png(6, 4, (1, 2, 3))
    for subfolder in ("", f"stock/{new_id()[:6]}"):
        form = aiohttp.FormData()
        form.add_field("image", io.BytesIO(data), filename=name, content_type="image/png")
        form.add_field("overwrite", "true")
        if subfolder:
            form.add_field("subfolder", subfolder)
        async with comfy.http.post(comfy.target.url + "/upload/image", data=form) as answer:
            assert answer.status == 200 and answer.content_type == "application/json"
            assert await answer.json() == {"name": name, "subfolder": subfolder, "type": "input"}
        status, stored, _ = await view(
            comfy, {"filename": name, "subfolder": subfolder, "type": "input"}
        )
        assert status == 200 and stored == data
    form = aiohttp.FormData()
    form.add_field("overwrite", "true")
    form.add_field("subfolder", "stock")
    assert (await comfy.call("POST", "/upload/image", data=form))[0] == 400


async def test_foreign_origin_is_refused(comfy: ComfyAPI) -> None:
    host = urlsplit(comfy.target.url)
    if host.hostname not in ("127.0.0.1", "localhost", "::1"):
        pytest.skip("the origin check only applies to a loopback Host")
    evil = await comfy.call("GET", "/system_stats", headers={"Origin": "http://evil.example"})
    assert evil[0] == 403
    same = await comfy.call("GET", "/system_stats", headers={"Origin": comfy.target.url})
    assert same[0] == 200


async def test_jobs_endpoint(comfy: ComfyAPI) -> None:
    run = await comfy.run(basic_graph(prefix()))
    status, job = await comfy.call("GET", f"/api/jobs/{run.prompt_id}")
    if status == 404 and not comfy.target.is_sim:
        pytest.skip("this ComfyUI has no /api/jobs")
    assert status == 200 and job["id"] == run.prompt_id and job["status"] == "completed"
    assert job["outputs_count"] == 1
    assert (await comfy.call("GET", f"/api/jobs/{new_id()}"))[0] == 404


async def test_jobs_api_says_where_queued_prompts_are_without_their_graphs(
    comfy: ComfyAPI,
) -> None:
    """What protocol/comfyui/whereabouts.py reads instead of /queue: the same places."""
    client_id = new_id()
    async with comfy.socket(client_id) as reader:
        slow = await comfy.submit(slow_graph(prefix(), comfy.target.is_sim), client_id=client_id)
        await reader.until(lambda e: e["type"] == "execution_start")
        later = [await comfy.submit(basic_graph(prefix()), client_id=client_id) for _ in range(3)]
        status, job = await comfy.call("GET", f"/api/jobs/{slow}")
        if status == 404 and not comfy.target.is_sim:
            pytest.skip("this ComfyUI has no /api/jobs")
        assert job["status"] == "in_progress"
        status, listed = await comfy.call("GET", "/api/jobs?status=pending")
        assert status == 200 and listed["pagination"]["total"] == 3
        assert {j["id"] for j in listed["jobs"]} == set(later)
        assert all(j["status"] == "pending" and "workflow" not in j for j in listed["jobs"])
        queue = (await comfy.call("GET", "/queue"))[1]
        numbers = {item[1]: item[0] for item in queue["queue_pending"]}
        assert {j["id"]: j["priority"] for j in listed["jobs"]} == numbers
        async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
            client = ComfyClient(comfy.target.url, http)
            places = [await whereabouts(client, p) for p in [slow, *later]]
        assert [(w.where, w.position) for w in places] == [
            ("running", None),
            ("pending", 1),
            ("pending", 2),
            ("pending", 3),
        ]
        assert (await comfy.call("GET", "/api/jobs?status=nope"))[0] == 400
        assert (await comfy.call("POST", "/queue", json={"clear": True}))[0] == 200
        await comfy.call("POST", "/interrupt", json={"prompt_id": slow})
        await reader.until(finished(slow), 30)


async def test_preview_and_animated_webp_outputs(comfy: ComfyAPI) -> None:
    graph = basic_graph(prefix())
    graph["1"]["inputs"]["batch_size"] = 2
    graph["4"] = {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}}
    graph["5"] = {"class_type": "SaveAnimatedWEBP", "inputs": {
        "images": ["2", 0], "filename_prefix": prefix(), "fps": 4.0, "lossless": True,
        "quality": 80, "method": "default"}}  # fmt: skip
    run = await comfy.run(graph)
    previews = run.entry["outputs"]["4"]["images"]
    assert len(previews) == 2 and {p["type"] for p in previews} == {"temp"}
    assert previews[0]["filename"].startswith("ComfyUI_temp_")
    status, data, _ = await view(comfy, previews[1])
    assert status == 200 and png_size(data) == (64, 48)
    webp = run.entry["outputs"]["5"]
    assert webp["animated"] == [True] and webp["images"][0]["filename"].endswith("_00001_.webp")
    status, data, _ = await view(comfy, webp["images"][0])
    assert status == 200 and data[:4] == b"RIFF" and data[8:12] == b"WEBP"
    assert len(run.entry["outputs"]["3"]["images"]) == 2


@sim_only
async def test_fault_drop_ws_after_events(comfy: ComfyAPI) -> None:
    await comfy.sim("/sim/faults", {"drop_ws_after_events": 3})
    client_id = new_id()
    async with comfy.socket(client_id) as reader:
        prompt_id = await comfy.submit(basic_graph(prefix()), client_id=client_id)
        await reader.quiet(2)
    assert reader.closed
    after_start = [e["type"] for e in reader.seen]
    after_start = after_start[after_start.index("execution_start") :]
    assert after_start == ["execution_start", "execution_cached", "progress_state"]
    entry = await comfy.wait_history(prompt_id)  # the prompt itself carried on
    assert entry["status"]["status_str"] == "success"


@sim_only
async def test_fault_stall_loses_events_but_execution_continues(comfy: ComfyAPI) -> None:
    await comfy.sim("/sim/faults", {"stall_ws_s": 0.8})  # starts after execution_start
    client_id = new_id()
    async with comfy.socket(client_id) as reader:
        prompt_id = await comfy.submit(basic_graph(prefix()), client_id=client_id)
        entry = await comfy.wait_history(prompt_id)
        assert entry["status"]["status_str"] == "success"
        observed = await reader.quiet(0.3)  # still inside the stall
        assert [e["type"] for e in observed if e["type"] in PROMPT_SCOPED] == ["execution_start"]
        await reader.quiet(0.6)  # the stall is over: events flow again
        run_id = await comfy.submit(basic_graph(prefix()), client_id=client_id)
        await reader.until(finished(run_id))


@sim_only
async def test_fault_oom_fails_the_ksampler_once(comfy: ComfyAPI) -> None:
    await comfy.sim("/sim/faults", {"oom_next": True})
    extra = {"sim": {"step_delay_ms": 1}}
    failed = await comfy.run(ksampler_graph(prefix(), 3, 1), extra_data=extra)
    error = next(e["data"] for e in failed.events if e["type"] == "execution_error")
    assert error["node_id"] == "5" and error["node_type"] == "KSampler"
    assert error["exception_type"] == "torch.OutOfMemoryError"
    assert "CUDA out of memory" in error["exception_message"]
    assert isinstance(error["traceback"], list) and "seed" in error["current_inputs"]
    assert error["executed"] and error["prompt_id"] == failed.prompt_id
    assert failed.entry["status"]["status_str"] == "error"
    assert failed.entry["status"]["messages"][-1][0] == "execution_error"
    again = await comfy.run(ksampler_graph(prefix(), 3, 2), extra_data=extra)
    assert again.entry["status"]["status_str"] == "success"


@sim_only
async def test_fault_cuda_error_sticks_until_free(comfy: ComfyAPI) -> None:
    await comfy.sim("/sim/faults", {"cuda_error_next": True})
    for _ in range(2):
        run = await comfy.run(basic_graph(prefix()))
        error = next(e["data"] for e in run.events if e["type"] == "execution_error")
        assert "illegal memory access" in error["exception_message"]
    assert (await comfy.sim("/sim/faults"))["cuda_broken"] is True
    await comfy.call("POST", "/free", json={"unload_models": True, "free_memory": True})
    run = await comfy.run(basic_graph(prefix()))
    assert run.entry["status"]["status_str"] == "success"


@sim_only
async def test_image_nodes_take_time_per_megapixel(comfy: ComfyAPI) -> None:
    graph = basic_graph(prefix(), 1000, 500)  # 0.5 MP
    graph["1"]["inputs"]["batch_size"] = 2  # 1 MP through every image node
    client_id = new_id()
    marks: dict[str | None, float] = {}
    async with comfy.socket(client_id) as reader:
        extra = {"sim": {"ms_per_megapixel": 300}}
        prompt_id = await comfy.submit(graph, client_id=client_id, extra_data=extra)
        while (event := await reader.next(10)) is not None:
            if event["type"] == "executing":
                marks[event["data"]["node"]] = time.monotonic()
            if finished(prompt_id)(event):
                break
    assert 0.28 <= marks["2"] - marks["1"] < 2  # EmptyImage: 1 MP at 300 ms/MP
    assert 0.28 <= marks["3"] - marks["2"] < 2  # ImageBlur
    stats = await comfy.sim("/sim/stats")
    assert stats["ended_at"][prompt_id] - stats["started_at"][prompt_id] >= 0.85
    bad = await comfy.run(basic_graph(prefix()), extra_data={"sim": {"ms_per_megapixel": "x"}})
    assert bad.entry["status"]["status_str"] == "success"  # a bad override falls back


@sim_only
async def test_fault_ignore_interrupt_holds_it_back_for_a_while(comfy: ComfyAPI) -> None:
    armed = await comfy.sim("/sim/faults", {"ignore_interrupt_s": 0.5})
    assert armed["ignore_interrupt_s"] == 0.5
    extra = {"sim": {"step_delay_ms": 10}}
    client_id = new_id()

    async def interrupt_mid_sampling(reader: EventReader, seed: int) -> tuple[float, list[Event]]:
        def at_step_3(e: Event) -> bool:
            return e["type"] == "progress" and int(e["data"]["value"]) >= 3

        graph = ksampler_graph(prefix(), steps=300, seed=seed)
        prompt_id = await comfy.submit(graph, client_id=client_id, extra_data=extra)
        await reader.until(at_step_3)
        await comfy.call("POST", "/interrupt", json={"prompt_id": prompt_id})
        sent = time.monotonic()
        events = await reader.until(lambda e: e["type"] == "execution_interrupted")
        waited = time.monotonic() - sent
        await reader.until(finished(prompt_id))
        return waited, events

    async with comfy.socket(client_id) as reader:
        deaf, events = await interrupt_mid_sampling(reader, 1)
        assert (await comfy.sim("/sim/faults"))["ignore_interrupt_s"] is None  # one-shot
        hearing, _ = await interrupt_mid_sampling(reader, 2)
    assert 0.45 <= deaf < 2, deaf
    assert len([e for e in events if e["type"] == "progress"]) >= 10  # it kept sampling
    interrupted = events[-1]["data"]
    assert interrupted["node_id"] == "5" and interrupted["node_type"] == "KSampler"
    assert hearing < 0.3, hearing  # the next prompt hears it at its next step


@sim_only
async def test_sim_large_output_is_deterministic(comfy: ComfyAPI) -> None:
    graph = {"1": {"class_type": "SimLargeOutput",
                   "inputs": {"size_mib": 2, "seed": 7, "filename_prefix": prefix()}}}  # fmt: skip
    run = await comfy.run(graph)
    item = run.entry["outputs"]["1"]["files"][0]
    status, data, _ = await view(comfy, item)
    expected = b"".join(hashlib.shake_256(f"7:{i}".encode()).digest(1 << 20) for i in range(2))
    assert status == 200 and data == expected


@sim_only
def test_cli_flags_map_onto_settings() -> None:
    settings = parse_args(["--ms-per-megapixel", "7.5", "--step-delay-ms", "3"])
    assert (settings.ms_per_megapixel, settings.step_delay_ms) == (7.5, 3)
    assert parse_args([]).ms_per_megapixel == SimSettings().ms_per_megapixel > 0


@sim_only
async def test_in_process_app_refuses_oversized_bodies(tmp_path: Path) -> None:
    settings = SimSettings(
        output_dir=tmp_path / "output", input_dir=tmp_path / "input", max_upload_size_mb=1
    )
    assert SimSettings().max_upload_bytes == 100 * 1024 * 1024  # ComfyUI's default
    async with TestClient(TestServer(create_app(settings))) as client:
        response = await client.post("/prompt", data=io.BytesIO(b"x" * (2 << 20)))
        assert response.status == 413
        response = await client.post("/api/prompt", json={"prompt": {}})
        assert response.status == 400
        assert (await response.json())["error"]["type"] == "prompt_no_outputs"
