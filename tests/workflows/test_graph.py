"""The graph, word for word: what a client is told about a bad graph, and the helpers.

workflows/graph.py (the format, hostile-input and input-file checks, seeds of the run: sampler
steps, overrides, save prefixes, load nodes) and activities/comfyui/graph.py (the check against
a backend's node registry). The messages are the contract (a client reads them to fix its
graph), so they are compared whole. The helpers never change the graph they are given.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from activities.comfyui.graph import registry_problems
from workflows.contracts import JobRequest
from workflows.errors import (
    GraphCycleError,
    GraphFormatError,
    GraphLinkError,
    GraphNameError,
    GraphRefused,
    UndeclaredInputFile,
)
from workflows.graph import (
    EDITOR_FORMAT_HINT,
    apply_overrides,
    bind_files,
    check_api_format,
    check_graph,
    check_input_files,
    is_link,
    iter_nodes,
    load_node_files,
    run_tag,
    safe_tag,
    sampler_steps,
    with_unique_save_prefixes,
)

EXAMPLE = Path(__file__).parents[2] / "examples" / "txt2img.json"


def example_graph() -> dict[str, Any]:
    graph: dict[str, Any] = json.loads(EXAMPLE.read_text())
    return graph


def node(class_type: str = "X", **inputs: Any) -> dict[str, Any]:
    return {"class_type": class_type, "inputs": inputs}


def refusal(graph: dict[str, Any]) -> str:
    with pytest.raises(GraphFormatError) as refused:
        check_api_format(graph)
    return str(refused.value)


def test_the_editor_format_gets_the_export_hint_word_for_word() -> None:
    assert refusal({"nodes": [], "links": []}) == (
        "this is the editor (UI) format with 'nodes' and 'links'; export the workflow in API "
        "format instead (ComfyUI menu: Workflow > Export (API), or 'Save (API Format)' with dev "
        "mode on)"
    )
    assert EDITOR_FORMAT_HINT == refusal({"nodes": [], "links": [], "version": 0.4})


def test_a_node_called_nodes_or_links_alone_is_no_editor_graph() -> None:
    check_api_format({"nodes": node(), "1": node()})
    check_api_format({"links": node(), "1": node()})


def test_a_prompt_request_body_is_told_to_pass_only_its_prompt() -> None:
    expected = "this looks like a /prompt request body; pass only its 'prompt' object as the graph"
    assert refusal({"prompt": {"1": node()}}) == expected
    assert refusal({"prompt": {"1": node()}, "client_id": "c", "extra_data": {}}) == expected


def test_a_graph_with_a_node_called_prompt_among_four_is_a_graph() -> None:
    check_api_format({"prompt": node(), "1": node(), "2": node(), "3": node()})


def test_a_prompt_key_that_is_no_object_is_a_bad_node_not_a_request_body() -> None:
    assert refusal({"prompt": "x"}) == "invalid API-format graph: node 'prompt' is not an object"


def test_an_empty_graph_needs_a_node() -> None:
    assert refusal({}) == "the graph is empty: it needs at least one node"


def test_every_problem_is_named_at_once_in_graph_order() -> None:
    graph = {
        "1": "SaveImage",
        "2": {"inputs": {}},
        "3": {"class_type": "", "inputs": {}},
        "4": {"class_type": 5, "inputs": {}},
        "5": {"class_type": "X", "inputs": ["a"]},
        "6": node(a=["9", 0], b=[9, 1], c=["1", 0]),
    }
    assert refusal(graph) == (
        "invalid API-format graph: "
        "node '1' is not an object; "
        "node '2' has no 'class_type'; "
        "node '3' has no 'class_type'; "
        "node '4' has no 'class_type'; "
        "node '5': 'inputs' must be an object; "
        "node '6' input 'a' links to node '9', which is not in the graph; "
        "node '6' input 'b' links to node 9, which is not in the graph"
    )


def test_a_node_without_class_type_still_has_its_links_checked() -> None:
    assert refusal({"1": {"inputs": {"a": ["2", 0]}}}) == (
        "invalid API-format graph: node '1' has no 'class_type'; "
        "node '1' input 'a' links to node '2', which is not in the graph"
    )


def test_a_valid_graph_passes_with_or_without_inputs_and_with_numeric_links() -> None:
    check_api_format({"1": {"class_type": "EmptyImage"}, "2": node(images=[1, 0], n=[3, 4, 5])})


@pytest.mark.parametrize(
    ("value", "link"),
    [
        (["1", 0], True),
        ([1, 2], True),
        (("1", 0), False),
        (["1"], False),
        (["1", 0, 0], False),
        (["1", True], False),
        (["1", "0"], False),
        ([1.5, 0], False),
        ([None, 0], False),
        ("1", False),
    ],
)
def test_a_link_is_a_source_id_and_an_output_index(value: Any, link: bool) -> None:
    assert is_link(value) is link


def test_nodes_are_listed_with_string_ids_and_empty_inputs_when_none_are_given() -> None:
    graph: dict[Any, Any] = {1: {"class_type": "A"}, "2": node("B", x=1)}
    assert list(iter_nodes(graph)) == [
        ("1", "A", {}),
        ("2", "B", {"x": 1}),
    ]


def test_only_samplers_with_a_positive_whole_step_count_count() -> None:
    graph = {
        "1": node("KSampler", steps=20),
        "2": node("KSamplerAdvanced", steps=1),
        "3": node("SamplerCustom", steps=3),
        "4": node("KSampler", steps=0),
        "5": node("KSampler", steps="20"),
        "6": node("KSampler", steps=["9", 0]),
        "7": node("SomethingElse", steps=20),
        "8": {"class_type": "KSampler"},
    }
    assert sampler_steps(graph) == {"1": 20, "2": 1, "3": 3}
    assert sampler_steps({"1": node("SaveImage")}) == {}


def test_example_graph_is_valid_and_counts_sampler_steps() -> None:
    request = JobRequest(graph=example_graph())
    assert sampler_steps(request.graph) == {"3": 20}


def test_overrides_merge_into_a_copy_and_name_an_unknown_node() -> None:
    graph = {"1": node("KSampler", seed=1, steps=20), "2": {"class_type": "EmptyImage"}}
    before = copy.deepcopy(graph)
    values = {"seed": [7]}
    result = apply_overrides(graph, {"1": values, "2": {"width": 64}})
    assert result == {
        "1": node("KSampler", seed=[7], steps=20),
        "2": {"class_type": "EmptyImage", "inputs": {"width": 64}},
    }
    assert graph == before, "the caller's graph is untouched"
    values["seed"].append(8)
    assert result["1"]["inputs"]["seed"] == [7], "the overrides are copied too"
    with pytest.raises(GraphFormatError) as refused:
        apply_overrides(graph, {"42": {"seed": 7}})
    assert str(refused.value) == "segment override names node '42', not in the graph"


def test_a_run_tag_names_the_job_segment_and_prompt() -> None:
    assert run_tag("job:1/x", 2, "abcdef0123456789") == "dc_job_1_x_2_abcdef01"
    assert run_tag("j", 0, "abc") == "dc_j_0_abc"


def test_a_job_id_becomes_a_file_name_part_of_at_most_48_characters() -> None:
    assert safe_tag("Job-1_a.b:c d/é") == "Job-1_a_b_c_d_é"
    assert safe_tag("a" * 48 + "bc") == "a" * 48
    assert safe_tag("") == ""


def test_save_prefixes_go_under_the_run_folder_and_nothing_else_changes() -> None:
    graph = {
        "1": node("SaveImage", filename_prefix="ComfyUI"),
        "2": node("SaveImage", filename_prefix="/abs/x"),
        "3": node("SaveImage", filename_prefix=""),
        "4": node("SaveImage", filename_prefix="//"),
        "5": node("SaveImage", filename_prefix=["9", 0]),
        "6": {"class_type": "EmptyImage"},
        "7": node("SaveImage", filename_prefix="XL/x"),
    }
    before = copy.deepcopy(graph)
    tagged = with_unique_save_prefixes(graph, "run1")
    assert [tagged[n].get("inputs", {}).get("filename_prefix") for n in "1234567"] == [
        "run1/ComfyUI",
        "run1/abs/x",
        "run1/output",
        "run1/output",
        ["9", 0],
        None,
        "run1/XL/x",
    ]
    assert tagged["6"] == {"class_type": "EmptyImage"}
    assert graph == before


def test_unique_prefixes_touch_only_save_nodes_and_leave_input_alone() -> None:
    graph = example_graph()
    tagged = with_unique_save_prefixes(graph, "dc_job_0_abcd")
    assert tagged["9"]["inputs"]["filename_prefix"] == "dc_job_0_abcd/ComfyUI"
    assert graph["9"]["inputs"]["filename_prefix"] == "ComfyUI"
    assert tagged["3"] == graph["3"]


def test_load_nodes_are_found_by_class_and_only_with_a_file_name() -> None:
    graph = {
        "1": node("LoadImage", image="face.png"),
        "2": node("LoadImageMask", image="mask.png", channel="alpha"),
        "3": node("LoadImage", image=["9", 0]),
        "4": node("SaveImage", image="not-a-load.png"),
        "5": {"class_type": "LoadImage"},
    }
    assert load_node_files(graph) == [("1", "image", "face.png"), ("2", "image", "mask.png")]


def test_files_are_bound_in_a_copy_and_unknown_names_stay() -> None:
    graph = {
        "1": node("LoadImage", image="face.png"),
        "2": node("LoadImageMask", image="other.png"),
    }
    before = copy.deepcopy(graph)
    bound = bind_files(graph, {"face.png": "dc_face.png"})
    assert bound == {
        "1": node("LoadImage", image="dc_face.png"),
        "2": node("LoadImageMask", image="other.png"),
    }
    assert graph == before


# -- the hostile-input checks (check_graph): one message each, compared whole ---------------


def graph_refusal(graph: dict[str, Any]) -> GraphRefused:
    with pytest.raises(GraphRefused) as refused:
        check_graph(graph)
    return refused.value


def test_a_cycle_names_only_the_nodes_on_it() -> None:
    refused = graph_refusal(
        {
            "1": node(a=["2", 0]),
            "2": node(b=["1", 0]),
            "3": node(c=["2", 0]),
        }
    )
    assert isinstance(refused, GraphCycleError)
    assert str(refused) == (
        "the graph has a cycle (ComfyUI cannot run it): "
        "node '1' input 'a' links to node '2', which depends on it; "
        "node '2' input 'b' links to node '1', which depends on it"
    )
    assert [(p.node, p.field) for p in refused.problems] == [("1", "inputs.a"), ("2", "inputs.b")]


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (["1", -1], "output -1: an output index is 0 or more"),
        (["1", 256], "output 256: at most 255"),
        (["1", 0.5], "output 0.5: an output index is a whole number"),
    ],
)
def test_a_link_output_index_is_a_small_whole_number(value: list[Any], words: str) -> None:
    refused = graph_refusal({"1": node(), "2": node(x=value)})
    assert isinstance(refused, GraphLinkError)
    assert str(refused) == f"invalid link: node '2' input 'x' links to node '1' {words}"
    assert (refused.node, refused.field) == ("2", "inputs.x")


def test_names_with_control_characters_are_refused_shown_escaped() -> None:
    refused = graph_refusal({"1\n": node("Save\x00Image")})
    assert isinstance(refused, GraphNameError)
    assert str(refused) == (
        "invalid node id or class_type: "
        "node id '1\\n': contains control or unassigned characters; "
        "node '1\\n' class_type: contains control or unassigned characters"
    )


def test_more_problems_than_shown_are_counted() -> None:
    graph = {str(i): node(x=[str(i), 0]) for i in range(25)}
    assert str(graph_refusal(graph)).endswith("; and 5 more")


def test_an_undeclared_file_is_named_with_the_declared_ones() -> None:
    graph = {"7": node("LoadImageMask", image="mask.png"), "8": node("LoadImage", image="a.png")}
    check_input_files(graph, {"mask.png", "a.png"})
    with pytest.raises(UndeclaredInputFile) as refused:
        check_input_files(graph, {"a.png", "b.png"})
    assert str(refused.value) == (
        "input file not declared: node '7' (LoadImageMask) input 'image' loads 'mask.png', "
        "which is not one of the request's inputs ('a.png', 'b.png'): pass the file as an "
        "input of that name (CLI: --input NAME=PATH)"
    )


# -- the registry check (activities/comfyui/graph.py): against a backend's /object_info --------

OBJECT_INFO: dict[str, Any] = {
    "EmptyImage": {
        "input": {"required": {"width": ["INT", {}], "height": ["INT", {}]}},
        "output": ["IMAGE"],
        "output_node": False,
    },
    "SaveImage": {
        "input": {"required": {"images": ["IMAGE"], "filename_prefix": ["STRING", {}]}},
        "output": [],
        "output_node": True,
    },
}


def test_registry_check_reports_every_problem_at_once() -> None:
    graph = {
        "1": {"class_type": "EmptyImage", "inputs": {"width": 8}},
        "2": {"class_type": "NoSuchNode", "inputs": {}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["1", 3], "filename_prefix": "x"}},
    }
    problems = registry_problems(graph, OBJECT_INFO)
    assert any("'NoSuchNode' is not installed" in p for p in problems)
    assert any("required input 'height' missing" in p for p in problems)
    assert any("uses output 3 of node 1" in p for p in problems)


def test_registry_check_wants_an_output_node() -> None:
    graph = {"1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8}}}
    assert registry_problems(graph, OBJECT_INFO) == [
        "the graph has no output node: add one (SaveImage, PreviewImage, SaveAnimatedWEBP, ...)"
    ]
