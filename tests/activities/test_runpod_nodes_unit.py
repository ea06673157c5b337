"""A RunPod pool's node registry (activities/runpod/nodes.py): the graph is checked before any
RunPod job exists, against what the endpoint's workers published, a captured `/object_info`, or
nothing (`off`); while nothing is published the check is skipped and the job goes on. Against a
scripted RunPod and the in-memory bucket of test_runpod_backend_unit: no server."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic_settings import SettingsError
from structlog.testing import capture_logs
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.runpod.nodes import NodeRegistries, check_captured_registries
from configuration.pools import PoolConfig
from protocol.runpod.contract import PublishedNodes, nodes_key
from tests.activities.test_runpod_backend_unit import (
    OUR_KEY,
    PNG,
    MemoryStore,
    ScriptedRunPod,
    backend,
    completed,
    env,
    follow_input,
    record,
)
from tests.support.cli import example
from workflows.activity_io import PreparedJob, PrepareInput
from workflows.shared import ErrorType

ENDPOINT = "ep1"  # test_runpod_backend_unit's pool


def object_info_of(graph: dict[str, Any]) -> dict[str, Any]:
    """A registry that has every class of `graph`, each requiring the inputs the graph gives it
    (what ComfyUI's `/object_info` says of them, cut down to what the check reads)."""
    info: dict[str, Any] = {}
    for node in graph.values():
        spec = info.setdefault(
            node["class_type"],
            {"input": {"required": {}}, "output": ["ANY"] * 3, "output_node": False},
        )
        for name in node["inputs"]:
            spec["input"]["required"][name] = ["ANY", {}]
    info["SaveImage"].update(output=[], output_node=True)
    return info


GRAPH = example(steps=4)
OBJECT_INFO = object_info_of(GRAPH)


def publish(store: MemoryStore, object_info: dict[str, Any] = OBJECT_INFO) -> None:
    document = PublishedNodes(
        endpoint_id=ENDPOINT,
        worker_id="w-published",
        published_at=datetime.now(UTC),
        object_info=object_info,
    )
    store.put(nodes_key(ENDPOINT), document.model_dump_json().encode())


def typo(graph: dict[str, Any]) -> dict[str, Any]:
    bad = copy.deepcopy(graph)
    bad["3"]["class_type"] = "KSamplerr"
    return bad


async def prepare(
    store: MemoryStore, runpod: ScriptedRunPod, graph: dict[str, Any], **pool: Any
) -> PreparedJob:
    req = PrepareInput(job_id="job-1", pool="cloud", graph=graph)
    result: PreparedJob = await ActivityEnvironment().run(
        backend(runpod, store, **pool).prepare, req, "cloud"
    )
    return result


async def refused(
    store: MemoryStore, runpod: ScriptedRunPod, graph: dict[str, Any], **pool: Any
) -> ApplicationError:
    with pytest.raises(ApplicationError) as failure:
        await prepare(store, runpod, graph, **pool)
    assert failure.value.type == ErrorType.INVALID_GRAPH and failure.value.non_retryable
    assert runpod.requests == [], "no RunPod call at all"
    return failure.value


async def test_a_typo_in_a_class_is_refused_from_the_published_registry() -> None:
    store, runpod = MemoryStore(), ScriptedRunPod()
    publish(store)
    error = await refused(store, runpod, typo(GRAPH))
    assert "node 3: class 'KSamplerr' is not installed" in error.message
    [details] = error.details
    assert details["problems"] == [error.message]
    assert nodes_key(ENDPOINT) in details["registry"] and "w-published" in details["registry"]
    # The right class passes.
    assert (await prepare(store, runpod, GRAPH)).graph == GRAPH


async def test_a_missing_required_input_is_refused() -> None:
    store, runpod = MemoryStore(), ScriptedRunPod()
    publish(store)
    graph = copy.deepcopy(GRAPH)
    del graph["3"]["inputs"]["steps"]
    error = await refused(store, runpod, graph)
    assert "node 3 (KSampler): required input 'steps' missing" in error.message


async def test_without_a_published_registry_the_check_is_skipped_and_logged() -> None:
    store, runpod = MemoryStore(), ScriptedRunPod()
    with capture_logs() as logs:
        prepared = await prepare(store, runpod, typo(GRAPH))
    assert prepared.graph["3"]["class_type"] == "KSamplerr"
    assert any(entry["event"] == "node_registry_unknown" for entry in logs), logs


async def test_an_unreadable_registry_is_no_check_rather_than_a_crash() -> None:
    store, runpod = MemoryStore(), ScriptedRunPod()
    store.put(nodes_key(ENDPOINT), b'{"KSampler": "not a spec", "published_at": 3}')
    with capture_logs() as logs:
        await prepare(store, runpod, typo(GRAPH))
    assert any(entry["event"] == "node_registry_unreadable" for entry in logs), logs


@pytest.mark.parametrize("form", ["bare", "published"])
async def test_a_captured_object_info_file_is_the_registry(tmp_path: Path, form: str) -> None:
    """What a stock endpoint's pool names: `curl .../object_info > nodes.json` (or a copy of
    a published document)."""
    captured = tmp_path / "nodes.json"
    if form == "bare":
        captured.write_text(json.dumps(OBJECT_INFO))
    else:
        document = PublishedNodes(published_at=datetime.now(UTC), object_info=OBJECT_INFO)
        captured.write_text(document.model_dump_json())
    store, runpod = MemoryStore(), ScriptedRunPod()
    error = await refused(store, runpod, typo(GRAPH), claims=False, node_registry=captured)
    assert "'KSamplerr' is not installed" in error.message
    assert str(captured) in error.details[0]["registry"]
    await prepare(store, runpod, GRAPH, claims=False, node_registry=captured)


async def test_a_published_loader_marker_holds_a_custom_loader_to_the_jobs_files() -> None:
    """A custom node's upload widget, as the workers' `/object_info` shows it: its input names a
    file of ComfyUI's folders (a warm worker keeps earlier jobs' files there)."""
    graph = copy.deepcopy(GRAPH)
    graph["20"] = {"class_type": "VHS_LoadVideo", "inputs": {"video": "earlier-job.mp4"}}
    registry = object_info_of(graph)
    registry["VHS_LoadVideo"]["input"]["optional"] = {}
    registry["VHS_LoadVideo"]["input"]["required"]["video"] = [["a.mp4"], {"video_upload": True}]
    store, runpod = MemoryStore(), ScriptedRunPod()
    publish(store, registry)
    with pytest.raises(ApplicationError) as failure:
        await prepare(store, runpod, graph)
    assert failure.value.type == ErrorType.MISSING_INPUT and failure.value.non_retryable
    assert "node '20' (VHS_LoadVideo) input 'video'" in failure.value.message
    assert runpod.requests == [], "no RunPod call at all"


async def test_a_pool_that_refuses_unclassified_graphs_takes_none_before_a_registry() -> None:
    store, runpod = MemoryStore(), ScriptedRunPod()
    error = await refused(store, runpod, GRAPH, unclassified_inputs="refuse")
    assert "knows no node registry" in error.message
    publish(store)
    await prepare(store, runpod, GRAPH, unclassified_inputs="refuse")


async def test_off_checks_nothing_even_with_a_published_registry() -> None:
    store, runpod = MemoryStore(), ScriptedRunPod()
    publish(store)
    prepared = await prepare(store, runpod, typo(GRAPH), node_registry="off")
    assert prepared.graph["3"]["class_type"] == "KSamplerr"


async def test_a_class_the_cached_registry_lacks_reads_it_again() -> None:
    """A new image's nodes are picked up at once, not a minute later."""
    store, runpod = MemoryStore(), ScriptedRunPod()
    newer = copy.deepcopy(GRAPH)
    newer["3"]["class_type"] = "KSamplerAdvanced"
    publish(store)
    await refused(store, runpod, newer)
    publish(store, OBJECT_INFO | {"KSamplerAdvanced": OBJECT_INFO["KSampler"]})
    await prepare(store, runpod, newer)


async def test_the_registry_is_kept_a_minute_then_read_again() -> None:
    store, now = MemoryStore(), [0.0]
    registries = NodeRegistries(store, clock=lambda: now[0])
    pool = PoolConfig(kind="runpod", endpoint_id=ENDPOINT)
    publish(store)
    await registries.check(GRAPH, "cloud", pool)
    del store.objects[("artifacts", nodes_key(ENDPOINT))]
    now[0] = 59.0
    without_save = {k: v for k, v in OBJECT_INFO.items() if k != "SaveImage"}
    publish(store, without_save | {"SaveImage2": OBJECT_INFO["SaveImage"]})
    await registries.check(GRAPH, "cloud", pool)  # the cached copy still has SaveImage
    now[0] = 61.0
    with pytest.raises(ApplicationError) as stale:
        await registries.check(GRAPH, "cloud", pool)
    assert "'SaveImage' is not installed" in stale.value.message


async def test_a_durable_submission_says_where_to_publish(tmp_path: Path) -> None:
    captured = tmp_path / "nodes.json"
    captured.write_text(json.dumps(OBJECT_INFO))
    targets = []
    for registry in (None, "off", captured):
        store, runpod = MemoryStore(), ScriptedRunPod(statuses=[completed([record(OUR_KEY)])])
        store.put(OUR_KEY, PNG)
        await env([]).run(backend(runpod, store, node_registry=registry).follow, follow_input())
        targets.append(runpod.bodies[0]["input"]["durable_comfy"].get("nodes"))
    assert targets == [{"bucket": "artifacts", "key": nodes_key(ENDPOINT)}, None, None]


def test_a_captured_file_that_is_no_registry_stops_the_worker_at_start(tmp_path: Path) -> None:
    broken = tmp_path / "nodes.json"
    broken.write_text("<html>not json</html>")
    pools = {"stock": PoolConfig(kind="runpod", endpoint_id="e", node_registry=broken)}
    with pytest.raises(SettingsError, match=r"pool 'stock': node_registry .*not JSON"):
        check_captured_registries(pools)
    pools["stock"] = PoolConfig(kind="runpod", endpoint_id="e", node_registry=tmp_path / "gone")
    with pytest.raises(SettingsError, match="No such file"):
        check_captured_registries(pools)


def test_node_registry_is_a_runpod_setting() -> None:
    assert PoolConfig(kind="runpod", endpoint_id="e", node_registry="off").node_registry == "off"
    as_path = PoolConfig(kind="runpod", endpoint_id="e", node_registry="/x/nodes.json")
    assert as_path.node_registry == Path("/x/nodes.json")
    with pytest.raises(ValueError, match="node_registry: only for pools of kind 'runpod'"):
        PoolConfig(url="http://gpu:8188", node_registry="off")
