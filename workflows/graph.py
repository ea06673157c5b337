"""Pure functions over ComfyUI API-format graphs: shape checks, bindings, progress units.

No I/O: the workflow, the activities and the clients all use these. Checks that need the
backend's node registry (`/object_info`) live in `activities/comfyui/graph.py`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

# Nodes whose `steps` input drives `progress` events (one per step).
SAMPLER_CLASSES = frozenset({"KSampler", "KSamplerAdvanced", "SamplerCustom"})
# Nodes that read a file from the backend's input directory by name.
LOAD_NODE_INPUTS: Mapping[str, str] = {"LoadImage": "image", "LoadImageMask": "image"}

EDITOR_FORMAT_HINT = (
    "this is the editor (UI) format with 'nodes' and 'links'; export the workflow in API format "
    "instead (ComfyUI menu: Workflow > Export (API), or 'Save (API Format)' with dev mode on)"
)


class GraphFormatError(ValueError):
    """The graph is not a ComfyUI API-format prompt. The message says what to fix."""


def check_api_format(graph: Mapping[str, Any]) -> None:
    """Reject anything that is not `{node_id: {class_type, inputs}}`, saying what to fix."""
    if "nodes" in graph and "links" in graph:
        raise GraphFormatError(EDITOR_FORMAT_HINT)
    if "prompt" in graph and isinstance(graph["prompt"], dict) and len(graph) <= 3:
        raise GraphFormatError(
            "this looks like a /prompt request body; pass only its 'prompt' object as the graph"
        )
    if not graph:
        raise GraphFormatError("the graph is empty: it needs at least one node")
    problems: list[str] = []
    for node_id, node in graph.items():
        if not isinstance(node, dict):
            problems.append(f"node {node_id!r} is not an object")
            continue
        class_type = node.get("class_type")
        if not isinstance(class_type, str) or not class_type:
            problems.append(f"node {node_id!r} has no 'class_type'")
        inputs = node.get("inputs", {})
        if not isinstance(inputs, dict):
            problems.append(f"node {node_id!r}: 'inputs' must be an object")
            continue
        for name, value in inputs.items():
            if is_link(value) and str(value[0]) not in graph:
                problems.append(
                    f"node {node_id!r} input {name!r} links to node {value[0]!r}, "
                    "which is not in the graph"
                )
    if problems:
        raise GraphFormatError("invalid API-format graph: " + "; ".join(problems))


def is_link(value: Any) -> bool:
    """In API format an input is a link when it is `[source_node_id, output_index]`."""
    return (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str | int)
        and isinstance(value[1], int)
        and not isinstance(value[1], bool)
    )


def iter_nodes(graph: Mapping[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for node_id, node in graph.items():
        yield str(node_id), str(node["class_type"]), node.get("inputs", {})


def sampler_steps(graph: Mapping[str, Any]) -> dict[str, int]:
    """Steps each sampler will report; empty when the graph has none (progress by nodes)."""
    found: dict[str, int] = {}
    for node_id, class_type, inputs in iter_nodes(graph):
        steps = inputs.get("steps")
        if class_type in SAMPLER_CLASSES and isinstance(steps, int) and steps > 0:
            found[node_id] = steps
    return found


def apply_overrides(
    graph: Mapping[str, Any], overrides: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """A copy of the graph with `{node_id: {input: value}}` overrides (seeds, frames...)."""
    result = copy.deepcopy(dict(graph))
    for node_id, values in overrides.items():
        if node_id not in result:
            raise GraphFormatError(f"segment override names node {node_id!r}, not in the graph")
        result[node_id].setdefault("inputs", {}).update(copy.deepcopy(dict(values)))
    return result


def run_tag(job_id: str, segment: int, prompt_id: str) -> str:
    """The folder one submission saves into: `dc_<job>_<segment>_<prompt id's first 8>`.

    The only place this format is written: the offload after a stop finds the finished outputs
    by it, so a second copy that drifted would silently keep nothing.
    """
    return f"dc_{safe_tag(job_id)}_{segment}_{prompt_id[:8]}"


def safe_tag(job_id: str) -> str:
    """The job ID as a file-name component on the backend (no ':' on every filesystem)."""
    cleaned = "".join(c if c.isalnum() or c in "-_" else "_" for c in job_id)
    return cleaned[:48]


def with_unique_save_prefixes(graph: Mapping[str, Any], run_tag: str) -> dict[str, Any]:
    """Prefix every `filename_prefix` with a per-run folder.

    ComfyUI serves an identical re-submitted graph from its cache, and its history then points at
    the earlier run's files; a prefix unique to this run makes every run's outputs its own and
    lets us tell them apart.
    """
    result = copy.deepcopy(dict(graph))
    for node in result.values():
        inputs = node.get("inputs", {})
        prefix = inputs.get("filename_prefix")
        if isinstance(prefix, str):
            inputs["filename_prefix"] = f"{run_tag}/{prefix.lstrip('/') or 'output'}"
    return result


def load_node_files(graph: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(node_id, input_name, file_name) for every node that loads an input file by name."""
    found: list[tuple[str, str, str]] = []
    for node_id, class_type, inputs in iter_nodes(graph):
        input_name = LOAD_NODE_INPUTS.get(class_type)
        if input_name and isinstance(inputs.get(input_name), str):
            found.append((node_id, input_name, inputs[input_name]))
    return found


def bind_files(graph: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """Replace file names in load nodes by the names the backend stored them under."""
    result = copy.deepcopy(dict(graph))
    for node_id, input_name, file_name in load_node_files(graph):
        if file_name in names:
            result[node_id]["inputs"][input_name] = names[file_name]
    return result
