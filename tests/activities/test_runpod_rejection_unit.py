"""A graph refused by ComfyUI on a RunPod worker reads as a rejection, in plain words: the
stock worker-comfyui handler's texts (its `queue_workflow`, 5.8.5) are typed PromptRejected
with ComfyUI's reason per node, never a Python repr; our handler's reason is not said twice."""

from __future__ import annotations

import json

import pytest

from activities.runpod.models import RunPodJob
from activities.runpod.outcome import Failed, read_job
from activities.runpod.rejection import MAX_REPR_CHARS, stock_rejection
from workflows.shared import ErrorType

JOB = "c80ffee4-f315-4e25-a146-0f3d98cf024b-u1"

# What the stock handler returns for a missing required input and a seed below its minimum
# (ComfyUI 0.8's node_errors, as the handler prints each key of them).
BULLETS = (
    "Workflow validation failed:\n"
    "• Node 5 (errors): [{'type': 'required_input_missing', 'message': 'Required input is "
    "missing', 'details': 'model', 'extra_info': {'input_name': 'model'}}, {'type': "
    "'value_smaller_than_min', 'message': 'Value -5 smaller than min of 0', 'details': 'seed', "
    "'extra_info': {'input_name': 'seed', 'input_config': ['INT', {'min': 0}], "
    "'received_value': -5}}]\n"
    "• Node 5 (dependent_outputs): ['9']\n"
    "• Node 5 (class_type): KSampler"
)
# A class that does not exist: ComfyUI sends no node_errors, the handler its raw answer.
RAW = "Cannot execute because node KSamplerr does not exist.. Raw response: " + json.dumps(
    {
        "error": {
            "type": "invalid_prompt",
            "message": "Cannot execute because node KSamplerr does not exist.",
            "details": "Node ID '#5'",
            "extra_info": {},
        },
        "node_errors": {},
    }
)


def failed(error: str, **output: object) -> Failed:
    job = RunPodJob(id=JOB, status="FAILED", workerId="w-1", error=error, output=output or None)
    outcome = read_job(job)
    assert isinstance(outcome, Failed)
    return outcome


def test_a_stock_rejection_per_node_is_typed_and_plain() -> None:
    outcome = failed(BULLETS)
    assert outcome.error_type == ErrorType.PROMPT_REJECTED and not outcome.resubmit
    assert "node 5 (KSampler): input 'model': Required input is missing" in outcome.message
    assert "node 5 (KSampler): input 'seed': Value -5 smaller than min of 0" in outcome.message
    for repr_noise in ("[{", "extra_info", "dependent_outputs", "input_config"):
        assert repr_noise not in outcome.message


def test_a_stock_rejection_of_an_unknown_class_reads_comfyuis_raw_answer() -> None:
    outcome = failed(RAW)
    assert outcome.error_type == ErrorType.PROMPT_REJECTED
    assert "Cannot execute because node KSamplerr does not exist. (Node ID '#5')" in outcome.message
    assert "Raw response" not in outcome.message and "{" not in outcome.message


def test_a_stock_rejection_completed_with_an_error_is_typed_too() -> None:
    job = RunPodJob(id=JOB, status="COMPLETED", output={"error": BULLETS})
    outcome = read_job(job)
    assert isinstance(outcome, Failed) and outcome.error_type == ErrorType.PROMPT_REJECTED


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            "ComfyUI validation failed (could not parse error response): <html>502</html>",
            "ComfyUI refused the graph: <html>502</html>",
        ),
        # A repr the parser cannot read is kept as words, bounded.
        (
            "Workflow validation failed:\n• Node 3 (errors): [{'type': 'x', 'message': <object>}]"
            "\n• Node 3 (class_type): Foo",
            "node 3 (Foo): [{'type': 'x', 'message': <object>}]",
        ),
        (
            "Workflow validation failed:\n• Node 3 (errors): [" + "[" * 2000 + "]" * 2000 + "]",
            "node 3 (?):",
        ),
        (
            "Workflow validation failed:\n• Node 3 (errors): " + "x" * (MAX_REPR_CHARS + 10),
            "xxx...",
        ),
    ],
)
def test_stock_rejections_that_cannot_be_parsed_fall_back_to_their_words(
    text: str, says: str
) -> None:
    outcome = failed(text)
    assert outcome.error_type == ErrorType.PROMPT_REJECTED
    assert says in outcome.message
    assert len(outcome.message) <= 1000


@pytest.mark.parametrize(
    "text",
    [
        "Job processing failed",
        "Workflow execution error: Node Type: KSampler, Node ID: 3, Message: boom",
        "Error queuing workflow: Connection refused",
        "a list:\n• with bullets of its own",
    ],
)
def test_other_stock_errors_are_no_rejection(text: str) -> None:
    assert stock_rejection(text) is None
    assert failed(text).error_type == ErrorType.EXECUTION_ERROR


def test_our_handlers_rejection_is_said_once() -> None:
    """The handler sends its reason as the error and again as its one detail."""
    reason = "Prompt outputs failed validation; node 5 (KSampler): input 'seed': Value -5"
    outcome = failed(
        f"ComfyUI rejected the workflow: {reason}", error_type="PromptRejected", details=[reason]
    )
    assert outcome.error_type == ErrorType.PROMPT_REJECTED
    assert outcome.message.count(reason) == 1, outcome.message
    # A detail that adds something is still told.
    added = failed("ComfyUI died", error_type="BackendFault", details=["CUDA error: illegal"])
    assert "ComfyUI died (CUDA error: illegal)" in added.message
