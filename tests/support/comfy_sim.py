"""Helpers for the ComfyUI protocol conformance tests: a simulator subprocess, a WebSocket event
reader, model-free graphs and a strict PNG reader. Plain functions: no pytest fixtures here."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.request
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from devstack.free_ports import free_port
from protocol.comfyui.events import PROMPT_EVENTS

REPO_ROOT = Path(__file__).resolve().parents[2]
# Events that belong to one prompt and must only reach that prompt's client socket: the
# follower's own list, so the conformance tests (simulator and real ComfyUI) check it too.
PROMPT_SCOPED = PROMPT_EVENTS
Event = dict[str, Any]


@dataclass(frozen=True)
class Target:
    """The ComfyUI under test: the simulator (default) or a real one from COMFYUI_URL."""

    url: str
    is_sim: bool

    def ws_url(self, client_id: str) -> str:
        base = self.url.replace("https://", "wss://").replace("http://", "ws://")
        return f"{base}/ws?clientId={client_id}"


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"simulator exited early:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"{url}/system_stats", timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"simulator did not come up:\n{log.read_text()}")


@contextlib.contextmanager
def run_simulator(workdir: Path, *extra_args: str) -> Iterator[str]:
    """Start `python -m devstack.comfy_sim` on a free loopback port; stop it by PID afterwards."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = workdir / "comfy_sim.log"
    args = [
        sys.executable, "-m", "devstack.comfy_sim", "--host", "127.0.0.1", "--port", str(port),
        "--output-dir", str(workdir / "output"), "--input-dir", str(workdir / "input"),
        "--step-delay-ms", "10", *extra_args,
    ]  # fmt: skip
    with log.open("wb") as log_file:
        proc = subprocess.Popen(args, cwd=REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        _wait_ready(url, proc, log)
        yield url
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)


class EventReader:
    """JSON events from one ComfyUI socket (binary preview frames are skipped)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.seen: list[Event] = []
        self.closed = False
        self.greeting: Event | None = None

    async def next(self, wait: float) -> Event | None:
        """The next event, or None on timeout or when the socket closed."""
        while True:
            try:
                msg = await self.ws.receive(timeout=wait)
            except TimeoutError:
                return None
            if msg.type == aiohttp.WSMsgType.TEXT:
                event: Event = json.loads(msg.data)
                self.seen.append(event)
                return event
            if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING,
                            aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):  # fmt: skip
                self.closed = True
                return None

    async def until(self, done: Callable[[Event], bool], within: float = 10) -> list[Event]:
        """Events up to and including the first one for which `done` is true."""
        deadline = time.monotonic() + within
        out: list[Event] = []
        while (left := deadline - time.monotonic()) > 0:
            event = await self.next(left)
            if event is None:
                break
            out.append(event)
            if done(event):
                return out
        raise AssertionError(f"condition not met within {within}s; got {summary(out)}")

    async def quiet(self, seconds: float) -> list[Event]:
        """Whatever arrives within `seconds`."""
        deadline = time.monotonic() + seconds
        out: list[Event] = []
        while (left := deadline - time.monotonic()) > 0:
            event = await self.next(left)
            if event is None:
                break
            out.append(event)
        return out


def finished(prompt_id: str) -> Callable[[Event], bool]:
    """The end marker: `executing {node: null, prompt_id}`."""
    return lambda e: (
        e["type"] == "executing"
        and e["data"].get("node") is None
        and e["data"].get("prompt_id") == prompt_id
    )


def summary(events: list[Event]) -> list[tuple[str, Any]]:
    """(type, node) pairs without the noisy status/progress_state broadcasts."""
    return [
        (e["type"], e["data"].get("node"))
        for e in events
        if e["type"] not in ("status", "progress_state")
    ]


def new_id() -> str:
    return uuid.uuid4().hex


def basic_graph(prefix: str, width: int = 64, height: int = 48, color: int | None = None) -> Any:
    """EmptyImage → ImageBlur → SaveImage: model-free, runs on any ComfyUI. Without a colour,
    a random one, so no node comes from ComfyUI's cache."""
    if color is None:
        color = uuid.uuid4().int & 0xFFFFFF
    return {
        "1": {"class_type": "EmptyImage",
              "inputs": {"width": width, "height": height, "batch_size": 1, "color": color}},
        "2": {"class_type": "ImageBlur",
              "inputs": {"image": ["1", 0], "blur_radius": 1, "sigma": 1.0}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": prefix}},
    }  # fmt: skip


# A node without a progress hook that runs for a few seconds on a real CPU-only ComfyUI 0.8.0:
# a radius-31 blur of a 1536x1536 image took ~3.8 s on 2 cores. The simulator gets there through
# its per-megapixel cost (2.36 MP at 600 ms/MP: ~1.4 s per image node); a real ComfyUI ignores
# extra_data.sim.
HOOKLESS_SIZE = 1536
HOOKLESS_EXTRA = {"sim": {"ms_per_megapixel": 600}}


def slow_graph(prefix: str, is_sim: bool, seconds: float = 0.6) -> Any:
    """EmptyImage → (slow node without progress bar) → SaveImage. On the simulator the slow
    node is SimSleep; on a real ComfyUI a large blur (best effort: its duration depends on the
    hardware; see HOOKLESS_SIZE)."""
    if is_sim:
        # Small: the per-megapixel time of the image nodes must keep SimSleep the one slow node.
        graph = basic_graph(prefix)
        graph["2"] = {"class_type": "SimSleep", "inputs": {"seconds": seconds, "images": ["1", 0]}}
    else:
        graph = basic_graph(prefix, HOOKLESS_SIZE, HOOKLESS_SIZE)
        graph["2"]["inputs"].update(blur_radius=31, sigma=10.0)
    return graph


def hookless_graph(prefix: str) -> Any:
    """EmptyImage → ImageBlur (large: the slow node, no progress hook) → ImageInvert → SaveImage;
    submit it with extra_data=HOOKLESS_EXTRA."""
    graph = basic_graph(prefix, HOOKLESS_SIZE, HOOKLESS_SIZE)
    graph["2"]["inputs"].update(blur_radius=31, sigma=10.0)
    graph["3"] = {"class_type": "ImageInvert", "inputs": {"image": ["2", 0]}}
    graph["4"] = {
        "class_type": "SaveImage",
        "inputs": {"images": ["3", 0], "filename_prefix": prefix},
    }
    return graph


def _primitive_info(name: str, display_name: str, kind: str, opts: dict[str, Any]) -> Any:
    return {
        "input": {"required": {"value": [kind, opts]}},
        "input_order": {"required": ["value"]},
        "output": [kind],
        "output_is_list": [False],
        "output_name": [kind],
        "output_tooltips": [None],
        "output_matchtypes": None,
        "name": name,
        "display_name": display_name,
        "description": "",
        "python_module": "comfy_extras.nodes_primitive",
        "category": "utils/primitive",
        "output_node": False,
        "deprecated": False,
        "experimental": False,
        "api_node": False,
    }


_INT64_MAX = 2**63 - 1  # sys.maxsize on a 64-bit ComfyUI
# comfy_extras/nodes_primitive.py (V3 nodes) as ComfyUI 0.8.0's /object_info shows them.
PRIMITIVES: dict[str, Any] = {
    "PrimitiveString": _primitive_info("PrimitiveString", "String", "STRING", {"multiline": False}),
    "PrimitiveStringMultiline": _primitive_info(
        "PrimitiveStringMultiline", "String (Multiline)", "STRING", {"multiline": True}
    ),
    "PrimitiveInt": _primitive_info(
        "PrimitiveInt",
        "Int",
        "INT",
        {"min": -_INT64_MAX, "max": _INT64_MAX, "control_after_generate": True},
    ),
    "PrimitiveFloat": _primitive_info(
        "PrimitiveFloat", "Float", "FLOAT", {"min": -_INT64_MAX, "max": _INT64_MAX, "step": 0.1}
    ),
    "PrimitiveBoolean": _primitive_info("PrimitiveBoolean", "Boolean", "BOOLEAN", {}),
}


# comfy_extras/nodes_string.py's StringConcatenate (V3), as ComfyUI 0.8.0's /object_info shows it.
STRING_CONCATENATE: dict[str, Any] = {
    "input": {
        "required": {
            "string_a": ["STRING", {"multiline": True}],
            "string_b": ["STRING", {"multiline": True}],
            "delimiter": ["STRING", {"default": "", "multiline": False}],
        }
    },
    "input_order": {"required": ["string_a", "string_b", "delimiter"]},
    "output": ["STRING"],
    "output_is_list": [False],
    "output_name": ["STRING"],
    "output_tooltips": [None],
    "output_matchtypes": None,
    "name": "StringConcatenate",
    "display_name": "Concatenate",
    "description": "",
    "python_module": "comfy_extras.nodes_string",
    "category": "utils/string",
    "output_node": False,
    "deprecated": False,
    "experimental": False,
    "api_node": False,
}


def ksampler_graph(prefix: str, steps: int, seed: int) -> Any:
    """The classic txt2img graph (needs a checkpoint: simulator only in these tests)."""
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sim.safetensors"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red fox", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage",
              "inputs": {"width": 256, "height": 192, "batch_size": 1}},
        "5": {"class_type": "KSampler",
              "inputs": {"model": ["1", 0], "seed": seed, "steps": steps, "cfg": 7.0,
                         "sampler_name": "euler", "scheduler": "normal", "positive": ["2", 0],
                         "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": prefix}},
    }  # fmt: skip


def choices(spec: list[Any]) -> list[Any]:
    """The options of a combo input in /object_info: `[[...], {...}]` (V1 nodes) or
    `["COMBO", {"options": [...]}]` (V3 nodes)."""
    if isinstance(spec[0], list):
        return spec[0]
    assert spec[0] == "COMBO", spec
    options: list[Any] = spec[1]["options"]
    return options


def png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """Every chunk of a PNG, checking the signature and each CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    chunks, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, f"bad CRC in {kind!r}"
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    return chunks


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height), after checking that the pixel data decompresses to the right length
    (8-bit RGB or RGBA, one filter byte per row)."""
    chunks = png_chunks(data)
    width, height, depth, colour = struct.unpack(">IIBB", chunks[0][1][:10])
    channels = {2: 3, 6: 4}[colour]
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    assert depth == 8 and len(raw) == height * (1 + width * channels)
    return int(width), int(height)


def make_png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A small solid RGB PNG to upload."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    raw = (b"\x00" + bytes(rgb) * width) * height
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )  # fmt: skip


async def poll(check: Callable[[], Any], within: float = 10, interval: float = 0.02) -> Any:
    """Await `check()` until it returns something truthy."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        result = await check()
        if result:
            return result
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {within}s")


@dataclass
class Run:
    prompt_id: str
    events: list[Event]
    entry: dict[str, Any]


class ComfyAPI:
    """Just enough of a ComfyUI client for the tests (full URLs, no retries)."""

    def __init__(self, target: Target, http: aiohttp.ClientSession) -> None:
        self.target = target
        self.http = http

    async def call(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        async with self.http.request(method, self.target.url + path, **kwargs) as response:
            body = await response.read()
            try:
                return response.status, json.loads(body) if body else None
            except ValueError:
                return response.status, body

    async def post_prompt(self, graph: Any, **fields: Any) -> tuple[int, Any]:
        body = {"prompt": graph, **{k: v for k, v in fields.items() if v is not None}}
        return await self.call("POST", "/prompt", json=body)

    async def submit(self, graph: Any, **fields: Any) -> str:
        status, body = await self.post_prompt(graph, **fields)
        assert status == 200, body
        return str(body["prompt_id"])

    async def history(self, prompt_id: str) -> Any:
        status, body = await self.call("GET", f"/history/{prompt_id}")
        assert status == 200
        return body

    async def wait_history(self, prompt_id: str, within: float = 15) -> dict[str, Any]:
        async def check() -> Any:
            return (await self.history(prompt_id)).get(prompt_id)

        entry: dict[str, Any] = await poll(check, within)
        return entry

    async def sim(self, path: str, body: Any = None) -> Any:
        status, answer = await self.call("POST" if body is not None else "GET", path, json=body)
        assert status == 200, answer
        return answer

    @contextlib.asynccontextmanager
    async def socket(self, client_id: str) -> Any:
        """An EventReader whose `greeting` is the first (status) event."""
        async with self.http.ws_connect(self.target.ws_url(client_id)) as ws:
            reader = EventReader(ws)
            reader.greeting = await reader.next(5)
            yield reader

    async def run(self, graph: Any, within: float = 15, **fields: Any) -> Run:
        """Submit with a fresh client ID, collect its events to the end marker, read history."""
        client_id = new_id()
        async with self.socket(client_id) as reader:
            prompt_id = await self.submit(graph, client_id=client_id, **fields)
            events = await reader.until(finished(prompt_id), within)
        return Run(prompt_id, events, await self.wait_history(prompt_id))


def save_node(source: list[Any]) -> dict[str, Any]:
    return {"class_type": "SaveImage", "inputs": {"images": source, "filename_prefix": "never"}}


def empty_node(**inputs: Any) -> dict[str, Any]:
    values = {"width": 8, "height": 8, "batch_size": 1, "color": 0} | inputs
    return {"class_type": "EmptyImage", "inputs": values}


# (case, prompt or None for "no prompt", error.type, node id with node_errors, its error type)
REJECTIONS: list[tuple[str, Any, str, str | None, str | None]] = [
    ("no prompt", None, "no_prompt", None, None),
    ("unknown class", {"1": {"class_type": "NoSuchNode", "inputs": {}}},
     "invalid_prompt", None, None),
    ("missing class_type", {"1": {"inputs": {}}}, "invalid_prompt", None, None),
    ("no output node", {"1": empty_node()}, "prompt_no_outputs", None, None),
    ("missing input", {"1": empty_node(), "2": {"class_type": "SaveImage", "inputs": {}}},
     "prompt_outputs_failed_validation", "2", "required_input_missing"),
    ("dangling link", {"1": empty_node(), "2": save_node(["99", 0])},
     "prompt_outputs_failed_validation", "2", "exception_during_validation"),
    ("bad output index", {"1": empty_node(), "2": save_node(["1", 5])},
     "prompt_outputs_failed_validation", "2", "exception_during_validation"),
    ("malformed link", {"1": empty_node(), "2": save_node(["1", 0, 0])},
     "prompt_outputs_failed_validation", "2", "bad_linked_input"),
    ("type mismatch", {"1": {"class_type": "EmptyLatentImage",
                             "inputs": {"width": 64, "height": 64, "batch_size": 1}},
                       "2": save_node(["1", 0])},
     "prompt_outputs_failed_validation", "2", "return_type_mismatch"),
    ("below min", {"1": empty_node(width=0), "2": save_node(["1", 0])},
     "prompt_outputs_failed_validation", "1", "value_smaller_than_min"),
    ("not an int", {"1": empty_node(width="wide"), "2": save_node(["1", 0])},
     "prompt_outputs_failed_validation", "1", "invalid_input_type"),
    ("not in list", {"1": empty_node(), "2": {"class_type": "ImageScale", "inputs": {
        "image": ["1", 0], "upscale_method": "bogus", "width": 8, "height": 8,
        "crop": "disabled"}}, "3": save_node(["2", 0])},
     "prompt_outputs_failed_validation", "2", "value_not_in_list"),
    ("string into an int", {"1": {"class_type": "PrimitiveString", "inputs": {"value": "8"}},
                            "2": empty_node(width=["1", 0]), "3": save_node(["2", 0])},
     "prompt_outputs_failed_validation", "2", "return_type_mismatch"),
    ("missing input file", {"1": {"class_type": "LoadImage", "inputs": {"image": "nope.png"}},
                            "2": save_node(["1", 0])},
     "prompt_outputs_failed_validation", "1", "custom_validation_failed"),
    ("cycle", {"1": {"class_type": "ImageInvert", "inputs": {"image": ["2", 0]}},
               "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
               "3": save_node(["2", 0])},
     "prompt_outputs_failed_validation", None, None),
]  # fmt: skip
