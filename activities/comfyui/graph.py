"""Checking a graph against the backend's node registry (`GET /object_info`) before any prompt.

Every problem is found and reported at once, in words that say which node and what to change,
so a bad graph costs no GPU time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workflows.graph import is_link, iter_nodes


def registry_problems(graph: Mapping[str, Any], object_info: Mapping[str, Any]) -> list[str]:
    problems: list[str] = []
    for node_id, class_type, inputs in iter_nodes(graph):
        spec = object_info.get(class_type)
        if spec is None:
            problems.append(
                f"node {node_id}: class {class_type!r} is not installed on this backend "
                "(a custom node missing, or a typo)"
            )
            continue
        required = spec.get("input", {}).get("required", {}) or {}
        for name in required:
            if name not in inputs:
                problems.append(f"node {node_id} ({class_type}): required input {name!r} missing")
        for name, value in inputs.items():
            if not is_link(value):
                continue
            source_id = str(value[0])
            source = graph.get(source_id)
            source_spec = object_info.get(source.get("class_type", "")) if source else None
            if source_spec is not None and value[1] >= len(source_spec.get("output", [])):
                problems.append(
                    f"node {node_id} ({class_type}): input {name!r} uses output {value[1]} of "
                    f"node {source_id}, which has only {len(source_spec.get('output', []))}"
                )
    if not problems and not output_nodes(graph, object_info):
        problems.append(
            "the graph has no output node: add one (SaveImage, PreviewImage, SaveAnimatedWEBP, ...)"
        )
    return problems


def output_nodes(graph: Mapping[str, Any], object_info: Mapping[str, Any]) -> list[str]:
    return [
        node_id
        for node_id, class_type, _inputs in iter_nodes(graph)
        if object_info.get(class_type, {}).get("output_node")
    ]


def available_input_files(object_info: Mapping[str, Any], class_type: str, name: str) -> set[str]:
    """Files the backend already has for a load node's input (its choice list)."""
    spec = object_info.get(class_type, {}).get("input", {}).get("required", {}).get(name)
    if isinstance(spec, list) and spec and isinstance(spec[0], list):
        return {str(choice) for choice in spec[0]}
    return set()
