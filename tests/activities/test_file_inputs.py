"""A graph reads only its job's own files from ComfyUI's folders (workflows/graph.py
`check_input_files`; docs/security.md, *Tenants*): the core loaders, the inputs a node registry
marks, a pool's `loader_inputs`; and on every node, no `[output]`/`[temp]` annotation and no
name of durable-comfy's files for another job."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from temporalio.exceptions import ApplicationError

from activities.comfyui.graph import refuse_foreign_files, refuse_hostile_graph
from configuration.pools import PoolConfig
from workflows.activity_io import PrepareInput
from workflows.contracts import JobRequest
from workflows.errors import (
    ForeignFileReference,
    RequestRefused,
    UnclassifiedNode,
    UndeclaredInputFile,
)
from workflows.graph import (
    CORE_FILE_INPUTS,
    bind_files,
    check_input_files,
    check_segment_files,
    load_node_files,
    registry_file_inputs,
    run_tag,
)
from workflows.request_checks import check_input_names
from workflows.shared import ErrorType

# Another job's output, as its run saved it on a shared server.
THEIRS = f"{run_tag('beta.0123', 0, 'abcdef0123')}/ComfyUI_00001_.png"
SAVE = {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "x"}}
# ComfyUI 0.8.0's /object_info entries with file markers (LoadImageOutput as the real server
# answers it), a custom node pack's loader with one, and one without any.
REGISTRY: dict[str, Any] = {
    "LoadImageOutput": {
        "input": {
            "required": {
                "image": [
                    "COMBO",
                    {
                        "image_upload": True,
                        "image_folder": "output",
                        "remote": {"route": "/internal/files/output", "refresh_button": True},
                    },
                ]
            }
        },
        "output": ["IMAGE", "MASK"],
    },
    "LoadVideo": {
        "input": {"required": {"file": ["COMBO", {"options": [], "video_upload": True}]}},
        "output": ["VIDEO"],
    },
    "VHS_LoadImages": {
        "input": {
            "required": {"directory": [["a", "b"], {}]},
            "optional": {"preview": ["COMBO", {"image_upload": True}]},
        },
        "output": ["IMAGE"],
    },
    "PlainLoader": {"input": {"required": {"path": ["STRING", {}]}}, "output": ["IMAGE"]},
    "SaveImage": {"input": {"required": {}}, "output": [], "output_node": True},
}


def graph_of(class_type: str, name: str, value: Any) -> dict[str, Any]:
    return {"1": {"class_type": class_type, "inputs": {name: value}}, "2": SAVE}


def refusal(graph: dict[str, Any], declared: tuple[str, ...] = ("mine.png",)) -> Exception:
    with pytest.raises((ForeignFileReference, UndeclaredInputFile)) as refused:
        check_input_files(graph, declared)
    return refused.value


def test_the_core_list_has_every_loader_of_comfyui_that_reads_its_folders_by_name() -> None:
    # Those without a registry marker first: nothing else would find them.
    for class_type in ("LoadLatent", "LoadAudio", "LoadImageDataSetFromFolder", "WebcamCapture"):
        assert class_type in CORE_FILE_INPUTS, class_type
    for class_type in ("LoadImage", "LoadImageMask", "LoadImageOutput", "LoadVideo", "Load3D"):
        assert class_type in CORE_FILE_INPUTS, class_type


@pytest.mark.parametrize(
    ("class_type", "name"),
    [(cls, name) for cls, names in CORE_FILE_INPUTS.items() for name in names],
)
def test_every_core_loader_may_read_only_a_file_the_job_sent(class_type: str, name: str) -> None:
    refused = refusal(graph_of(class_type, name, "ComfyUI_00001_.png"))
    assert isinstance(refused, UndeclaredInputFile)
    assert f"node '1' ({class_type}) input {name!r}" in str(refused)
    check_input_files(graph_of(class_type, name, "mine.png"), ("mine.png",))


@pytest.mark.parametrize(
    "value",
    [
        f"{THEIRS} [output]",
        "ComfyUI_temp_abcde_00001_.png [temp]",
        "../output/x.png",
        "sub/mine.png",
        "mine.png [input]",
        "..",
        ["3", 0],  # a link: what it carries cannot be checked before the run
        {"image": "mine.png"},
    ],
)
def test_a_loader_takes_a_plain_file_name_only(value: Any) -> None:
    refused = refusal(graph_of("LoadImageOutput", "image", value))
    assert isinstance(refused, ForeignFileReference)
    problem = refused.problems[0]
    assert (problem.node, problem.field) == ("1", "inputs.image")


@pytest.mark.parametrize(
    ("class_type", "name", "value"),
    [
        ("PrimitiveString", "value", f"{THEIRS} [output]"),
        ("SomeCustomLoader", "path", "anything.png [temp]"),
        ("SomeCustomLoader", "path", THEIRS),  # another run's folder
        ("SomeCustomLoader", "path", "dc_beta.0123_cat.png"),  # another job's upload
        ("SomeCustomLoader", "paths", ["ok.png", {"deep": f"x/{THEIRS}"}]),
    ],
)
def test_on_every_node_a_value_reaching_for_another_jobs_file_is_refused(
    class_type: str, name: str, value: Any
) -> None:
    refused = refusal(graph_of(class_type, name, value))
    assert isinstance(refused, ForeignFileReference)
    assert refused.problems[0].node == "1" and "a job may load only its own" in str(refused)


@pytest.mark.parametrize(
    "value",
    [
        "a photo of dc_comics_style heroes",
        "dc_only",
        "[output] at the start is not an annotation",
        "the output folder",
    ],
)
def test_ordinary_text_passes(value: str) -> None:
    check_input_files(graph_of("CLIPTextEncode", "text", value), ())


def test_a_save_prefix_may_name_anything_it_is_rewritten_into_the_run_folder() -> None:
    check_input_files(graph_of("SaveImage", "filename_prefix", "dc_a_b/c"), ())


def test_a_segment_override_is_held_to_the_same_rules() -> None:
    graph = graph_of("LoadImage", "image", "mine.png")
    check_segment_files(graph, [{"1": {"image": "mine.png"}}], ("mine.png",))
    with pytest.raises(ForeignFileReference):
        check_segment_files(graph, [{}, {"1": {"image": f"{THEIRS} [output]"}}], ("mine.png",))
    with pytest.raises(UndeclaredInputFile):
        check_segment_files(graph, [{"1": {"image": "theirs.png"}}], ("mine.png",))


def test_the_client_refuses_it_before_anything_is_sent() -> None:
    with pytest.raises(ValidationError, match="reads from ComfyUI's output or temp folder"):
        JobRequest(graph=graph_of("LoadImage", "image", f"{THEIRS} [output]"))
    with pytest.raises(ValidationError, match="not one of the request's inputs"):
        JobRequest(graph=graph_of("LoadImageOutput", "image", THEIRS.rsplit("/")[-1]))
    with pytest.raises(ValidationError, match="reads from ComfyUI's output"):
        JobRequest(
            graph=graph_of("LoadImage", "image", "mine.png"),
            inputs={"mine.png": {"kind": "inline", "filename": "m.png", "data_b64": ""}},
            segments=[{"1": {"image": f"{THEIRS} [output]"}}],
        )


@pytest.mark.parametrize("name", ["a/b.png", "..\\b.png", "x.png [output]", "y.png [input]"])
def test_an_input_is_named_like_a_file(name: str) -> None:
    with pytest.raises(RequestRefused, match="named like a file"):
        check_input_names({name: {}})


def test_the_registry_marks_file_inputs_required_and_optional() -> None:
    assert registry_file_inputs(REGISTRY) == {
        "LoadImageOutput": {"image"},
        "LoadVideo": {"file"},
        "VHS_LoadImages": {"preview"},
    }


def test_a_custom_loader_is_found_through_its_marker_and_bound_like_a_core_one() -> None:
    graph = graph_of("VHS_LoadImages", "preview", "mine.png")
    files = registry_file_inputs(REGISTRY)
    assert load_node_files(graph, files) == [("1", "preview", "mine.png")]
    assert bind_files(graph, {"mine.png": "dc_j_mine.png"}, files)["1"]["inputs"] == {
        "preview": "dc_j_mine.png"
    }
    with pytest.raises(UndeclaredInputFile):
        check_input_files(graph_of("VHS_LoadImages", "preview", "x.png"), (), files)


def prepare(graph: dict[str, Any], **inputs: Any) -> PrepareInput:
    return PrepareInput(job_id="j", pool="gpu", graph=graph, inputs=inputs)


def test_the_worker_holds_registry_marked_inputs_to_the_jobs_files() -> None:
    pool = PoolConfig(kind="comfyui", url="http://127.0.0.1:1")
    req = prepare(graph_of("VHS_LoadImages", "preview", "theirs.png"))
    refuse_hostile_graph(req, "gpu", pool)  # no registry yet: not known as a loader
    with pytest.raises(ApplicationError) as refused:
        refuse_foreign_files(req, "gpu", pool, REGISTRY)
    assert refused.value.type == ErrorType.MISSING_INPUT and refused.value.non_retryable
    assert "node '1' (VHS_LoadImages) input 'preview'" in str(refused.value)


def test_a_pools_loader_inputs_name_its_custom_loaders() -> None:
    pool = PoolConfig(kind="comfyui", url="http://x", loader_inputs={"PlainLoader": ["path"]})
    req = prepare(graph_of("PlainLoader", "path", "elsewhere.png"))
    with pytest.raises(ApplicationError) as refused:
        refuse_hostile_graph(req, "gpu", pool)
    assert refused.value.type == ErrorType.MISSING_INPUT
    plain = PoolConfig(kind="comfyui", url="http://x")
    refuse_foreign_files(req, "gpu", plain, REGISTRY)  # without the entry it is a string


def test_a_foreign_annotation_is_an_invalid_graph_naming_node_input_and_file() -> None:
    pool = PoolConfig(kind="comfyui", url="http://x")
    req = prepare(graph_of("LoadImage", "image", f"{THEIRS} [output]"))
    with pytest.raises(ApplicationError) as refused:
        refuse_hostile_graph(req, "gpu", pool)
    assert refused.value.type == ErrorType.INVALID_GRAPH
    [details] = refused.value.details
    assert details["kind"] == "ForeignFileReference"
    assert details["problems"][0]["node"] == "1"
    assert details["problems"][0]["field"] == "inputs.image"
    assert "ComfyUI_00001_.png" in details["problems"][0]["message"]


def test_a_pool_may_refuse_graphs_no_registry_describes() -> None:
    strict = PoolConfig(kind="runpod", endpoint_id="e", unclassified_inputs="refuse")
    req = prepare(graph_of("MysteryNode", "x", 1))
    with pytest.raises(ApplicationError) as refused:
        refuse_foreign_files(req, "gpu", strict, None)
    assert refused.value.type == ErrorType.INVALID_GRAPH
    assert refused.value.details[0]["kind"] == UnclassifiedNode.__name__
    assert "knows no node registry" in str(refused.value)
    with pytest.raises(ApplicationError, match="'MysteryNode': pool 'gpu' has no description"):
        refuse_foreign_files(req, "gpu", strict, REGISTRY)
    refuse_foreign_files(req, "gpu", strict, {**REGISTRY, "MysteryNode": {"input": {}}})
    lenient = PoolConfig(kind="runpod", endpoint_id="e")
    refuse_foreign_files(req, "gpu", lenient, None)


def test_loader_inputs_must_name_classes_and_inputs() -> None:
    bads: list[dict[str, list[str]]] = [{"": ["x"]}, {"Node": []}, {"Node": [" "]}]
    for bad in bads:
        with pytest.raises(ValidationError, match="loader_inputs"):
            PoolConfig(kind="comfyui", url="http://x", loader_inputs=bad)
