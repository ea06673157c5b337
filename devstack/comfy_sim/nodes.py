"""The simulator's node registry: the real core classes' names, inputs and outputs, plus a few
simulator-only nodes whose names start with `Sim`.

Input specs use ComfyUI's INPUT_TYPES format (a type name or a list of choices, then options), so
`/object_info` can be rendered from them exactly like ComfyUI's V1 `node_info`. How each node
behaves lives in `behaviours.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .settings import SimSettings

MAX_RESOLUTION = 16384
SEED_MAX = 0xFFFFFFFFFFFFFFFF


class Dynamic:
    """Choices computed at request time (ComfyUI lists files from disk on every INPUT_TYPES)."""

    INPUT_FILES = "input_files"
    CHECKPOINTS = "checkpoints"


InputSpec = tuple[Any, dict[str, Any]]

SAMPLERS = [
    "euler", "euler_cfg_pp", "euler_ancestral", "euler_ancestral_cfg_pp", "heun", "heunpp2",
    "dpm_2", "dpm_2_ancestral", "lms", "dpm_fast", "dpm_adaptive", "dpmpp_2s_ancestral",
    "dpmpp_2s_ancestral_cfg_pp", "dpmpp_sde", "dpmpp_sde_gpu", "dpmpp_2m", "dpmpp_2m_cfg_pp",
    "dpmpp_2m_sde", "dpmpp_2m_sde_gpu", "dpmpp_3m_sde", "dpmpp_3m_sde_gpu", "ddpm", "lcm",
    "ipndm", "ipndm_v", "deis", "res_multistep", "res_multistep_cfg_pp", "gradient_estimation",
    "er_sde", "seeds_2", "seeds_3", "ddim", "uni_pc", "uni_pc_bh2",
]  # fmt: skip
SCHEDULERS = [
    "simple", "sgm_uniform", "karras", "exponential", "ddim_uniform", "beta", "normal",
    "linear_quadratic", "kl_optimal",
]  # fmt: skip
UPSCALE_METHODS = ["nearest-exact", "bilinear", "area", "bicubic", "lanczos"]
SAVE_HIDDEN = {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"}


def _int(default: int, lo: int, hi: int, step: int | None = None, **extra: Any) -> InputSpec:
    opts: dict[str, Any] = {"default": default, "min": lo, "max": hi}
    if step is not None:
        opts["step"] = step
    return ("INT", opts | extra)


def _float(default: float, lo: float, hi: float, step: float, **extra: Any) -> InputSpec:
    return ("FLOAT", {"default": default, "min": lo, "max": hi, "step": step} | extra)


@dataclass(frozen=True)
class NodeSpec:
    name: str
    display_name: str
    category: str
    required: dict[str, InputSpec]
    optional: dict[str, InputSpec] = field(default_factory=dict)
    hidden: dict[str, str] = field(default_factory=dict)
    outputs: tuple[str, ...] = ()
    output_names: tuple[str, ...] | None = None
    output_node: bool = False
    description: str = ""
    python_module: str = "nodes"
    # Inputs a VALIDATE_INPUTS hook owns: ComfyUI then skips its own min/max/choice checks.
    custom_validated: tuple[str, ...] = ()
    # IS_CHANGED answers NaN: the node never comes from the cache.
    always_run: bool = False

    def input_types(self, settings: SimSettings) -> dict[str, dict[str, Any]]:
        """INPUT_TYPES(), with dynamic choices resolved against the simulator's directories."""
        out: dict[str, dict[str, Any]] = {"required": _resolve(self.required, settings)}
        if self.optional:
            out["optional"] = _resolve(self.optional, settings)
        if self.hidden:
            out["hidden"] = dict(self.hidden)
        return out


def _resolve(specs: dict[str, InputSpec], settings: SimSettings) -> dict[str, Any]:
    resolved: dict[str, Any] = {}
    for name, (kind, opts) in specs.items():
        if kind == Dynamic.INPUT_FILES:
            kind = input_files(settings.input_dir)
        elif kind == Dynamic.CHECKPOINTS:
            kind = list(settings.checkpoints)
        resolved[name] = [kind, opts] if opts else [kind]
    return resolved


def input_files(input_dir: Path) -> list[str]:
    if not input_dir.is_dir():
        return []
    return sorted(p.name for p in input_dir.iterdir() if p.is_file())


def node_info(spec: NodeSpec, settings: SimSettings) -> dict[str, Any]:
    """One entry of GET /object_info, shaped like ComfyUI's V1 node_info()."""
    inputs = spec.input_types(settings)
    info: dict[str, Any] = {
        "input": inputs,
        "input_order": {key: list(value) for key, value in inputs.items()},
        "output": list(spec.outputs),
        "output_is_list": [False] * len(spec.outputs),
        "output_name": list(spec.output_names or spec.outputs),
        "name": spec.name,
        "display_name": spec.display_name,
        "description": spec.description,
        "python_module": spec.python_module,
        "category": spec.category,
        "output_node": spec.output_node,
    }
    return info


_IMAGE: InputSpec = ("IMAGE", {})
_SIM_MODULE = "custom_nodes.durable_comfy_sim"
_SIM_CATEGORY = "durable-comfy simulator"

_SPECS = [
    NodeSpec(
        "CheckpointLoaderSimple",
        "Load Checkpoint",
        "loaders",
        {"ckpt_name": (Dynamic.CHECKPOINTS, {})},
        outputs=("MODEL", "CLIP", "VAE"),
        custom_validated=("ckpt_name",),
        description="Loads a diffusion model checkpoint (simulated: no weights are read).",
    ),
    NodeSpec(
        "CLIPTextEncode",
        "CLIP Text Encode (Prompt)",
        "conditioning",
        {"text": ("STRING", {"multiline": True, "dynamicPrompts": True}), "clip": ("CLIP", {})},
        outputs=("CONDITIONING",),
    ),
    NodeSpec(
        "EmptyLatentImage",
        "Empty Latent Image",
        "latent",
        {
            "width": _int(512, 16, MAX_RESOLUTION, 8),
            "height": _int(512, 16, MAX_RESOLUTION, 8),
            "batch_size": _int(1, 1, 4096),
        },
        outputs=("LATENT",),
    ),
    NodeSpec(
        "KSampler",
        "KSampler",
        "sampling",
        {
            "model": ("MODEL", {}),
            "seed": _int(0, 0, SEED_MAX, control_after_generate=True),
            "steps": _int(20, 1, 10000),
            "cfg": _float(8.0, 0.0, 100.0, 0.1, round=0.01),
            "sampler_name": (SAMPLERS, {}),
            "scheduler": (SCHEDULERS, {}),
            "positive": ("CONDITIONING", {}),
            "negative": ("CONDITIONING", {}),
            "latent_image": ("LATENT", {}),
            "denoise": _float(1.0, 0.0, 1.0, 0.01),
        },
        outputs=("LATENT",),
        description="Denoises a latent (simulated: one progress event per step).",
    ),
    NodeSpec(
        "VAEDecode",
        "VAE Decode",
        "latent",
        {"samples": ("LATENT", {}), "vae": ("VAE", {})},
        outputs=("IMAGE",),
    ),
    NodeSpec(
        "SaveImage",
        "Save Image",
        "image",
        {"images": _IMAGE, "filename_prefix": ("STRING", {"default": "ComfyUI"})},
        hidden=SAVE_HIDDEN,
        output_node=True,
        description="Saves the input images to your ComfyUI output directory.",
    ),
    NodeSpec(
        "PreviewImage",
        "Preview Image",
        "image",
        {"images": _IMAGE},
        hidden=SAVE_HIDDEN,
        output_node=True,
    ),
    NodeSpec(
        "LoadImage",
        "Load Image",
        "image",
        {"image": (Dynamic.INPUT_FILES, {"image_upload": True})},
        outputs=("IMAGE", "MASK"),
        custom_validated=("image",),
    ),
    NodeSpec(
        "EmptyImage",
        "EmptyImage",
        "image",
        {
            "width": _int(512, 1, MAX_RESOLUTION, 1),
            "height": _int(512, 1, MAX_RESOLUTION, 1),
            "batch_size": _int(1, 1, 4096),
            "color": _int(0, 0, 0xFFFFFF, 1, display="color"),
        },
        outputs=("IMAGE",),
    ),
    NodeSpec(
        "ImageScale",
        "Upscale Image",
        "image/upscaling",
        {
            "image": _IMAGE,
            "upscale_method": (UPSCALE_METHODS, {}),
            "width": _int(512, 0, MAX_RESOLUTION, 1),
            "height": _int(512, 0, MAX_RESOLUTION, 1),
            "crop": (["disabled", "center"], {}),
        },
        outputs=("IMAGE",),
    ),
    NodeSpec(
        "ImageBlur",
        "Image Blur",
        "image/postprocessing",
        {"image": _IMAGE, "blur_radius": _int(1, 1, 31, 1), "sigma": _float(1.0, 0.1, 10.0, 0.1)},
        outputs=("IMAGE",),
        python_module="comfy_extras.nodes_post_processing",
    ),
    NodeSpec(
        "ImageInvert",
        "Invert Image",
        "image",
        {"image": _IMAGE},
        outputs=("IMAGE",),
    ),
    NodeSpec(
        "SaveAnimatedWEBP",
        "SaveAnimatedWEBP",
        "image/animation",
        {
            "images": _IMAGE,
            "filename_prefix": ("STRING", {"default": "ComfyUI"}),
            "fps": _float(6.0, 0.01, 1000.0, 0.01),
            "lossless": ("BOOLEAN", {"default": True}),
            "quality": _int(80, 0, 100),
            "method": (["default", "fastest", "slowest"], {}),
        },
        hidden=SAVE_HIDDEN,
        output_node=True,
        python_module="comfy_extras.nodes_images",
    ),
    NodeSpec(
        "SimLargeOutput",
        "Sim Large Output (simulator only)",
        _SIM_CATEGORY,
        {
            "size_mib": _int(1, 0, 65536, 1),
            "seed": _int(0, 0, SEED_MAX),
            "filename_prefix": ("STRING", {"default": "sim_large"}),
        },
        output_node=True,
        python_module=_SIM_MODULE,
        description="Simulator only: writes size_mib MiB of deterministic bytes to the output "
        "directory (listed under `files` in the node's output).",
    ),
    NodeSpec(
        "SimSleep",
        "Sim Sleep (simulator only)",
        _SIM_CATEGORY,
        {"seconds": _float(1.0, 0.0, 86400.0, 0.1)},
        optional={"images": _IMAGE},
        outputs=("IMAGE",),
        python_module=_SIM_MODULE,
        always_run=True,
        description="Simulator only: sleeps without a progress bar (a silent socket), then "
        "passes `images` through (an 8x8 black image when none is linked). Not an output "
        "node: link it into SaveImage or PreviewImage. Never served from the cache.",
    ),
]

REGISTRY: dict[str, NodeSpec] = {spec.name: spec for spec in _SPECS}
