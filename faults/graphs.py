"""Graphs and policies for chaos runs: a sampler long enough to hurt mid-way, short timeouts.

Model-free (the simulator renders deterministic images), in ComfyUI's API format, built from the
same examples/txt2img.json the demo uses so they are what a user would submit.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from workflows.contracts import JobPolicy, ReconnectPolicy

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "txt2img.json"

SAMPLER_NODE = "3"  # the KSampler in examples/txt2img.json
SAVE_NODE = "9"  # its SaveImage
EARLY_IMAGE_NODE = "20"
EARLY_SAVE_NODE = "21"


def fresh_seed() -> int:
    """A seed no earlier prompt used: ComfyUI (and the simulator) serve a node whose inputs did
    not change from the cache, so a repeated graph would run no sampler steps at all."""
    return random.SystemRandom().randrange(1, 2**48)


def sampler_graph(steps: int, *, seed: int | None = None) -> dict[str, Any]:
    """examples/txt2img.json with `steps` sampler steps (one progress event each)."""
    graph: dict[str, Any] = json.loads(EXAMPLE.read_text())
    graph[SAMPLER_NODE]["inputs"]["steps"] = steps
    graph[SAMPLER_NODE]["inputs"]["seed"] = fresh_seed() if seed is None else seed
    return graph


def two_output_graph(steps: int, *, seed: int | None = None) -> dict[str, Any]:
    """A quick EmptyImage -> SaveImage output next to the long sampler branch.

    ComfyUI (and the simulator) run ready output nodes and their direct inputs first, so the
    early image is saved, and uploaded, while the sampler still has most of its steps to go:
    what a cancel must keep.
    """
    graph = sampler_graph(steps, seed=seed)
    graph[EARLY_IMAGE_NODE] = {
        "class_type": "EmptyImage",
        "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 0x3366CC},
    }
    graph[EARLY_SAVE_NODE] = {
        "class_type": "SaveImage",
        "inputs": {"images": [EARLY_IMAGE_NODE, 0], "filename_prefix": "early"},
    }
    return graph


def seed_segments(count: int) -> list[dict[str, Any]]:
    """`count` segments, each the sampler with a seed of its own (a resumable unit of work)."""
    return [{SAMPLER_NODE: {"seed": fresh_seed()}} for _ in range(count)]


def chaos_policy(
    *,
    heartbeat_timeout_s: float = 2.0,
    abandon_after_s: float | None = None,
    horizon_s: float = 90.0,
    execution_timeout_s: float = 300.0,
) -> JobPolicy:
    """Short timeouts so a lost worker or socket is noticed in seconds, not minutes.

    `abandon_after_s=None` makes the job detached (nobody has to keep it alive); tests about
    abandonment pass a number.
    """
    return JobPolicy(
        execution_timeout_s=execution_timeout_s,
        heartbeat_timeout_s=heartbeat_timeout_s,
        reconnect=ReconnectPolicy(base_delay_s=0.3, max_delay_s=2.0, horizon_s=horizon_s),
        abandon_after_s=abandon_after_s,
        # Finer progress signals make a readable timeline; still bounded by fraction moved.
        progress_interval_s=0.2,
    )
