"""The files one run leaves in the worker's ComfyUI folders, and their removal.

A warm worker serves job after job, maybe of different tenants, and ComfyUI's folders outlive
each job: any later graph could load an earlier job's input or output by name (`LoadImage`
reads `name [output]` too). So the handler removes what each run put there, from the filesystem
(ComfyUI has no route to delete a file, and the handler runs in its container):

- the input files it uploaded (`images`, staged `durable_comfy.inputs`), under the name each
  was sent as and the one ComfyUI answered;
- every file the prompt's events and history list in the `temp` folder (previews);
- every file they list in the `output` folder that the run stored (in S3, or read into a
  base64 answer). An output that could not be stored stays: a later delivery of the same
  submission re-attaches to the prompt and stores it from there (endpoint/README.md,
  "Storage outages"); and while the run's outcome is not recorded in its claim, so that such a
  delivery may still come, the stored ones stay too, since it stores every output again;
- the folders (the run's own `dc_...` folder) those removals leave empty.

`JobFiles.clear` is called by endpoint/job.py once the prompt has ended (or was stopped) and
the run's outcome is settled. Every name is untrusted (a job's input names, ComfyUI's history,
which custom nodes write): a path is removed only when it resolves inside its folder. A failure
to remove is logged, never raised: the job's result stands.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import structlog

from endpoint.errors import UnsafePath
from endpoint.settings import ComfyFolders
from protocol.comfyui.events import output_files
from protocol.keys import shown

log = structlog.get_logger(__name__)

FolderKind = Literal["input", "output", "temp"]
_SEPARATORS = re.compile(r"[\\/]")
_DRIVE = re.compile(r"^[A-Za-z]:")
# The output types whose files the handler removes (`input` ones are never a run's output).
_REMOVED_TYPES: dict[str, FolderKind] = {"output": "output", "temp": "temp"}
# The variable that names each folder, for the warning when one is missing.
_VARIABLES: dict[FolderKind, str] = {
    "input": "COMFY_INPUT_DIR",
    "output": "COMFY_OUTPUT_DIR",
    "temp": "COMFY_TEMP_DIR",
}


# The input the handler gives each output node of a graph it submits: unknown to the node, so
# ComfyUI passes it to nothing, but part of the node's cache signature (every input is), so an
# output node never answers from ComfyUI's cache with an earlier run's file, which is removed.
RUN_MARKER_INPUT = "durable_comfy_run"


def with_fresh_outputs(graph: Mapping[str, Any], prompt_id: str) -> dict[str, Any]:
    """A copy of `graph` in which every node that may write a file runs again rather than
    answer from the cache: each node with a `filename_prefix` (literal or linked) and each node
    nothing links from (where output nodes are; a sink that is no output node never runs).
    Their ancestors still come from the cache: a repeated graph repeats only its saves. The
    marker is the prompt's ID: a re-delivery that re-attaches submits the same graph."""
    linked = {
        str(value[0])
        for node in graph.values()
        for value in node.get("inputs", {}).values()
        if isinstance(value, list) and len(value) == 2 and isinstance(value[1], int)
    }
    fresh: dict[str, Any] = {}
    for node_id, node in graph.items():
        inputs = node.get("inputs", {})
        if "filename_prefix" in inputs or str(node_id) not in linked:
            node = {**node, "inputs": {**inputs, RUN_MARKER_INPUT: prompt_id}}
        fresh[node_id] = node
    return fresh


def inside(folder: Path, relative: str) -> Path:
    """`folder/relative` as a path to remove, provided it stays inside `folder`.

    Refused (`UnsafePath`): an empty name, NUL, an absolute name (`/x`, `\\x`, `C:x`), a `..`
    level, and anything that resolves (through symlinks, the folder's own included) outside
    the resolved folder or onto it. The last level is not followed: a symlink inside the folder
    is removed itself, never its target."""
    if not relative or "\x00" in relative:
        raise UnsafePath("empty, or a NUL in the name")
    if relative[:1] in ("/", "\\") or _DRIVE.match(relative):
        raise UnsafePath("an absolute name")
    levels = [level for level in _SEPARATORS.split(relative) if level not in ("", ".")]
    if not levels or ".." in levels:
        raise UnsafePath("a `..` level, or no name at all")
    root = folder.resolve()
    candidate = folder.joinpath(*levels)
    parent = candidate.parent.resolve()
    if parent != root and not parent.is_relative_to(root):
        raise UnsafePath(f"its folder resolves outside {root}")
    target = parent / candidate.name
    resolved = target.resolve()
    if resolved == root or not resolved.is_relative_to(root):
        raise UnsafePath(f"it resolves outside {root}")
    return target


@functools.cache
def located(folders: ComfyFolders) -> dict[FolderKind, Path]:
    """The folders that exist, resolved; one warning per process for those that do not (their
    files then stay). Cached: asked again, the answer is the same."""
    found: dict[FolderKind, Path] = {}
    missing: dict[FolderKind, Path] = {}
    named: list[tuple[FolderKind, Path]] = [
        ("input", folders.input),
        ("output", folders.output),
        ("temp", folders.temp),
    ]
    for kind, path in named:
        if path.is_dir():
            found[kind] = path.resolve()
        else:
            missing[kind] = path
    if missing:
        log.warning(
            "comfy_folders_unknown",
            missing={kind: str(path) for kind, path in missing.items()},
            effect="finished jobs' files stay in these ComfyUI folders, readable by later jobs",
            fix=(
                "set COMFY_DIR to ComfyUI's root, or "
                + ", ".join(_VARIABLES[kind] for kind in missing)
                + " to the folders ComfyUI uses (COMFY_TEMP_DIR as given to --temp-directory)"
            ),
        )
    return found


@dataclass
class _Outcome:
    removed: int = 0
    refused: int = 0
    failed: int = 0
    folders: int = 0


@dataclass
class JobFiles:
    """What one run put in ComfyUI's folders, as it happens; `clear` removes it."""

    folders: ComfyFolders
    # Relative to the input folder: the names sent, and those ComfyUI stored them as.
    inputs: set[str] = field(default_factory=set)
    # (type, subfolder, filename) of every output and preview listed, and those stored.
    listed: set[tuple[FolderKind, str, str]] = field(default_factory=set)
    stored: set[tuple[FolderKind, str, str]] = field(default_factory=set)

    async def locate(self) -> None:
        """Find the folders now (once per process): ComfyUI creates them as it starts, so ask
        once it answers."""
        await asyncio.to_thread(located, self.folders)

    def uploading(self, name: str) -> None:
        """An input is about to be uploaded as `name`: an upload whose answer is lost may
        still have written it."""
        self.inputs.add(name)

    def uploaded(self, stored_as: str) -> None:
        self.inputs.add(stored_as)

    def list_outputs(self, outputs: Mapping[str, Any]) -> None:
        """An event or the history names files (`{node_id: node output}`)."""
        for _node, item in output_files(dict(outputs)):
            kind = _REMOVED_TYPES.get(item.get("type", "output"))
            if kind is not None:
                self.listed.add((kind, item.get("subfolder", ""), item["filename"]))

    def mark_stored(self, subfolder: str, filename: str) -> None:
        """An output is stored (verified in S3, or read into the answer)."""
        self.stored.add(("output", subfolder, filename))

    async def clear(self, *, stored_outputs: bool) -> None:
        """Remove the run's inputs and previews, and with `stored_outputs` every output it
        stored; an output not stored stays. What was removed is forgotten, so a second call
        removes only what came since."""
        inputs, self.inputs = self.inputs, set()
        previews = {entry for entry in self.listed if entry[0] == "temp"}
        outputs = set(self.stored) if stored_outputs else set()
        self.listed -= previews | outputs
        self.stored -= outputs
        if inputs or previews or outputs:
            try:
                outcome = await asyncio.to_thread(self._remove, inputs, previews | outputs)
            except Exception as exc:  # never the job's failure
                log.warning("comfy_files_not_removed", error=f"{type(exc).__name__}: {exc}")
            else:
                log.info(
                    "comfy_files_removed",
                    inputs=len(inputs),
                    outputs=len(outputs),
                    previews=len(previews),
                    removed=outcome.removed,
                    folders=outcome.folders,
                    refused=outcome.refused,
                    failed=outcome.failed,
                )
        if self.listed:
            log.info(
                "comfy_outputs_kept",
                outputs=len(self.listed),
                stored=len(self.stored),
                reason=(
                    "not stored: a finished output stays in ComfyUI's folder until it is"
                    if stored_outputs
                    else "the run's outcome is not recorded in its claim: a later delivery may "
                    "re-attach to the prompt and store them again from here"
                ),
            )

    def _remove(
        self, inputs: Iterable[str], entries: Iterable[tuple[FolderKind, str, str]]
    ) -> _Outcome:
        folders = located(self.folders)
        outcome = _Outcome()
        emptied: set[tuple[Path, Path]] = set()
        for name in sorted(inputs):
            self._remove_one(folders, "input", name, outcome, emptied)
        for kind, subfolder, filename in sorted(entries):
            relative = f"{subfolder}/{filename}" if subfolder else filename
            self._remove_one(folders, kind, relative, outcome, emptied)
        for root, folder in sorted(emptied, key=lambda pair: -len(pair[1].parts)):
            outcome.folders += _prune(root, folder)
        return outcome

    @staticmethod
    def _remove_one(
        folders: Mapping[FolderKind, Path],
        kind: FolderKind,
        relative: str,
        outcome: _Outcome,
        emptied: set[tuple[Path, Path]],
    ) -> None:
        root = folders.get(kind)
        if root is None:
            return  # unknown folder: warned about once, at start
        try:
            path = inside(root, relative)
        except UnsafePath as exc:
            outcome.refused += 1
            log.warning("comfy_file_refused", folder=kind, name=shown(relative), reason=str(exc))
            return
        try:
            path.unlink()
        except FileNotFoundError:
            return  # never written, or already gone: nothing of the run is left there
        except OSError as exc:
            outcome.failed += 1
            log.warning(
                "comfy_file_not_removed",
                folder=kind,
                name=shown(relative),
                error=f"{type(exc).__name__}: {exc.strerror or exc}",
            )
            return
        outcome.removed += 1
        if path.parent != root:
            emptied.add((root, path.parent))


def _prune(root: Path, folder: Path) -> int:
    """Remove `folder` and its parents up to (not including) `root` while they are empty."""
    removed = 0
    while folder != root and folder.is_relative_to(root):
        try:
            folder.rmdir()
        except FileNotFoundError:
            pass  # a deeper pass removed it already
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                log.warning(
                    "comfy_folder_not_removed",
                    name=shown(str(folder.relative_to(root))),
                    error=f"{type(exc).__name__}: {exc.strerror or exc}",
                )
            return removed
        else:
            removed += 1
        folder = folder.parent
    return removed
