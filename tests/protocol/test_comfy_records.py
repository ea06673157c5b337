"""What the ComfyUI client makes of ComfyUI's own records: rejections, queue places, endings.

The shapes are ComfyUI 0.8.0's, as docs/comfyui-protocol.md and the conformance suite describe them.
"""

from __future__ import annotations

from typing import Any

from protocol.comfyui.client import QueuePlace
from protocol.comfyui.events import ending_of
from protocol.errors import describe_rejection


def test_rejection_keeps_node_class_input_and_comfyuis_message() -> None:
    error = {
        "type": "prompt_outputs_failed_validation",
        "message": "Prompt outputs failed validation",
        "details": "",
        "extra_info": {},
    }
    node_errors = {
        "3": {
            "errors": [
                {
                    "type": "value_smaller_than_min",
                    "message": "Value -5 smaller than min of 0",
                    "details": "seed",
                    "extra_info": {"input_name": "seed", "received_value": -5},
                }
            ],
            "dependent_outputs": ["9"],
            "class_type": "KSampler",
        }
    }
    text = describe_rejection(error, node_errors)
    assert text == (
        "Prompt outputs failed validation; "
        "node 3 (KSampler): input 'seed': Value -5 smaller than min of 0"
    )


def test_rejection_keeps_details_that_say_more_than_the_input_name() -> None:
    error = {
        "type": "invalid_prompt",
        "message": "Cannot execute because node NoSuchNode does not exist.",
        "details": "Node ID '#1'",
        "extra_info": {},
    }
    assert describe_rejection(error, {}) == (
        "Cannot execute because node NoSuchNode does not exist. (Node ID '#1')"
    )
    item = {
        "type": "custom_validation_failed",
        "message": "Custom validation failed for node",
        "details": "image - Invalid image file: nope.png",
        "extra_info": {"input_name": "image"},
    }
    text = describe_rejection(
        {"message": "m"}, {"5": {"errors": [item], "class_type": "LoadImage"}}
    )
    assert "node 5 (LoadImage): input 'image': Custom validation failed for node" in text
    assert "Invalid image file: nope.png" in text


def test_queue_place_orders_pending_by_number() -> None:
    queue: dict[str, list[list[Any]]] = {
        "queue_running": [[4, "r", {}, {}, []]],
        # /queue does not promise an order: ComfyUI runs the lowest number first.
        "queue_pending": [[9, "c", {}, {}, []], [5, "a", {}, {}, []], [7, "b", {}, {}, []]],
    }
    assert QueuePlace.of("r", queue).where == "running"
    assert QueuePlace.of("a", queue).position == 1
    assert QueuePlace.of("c", queue) == QueuePlace("pending", 3, ("r",))
    assert QueuePlace.of("zz", queue).where is None


def test_ending_reads_the_prompts_own_messages() -> None:
    interrupted = {
        "status": {
            "status_str": "error",
            "completed": False,
            "messages": [
                ["execution_start", {"prompt_id": "p"}],
                [
                    "execution_interrupted",
                    {"prompt_id": "p", "node_id": "2", "node_type": "ImageBlur", "executed": []},
                ],
            ],
        }
    }
    ending = ending_of(interrupted)
    assert (ending.outcome, ending.node, ending.node_type) == ("interrupted", "2", "ImageBlur")
    failed = {
        "status": {
            "status_str": "error",
            "messages": [
                [
                    "execution_error",
                    {
                        "node_id": 3,
                        "node_type": "KSampler",
                        "exception_type": "torch.OutOfMemoryError",
                        "exception_message": "CUDA out of memory",
                    },
                ]
            ],
        }
    }
    assert ending_of(failed).outcome == "error" and ending_of(failed).node == "3"
    assert "out of memory" in ending_of(failed).message
    assert ending_of({"status": {"status_str": "success", "messages": []}}).outcome == "success"
    assert ending_of(None).outcome == "unknown"


def test_comfyui_http_errors_keep_their_status_and_say_what_kind_they_are() -> None:
    from activities.errors import from_comfy
    from protocol.errors import ComfyHTTPError, ComfyUnavailable
    from workflows.shared import ErrorType

    refused = from_comfy(ComfyHTTPError("GET /view 'x.png': HTTP 404", 404), "fetching x.png")
    assert (refused.type, refused.non_retryable) == (ErrorType.BACKEND_ERROR, True)
    assert refused.details == ({"status_code": 404},)
    too_big = from_comfy(ComfyHTTPError("POST /upload/image: HTTP 413", 413), "uploading")
    assert too_big.type == ErrorType.INVALID_REQUEST and "max-upload-size" in too_big.message
    down = from_comfy(ComfyUnavailable("GET /queue: HTTP 502"), "asking the queue")
    assert (down.type, down.non_retryable) == (ErrorType.BACKEND_UNAVAILABLE, False)
