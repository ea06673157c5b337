"""Checking a graph before any prompt: the checks every prepare activity runs again
(`refuse_hostile_graph`, both kinds of pool), and the check against a ComfyUI backend's node
registry (`GET /object_info`).

Every problem is found and reported at once, in words that say which node and what to change,
so a bad graph costs no GPU time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from temporalio.exceptions import ApplicationError

from activities.errors import fatal
from configuration.pools import PoolConfig
from workflows.activity_io import PrepareInput
from workflows.errors import GraphFormatError, GraphRefused, UndeclaredInputFile, safe_text
from workflows.graph import (
    CORE_FILE_INPUTS,
    FileInputs,
    check_classified,
    check_graph,
    check_input_files,
    check_node_classes,
    check_segment_files,
    is_link,
    iter_nodes,
    merged_file_inputs,
    registry_file_inputs,
)
from workflows.shared import ErrorType


def refuse_hostile_graph(req: PrepareInput, pool: str, config: PoolConfig) -> None:
    """The client's and the workflow's graph checks once more, where the pool is known: the
    pool's allow-list of node classes, and its files rule with the pool's own `loader_inputs`
    (its registry's markers come with `refuse_foreign_files`, once it is read). An
    `ApplicationError` (non-retryable) before the backend is asked anything. A job started by a
    client that skipped the checks, or by an older worker's workflow, is refused here all the
    same."""
    try:
        check_graph(req.graph)
        file_inputs = merged_file_inputs(CORE_FILE_INPUTS, config.loader_inputs or {})
        check_input_files(req.graph, req.inputs, file_inputs)
        check_segment_files(req.graph, req.segments, req.inputs, file_inputs)
        if config.allowed_node_classes is not None:
            check_node_classes(req.graph, frozenset(config.allowed_node_classes), pool)
    except GraphFormatError as exc:
        raise graph_refusal(exc) from exc


def refuse_foreign_files(
    req: PrepareInput, pool: str, config: PoolConfig, object_info: Mapping[str, Any] | None
) -> FileInputs:
    """The files rule with everything known of the pool's nodes: the core loaders, its
    `loader_inputs`, and the inputs its node registry marks (None: no registry known). With
    `unclassified_inputs: refuse`, a node none of them describes is refused too. Returns the
    file inputs, which the prepare binds and stages."""
    file_inputs = merged_file_inputs(
        CORE_FILE_INPUTS, config.loader_inputs or {}, registry_file_inputs(object_info or {})
    )
    try:
        check_input_files(req.graph, req.inputs, file_inputs)
        check_segment_files(req.graph, req.segments, req.inputs, file_inputs)
        if config.unclassified_inputs == "refuse":
            known = {*CORE_FILE_INPUTS, *(config.loader_inputs or {})}
            check_classified(req.graph, object_info, known, pool)
    except GraphFormatError as exc:
        raise graph_refusal(exc) from exc
    return file_inputs


def graph_refusal(exc: GraphFormatError) -> ApplicationError:
    """A refused graph as the activity failure: `MissingInput` for an undeclared file,
    `InvalidGraph` otherwise; details name each problem's node and field."""
    error_type = (
        ErrorType.MISSING_INPUT if isinstance(exc, UndeclaredInputFile) else ErrorType.INVALID_GRAPH
    )
    message = safe_text(str(exc))
    if not isinstance(exc, GraphRefused):
        return fatal(error_type, message)
    problems = [problem.as_dict() for problem in exc.problems]
    return fatal(error_type, message, kind=type(exc).__name__, problems=problems)


def lacks_a_class(graph: Mapping[str, Any], object_info: Mapping[str, Any]) -> bool:
    """Whether `graph` names a class the registry has not got (one installed since it was read,
    perhaps)."""
    return any(cls not in object_info for _id, cls, _inputs in iter_nodes(graph))


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
            if value[1] < 0:
                problems.append(
                    f"node {node_id} ({class_type}): input {name!r} uses output {value[1]} of "
                    f"node {source_id}; an output index is 0 or more"
                )
            elif source_spec is not None and value[1] >= len(source_spec.get("output", [])):
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


def warm_key(graph: Mapping[str, Any]) -> str:
    """What a server keeps loaded after running `graph`: its node classes and the files its
    loaders name (every string input of a node whose class names a loader: checkpoints, LoRAs,
    VAEs, CLIPs), hashed. Two jobs of one graph with other prompts or seeds share the key, so
    the queue sends the second where the first left its models warm."""
    loaded: set[str] = set()
    for _node_id, class_type, inputs in iter_nodes(graph):
        loaded.add(class_type)
        if "loader" not in class_type.lower():
            continue
        for name, value in sorted(inputs.items()):
            if isinstance(value, str):
                loaded.add(f"{class_type}.{name}={value}")
    digest = hashlib.sha256("\n".join(sorted(loaded)).encode()).hexdigest()
    return digest[:16]
