"""Request validation and the pure graph helpers: errors that say what to fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from activities.comfyui.graph import registry_problems
from workflows.contracts import (
    JobPolicy,
    JobRequest,
    JobStatus,
    validate_job_id,
)
from workflows.graph import (
    GraphFormatError,
    apply_overrides,
    bind_files,
    check_api_format,
    load_node_files,
    sampler_steps,
    with_unique_save_prefixes,
)

EXAMPLE = Path(__file__).parent.parent / "examples" / "txt2img.json"


def example_graph() -> dict[str, Any]:
    graph: dict[str, Any] = json.loads(EXAMPLE.read_text())
    return graph


def test_editor_format_is_rejected_with_export_hint() -> None:
    with pytest.raises(ValidationError) as info:
        JobRequest(graph={"nodes": [{"id": 1}], "links": [], "version": 0.4})
    assert "export the workflow in API format" in str(info.value)


@pytest.mark.parametrize(
    ("graph", "message"),
    [
        ({}, "empty"),
        ({"1": {"inputs": {}}}, "no 'class_type'"),
        ({"1": {"class_type": "X", "inputs": {"a": ["9", 0]}}}, "not in the graph"),
        ({"1": "SaveImage"}, "not an object"),
        ({"prompt": {"1": {}}, "client_id": "x"}, "/prompt request body"),
    ],
)
def test_malformed_graphs_name_the_problem(graph: dict[str, Any], message: str) -> None:
    with pytest.raises(GraphFormatError, match=message):
        check_api_format(graph)


def test_example_graph_is_valid_and_counts_sampler_steps() -> None:
    request = JobRequest(graph=example_graph())
    assert sampler_steps(request.graph) == {"3": 20}


def test_unique_prefixes_touch_only_save_nodes_and_leave_input_alone() -> None:
    graph = example_graph()
    tagged = with_unique_save_prefixes(graph, "dc_job_0_abcd")
    assert tagged["9"]["inputs"]["filename_prefix"] == "dc_job_0_abcd/ComfyUI"
    assert graph["9"]["inputs"]["filename_prefix"] == "ComfyUI"
    assert tagged["3"] == graph["3"]


def test_overrides_apply_per_node_and_reject_unknown_nodes() -> None:
    graph = example_graph()
    assert apply_overrides(graph, {"3": {"seed": 7}})["3"]["inputs"]["seed"] == 7
    with pytest.raises(GraphFormatError, match="node '42'"):
        apply_overrides(graph, {"42": {"seed": 7}})


def test_load_nodes_are_found_and_bound() -> None:
    graph = {
        "1": {"class_type": "LoadImage", "inputs": {"image": "face.png"}},
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "x"}},
    }
    assert load_node_files(graph) == [("1", "image", "face.png")]
    assert bind_files(graph, {"face.png": "dc_face.png"})["1"]["inputs"]["image"] == "dc_face.png"


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


def test_abandonment_defaults_to_the_reconnect_horizon_and_null_detaches() -> None:
    assert JobPolicy().abandon_after_s == 300
    assert JobPolicy.model_validate({"reconnect": {"horizon_s": 42}}).abandon_after_s == 42
    assert JobPolicy(abandon_after_s=60).abandon_after_s == 60
    detached = JobPolicy.model_validate({"abandon_after_s": None})
    assert detached.detached
    # What travels through Temporal is the full JSON: the meaning must survive it.
    assert JobPolicy.model_validate_json(detached.model_dump_json()).detached
    assert not JobPolicy.model_validate_json(JobPolicy().model_dump_json()).detached


@pytest.mark.parametrize("job_id", ["", "a b", "x" * 201, "job/1"])
def test_bad_job_ids_are_refused(job_id: str) -> None:
    with pytest.raises(ValueError, match="not valid"):
        validate_job_id(job_id)


def test_request_never_carries_a_url_as_pool() -> None:
    with pytest.raises(ValidationError):
        JobRequest(graph=example_graph(), pool="http://10.0.0.1:8188")


def test_status_round_trips_through_json() -> None:
    status = JobStatus(job_id="j1")
    assert JobStatus.model_validate_json(status.model_dump_json()) == status
