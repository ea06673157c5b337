"""Building a `JobRequest` from files on disk, checked before anything is sent."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from starter.errors import InputFileError, InvalidOverride
from workflows.contracts import InlineInput, InputRef, JobRequest, S3Input, UrlInput
from workflows.errors import GraphFormatError

S3_URI = re.compile(r"^s3://[^/]+/.+")


def load_graph(path: str | Path) -> dict[str, Any]:
    """Read an API-format graph file (a path as `str` or `Path`)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise InputFileError(f"graph file not found: {path}") from exc
    except IsADirectoryError:
        raise InputFileError(f"{path} is a directory: give the graph's JSON file") from None
    except UnicodeDecodeError:
        raise InputFileError(
            f"{path} is not a text file (an image?): give the graph's API-format JSON file "
            "(ComfyUI: Workflow > Export (API))"
        ) from None
    except OSError as exc:
        raise InputFileError(f"graph file {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise InputFileError(f"{path} is not JSON: {exc}") from exc
    except RecursionError:
        raise InputFileError(f"{path}: its JSON is nested too deeply to be a graph") from None
    if not isinstance(raw, dict):
        raise GraphFormatError(f"{path}: a graph is a JSON object of nodes")
    return raw


def parse_input_option(option: str) -> tuple[str, str]:
    name, sep, source = option.partition("=")
    if not sep or not name or not source:
        raise InputFileError(
            f"--input {option!r}: use NAME=PATH, NAME=s3://BUCKET/KEY or NAME=https://URL, "
            "e.g. --input face.png=./face.png"
        )
    return name, source


def input_ref(name: str, source: str) -> InputRef:
    """An `s3://` or `https://` source travels as a reference (the worker reads it); a path is
    read inline, and `JobClient.start` stages a file over `MAX_INLINE_INPUT_BYTES` to S3
    (`starter.staging`)."""
    if source.startswith("s3://"):
        if not S3_URI.match(source):
            raise InputFileError(f"input {name!r}: {source!r} is not s3://BUCKET/KEY")
        return S3Input(uri=source)
    if source.startswith("https://"):
        return UrlInput(url=source)  # fetched by the worker, public addresses only
    if source.startswith("http://"):
        raise InputFileError(f"input {name!r}: URL inputs must be https, not {source!r}")
    return inline_input(name, Path(source))


def inline_input(name: str, path: Path) -> InlineInput:
    """The file's bytes, whatever their size: one too large for a request is staged to S3 when
    the request is started (`starter.staging`), or refused there without S3 access."""
    if not path.is_file():
        raise InputFileError(f"input {name!r}: file not found: {path}")
    return InlineInput(filename=path.name, data_b64=base64.b64encode(path.read_bytes()).decode())


def request_from_files(
    graph_path: str | Path,
    *,
    inputs: list[str] | None = None,
    segments_path: str | Path | None = None,
    pool: str | None = None,
    **fields: Any,
) -> JobRequest:
    """The request the CLI sends; raises before any job exists when something is wrong."""
    graph = load_graph(graph_path)
    bound = dict(parse_input_option(option) for option in inputs or [])
    segments: list[Any] = []
    if segments_path is not None:
        try:
            segments = json.loads(Path(segments_path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputFileError(f"segments file {segments_path}: {exc}") from exc
    request = JobRequest.model_validate(
        {
            "graph": graph,
            "inputs": {name: input_ref(name, source) for name, source in bound.items()},
            "segments": segments,
            "pool": pool,
            **fields,
        }
    )
    check_segment_overrides(request.graph, request.segments)
    return request


def check_segment_overrides(
    graph: Mapping[str, Any], segments: Sequence[Mapping[str, Any]], what: str = "segment"
) -> None:
    """Every override must name a node of the graph and an input that node has.

    The graph is in API format, where a node lists all its inputs (widget values and links), so
    an input it does not list is a typo or belongs to another node.
    """
    problems: list[str] = []
    for index, overrides in enumerate(segments):
        for node_id, values in overrides.items():
            node = graph.get(str(node_id))
            if not isinstance(node, dict):
                problems.append(f"{what} {index}: node {node_id!r} is not in the graph")
                continue
            if not isinstance(values, Mapping):
                problems.append(f"{what} {index}: node {node_id!r} needs an object of inputs")
                continue
            known = node.get("inputs") or {}
            for input_name in values:
                if input_name not in known:
                    problems.append(
                        f"{what} {index}: node {node_id!r} ({node.get('class_type')}) has no "
                        f"input {input_name!r} (its inputs: {', '.join(sorted(known)) or 'none'})"
                    )
    if problems:
        raise InvalidOverride("; ".join(problems))


def request_sha256(request: JobRequest) -> str:
    """A fingerprint of the request that ignores key order (graphs come from hand-edited JSON)."""
    canonical = json.dumps(request.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
