"""Building a `JobRequest` from files on disk, checked before anything is sent."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from starter.errors import InputFileError
from workflows.contracts import MAX_INLINE_INPUT_BYTES, InlineInput, JobRequest
from workflows.graph import GraphFormatError


def load_graph(path: Path) -> dict[str, Any]:
    """Read an API-format graph; a `/prompt` body's `prompt` is taken as the graph."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise InputFileError(f"graph file not found: {path}") from exc
    except json.JSONDecodeError as exc:
        raise InputFileError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise GraphFormatError(f"{path}: a graph is a JSON object of nodes")
    return raw


def parse_input_option(option: str) -> tuple[str, Path]:
    name, sep, path = option.partition("=")
    if not sep or not name or not path:
        raise InputFileError(f"--input {option!r}: use NAME=PATH, e.g. --input face.png=./face.png")
    return name, Path(path)


def inline_input(name: str, path: Path) -> InlineInput:
    if not path.is_file():
        raise InputFileError(f"input {name!r}: file not found: {path}")
    size = path.stat().st_size
    if size > MAX_INLINE_INPUT_BYTES:
        raise InputFileError(
            f"input {name!r}: {path} is {size} bytes; inline inputs are limited to "
            f"{MAX_INLINE_INPUT_BYTES} bytes (upload it to S3 and pass an s3:// reference)"
        )
    return InlineInput(filename=path.name, data_b64=base64.b64encode(path.read_bytes()).decode())


def request_from_files(
    graph_path: Path,
    *,
    inputs: list[str] | None = None,
    segments_path: Path | None = None,
    pool: str | None = None,
    **fields: Any,
) -> JobRequest:
    """The request the CLI sends; raises before any job exists when something is wrong."""
    graph = load_graph(graph_path)
    bound = dict(parse_input_option(option) for option in inputs or [])
    segments: list[Any] = []
    if segments_path is not None:
        try:
            segments = json.loads(segments_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InputFileError(f"segments file {segments_path}: {exc}") from exc
    return JobRequest.model_validate(
        {
            "graph": graph,
            "inputs": {name: inline_input(name, path) for name, path in bound.items()},
            "segments": segments,
            "pool": pool,
            **fields,
        }
    )
