"""Where files live: ComfyUI's folder_paths rules for output/input/temp, annotated names
(`name.png [input]`), save-path counters and upload name clashes."""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .settings import SimSettings

FOLDER_TYPES = ("output", "input", "temp")


class SaveOutsideOutputError(Exception):
    """What ComfyUI raises when a filename_prefix climbs out of the output directory."""


def directory_by_type(settings: SimSettings, kind: str | None) -> Path | None:
    if kind == "output":
        return settings.output_dir
    if kind == "input":
        return settings.input_dir
    if kind == "temp":
        return settings.temp_path
    return None


def annotated_filepath(name: str, settings: SimSettings) -> tuple[str, Path | None]:
    """Split `name [output]` style annotations off a file name (folder_paths.annotated_filepath)."""
    for kind in FOLDER_TYPES:
        suffix = f" [{kind}]"
        if name.endswith(suffix):
            return name[: -len(suffix)], directory_by_type(settings, kind)
    return name, None


def input_file_exists(name: str, settings: SimSettings) -> bool:
    """LoadImage's VALIDATE_INPUTS: the (annotated) name must exist, relative to input/."""
    plain, base = annotated_filepath(name, settings)
    return (base or settings.input_dir).joinpath(plain).exists()


def input_file_path(name: str, settings: SimSettings) -> Path:
    plain, base = annotated_filepath(name, settings)
    return (base or settings.input_dir) / plain


def is_within(base: Path, candidate: str | Path) -> bool:
    """os.path.commonpath((base, abspath(candidate))) == base, as ComfyUI checks it."""
    base_s = os.path.abspath(base)
    try:
        return os.path.commonpath((base_s, os.path.abspath(candidate))) == base_s
    except ValueError:
        return False


def subfolder_path(folder: Path, subfolder: str) -> Path:
    return folder.joinpath(os.path.normpath(subfolder))


def _compute_vars(prefix: str, width: int, height: int) -> str:
    now = time.localtime()
    for key, value in (
        ("%width%", str(width)),
        ("%height%", str(height)),
        ("%year%", str(now.tm_year)),
        ("%month%", f"{now.tm_mon:02}"),
        ("%day%", f"{now.tm_mday:02}"),
        ("%hour%", f"{now.tm_hour:02}"),
        ("%minute%", f"{now.tm_min:02}"),
        ("%second%", f"{now.tm_sec:02}"),
    ):
        prefix = prefix.replace(key, value)
    return prefix


@dataclass(frozen=True)
class SavePath:
    folder: Path
    filename: str  # the prefix's base name
    counter: int  # first free counter
    subfolder: str  # what history reports as `subfolder`


def save_path(prefix: str, output_dir: Path, width: int = 0, height: int = 0) -> SavePath:
    """folder_paths.get_save_image_path: `<dir of prefix>/<base>_00001_.ext`, continuing after the
    highest counter already on disk for that base name."""
    if "%" in prefix:
        prefix = _compute_vars(prefix, width, height)
    normalized = os.path.normpath(prefix)
    subfolder = os.path.dirname(normalized)
    filename = os.path.basename(normalized)
    folder = Path(os.path.join(output_dir, subfolder))
    if not is_within(output_dir, folder):
        raise SaveOutsideOutputError(
            "**** ERROR: Saving image outside the output folder is not allowed."
            f"\n full_output_folder: {os.path.abspath(folder)}"
            f"\n         output_dir: {output_dir}"
        )
    counter = 1
    if folder.is_dir():
        for entry in os.listdir(folder):
            head = entry[: len(filename) + 1]
            if os.path.normcase(head[:-1]) != os.path.normcase(filename) or head[-1:] != "_":
                continue
            try:
                counter = max(counter, int(entry[len(filename) + 1 :].split("_")[0]) + 1)
            except ValueError:
                continue
    else:
        folder.mkdir(parents=True, exist_ok=True)
    return SavePath(folder=folder, filename=filename, counter=counter, subfolder=subfolder)


def upload_name(folder: Path, filename: str, content: bytes, overwrite: bool) -> tuple[str, bool]:
    """(name to use, already present with identical bytes). Without overwrite a clash becomes
    `name (1).ext`, `name (2).ext`, ... unless the existing file has the same content."""
    if overwrite:
        return filename, False
    stem, ext = os.path.splitext(filename)
    digest = hashlib.sha256(content).digest()
    candidate, i = filename, 1
    while (folder / candidate).exists():
        if hashlib.sha256((folder / candidate).read_bytes()).digest() == digest:
            return candidate, True
        candidate = f"{stem} ({i}){ext}"
        i += 1
    return candidate, False


def claim_file(folder: Path, stem: str, counter: int, ext: str) -> tuple[str, int]:
    """The first `<stem>_<counter>_.<ext>` from `counter` on that no file has yet, created
    empty for the caller alone, and its counter. ComfyUI saves one prompt at a time, so the
    counter `save_path` read is free; the simulator's parallel mode saves several at once
    (each prompt standing for a ComfyUI of its own), and two prompts that read the same counter
    would otherwise write one file, the second truncating it while the first's is served."""
    while True:
        file = f"{stem}_{counter:05}_.{ext}"
        try:
            os.close(os.open(folder / file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            counter += 1
            continue
        return file, counter
