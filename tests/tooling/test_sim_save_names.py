"""The simulator's saved outputs never share a file: in parallel mode several prompts save at
once (each standing for a ComfyUI of its own), and two that read the same counter on disk
would write one file, the second truncating it while the first's /view is being served (a
`make bench` once failed on that: headers, then no body)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from devstack.comfy_sim import behaviours
from devstack.comfy_sim.files import SavePath, claim_file, save_path
from devstack.comfy_sim.settings import SimSettings
from devstack.comfy_sim.values import SimImage


@dataclass
class Context:
    settings: SimSettings
    prompt: dict[str, Any] = field(default_factory=dict)
    extra_data: dict[str, Any] = field(default_factory=dict)


def test_a_claimed_name_is_skipped_and_the_claim_is_exclusive(tmp_path: Path) -> None:
    (tmp_path / "out_00003_.png").write_bytes(b"another prompt's")
    assert claim_file(tmp_path, "out", 3, "png") == ("out_00004_.png", 4)
    assert (tmp_path / "out_00004_.png").read_bytes() == b""
    assert claim_file(tmp_path, "out", 3, "png") == ("out_00005_.png", 5)
    assert (tmp_path / "out_00003_.png").read_bytes() == b"another prompt's"


def test_two_saves_that_read_the_same_counter_write_two_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = Context(SimSettings(output_dir=tmp_path))
    image = SimImage(width=8, height=8, batch=2, fingerprint=1, solid=(1, 2, 3))
    # Both saves read the folder before either wrote: the same counter for each.
    stale: SavePath = save_path("sim", tmp_path)
    monkeypatch.setattr(behaviours, "save_path", lambda *args: stale)
    first = behaviours._save_pngs(ctx, image, "sim", "output")  # type: ignore[arg-type]
    written = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    other = SimImage(width=8, height=8, batch=2, fingerprint=2, solid=(9, 9, 9))
    second = behaviours._save_pngs(ctx, other, "sim", "output")  # type: ignore[arg-type]
    assert first.ui is not None and second.ui is not None
    names = [e["filename"] for r in (first.ui, second.ui) for e in r["images"]]
    assert names == [f"sim_{n:05}_.png" for n in (1, 2, 3, 4)]
    for name, content in written.items():
        assert (tmp_path / name).read_bytes() == content, "the first save's files untouched"
