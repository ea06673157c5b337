"""The values that flow along the simulated graph's links.

A real ComfyUI passes tensors and model objects; the simulator passes small descriptions of them:
enough to know an image's size and to derive deterministic pixels from the graph's inputs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

RGB = tuple[int, int, int]


def mix(*parts: object) -> int:
    """A stable 64-bit fingerprint of `parts` (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass(frozen=True)
class SimImage:
    """An IMAGE batch: [batch, height, width, 3] in ComfyUI. `solid` = every pixel one colour."""

    width: int
    height: int
    batch: int
    fingerprint: int
    solid: RGB | None = None

    def inverted(self) -> SimImage:
        solid = (
            None
            if self.solid is None
            else (255 - self.solid[0], 255 - self.solid[1], 255 - self.solid[2])
        )
        return replace(self, fingerprint=mix("invert", self.fingerprint), solid=solid)

    def frame(self, index: int) -> SimImage:
        """One image of the batch, with its own pixels (unless the batch is a solid fill)."""
        return replace(self, batch=1, fingerprint=mix("frame", self.fingerprint, index))

    def __str__(self) -> str:
        return f"SimImage(batch={self.batch}, height={self.height}, width={self.width})"


@dataclass(frozen=True)
class SimMask:
    width: int
    height: int
    batch: int

    def __str__(self) -> str:
        return f"SimMask(batch={self.batch}, height={self.height}, width={self.width})"


@dataclass(frozen=True)
class SimLatent:
    """A LATENT: ComfyUI's {"samples": [batch, 4, height/8, width/8]}."""

    width: int  # in latent pixels (image width // 8)
    height: int
    batch: int
    fingerprint: int

    def __str__(self) -> str:
        return f"SimLatent(samples=[{self.batch}, 4, {self.height}, {self.width}])"


@dataclass(frozen=True)
class SimModelPart:
    """MODEL, CLIP or VAE loaded from a (pretend) checkpoint."""

    kind: str
    checkpoint: str

    def __str__(self) -> str:
        return f"<sim {self.kind} from {self.checkpoint!r}>"


@dataclass(frozen=True)
class SimConditioning:
    text: str
    clip: str

    def __str__(self) -> str:
        return f"<sim CONDITIONING {self.text[:40]!r}>"


def format_value(value: Any) -> Any:
    """ComfyUI's execution.format_value: JSON scalars as they are, anything else as str()."""
    if value is None or isinstance(value, int | float | bool | str):
        return value
    return str(value)
