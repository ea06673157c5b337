"""Property tests of whole requests, no servers: what a client can send is accepted or refused
with a documented error naming the field, and what the client accepts the workflow accepts.

The documented errors: `pydantic.ValidationError` (every field check, graph checks included),
and from `starter.requests` / `JobClient.start` the `ClientError`s and `GraphFormatError`.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from temporalio.contrib.pydantic import pydantic_data_converter

from starter.client import JobClient
from starter.errors import ClientError, InputFileError
from starter.requests import request_from_files
from tests.support.no_ledger import NoLedgers
from tests.support.properties import (
    FIXED,
    NAME_CHARS,
    Case,
    json_values,
    near_valid_cases,
    valid_cases,
)
from workflows.contracts import JobRequest
from workflows.errors import GraphFormatError, RequestRefused
from workflows.graph import CORE_FILE_INPUTS
from workflows.job_input import JobInput, read_job_input
from workflows.request_checks import MAX_LABEL_VALUE_CHARS, MAX_POLICY_SECONDS


def request_data(case: Case) -> dict[str, Any]:
    inputs = {name: {"kind": "s3", "uri": f"s3://b/{i}"} for i, name in enumerate(case.declared)}
    return {"graph": case.graph, "inputs": inputs}


# (what is changed, a value, the error location it must be reported under)
REQUEST_MUTATIONS: list[tuple[str, st.SearchStrategy[Any]]] = [
    ("unknown_field", st.text(NAME_CHARS, min_size=1, max_size=10)),
    (
        "bad_pool",
        st.text(max_size=80).filter(lambda s: not s or len(s) > 64 or "/" in s or " " in s),
    ),
    ("wrong_type", json_values(5).filter(lambda v: not isinstance(v, int | float) or v is True)),
    ("long_label", st.integers(MAX_LABEL_VALUE_CHARS + 1, 5000)),
    ("long_deadline", st.floats(MAX_POLICY_SECONDS * 1.01, 1e300)),
    ("override_not_object", st.one_of(st.integers(), st.text(), st.lists(st.integers()))),
    ("bad_input_kind", st.text(max_size=10).filter(lambda s: s not in ("inline", "s3", "url"))),
]


@st.composite
def mutated_requests(draw: st.DrawFn) -> tuple[dict[str, Any], str, tuple[Any, ...], str | None]:
    """A valid request with one non-graph mutation: (data, mutation, loc prefix, field)."""
    data = request_data(draw(valid_cases(max_nodes=4)))
    mutation, values = draw(st.sampled_from(REQUEST_MUTATIONS))
    value = draw(values)
    node = next(iter(data["graph"]))
    if mutation == "unknown_field":
        name = f"x_{value}"
        data[name] = 1
        return data, mutation, (name,), None
    if mutation == "bad_pool":
        data["pool"] = value
        return data, mutation, ("pool",), None
    if mutation == "wrong_type":
        data["policy"] = {"execution_timeout_s": value}
        return data, mutation, ("policy", "execution_timeout_s"), None
    if mutation == "long_label":
        data["labels"] = {"tenant": "t" * value}
        return data, mutation, ("labels",), "labels.tenant"
    if mutation == "long_deadline":
        data["policy"] = {"execution_timeout_s": value}
        return data, mutation, ("policy",), "policy.execution_timeout_s"
    if mutation == "override_not_object":
        data["segments"] = [{node: value}]
        return data, mutation, ("segments",), f"segments.0.{node}"
    data["inputs"] = {"face.png": {"kind": value, "uri": "s3://b/k"}}
    return data, mutation, ("inputs", "face.png"), None


@settings(FIXED, max_examples=300)
@given(mutated_requests())
def test_a_request_with_one_bad_field_is_refused_naming_that_field(
    mutated: tuple[dict[str, Any], str, tuple[Any, ...], str | None],
) -> None:
    data, mutation, loc, field = mutated
    with pytest.raises(ValidationError) as caught:
        JobRequest.model_validate(data)
    errors = caught.value.errors()
    assert any(tuple(e["loc"])[: len(loc)] == loc for e in errors), (mutation, errors)
    if field is not None:
        causes = [(e.get("ctx") or {}).get("error") for e in errors]
        refused = [c for c in causes if isinstance(c, RequestRefused)]
        assert [c.field for c in refused] == [field], (mutation, errors)
        assert str(refused[0]).startswith(f"{field}: ")


DOCUMENTED = (ValidationError, ClientError, GraphFormatError)


@settings(FIXED, max_examples=200)
@given(
    st.one_of(
        valid_cases().map(lambda c: c.graph),
        near_valid_cases().map(lambda c: c.graph),
        json_values(),
    ),
    st.one_of(st.none(), st.lists(json_values(8), max_size=3), json_values(8)),
    st.one_of(st.none(), st.text(max_size=70)),
)
def test_request_from_files_raises_only_documented_errors(
    graph: Any, segments: Any, pool: str | None
) -> None:
    with tempfile.TemporaryDirectory() as folder:
        graph_path = Path(folder) / "graph.json"
        graph_path.write_text(json.dumps(graph))
        segments_path = None
        if segments is not None:
            segments_path = Path(folder) / "segments.json"
            segments_path.write_text(json.dumps(segments))
        try:
            request_from_files(graph_path, segments_path=segments_path, pool=pool)
        except DOCUMENTED:
            return


class RecordingTemporal(NoLedgers):
    """What `JobClient.start` uses of a Temporal client: the data converter and a start that
    records the payload it would send."""

    def __init__(self) -> None:
        self.data_converter = pydantic_data_converter
        self.started: list[Any] = []

    async def start_workflow(self, workflow: str, arg: Any, **_options: Any) -> None:
        [payload] = self.data_converter.payload_converter.to_payloads([arg])
        self.started.append(json.loads(payload.data))


@st.composite
def accepted_requests(draw: st.DrawFn) -> JobRequest:
    case = draw(valid_cases(max_nodes=5))
    data = request_data(case)
    if draw(st.booleans()):
        # Overrides of inputs the graph's nodes have, as a client's segments would be (a
        # number where a file name belongs is refused: not a load node's file input).
        node, body = draw(st.sampled_from(list(case.graph.items())))
        file_inputs = CORE_FILE_INPUTS.get(body["class_type"], ())
        names = [
            n
            for n in body.get("inputs", {})
            if not isinstance(body["inputs"][n], list) and n not in file_inputs
        ]
        if names:
            data["segments"] = [{node: {draw(st.sampled_from(names)): draw(st.integers())}}]
    data["labels"] = draw(
        st.dictionaries(st.sampled_from(["tenant", "team"]), st.text(max_size=30))
    )
    data["policy"] = {"execution_timeout_s": draw(st.floats(1, MAX_POLICY_SECONDS))}
    return JobRequest.model_validate(data)


@settings(FIXED, max_examples=100)
@given(accepted_requests(), st.booleans())
async def test_what_the_client_starts_the_workflow_reads_without_refusal(
    request: JobRequest, detached: bool
) -> None:
    temporal = RecordingTemporal()
    client = JobClient(temporal, task_queue="q")  # type: ignore[arg-type]
    outcome = await client.start(request, detached=detached)
    [sent] = temporal.started
    reading = read_job_input(sent)
    assert reading.refusal is None, reading.refusal
    assert reading.input.request.graph == request.graph
    assert outcome.job_id and not outcome.existed
    assert JobInput.model_validate(sent).request.segments == request.segments


def test_a_graph_file_nested_past_the_json_parser_limit_is_an_input_file_error(
    tmp_path: Path,
) -> None:
    graph_path = tmp_path / "deep.json"
    graph_path.write_text('{"1": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(InputFileError, match="nested too deeply"):
        request_from_files(graph_path)
