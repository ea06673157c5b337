"""Property tests of the graph checks (workflows/graph.py), no servers: generated graphs are
accepted when valid, and refused, typed and naming the node and field, after any one mutation.

Each property runs hundreds of derandomized examples (tests/support/properties.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from activities.comfyui.graph import registry_problems
from tests.support.properties import FIXED, Case, json_values, near_valid_cases, valid_cases
from workflows.contracts import JobRequest, S3Input
from workflows.errors import GraphCycleError, GraphFormatError, GraphRefused
from workflows.graph import (
    MAX_NODES,
    check_acyclic,
    check_graph,
    check_input_files,
    check_node_classes,
    iter_nodes,
)


def request_data(case: Case) -> dict[str, Any]:
    inputs = {name: {"kind": "s3", "uri": f"s3://b/{i}"} for i, name in enumerate(case.declared)}
    return {"graph": case.graph, "inputs": inputs}


def refusal_of(error: ValidationError) -> GraphRefused:
    """The graph refusal pydantic wrapped (a validator's ValueError is kept in `ctx`)."""
    [detail] = error.errors()
    cause = (detail.get("ctx") or {}).get("error")
    assert isinstance(cause, GraphRefused), detail
    return cause


@settings(FIXED, max_examples=200)
@given(valid_cases())
def test_every_valid_graph_is_accepted_by_the_checks_and_by_a_request(case: Case) -> None:
    check_graph(case.graph)
    check_input_files(case.graph, case.declared)
    request = JobRequest.model_validate(request_data(case))
    assert request.graph == case.graph
    # What the client sends is what the workflow reads: a JSON round trip changes nothing.
    assert JobRequest.model_validate_json(request.model_dump_json()) == request


@settings(FIXED, max_examples=400)
@given(near_valid_cases())
def test_one_mutation_is_refused_typed_naming_its_node_and_field(case: Case) -> None:
    data = request_data(case)
    with pytest.raises(ValidationError) as caught:
        JobRequest.model_validate(data)
    refusal = refusal_of(caught.value)
    assert isinstance(refusal, case.expected or type(None)), (case.mutation, refusal)
    [loc] = {tuple(e["loc"]) for e in caught.value.errors()}
    assert loc == (("inputs",) if case.mutation == "undeclared_file" else ("graph",))
    named = {(p.node, p.field) for p in refusal.problems}
    if case.node is None:
        assert (None, "graph") in named
        return
    if isinstance(refusal, GraphCycleError):
        # Every node named is in the cycle: the input named links to another node named.
        cycle = {node for node, _ in named}
        assert case.node in cycle or case.also_nodes & cycle
        for node, field in named:
            assert node is not None
            link = case.graph[node]["inputs"][field.removeprefix("inputs.")]
            assert str(link[0]) in cycle, (case.mutation, named)
        return
    assert (case.node, case.field) in named, (case.mutation, named)
    # The message names the node (as repr: it may hold control characters) and the input.
    text = str(refusal)
    assert repr(case.node)[:60].rstrip("'") in text
    if case.field.startswith("inputs."):
        assert repr(case.field.removeprefix("inputs.")) in text


@settings(FIXED, max_examples=300)
@given(json_values())
def test_garbage_is_refused_with_a_validation_error_and_nothing_else(garbage: Any) -> None:
    for data in (garbage, {"graph": garbage}, {"graph": {"1": garbage}}):
        try:
            JobRequest.model_validate(data)
        except ValidationError:
            continue


@settings(FIXED, max_examples=200)
@given(json_values(max_leaves=40))
def test_arbitrary_json_graphs_are_accepted_or_refused_typed(graph: Any) -> None:
    """The checks themselves on anything JSON: a GraphFormatError or nothing, never a crash."""
    if not isinstance(graph, dict):
        graph = {"1": graph}
    try:
        check_graph(graph)
    except GraphFormatError:
        return


def chain(length: int, *, closed: bool = False) -> dict[str, Any]:
    graph: dict[str, Any] = {
        str(i): {"class_type": "N", "inputs": {"x": [str(i - 1), 0]} if i else {}}
        for i in range(length)
    }
    if closed:
        graph["0"]["inputs"] = {"x": [str(length - 1), 0]}
    return graph


def test_a_chain_of_the_most_nodes_is_checked_without_recursion_and_its_cycle_named() -> None:
    check_graph(chain(MAX_NODES))
    with pytest.raises(GraphCycleError) as caught:
        check_acyclic(chain(MAX_NODES, closed=True))
    assert len(caught.value.problems) == MAX_NODES
    # Nodes fed by a cycle are not in it: only the cycle is named.
    graph = chain(50)
    graph["10"]["inputs"]["y"] = ["20", 0]
    with pytest.raises(GraphCycleError) as caught:
        check_acyclic(graph)
    assert sorted(int(p.node or -1) for p in caught.value.problems) == list(range(10, 21))


def test_the_size_limit_is_counted_in_serialized_bytes() -> None:
    text = "é" * 55_000  # 110 kB of UTF-8 per node (55 k characters): 9 nodes pass, 10 do not
    graph = {str(i): {"class_type": "N", "inputs": {"t": text}} for i in range(9)}
    check_graph(graph)
    graph["9"] = graph["0"]
    with pytest.raises(GraphRefused, match=r"bytes of JSON; at most 1,048,576") as caught:
        check_graph(graph)
    assert (caught.value.node, caught.value.field) == (None, "graph")


@settings(FIXED, max_examples=150)
@given(valid_cases(), st.data())
def test_the_allow_list_refuses_exactly_the_classes_it_lacks(
    case: Case, data: st.DataObject
) -> None:
    classes = sorted({class_type for _, class_type, _ in iter_nodes(case.graph)})
    allowed = set(data.draw(st.lists(st.sampled_from(classes), unique=True)))
    outside = {node for node, class_type, _ in iter_nodes(case.graph) if class_type not in allowed}
    try:
        check_node_classes(case.graph, allowed, "locked")
    except GraphRefused as refused:
        assert {(p.node, p.field) for p in refused.problems} == {(n, "class_type") for n in outside}
        assert "pool 'locked'" in str(refused)
    else:
        assert not outside


def test_registry_check_refuses_an_output_index_the_class_lacks_or_below_zero() -> None:
    object_info = {
        "A": {"input": {"required": {}}, "output": ["IMAGE"], "output_node": False},
        "S": {"input": {"required": {}}, "output": [], "output_node": True},
    }
    graph = {"1": {"class_type": "A", "inputs": {}}, "2": {"class_type": "S", "inputs": {}}}
    for index, expected in ((0, []), (1, ["which has only 1"]), (-1, ["index is 0 or more"])):
        graph["2"]["inputs"] = {"images": ["1", index]}
        problems = registry_problems(graph, object_info)
        assert len(problems) == len(expected)
        for problem, words in zip(problems, expected, strict=True):
            assert words in problem and "input 'images'" in problem and "node 2" in problem


def test_an_undeclared_load_is_refused_on_the_request_naming_node_and_input() -> None:
    graph = {
        "1": {"class_type": "LoadImage", "inputs": {"image": "face.png"}},
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "x"}},
    }
    with pytest.raises(ValidationError) as caught:
        JobRequest(graph=graph)
    refusal = refusal_of(caught.value)
    assert (refusal.node, refusal.field) == ("1", "inputs.image")
    assert "node '1' (LoadImage) input 'image' loads 'face.png'" in str(refusal)
    JobRequest(graph=graph, inputs={"face.png": S3Input(uri="s3://b/face.png")})


def test_a_refusal_dumps_to_json_even_with_a_lone_surrogate_in_a_name() -> None:
    graph = {"1\ud800": {"class_type": "N", "inputs": {}}}
    with pytest.raises(GraphRefused) as caught:
        check_graph(graph)
    json.dumps([p.as_dict() for p in caught.value.problems]).encode()
