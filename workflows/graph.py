"""Pure functions over ComfyUI API-format graphs: shape checks, bindings, progress units.

No I/O: the workflow, the activities and the clients all use these. Checks that need the
backend's node registry (`/object_info`) live in `activities/comfyui/graph.py`.
"""

from __future__ import annotations

import copy
import json
import re
import unicodedata
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

from workflows.errors import (
    ForeignFileReference,
    GraphCycleError,
    GraphFormatError,
    GraphLinkError,
    GraphNameError,
    GraphProblem,
    GraphShapeError,
    GraphTooLarge,
    NodeClassNotAllowed,
    UnclassifiedNode,
    UndeclaredInputFile,
)

# Nodes whose `steps` input drives `progress` events (one per step).
SAMPLER_CLASSES = frozenset({"KSampler", "KSamplerAdvanced", "SamplerCustom"})

# Which node inputs name a file: class -> its inputs that do.
FileInputs = Mapping[str, Collection[str]]
# ComfyUI's core nodes (0.8) that read a file, or a folder of files, from its input, output or
# temp folder by name. A job may name only its own input files there (`check_input_files`):
# on a shared server, or a warm RunPod worker, those folders hold other jobs' files.
CORE_FILE_INPUTS: FileInputs = {
    "LoadImage": ("image",),
    "LoadImageMask": ("image",),
    "LoadImageOutput": ("image",),  # its own folder is the output folder
    "LoadLatent": ("latent",),
    "LoadAudio": ("audio",),
    "LoadVideo": ("file",),
    "Load3D": ("model_file", "image"),
    "WebcamCapture": ("image",),
    "LoadImageDataSetFromFolder": ("folder",),
    "LoadImageTextDataSetFromFolder": ("folder",),
    "LoadTrainingDataset": ("folder_name",),  # a folder of the output folder
    "GeminiInputFiles": ("file",),
    "OpenAIInputFiles": ("file",),
}
# An input whose options in a node registry (`/object_info`) carry one of these names a file
# of those folders: an upload widget, the folder it previews from, a list read from the server.
FILE_INPUT_MARKERS = (
    "image_upload",
    "video_upload",
    "audio_upload",
    "file_upload",
    "image_folder",
    "remote",
)
# ComfyUI reads `name [output]` from its output folder and `name [temp]` from its temp folder,
# whatever node reads it (folder_paths.annotated_filepath): refused on every node's every value.
FOREIGN_FOLDER_ANNOTATIONS = ("[output]", "[temp]")
_ANNOTATIONS = (*FOREIGN_FOLDER_ANNOTATIONS, "[input]")
# The first level of every file durable-comfy puts on a backend: inputs are uploaded as
# `dc_<job>_<name>`, outputs saved under `dc_<job>_<segment>_<prompt>/` (`run_tag`). A value
# naming one is another job's file, whatever node reads it. (Save prefixes are ours to rewrite.)
_OWN_FILE_LEVEL = re.compile(
    r"(?:^|[\\/])dc_[A-Za-z0-9.-]+_[A-Za-z0-9_.-]*(?:$|[\\/]|\s*\[)", re.IGNORECASE
)
_SAVE_PREFIX_INPUT = "filename_prefix"

EDITOR_FORMAT_HINT = (
    "this is the editor (UI) format with 'nodes' and 'links'; export the workflow in API format "
    "instead (ComfyUI menu: Workflow > Export (API), or 'Save (API Format)' with dev mode on)"
)


# -- bounds ----------------------------------------------------------------------------------
# Generous for real graphs (examples/, exported SDXL/video workflows run to ~300 nodes and tens
# of kB), tight enough that a hostile graph cannot make the client, the workflow or ComfyUI
# spend long on it. A job's whole request is one history payload (2 MiB by default), so the
# graph gets half of it and inline inputs and the rest the other half.
MAX_GRAPH_BYTES = 1024 * 1024
MAX_NODES = 2000
MAX_INPUTS_PER_NODE = 256
MAX_STRING_CHARS = 100_000  # a prompt text; one string, after JSON decoding
MAX_NODE_ID_CHARS = 64
MAX_CLASS_TYPE_CHARS = 200
MAX_INPUT_NAME_CHARS = 200
MAX_OUTPUT_INDEX = 255  # without the registry; with it, the class's real outputs
MAX_VALUE_DEPTH = 32  # lists and objects inside one input value


def check_api_format(graph: Mapping[str, Any]) -> None:
    """Reject anything that is not `{node_id: {class_type, inputs}}`, saying what to fix."""
    if "nodes" in graph and "links" in graph:
        raise GraphShapeError([GraphProblem(None, "graph", EDITOR_FORMAT_HINT)], summary="")
    if "prompt" in graph and isinstance(graph["prompt"], dict) and len(graph) <= 3:
        raise GraphShapeError(
            [
                GraphProblem(
                    None,
                    "graph",
                    "this looks like a /prompt request body; pass only its 'prompt' object as "
                    "the graph",
                )
            ],
            summary="",
        )
    if not graph:
        raise GraphShapeError(
            [GraphProblem(None, "graph", "the graph is empty: it needs at least one node")],
            summary="",
        )
    problems: list[GraphProblem] = []
    for node_id, node in graph.items():
        if not isinstance(node, dict):
            problems.append(
                GraphProblem(str(node_id), "graph", f"node {node_id!r} is not an object")
            )
            continue
        class_type = node.get("class_type")
        if not isinstance(class_type, str) or not class_type:
            problems.append(
                GraphProblem(str(node_id), "class_type", f"node {node_id!r} has no 'class_type'")
            )
        inputs = node.get("inputs", {})
        if not isinstance(inputs, dict):
            problems.append(
                GraphProblem(
                    str(node_id), "inputs", f"node {node_id!r}: 'inputs' must be an object"
                )
            )
            continue
        for name, value in inputs.items():
            if is_link(value) and str(value[0]) not in graph:
                problems.append(
                    GraphProblem(
                        str(node_id),
                        f"inputs.{name}",
                        f"node {node_id!r} input {name!r} links to node {value[0]!r}, "
                        "which is not in the graph",
                    )
                )
    if problems:
        raise GraphShapeError(problems)


def check_graph(graph: Mapping[str, Any]) -> None:
    """Everything that can be checked without the backend, cheapest first; raises the first
    kind of `GraphRefused` found, with all its problems.

    Size (bytes, nodes, inputs, strings, nesting), then the API format and dangling links,
    then ids and class names, links' output indexes, and cycles. Runs in the client (through
    `JobRequest` validation), in the workflow (which validates its input again) and in the
    prepare activity, so a client that skips it is refused all the same.
    """
    _check_size(graph)
    check_api_format(graph)
    _check_names(graph)
    _check_link_indexes(graph)
    check_acyclic(graph)


def _check_size(graph: Mapping[str, Any]) -> None:
    if len(graph) > MAX_NODES:
        raise GraphTooLarge(
            [GraphProblem(None, "graph", f"{len(graph):,} nodes; at most {MAX_NODES:,}")]
        )
    problems: list[GraphProblem] = []
    for node_id, node in graph.items():
        inputs = node.get("inputs") if isinstance(node, dict) else None
        if not isinstance(inputs, dict):
            continue
        if len(inputs) > MAX_INPUTS_PER_NODE:
            problems.append(
                GraphProblem(
                    str(node_id),
                    "inputs",
                    f"node {_shown(node_id)} has {len(inputs):,} inputs; at most "
                    f"{MAX_INPUTS_PER_NODE}",
                )
            )
            continue
        for name, value in inputs.items():
            problem = value_problem(value)
            if problem is not None:
                problems.append(
                    GraphProblem(
                        str(node_id),
                        f"inputs.{_clip(name)}",
                        f"node {_shown(node_id)} input {_shown(name)}: {problem}",
                    )
                )
    if problems:
        raise GraphTooLarge(problems)
    # Only now is json.dumps safe: nesting is bounded and every value is JSON.
    text = json.dumps(graph, separators=(",", ":"), ensure_ascii=False)
    size = len(text.encode("utf-8", "surrogatepass"))  # (node ids are checked after this)
    if size > MAX_GRAPH_BYTES:
        raise GraphTooLarge(
            [
                GraphProblem(
                    None,
                    "graph",
                    f"{size:,} bytes of JSON; at most {MAX_GRAPH_BYTES:,} (a job's request is "
                    "one Temporal history payload)",
                )
            ]
        )


def value_problem(value: Any) -> str | None:
    """Why an input value cannot travel (too deep, too long a string, not JSON); None if it can.

    Iterative, so a hostile nesting cannot exhaust the stack.
    """
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if depth > MAX_VALUE_DEPTH:
            return f"nested more than {MAX_VALUE_DEPTH} levels deep"
        if isinstance(item, str):
            if len(item) > MAX_STRING_CHARS:
                return f"a string of {len(item):,} characters; at most {MAX_STRING_CHARS:,}"
            if not is_unicode(item):
                return "a string with a lone surrogate (not Unicode text)"
        elif isinstance(item, list | tuple):
            pending.extend((child, depth + 1) for child in item)
        elif isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    return f"an object key {_shown(key)} that is not a string"
                if len(key) > MAX_STRING_CHARS or not is_unicode(key):
                    return f"an object key {_shown(key)} that is too long or not Unicode text"
                pending.append((child, depth + 1))
        elif isinstance(item, float):
            if item != item or item in (float("inf"), float("-inf")):
                return f"{item} is not a JSON number"
        elif item is not None and not isinstance(item, bool | int):
            return f"a {type(item).__name__}, which is not JSON"
    return None


def is_unicode(text: str) -> bool:
    """False for a string with a lone surrogate (JSON's `"\\ud800"` decodes to one): it has no
    UTF-8 form, so it cannot be sent on to Temporal or ComfyUI."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_names(graph: Mapping[str, Any]) -> None:
    problems: list[GraphProblem] = []
    for node_id, node in graph.items():
        shown = _shown(node_id)
        if not isinstance(node_id, str | int) or isinstance(node_id, bool):
            problems.append(GraphProblem(_clip(node_id), "graph", f"node id {shown} is no string"))
            continue
        problem = name_problem(str(node_id), MAX_NODE_ID_CHARS)
        if problem:
            problems.append(GraphProblem(_clip(node_id), "graph", f"node id {shown}: {problem}"))
        problem = name_problem(node["class_type"], MAX_CLASS_TYPE_CHARS)
        if problem:
            problems.append(
                GraphProblem(_clip(node_id), "class_type", f"node {shown} class_type: {problem}")
            )
        for name in node.get("inputs", {}):
            problem = name_problem(name, MAX_INPUT_NAME_CHARS)
            if problem:
                problems.append(
                    GraphProblem(
                        _clip(node_id),
                        "inputs",
                        f"node {shown} input name {_shown(name)}: {problem}",
                    )
                )
    if problems:
        raise GraphNameError(problems)


def name_problem(name: Any, limit: int) -> str | None:
    """Why a node id, class or input name cannot be used (empty, long, control characters)."""
    if not isinstance(name, str) or not name:
        return "must be a non-empty string"
    if len(name) > limit:
        return f"{len(name):,} characters; at most {limit}"
    if any(unicodedata.category(c).startswith("C") for c in name):
        return "contains control or unassigned characters"
    return None


def _check_link_indexes(graph: Mapping[str, Any]) -> None:
    problems: list[GraphProblem] = []
    for node_id, _class_type, inputs in iter_nodes(graph):
        for name, value in inputs.items():
            problem = link_index_problem(value)
            if problem:
                problems.append(
                    GraphProblem(
                        node_id,
                        f"inputs.{name}",
                        f"node {node_id!r} input {name!r} links to node {value[0]!r} {problem}",
                    )
                )
    if problems:
        raise GraphLinkError(problems)


def link_index_problem(value: Any) -> str | None:
    """What is wrong with a link's output index, if `value` is (or ComfyUI takes it for) a link.

    ComfyUI takes `[str, float]` for a link too, so a fractional index is refused here rather
    than passed as a widget value that ComfyUI would follow.
    """
    if is_link(value):
        index = value[1]
        if index < 0:
            return f"output {index}: an output index is 0 or more"
        if index > MAX_OUTPUT_INDEX:
            return f"output {index}: at most {MAX_OUTPUT_INDEX}"
        return None
    if (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], float)
    ):
        return f"output {value[1]!r}: an output index is a whole number"
    return None


def check_acyclic(graph: Mapping[str, Any]) -> None:
    """Kahn's algorithm over the links (no recursion: a 2,000-node chain is fine)."""
    nodes = {node_id: inputs for node_id, _class_type, inputs in iter_nodes(graph)}
    waiting_on: dict[str, int] = {}
    feeds: dict[str, list[str]] = {}
    for node_id, inputs in nodes.items():
        sources = {str(v[0]) for v in inputs.values() if is_link(v) and str(v[0]) in nodes}
        waiting_on[node_id] = len(sources)
        for source in sources:
            feeds.setdefault(source, []).append(node_id)
    ready = [node_id for node_id, count in waiting_on.items() if count == 0]
    while ready:
        for target in feeds.get(ready.pop(), []):
            waiting_on[target] -= 1
            if waiting_on[target] == 0:
                ready.append(target)
    # Left over: the nodes in a cycle and those it feeds. Peel off the ones that feed no other
    # left-over node (the same algorithm backwards), so only the cycles are named.
    stuck = {node_id for node_id, count in waiting_on.items() if count > 0}
    feeding = {node_id: {t for t in feeds.get(node_id, []) if t in stuck} for node_id in stuck}
    fed_by: dict[str, set[str]] = {node_id: set() for node_id in stuck}
    for node_id, targets in feeding.items():
        for target in targets:
            fed_by[target].add(node_id)
    leaves = [node_id for node_id, targets in feeding.items() if not targets]
    while leaves:
        leaf = leaves.pop()
        stuck.discard(leaf)
        for source in fed_by[leaf]:
            feeding[source].discard(leaf)
            if not feeding[source]:
                leaves.append(source)
    problems = []
    for node_id in sorted(stuck, key=list(nodes).index):
        name = next(n for n, v in nodes[node_id].items() if is_link(v) and str(v[0]) in stuck)
        problems.append(
            GraphProblem(
                node_id,
                f"inputs.{name}",
                f"node {node_id!r} input {name!r} links to node {nodes[node_id][name][0]!r}, "
                "which depends on it",
            )
        )
    if problems:
        raise GraphCycleError(problems)


def check_input_files(
    graph: Mapping[str, Any], declared: Collection[str], file_inputs: FileInputs = CORE_FILE_INPUTS
) -> None:
    """Every file a node reads from the backend's folders must be one the job sent.

    On every node, a value annotated `[output]` or `[temp]`, or naming one of durable-comfy's
    files on the backend (`dc_...`: another job's upload or output), is refused
    (`ForeignFileReference`). An input of `file_inputs` (the core loaders by default; a worker
    adds its pool's registry markers and `loader_inputs`) must be a plain file name, no path, no
    annotation (`ForeignFileReference` again), and one of the request's `inputs`
    (`UndeclaredInputFile`): a name that is not declared would read whatever the folder holds
    under it, another job's upload or a file left there. Each problem names node, input, file.
    """
    foreign = [*_foreign_values(graph), *_file_input_shapes(graph, file_inputs)]
    if foreign:
        raise ForeignFileReference(foreign)
    listed = ", ".join(_shown(name) for name in sorted(declared)) or "none declared"
    problems = [
        GraphProblem(
            node_id,
            f"inputs.{input_name}",
            f"node {node_id!r} ({class_type}) input {input_name!r} loads {_shown(file_name)}, "
            f"which is not one of the request's inputs ({listed}): pass the file as an input "
            f"of that name (CLI: --input NAME=PATH)",
        )
        for node_id, class_type, input_name, file_name in _named_files(graph, file_inputs)
        if file_name not in declared
    ]
    if problems:
        raise UndeclaredInputFile(problems)


def check_segment_files(
    graph: Mapping[str, Any],
    segments: Sequence[Mapping[str, Mapping[str, Any]]],
    declared: Collection[str],
    file_inputs: FileInputs = CORE_FILE_INPUTS,
) -> None:
    """`check_input_files` on each segment's graph: an override is a value like any other.
    (An override naming a node the graph lacks is refused elsewhere; skipped here.)"""
    for overrides in segments:
        known = {node: values for node, values in overrides.items() if str(node) in graph}
        if known:
            check_input_files(apply_overrides(graph, known), declared, file_inputs)


def file_input_problem(value: str) -> str | None:
    """Why a file input's value is not a plain file name (a declared input's name)."""
    if any(sep in value for sep in "/\\"):
        return "holds a path separator"
    if ".." in value:
        return "holds '..'"
    if value.rstrip().endswith(_ANNOTATIONS):
        return "carries a folder annotation"
    return None


def foreign_value_problem(text: str, *, save_prefix: bool = False) -> str | None:
    """Why a string, on any node, reaches for a file that is not the job's own (None: it
    does not): an `[output]`/`[temp]` annotation, or a level named like durable-comfy's own
    files on the backend (not checked in a save prefix, which the run rewrites into its own
    folder)."""
    if text.rstrip().endswith(FOREIGN_FOLDER_ANNOTATIONS):
        return "reads from ComfyUI's output or temp folder"
    if not save_prefix and _OWN_FILE_LEVEL.search(text):
        return "names a file durable-comfy put on the backend for another job"
    return None


def _foreign_values(graph: Mapping[str, Any]) -> list[GraphProblem]:
    problems = []
    for node_id, class_type, inputs in iter_nodes(graph):
        for name, value in inputs.items():
            for text in _strings(value):
                why = foreign_value_problem(text, save_prefix=name == _SAVE_PREFIX_INPUT)
                if why:
                    problems.append(
                        GraphProblem(
                            node_id,
                            f"inputs.{name}",
                            f"node {node_id!r} ({class_type}) input {name!r} value "
                            f"{_shown(text)} {why}: a job may load only its own input files "
                            "(the request's inputs; a stored result is passed back as an "
                            "s3:// or https input)",
                        )
                    )
                    break
    return problems


def _file_input_shapes(graph: Mapping[str, Any], file_inputs: FileInputs) -> list[GraphProblem]:
    problems = []
    for node_id, class_type, inputs in iter_nodes(graph):
        for name in file_inputs.get(class_type, ()):
            if name not in inputs:
                continue
            value = inputs[name]
            why = (
                file_input_problem(value)
                if isinstance(value, str)
                else "is not a file name (a link or another value cannot be checked)"
            )
            if why:
                problems.append(
                    GraphProblem(
                        node_id,
                        f"inputs.{name}",
                        f"node {node_id!r} ({class_type}) input {name!r} names a file; its value "
                        f"{_shown(value)} {why}: give the name of one of the request's inputs",
                    )
                )
    return problems


def _named_files(
    graph: Mapping[str, Any], file_inputs: FileInputs
) -> Iterator[tuple[str, str, str, str]]:
    for node_id, class_type, inputs in iter_nodes(graph):
        for name in file_inputs.get(class_type, ()):
            value = inputs.get(name)
            if isinstance(value, str):
                yield node_id, class_type, name, value


def _strings(value: Any) -> Iterator[str]:
    """Every string in a value, however nested (bounded by `value_problem` beforehand)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, list | tuple):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.values())


def registry_file_inputs(object_info: Mapping[str, Any]) -> dict[str, set[str]]:
    """The inputs a node registry marks as naming a file (`FILE_INPUT_MARKERS`), per class."""
    found: dict[str, set[str]] = {}
    for class_type, spec in object_info.items():
        groups = spec.get("input") if isinstance(spec, dict) else None
        if not isinstance(groups, dict):
            continue
        for group in ("required", "optional"):
            specs = groups.get(group)
            if not isinstance(specs, dict):
                continue
            for name, options in specs.items():
                extra = options[1] if isinstance(options, list) and len(options) > 1 else None
                if isinstance(extra, dict) and any(extra.get(m) for m in FILE_INPUT_MARKERS):
                    found.setdefault(str(class_type), set()).add(str(name))
    return found


def merged_file_inputs(*maps: FileInputs) -> dict[str, set[str]]:
    merged: dict[str, set[str]] = {}
    for found in maps:
        for class_type, names in found.items():
            merged.setdefault(class_type, set()).update(names)
    return merged


def check_classified(
    graph: Mapping[str, Any], registry: Mapping[str, Any] | None, known: Collection[str], pool: str
) -> None:
    """For a pool with `unclassified_inputs: refuse`: every node's class must be one whose file
    inputs are known, in its node `registry` or in `known` (the core loaders, the pool's
    `loader_inputs`). No registry at all: nothing tells, and the graph is refused."""
    if registry is None:
        raise UnclassifiedNode(
            [
                GraphProblem(
                    None,
                    "graph",
                    f"pool {pool!r} knows no node registry to tell which inputs name files, "
                    "and takes no graph it cannot check (unclassified_inputs: refuse): let the "
                    "endpoint's workers publish theirs (DURABLE_COMFY_BUCKET on the endpoint) "
                    "or name a captured /object_info in the pool's node_registry",
                )
            ]
        )
    problems = [
        GraphProblem(
            node_id,
            "class_type",
            f"node {node_id!r} class_type {class_type!r}: pool {pool!r} has no description of "
            "it, and takes only nodes whose file inputs it knows (declare them in the pool's "
            "loader_inputs, or install the node where the registry is read)",
        )
        for node_id, class_type, _inputs in iter_nodes(graph)
        if class_type not in registry and class_type not in known
    ]
    if problems:
        raise UnclassifiedNode(problems)


def check_node_classes(graph: Mapping[str, Any], allowed: Collection[str], pool: str) -> None:
    """Every node's class must be on the pool's allow-list (`PoolConfig.allowed_node_classes`)."""
    problems = [
        GraphProblem(
            node_id,
            "class_type",
            f"node {node_id!r} class_type {class_type!r} is not allowed on pool {pool!r}",
        )
        for node_id, class_type, _inputs in iter_nodes(graph)
        if class_type not in allowed
    ]
    if problems:
        raise NodeClassNotAllowed(problems)


def _clip(value: Any) -> str:
    return str(value)[:MAX_NODE_ID_CHARS]


def _shown(value: Any) -> str:
    """A name as a message shows it: repr, cut short (a hostile name can be a megabyte)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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


def load_node_files(
    graph: Mapping[str, Any], file_inputs: FileInputs = CORE_FILE_INPUTS
) -> list[tuple[str, str, str]]:
    """(node_id, input_name, file_name) for every input that names a file."""
    return [(node, name, value) for node, _cls, name, value in _named_files(graph, file_inputs)]


def bind_files(
    graph: Mapping[str, Any],
    names: Mapping[str, str],
    file_inputs: FileInputs = CORE_FILE_INPUTS,
) -> dict[str, Any]:
    """Replace file names in load nodes by the names the backend stored them under."""
    result = copy.deepcopy(dict(graph))
    for node_id, input_name, file_name in load_node_files(graph, file_inputs):
        if file_name in names:
            result[node_id]["inputs"][input_name] = names[file_name]
    return result
