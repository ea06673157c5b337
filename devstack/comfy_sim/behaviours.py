"""What each simulated node does when it runs: cheap stand-ins for the real computations that keep
sizes, file naming, progress reporting and time faithful to ComfyUI.

Time: KSampler waits `step_delay_s` per step and calls the progress hook after each (where an
interrupt can land, as in ComfyUI's sampler callback). Image nodes have no progress hook in
ComfyUI: they take `ms_per_megapixel` per megapixel of the image they make or consume and never
look at the interrupt flag, so an interrupt sent meanwhile lands at the next node boundary.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import string
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .files import claim_file, input_file_path, save_path
from .png import encode_animated_webp, encode_png, png_size
from .settings import SimSettings
from .values import SimConditioning, SimImage, SimLatent, SimMask, SimModelPart, mix

MIB = 1024 * 1024
MEGAPIXEL = 1_000_000


@dataclass
class NodeResult:
    outputs: tuple[Any, ...]
    ui: dict[str, list[Any]] | None = None


class NodeContext(Protocol):
    @property
    def settings(self) -> SimSettings: ...
    @property
    def prompt(self) -> dict[str, Any]: ...
    @property
    def extra_data(self) -> dict[str, Any]: ...
    @property
    def step_delay_s(self) -> float: ...
    @property
    def ms_per_megapixel(self) -> float: ...

    async def progress(self, value: int, total: int) -> None:
        """ComfyUI's progress hook: may raise the interrupt, then reports the step."""


Behaviour = Callable[[NodeContext, dict[str, Any]], Awaitable[NodeResult]]


def pixels(*images: SimImage) -> int:
    """A node's work size: the largest of the images it makes or consumes (width*height*batch)."""
    return max((image.width * image.height * image.batch for image in images), default=0)


async def pixel_work(ctx: NodeContext, count: int) -> None:
    """The node's computation: a plain wait with no progress hook, so no interrupt check."""
    seconds = ctx.ms_per_megapixel * count / MEGAPIXEL / 1000
    if seconds > 0:
        await asyncio.sleep(seconds)


async def checkpoint_loader(ctx: NodeContext, i: dict[str, Any]) -> NodeResult:
    name = str(i["ckpt_name"])
    return NodeResult(tuple(SimModelPart(kind, name) for kind in ("MODEL", "CLIP", "VAE")))


async def clip_text_encode(ctx: NodeContext, i: dict[str, Any]) -> NodeResult:
    return NodeResult((SimConditioning(text=i["text"], clip=i["clip"].checkpoint),))


async def empty_latent(ctx: NodeContext, i: dict[str, Any]) -> NodeResult:
    w, h, b = i["width"], i["height"], i["batch_size"]
    return NodeResult((SimLatent(w // 8, h // 8, b, mix("latent", w, h, b)),))


async def ksampler(ctx: NodeContext, i: dict[str, Any]) -> NodeResult:
    steps: int = i["steps"]
    # ComfyUI's sampler callback reports after each step: value 1..steps, max steps.
    for step in range(1, steps + 1):
        await asyncio.sleep(ctx.step_delay_s)
        await ctx.progress(step, steps)
    latent: SimLatent = i["latent_image"]
    fingerprint = mix(
        "sample",
        i["seed"],
        i["positive"].text,
        i["negative"].text,
        steps,
        i["cfg"],
        i["sampler_name"],
        i["scheduler"],
        i["denoise"],
        latent.fingerprint,
        i["model"].checkpoint,
    )
    return NodeResult((SimLatent(latent.width, latent.height, latent.batch, fingerprint),))


async def vae_decode(ctx: NodeContext, i: dict[str, Any]) -> NodeResult:
    latent: SimLatent = i["samples"]
    image = SimImage(latent.width * 8, latent.height * 8, latent.batch, mix("decode", latent))
    await pixel_work(ctx, pixels(image))
    return NodeResult((image,))


def _metadata(ctx: NodeContext) -> dict[str, str]:
    """SaveImage's PNG text chunks: the API prompt and every extra_pnginfo entry, as JSON."""
    text = {"prompt": json.dumps(ctx.prompt)}
    extra = ctx.extra_data.get("extra_pnginfo")
    if isinstance(extra, dict):
        text.update({key: json.dumps(value) for key, value in extra.items()})
    return text


def _save_pngs(ctx: NodeContext, images: SimImage, prefix: str, folder_type: str) -> NodeResult:
    base = ctx.settings.output_dir if folder_type == "output" else ctx.settings.temp_path
    # ComfyUI passes (shape[1], shape[0]) = (height, batch) as the %width%/%height% values.
    target = save_path(prefix, base, images.height, images.batch)
    metadata = _metadata(ctx)
    results, counter = [], target.counter
    for index in range(images.batch):
        name = target.filename.replace("%batch_num%", str(index))
        file, counter = claim_file(target.folder, name, counter, "png")
        frame = images if images.solid is not None else images.frame(index)
        (target.folder / file).write_bytes(encode_png(frame, metadata))
        results.append({"filename": file, "subfolder": target.subfolder, "type": folder_type})
        counter += 1
    return NodeResult((), {"images": results})


async def save_image(ctx: NodeContext, i: dict[str, Any]) -> NodeResult:
    await pixel_work(ctx, pixels(i["images"]))
    return await asyncio.to_thread(_save_pngs, ctx, i["images"], i["filename_prefix"], "output")


async def preview_image(ctx: NodeContext, i: dict[str, Any]) -> NodeResult:
    await pixel_work(ctx, pixels(i["images"]))
    suffix = "".join(random.choice(string.ascii_lowercase) for _ in range(5))
    return await asyncio.to_thread(_save_pngs, ctx, i["images"], f"ComfyUI_temp_{suffix}", "temp")


def _load(path: Path) -> tuple[SimImage, SimMask]:
    data = path.read_bytes()  # FileNotFoundError here is an execution_error, as in ComfyUI
    width, height = png_size(data) or (512, 512)
    fingerprint = int.from_bytes(hashlib.sha256(data).digest()[:8], "big")
    return SimImage(width, height, 1, fingerprint), SimMask(64, 64, 1)


async def load_image(ctx: NodeContext, i: dict[str, Any]) -> NodeResult:
    image, mask = await asyncio.to_thread(_load, input_file_path(i["image"], ctx.settings))
    await pixel_work(ctx, pixels(image))
    return NodeResult((image, mask))


async def empty_image(ctx: NodeContext, i: dict[str, Any]) -> NodeResult:
    color: int = i["color"]
    rgb = ((color >> 16) & 0xFF, (color >> 8) & 0xFF, color & 0xFF)
    w, h, b = i["width"], i["height"], i["batch_size"]
    image = SimImage(w, h, b, mix("empty", w, h, b, color), solid=rgb)
    await pixel_work(ctx, pixels(image))
    return NodeResult((image,))


async def image_scale(ctx: NodeContext, i: dict[str, Any]) -> NodeResult:
    image: SimImage = i["image"]
    width, height = i["width"], i["height"]
    if width == 0 and height == 0:
        return NodeResult((image,))
    if width == 0:
        width = max(1, round(image.width * height / image.height))
    elif height == 0:
        height = max(1, round(image.height * width / image.width))
    fp = mix("scale", image.fingerprint, width, height, i["upscale_method"], i["crop"])
    scaled = SimImage(width, height, image.batch, fp, image.solid)
    await pixel_work(ctx, pixels(image, scaled))
    return NodeResult((scaled,))


async def image_blur(ctx: NodeContext, i: dict[str, Any]) -> NodeResult:
    image: SimImage = i["image"]
    fp = mix("blur", image.fingerprint, i["blur_radius"], i["sigma"])
    await pixel_work(ctx, pixels(image))
    return NodeResult((SimImage(image.width, image.height, image.batch, fp, image.solid),))


async def image_invert(ctx: NodeContext, i: dict[str, Any]) -> NodeResult:
    await pixel_work(ctx, pixels(i["image"]))
    return NodeResult((i["image"].inverted(),))


def _save_webp(ctx: NodeContext, images: SimImage, prefix: str, fps: float) -> NodeResult:
    target = save_path(prefix, ctx.settings.output_dir, images.height, images.batch)
    file, _ = claim_file(target.folder, target.filename, target.counter, "webp")
    frames = [images.frame(index) for index in range(images.batch)]
    (target.folder / file).write_bytes(encode_animated_webp(frames, fps))
    entry = {"filename": file, "subfolder": target.subfolder, "type": "output"}
    ui: dict[str, list[Any]] = {"images": [entry]}
    if images.batch > 1:  # SavedImages(is_animated=...) omits the key for a single frame
        ui["animated"] = [True]
    return NodeResult((), ui)


async def save_animated_webp(ctx: NodeContext, i: dict[str, Any]) -> NodeResult:
    await pixel_work(ctx, pixels(i["images"]))
    return await asyncio.to_thread(_save_webp, ctx, i["images"], i["filename_prefix"], i["fps"])


def _write_large(ctx: NodeContext, size_mib: int, seed: int, prefix: str) -> NodeResult:
    target = save_path(prefix, ctx.settings.output_dir)
    file, _ = claim_file(target.folder, target.filename, target.counter, "bin")
    with (target.folder / file).open("wb") as out:
        # Each MiB differs, so a client that reorders or drops parts produces a different hash.
        for index in range(size_mib):
            out.write(hashlib.shake_256(f"{seed}:{index}".encode()).digest(MIB))
    entry = {"filename": file, "subfolder": target.subfolder, "type": "output"}
    return NodeResult((), {"files": [entry]})


async def sim_large_output(ctx: NodeContext, i: dict[str, Any]) -> NodeResult:
    args = (ctx, i["size_mib"], i["seed"], i["filename_prefix"])
    return await asyncio.to_thread(_write_large, *args)


async def sim_sleep(ctx: NodeContext, i: dict[str, Any]) -> NodeResult:
    """The documented "node without a progress hook": for its `seconds` nothing reaches the
    socket and interrupts are ignored (they land at the next node boundary), like a model load
    or a big VAE decode in ComfyUI. Not scaled by ms_per_megapixel: the time is explicit."""
    await asyncio.sleep(i["seconds"])
    image = i.get("images") or SimImage(8, 8, 1, mix("sleep"), solid=(0, 0, 0))
    return NodeResult((image,))


async def primitive(ctx: NodeContext, i: dict[str, Any]) -> NodeResult:
    """PrimitiveString/Int/Float/Boolean: the widget's value, already converted by validation."""
    return NodeResult((i["value"],))


async def string_concatenate(ctx: NodeContext, i: dict[str, Any]) -> NodeResult:
    return NodeResult((i["delimiter"].join((i["string_a"], i["string_b"])),))


BEHAVIOURS: dict[str, Behaviour] = {
    "CheckpointLoaderSimple": checkpoint_loader,
    "CLIPTextEncode": clip_text_encode,
    "EmptyLatentImage": empty_latent,
    "KSampler": ksampler,
    "VAEDecode": vae_decode,
    "SaveImage": save_image,
    "PreviewImage": preview_image,
    "LoadImage": load_image,
    "EmptyImage": empty_image,
    "ImageScale": image_scale,
    "ImageBlur": image_blur,
    "ImageInvert": image_invert,
    "SaveAnimatedWEBP": save_animated_webp,
    "SimLargeOutput": sim_large_output,
    "SimSleep": sim_sleep,
    "PrimitiveString": primitive,
    "PrimitiveStringMultiline": primitive,
    "PrimitiveInt": primitive,
    "PrimitiveFloat": primitive,
    "PrimitiveBoolean": primitive,
    "StringConcatenate": string_concatenate,
}
