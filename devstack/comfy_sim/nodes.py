"""The simulator's node registry: the real core classes' names, inputs and outputs (as ComfyUI
0.8.0's /object_info shows them), plus a few simulator-only nodes whose names start with `Sim`.

Input specs use ComfyUI's INPUT_TYPES format (a type name or a list of choices, then options), so
`/object_info` can be rendered from them exactly like ComfyUI does. Two renderings exist, because
ComfyUI 0.8.0 has two node APIs: classic (V1) nodes, and nodes written against comfy_api's V3
schema (ImageBlur, SaveAnimatedWEBP, the Primitive* nodes), which /object_info shows with a few
more keys, an options object on every input, `COMBO` choices and list-valued hidden inputs. How
each node behaves lives in `behaviours.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .settings import SimSettings

MAX_RESOLUTION = 16384
SEED_MAX = 0xFFFFFFFFFFFFFFFF
# The primitives' bounds are sys.maxsize on ComfyUI's (64-bit) host; fixed here so the simulator
# shows the same numbers whatever it runs on.
PRIMITIVE_MAX = 2**63 - 1


class Dynamic:
    """Choices computed at request time (ComfyUI lists files from disk on every INPUT_TYPES)."""

    INPUT_FILES = "input_files"
    CHECKPOINTS = "checkpoints"


InputSpec = tuple[Any, dict[str, Any]]

SAMPLERS = [
    "euler", "euler_cfg_pp", "euler_ancestral", "euler_ancestral_cfg_pp", "heun", "heunpp2",
    "exp_heun_2_x0", "exp_heun_2_x0_sde", "dpm_2", "dpm_2_ancestral", "lms", "dpm_fast",
    "dpm_adaptive", "dpmpp_2s_ancestral", "dpmpp_2s_ancestral_cfg_pp", "dpmpp_sde",
    "dpmpp_sde_gpu", "dpmpp_2m", "dpmpp_2m_cfg_pp", "dpmpp_2m_sde", "dpmpp_2m_sde_gpu",
    "dpmpp_2m_sde_heun", "dpmpp_2m_sde_heun_gpu", "dpmpp_3m_sde", "dpmpp_3m_sde_gpu", "ddpm",
    "lcm", "ipndm", "ipndm_v", "deis", "res_multistep", "res_multistep_cfg_pp",
    "res_multistep_ancestral", "res_multistep_ancestral_cfg_pp", "gradient_estimation",
    "gradient_estimation_cfg_pp", "er_sde", "seeds_2", "seeds_3", "sa_solver", "sa_solver_pece",
    "ddim", "uni_pc", "uni_pc_bh2",
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


def _combo(options: list[str]) -> InputSpec:
    """A V3 choice input: the choices move into the options object."""
    return ("COMBO", {"multiselect": False, "options": options})


def _tip(kind: Any, tooltip: str, **opts: Any) -> InputSpec:
    return (kind, opts | {"tooltip": tooltip})


@dataclass(frozen=True)
class NodeSpec:
    name: str
    # None: a V3 node without one (its /object_info shows null).
    display_name: str | None
    category: str
    required: dict[str, InputSpec]
    optional: dict[str, InputSpec] = field(default_factory=dict)
    hidden: dict[str, str] = field(default_factory=dict)
    outputs: tuple[str, ...] = ()
    output_names: tuple[str, ...] | None = None
    output_tooltips: tuple[str, ...] | None = None
    output_node: bool = False
    description: str = ""
    python_module: str = "nodes"
    # Written against comfy_api's V3 schema in ComfyUI 0.8.0: changes how /object_info shows it.
    v3: bool = False
    # Inputs a VALIDATE_INPUTS hook owns: ComfyUI then skips its own min/max/choice checks.
    custom_validated: tuple[str, ...] = ()
    # IS_CHANGED answers NaN: the node never comes from the cache.
    always_run: bool = False

    def input_types(self, settings: SimSettings) -> dict[str, dict[str, Any]]:
        """INPUT_TYPES(), with dynamic choices resolved against the simulator's directories."""
        out: dict[str, dict[str, Any]] = {"required": _resolve(self.required, settings, self.v3)}
        if self.optional:
            out["optional"] = _resolve(self.optional, settings, self.v3)
        if self.hidden:
            # A V3 schema renders each hidden input as a one-element tuple.
            out["hidden"] = {k: [v] if self.v3 else v for k, v in self.hidden.items()}
        return out


def _resolve(specs: dict[str, InputSpec], settings: SimSettings, v3: bool) -> dict[str, Any]:
    resolved: dict[str, Any] = {}
    for name, (kind, opts) in specs.items():
        if kind == Dynamic.INPUT_FILES:
            kind = input_files(settings.input_dir)
        elif kind == Dynamic.CHECKPOINTS:
            kind = list(settings.checkpoints)
        # V1 nodes write ("IMAGE",) when there are no options; V3 always emits the (empty) dict.
        resolved[name] = [kind, dict(opts)] if opts or v3 else [kind]
    return resolved


def input_files(input_dir: Path) -> list[str]:
    if not input_dir.is_dir():
        return []
    return sorted(p.name for p in input_dir.iterdir() if p.is_file())


def node_info(spec: NodeSpec, settings: SimSettings) -> dict[str, Any]:
    """One entry of GET /object_info, in ComfyUI's key order: server.node_info() for V1 nodes,
    dataclasses.asdict(NodeInfoV1) for V3 ones."""
    inputs = spec.input_types(settings)
    head: dict[str, Any] = {
        "input": inputs,
        "input_order": {key: list(value) for key, value in inputs.items()},
        "output": list(spec.outputs),
        "output_is_list": [False] * len(spec.outputs),
        "output_name": list(spec.output_names or spec.outputs),
    }
    tail: dict[str, Any] = {
        "name": spec.name,
        "display_name": spec.display_name,
        "description": spec.description,
        "python_module": spec.python_module,
        "category": spec.category,
        "output_node": spec.output_node,
    }
    if spec.v3:
        tooltips = list(spec.output_tooltips or [None] * len(spec.outputs))
        head |= {"output_tooltips": tooltips, "output_matchtypes": None}
        return head | tail | {"deprecated": False, "experimental": False, "api_node": False}
    if spec.output_tooltips is not None:
        tail["output_tooltips"] = list(spec.output_tooltips)
    return head | tail


_IMAGE: InputSpec = ("IMAGE", {})
_SIM_MODULE = "custom_nodes.durable_comfy_sim"
_SIM_CATEGORY = "durable-comfy simulator"
_PRIMITIVE_MODULE = "comfy_extras.nodes_primitive"
_PRIMITIVE_CATEGORY = "utils/primitive"
_SAVE_DESCRIPTION = "Saves the input images to your ComfyUI output directory."
_PREFIX_TOOLTIP = (
    "The prefix for the file to save. This may include formatting information such as "
    "%date:yyyy-MM-dd% or %Empty Latent Image.width% to include values from nodes."
)
_CFG_TOOLTIP = (
    "The Classifier-Free Guidance scale balances creativity and adherence to the prompt. Higher "
    "values result in images more closely matching the prompt however too high values will "
    "negatively impact quality."
)
_DENOISE_TOOLTIP = (
    "The amount of denoising applied, lower values will maintain the structure of the initial "
    "image allowing for image to image sampling."
)
_SAMPLER_TOOLTIP = (
    "The algorithm used when sampling, this can affect the quality, speed, and style of the "
    "generated output."
)


def _primitive(name: str, display_name: str, spec: InputSpec) -> NodeSpec:
    return NodeSpec(
        name,
        display_name,
        _PRIMITIVE_CATEGORY,
        {"value": spec},
        outputs=(spec[0],),
        python_module=_PRIMITIVE_MODULE,
        v3=True,
    )


_SPECS = [
    NodeSpec(
        "CheckpointLoaderSimple",
        "Load Checkpoint",
        "loaders",
        # The simulator lists pretend checkpoints where a model-less ComfyUI lists none.
        {"ckpt_name": _tip(Dynamic.CHECKPOINTS, "The name of the checkpoint (model) to load.")},
        outputs=("MODEL", "CLIP", "VAE"),
        output_tooltips=(
            "The model used for denoising latents.",
            "The CLIP model used for encoding text prompts.",
            "The VAE model used for encoding and decoding images to and from latent space.",
        ),
        custom_validated=("ckpt_name",),
        description="Loads a diffusion model checkpoint, diffusion models are used to denoise "
        "latents.",
    ),
    NodeSpec(
        "CLIPTextEncode",
        "CLIP Text Encode (Prompt)",
        "conditioning",
        {
            "text": _tip("STRING", "The text to be encoded.", multiline=True, dynamicPrompts=True),
            "clip": _tip("CLIP", "The CLIP model used for encoding the text."),
        },
        outputs=("CONDITIONING",),
        output_tooltips=(
            "A conditioning containing the embedded text used to guide the diffusion model.",
        ),
        description="Encodes a text prompt using a CLIP model into an embedding that can be "
        "used to guide the diffusion model towards generating specific images.",
    ),
    NodeSpec(
        "EmptyLatentImage",
        "Empty Latent Image",
        "latent",
        {
            "width": _int(
                512, 16, MAX_RESOLUTION, 8, tooltip="The width of the latent images in pixels."
            ),
            "height": _int(
                512, 16, MAX_RESOLUTION, 8, tooltip="The height of the latent images in pixels."
            ),
            "batch_size": _int(1, 1, 4096, tooltip="The number of latent images in the batch."),
        },
        outputs=("LATENT",),
        output_tooltips=("The empty latent image batch.",),
        description="Create a new batch of empty latent images to be denoised via sampling.",
    ),
    NodeSpec(
        "KSampler",
        "KSampler",
        "sampling",
        {
            "model": _tip("MODEL", "The model used for denoising the input latent."),
            "seed": _int(
                0,
                0,
                SEED_MAX,
                control_after_generate=True,
                tooltip="The random seed used for creating the noise.",
            ),
            "steps": _int(
                20, 1, 10000, tooltip="The number of steps used in the denoising process."
            ),
            "cfg": _float(8.0, 0.0, 100.0, 0.1, round=0.01, tooltip=_CFG_TOOLTIP),
            "sampler_name": _tip(SAMPLERS, _SAMPLER_TOOLTIP),
            "scheduler": _tip(
                SCHEDULERS,
                "The scheduler controls how noise is gradually removed to form the image.",
            ),
            "positive": _tip(
                "CONDITIONING",
                "The conditioning describing the attributes you want to include in the image.",
            ),
            "negative": _tip(
                "CONDITIONING",
                "The conditioning describing the attributes you want to exclude from the image.",
            ),
            "latent_image": _tip("LATENT", "The latent image to denoise."),
            "denoise": _float(1.0, 0.0, 1.0, 0.01, tooltip=_DENOISE_TOOLTIP),
        },
        outputs=("LATENT",),
        output_tooltips=("The denoised latent.",),
        description="Uses the provided model, positive and negative conditioning to denoise the "
        "latent image.",
    ),
    NodeSpec(
        "VAEDecode",
        "VAE Decode",
        "latent",
        {
            "samples": _tip("LATENT", "The latent to be decoded."),
            "vae": _tip("VAE", "The VAE model used for decoding the latent."),
        },
        outputs=("IMAGE",),
        output_tooltips=("The decoded image.",),
        description="Decodes latent images back into pixel space images.",
    ),
    NodeSpec(
        "SaveImage",
        "Save Image",
        "image",
        {
            "images": _tip("IMAGE", "The images to save."),
            "filename_prefix": _tip("STRING", _PREFIX_TOOLTIP, default="ComfyUI"),
        },
        hidden=SAVE_HIDDEN,
        output_node=True,
        description=_SAVE_DESCRIPTION,
    ),
    NodeSpec(
        "PreviewImage",
        "Preview Image",
        "image",
        {"images": _IMAGE},
        hidden=SAVE_HIDDEN,
        output_node=True,
        # ComfyUI's PreviewImage subclasses SaveImage and inherits its description.
        description=_SAVE_DESCRIPTION,
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
        None,
        "image/postprocessing",
        {"image": _IMAGE, "blur_radius": _int(1, 1, 31, 1), "sigma": _float(1.0, 0.1, 10.0, 0.1)},
        outputs=("IMAGE",),
        python_module="comfy_extras.nodes_post_processing",
        v3=True,
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
        None,
        "image/animation",
        {
            "images": _IMAGE,
            "filename_prefix": ("STRING", {"default": "ComfyUI", "multiline": False}),
            "fps": _float(6.0, 0.01, 1000.0, 0.01),
            "lossless": ("BOOLEAN", {"default": True}),
            "quality": _int(80, 0, 100),
            "method": _combo(["default", "fastest", "slowest"]),
        },
        hidden=SAVE_HIDDEN,
        output_node=True,
        python_module="comfy_extras.nodes_images",
        v3=True,
    ),
    _primitive("PrimitiveString", "String", ("STRING", {"multiline": False})),
    _primitive("PrimitiveStringMultiline", "String (Multiline)", ("STRING", {"multiline": True})),
    _primitive(
        "PrimitiveInt",
        "Int",
        ("INT", {"min": -PRIMITIVE_MAX, "max": PRIMITIVE_MAX, "control_after_generate": True}),
    ),
    _primitive(
        "PrimitiveFloat",
        "Float",
        ("FLOAT", {"min": -PRIMITIVE_MAX, "max": PRIMITIVE_MAX, "step": 0.1}),
    ),
    _primitive("PrimitiveBoolean", "Boolean", ("BOOLEAN", {})),
    # A string built at run time, e.g. a save prefix no check before the run can read.
    NodeSpec(
        "StringConcatenate",
        "Concatenate",
        "utils/string",
        {
            "string_a": ("STRING", {"multiline": True}),
            "string_b": ("STRING", {"multiline": True}),
            "delimiter": ("STRING", {"default": "", "multiline": False}),
        },
        outputs=("STRING",),
        python_module="comfy_extras.nodes_string",
        v3=True,
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
        description="Simulator only: a node without a progress hook. Sleeps `seconds` with no "
        "progress bar (a silent socket) and ignores interrupts meanwhile (one sent during the "
        "sleep lands at the next node boundary), then passes `images` through (an 8x8 black "
        "image when none is linked). Not an output node: link it into SaveImage or "
        "PreviewImage. Never served from the cache.",
    ),
]

REGISTRY: dict[str, NodeSpec] = {spec.name: spec for spec in _SPECS}
