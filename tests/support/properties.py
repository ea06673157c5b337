"""Hypothesis strategies for the hostile-input property tests (tests/*/test_properties_*.py).

Three families:

- `valid_cases()`: API-format graphs that every check must accept (random DAGs of arbitrary
  class and input names, links only to earlier nodes, load nodes naming declared inputs);
- `near_valid_cases()`: one of those with exactly one mutation, and the refusal it must get
  (the error class, the node and the field it must name);
- `json_values()`: arbitrary JSON, for garbage.

Settings are fixed (`derandomize=True`, no example database) so CI runs the same examples.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from workflows.errors import (
    GraphCycleError,
    GraphLinkError,
    GraphNameError,
    GraphRefused,
    GraphShapeError,
    GraphTooLarge,
    UndeclaredInputFile,
)
from workflows.graph import (
    MAX_NODES,
    MAX_OUTPUT_INDEX,
    MAX_STRING_CHARS,
    MAX_VALUE_DEPTH,
    file_input_problem,
    foreign_value_problem,
)

# Reproducible, and fast enough for `make test`: no database, no deadline (CI machines stall).
FIXED = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Printable names: no control, format, private-use, surrogate or unassigned characters.
NAME_CHARS = st.characters(exclude_categories=["C"])
# Node ids that would make a valid graph look like something else (the editor format, a
# /prompt body) are not drawn for valid graphs; mutations make those on purpose.
_SPECIAL_IDS = {"nodes", "links", "prompt"}
NODE_IDS = st.one_of(
    st.integers(0, 10**6).map(str),
    st.text(NAME_CHARS, min_size=1, max_size=12).filter(lambda s: s not in _SPECIAL_IDS),
)
CLASS_TYPES = st.one_of(
    st.sampled_from(["KSampler", "CLIPTextEncode", "VAEDecode", "SaveImage", "EmptyImage"]),
    st.text(NAME_CHARS, min_size=1, max_size=30),
)
INPUT_NAMES = st.text(NAME_CHARS, min_size=1, max_size=16)
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**53), 2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    # (a value reaching for another job's file is refused whatever else is wrong: not drawn)
    st.text(max_size=20).filter(lambda text: foreign_value_problem(text) is None),
)
# Widget values: never a 2-list (that reads as a link), nesting kept shallow.
WIDGETS = st.one_of(
    LEAVES,
    st.lists(LEAVES, max_size=4).filter(lambda v: len(v) != 2),
    st.dictionaries(st.text(max_size=8), LEAVES, max_size=3),
)
FILE_NAMES = (
    st.text(NAME_CHARS, min_size=1, max_size=20)
    .map(lambda s: f"{s}.png")
    .filter(lambda name: file_input_problem(name) is None and foreign_value_problem(name) is None)
)


def json_values(max_leaves: int = 30) -> st.SearchStrategy[Any]:
    return st.recursive(
        LEAVES,
        lambda children: st.one_of(
            st.lists(children, max_size=5),
            st.dictionaries(st.text(max_size=10), children, max_size=5),
        ),
        max_leaves=max_leaves,
    )


@dataclass
class Case:
    """A graph, the input names its request declares, and the refusal it must get (None:
    accepted). `node`/`field`: what the refusal must name (None: the graph as a whole)."""

    graph: dict[str, Any]
    declared: list[str]
    expected: type[GraphRefused] | None = None
    node: str | None = None
    field: str = "graph"
    mutation: str = "none"
    also_nodes: set[str] = dataclasses.field(default_factory=set)


@st.composite
def valid_cases(draw: st.DrawFn, max_nodes: int = 6) -> Case:
    ids = draw(st.lists(NODE_IDS, min_size=1, max_size=max_nodes, unique=True))
    declared: list[str] = []
    graph: dict[str, Any] = {}
    for index, node_id in enumerate(ids):
        if draw(st.integers(0, 7)) == 0:
            file_name = draw(FILE_NAMES)
            declared.append(file_name)
            graph[node_id] = {"class_type": "LoadImage", "inputs": {"image": file_name}}
            continue
        names = draw(st.lists(INPUT_NAMES, max_size=4, unique=True))
        inputs: dict[str, Any] = {}
        for name in names:
            if index and draw(st.booleans()):
                source = ids[draw(st.integers(0, index - 1))]
                inputs[name] = [source, draw(st.integers(0, 5))]
            else:
                inputs[name] = draw(WIDGETS)
        graph[node_id] = {"class_type": draw(CLASS_TYPES), "inputs": inputs}
        if draw(st.booleans()):
            graph[node_id]["_meta"] = {"title": draw(st.text(max_size=20))}
    return Case(graph, sorted(set(declared)))


def _deep(depth: int) -> Any:
    value: Any = "bottom"
    for _ in range(depth):
        value = [value]
    return value


MUTATIONS = [
    "dangling_link",
    "self_loop",
    "two_cycle",
    "negative_index",
    "huge_index",
    "fractional_index",
    "no_class_type",
    "class_type_not_text",
    "inputs_not_object",
    "node_not_object",
    "huge_string",
    "deep_value",
    "control_char_id",
    "control_char_class",
    "editor_format",
    "undeclared_file",
    "too_many_nodes",
]


@st.composite
def near_valid_cases(draw: st.DrawFn) -> Case:
    """A valid graph with exactly one mutation, and the refusal that names it."""
    base = draw(valid_cases(max_nodes=5))
    graph = copy.deepcopy(base.graph)
    ids = list(graph)
    target = draw(st.sampled_from(ids))
    mutation = draw(st.sampled_from(MUTATIONS))
    case = Case(graph, base.declared, mutation=mutation)

    def add_input(value: Any) -> str:
        name = "mutated"
        graph[target].setdefault("inputs", {})[name] = value
        case.node, case.field = target, f"inputs.{name}"
        return name

    if mutation == "dangling_link":
        missing = draw(NODE_IDS.filter(lambda i: i not in graph))
        add_input([missing, 0])
        case.expected = GraphShapeError
    elif mutation == "self_loop":
        add_input([target, 0])
        case.expected = GraphCycleError
    elif mutation == "two_cycle":
        other = draw(st.sampled_from(ids))
        if other == target:
            add_input([target, 0])
        else:
            graph[other].setdefault("inputs", {})["back"] = [target, 0]
            add_input([other, 0])
            case.also_nodes = {other}
        case.expected = GraphCycleError
    elif mutation in ("negative_index", "huge_index", "fractional_index"):
        index: Any = {
            "negative_index": draw(st.integers(-(2**40), -1)),
            "huge_index": draw(st.integers(MAX_OUTPUT_INDEX + 1, 2**40)),
            "fractional_index": draw(st.floats(0.1, 9.9).filter(lambda f: f != int(f))),
        }[mutation]
        add_input([draw(st.sampled_from(ids)), index])
        case.expected = GraphLinkError
    elif mutation == "no_class_type":
        graph[target] = {"inputs": graph[target].get("inputs", {})}
        case.node, case.field, case.expected = target, "class_type", GraphShapeError
    elif mutation == "class_type_not_text":
        graph[target]["class_type"] = draw(st.one_of(st.integers(), st.none(), st.just("")))
        case.node, case.field, case.expected = target, "class_type", GraphShapeError
    elif mutation == "inputs_not_object":
        graph[target]["inputs"] = draw(st.one_of(st.text(), st.lists(st.integers())))
        case.node, case.field, case.expected = target, "inputs", GraphShapeError
    elif mutation == "node_not_object":
        graph[target] = draw(st.one_of(st.text(), st.integers(), st.none()))
        case.node, case.field, case.expected = target, "graph", GraphShapeError
    elif mutation == "huge_string":
        add_input("x" * (MAX_STRING_CHARS + draw(st.integers(1, 1000))))
        case.expected = GraphTooLarge
    elif mutation == "deep_value":
        add_input(_deep(MAX_VALUE_DEPTH + draw(st.integers(1, 60))))
        case.expected = GraphTooLarge
    elif mutation == "control_char_id":
        bad = draw(st.sampled_from(["\x00", "\n", "\x1b[2J", "\u200b"]))
        renamed = f"{target}{bad}"
        graph[renamed] = graph.pop(target)
        for node in graph.values():  # links to it follow the new name
            for name, value in node.get("inputs", {}).items():
                if isinstance(value, list) and len(value) == 2 and value[0] == target:
                    node["inputs"][name] = [renamed, value[1]]
        case.node, case.field, case.expected = renamed, "graph", GraphNameError
    elif mutation == "control_char_class":
        bad = draw(st.sampled_from(["\x00", "\r", "\x7f"]))
        graph[target]["class_type"] = "Save" + bad + "Image"
        case.node, case.field, case.expected = target, "class_type", GraphNameError
    elif mutation == "editor_format":
        graph["nodes"] = [{"id": 1}]
        graph["links"] = []
        case.expected = GraphShapeError
    elif mutation == "undeclared_file":
        file_name = draw(FILE_NAMES.filter(lambda name: name not in base.declared))
        graph[target] = {"class_type": "LoadImage", "inputs": {"image": file_name}}
        # Nothing may link to an input the node no longer has: links stay valid (outputs).
        case.node, case.field, case.expected = target, "inputs.image", UndeclaredInputFile
    elif mutation == "too_many_nodes":
        for number in range(MAX_NODES + 1 - len(graph)):
            graph[f"extra-{number}"] = {"class_type": "EmptyImage", "inputs": {}}
        case.expected = GraphTooLarge
    return case
