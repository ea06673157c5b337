"""Settings of the ComfyUI simulator (durable-comfy's stand-in for ComfyUI; not ComfyUI itself)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from .state import PROGRESS_LOG_PROMPTS

SIM_VERSION = "sim-0.1 (durable-comfy ComfyUI simulator)"

# Checkpoint names the simulator lists in /object_info and /models/checkpoints. Any string is
# accepted for `ckpt_name` at validation time: the simulator has no models to be missing.
DEFAULT_CHECKPOINTS = (
    "sim-checkpoint.safetensors",
    "v1-5-pruned-emaonly.safetensors",
    "v1-5-pruned-emaonly-fp16.safetensors",
    "sd_xl_base_1.0.safetensors",
)

# Small enough that a 512x512 graph spends about a millisecond per image node, so demos and
# tests that do not care about node time are not slowed down.
DEFAULT_MS_PER_MEGAPIXEL = 5.0


class SimSettings(BaseModel):
    """Everything `create_app` needs; the CLI flags map one to one onto these fields."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8188, ge=0, le=65535)
    output_dir: Path = Path("output")
    input_dir: Path = Path("input")
    # ComfyUI keeps previews in <base>/temp; by default the simulator puts it next to output_dir.
    temp_dir: Path | None = None
    step_delay_ms: float = Field(default=100, ge=0)
    # What an image node (EmptyImage, ImageBlur, VAEDecode, SaveImage, ...) costs per megapixel
    # of width * height * batch. Small by default so demo graphs stay quick, yet non-zero so a
    # big image makes a node that runs for a while without any progress hook (per prompt:
    # extra_data.sim.ms_per_megapixel).
    ms_per_megapixel: float = Field(default=DEFAULT_MS_PER_MEGAPIXEL, ge=0)
    # ComfyUI's --max-upload-size, in MB: bodies above it answer 413.
    max_upload_size_mb: float = Field(default=100, gt=0)
    # ComfyUI's --cache-none: never reuse node outputs between prompts.
    cache_none: bool = False
    # Simulator only: how many queued prompts run at once, each in an executor of its own (own
    # node cache, own interrupt flag), standing for N GPU workers behind one API (`make bench`'s
    # throughput and scale groups). 1, the default, is ComfyUI: one prompt at a time, in queue
    # order. With more, a prompt's `progress_state` goes to its own client only (as from a server
    # of its own) instead of to every socket. The per-prompt faults (drop/stall/OOM, ...) are
    # meant for 1: with more, a fault hits whichever prompt starts next.
    parallel: int = Field(default=1, ge=1, le=10000)
    # Simulator only: how many prompts GET /sim/progress keeps the event times of (oldest dropped
    # first); `make bench` raises it to time every job of a large batch.
    progress_log_prompts: int = Field(default=PROGRESS_LOG_PROMPTS, ge=1, le=100000)
    checkpoints: tuple[str, ...] = DEFAULT_CHECKPOINTS

    def resolved(self) -> SimSettings:
        """A copy with absolute directories (ComfyUI compares paths with os.path.commonpath)."""
        output_dir = self.output_dir.expanduser().resolve()
        temp_dir = (self.temp_dir or output_dir.parent / "temp").expanduser().resolve()
        return self.model_copy(
            update={
                "output_dir": output_dir,
                "input_dir": self.input_dir.expanduser().resolve(),
                "temp_dir": temp_dir,
            }
        )

    @property
    def temp_path(self) -> Path:
        return self.temp_dir or self.output_dir.parent / "temp"

    @property
    def max_upload_bytes(self) -> int:
        return round(self.max_upload_size_mb * 1024 * 1024)
