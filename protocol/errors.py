"""Every exception of the protocol core's own making, shared by the worker and the RunPod
handler. Each side maps them once, at its edge: activities/errors.py into Temporal's
`ApplicationError`s, endpoint/failures.py into the handler's `EndpointError`.

    ComfyError                     talking to ComfyUI failed (comfyui/client.py, from httpx)
    ├── ComfyUnavailable           connection refused/reset, timeouts, 5xx: worth retrying later
    ├── ComfyPromptRejected        400 from /prompt: the graph is wrong, retrying cannot help
    └── ComfyHTTPError             any other unexpected status
    UnsafeOutputName (ValueError)  an output record `/view` is not asked for: no retry changes
                                   a name
    PromptLost                     ComfyUI knows nothing of a prompt it was given (it restarted)
    ComfyGone                      ComfyUI's process exited or never answered
    HistoryMissing                 the prompt ended, and no history entry was written in time
    TooManyParts (ValueError)      a stream longer than S3's 10,000 parts of the upload's size

Untrusted names reach these messages only through `protocol.keys.shown`.
"""

from __future__ import annotations

from typing import Any

from protocol.keys import shown

# -- ComfyUI ---------------------------------------------------------------------------------


class ComfyError(Exception):
    """Base of every error talking to ComfyUI."""


class ComfyUnavailable(ComfyError):
    """The server could not be reached or answered 5xx."""


class ComfyHTTPError(ComfyError):
    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class UnsafeOutputName(ValueError):
    """An output record the client will not ask `/view` for (comfyui/client.py
    `check_view_request`)."""

    def __init__(self, filename: str, subfolder: str, kind: str, reason: str) -> None:
        self.filename = filename
        self.subfolder = subfolder
        self.kind = kind
        self.reason = reason
        super().__init__(
            f"output {shown(filename)} (subfolder {shown(subfolder)}, type {shown(kind)}) "
            f"refused, not fetched: {reason}"
        )


class ComfyPromptRejected(ComfyError):
    """/prompt answered 400: `error` and `node_errors` are ComfyUI's own."""

    def __init__(self, error: dict[str, Any], node_errors: dict[str, Any]) -> None:
        self.error = error
        self.node_errors = node_errors
        super().__init__(describe_rejection(error, node_errors))


def describe_rejection(error: dict[str, Any], node_errors: dict[str, Any]) -> str:
    """ComfyUI's reason in full: node, class, input name *and* ComfyUI's own message.

    `details` is often just the input name ("seed") while the reason is in `message`
    ("Value -5 smaller than min of 0"): both are kept.
    """
    parts = [_join(error.get("message") or error.get("type") or "prompt rejected", error)]
    for node_id, entry in node_errors.items():
        if not isinstance(entry, dict):
            continue
        where = f"node {node_id} ({entry.get('class_type', '?')})"
        for item in entry.get("errors", []):
            if isinstance(item, dict):
                parts.append(f"{where}: {_describe_item(item)}")
    return "; ".join(parts)


def _describe_item(item: dict[str, Any]) -> str:
    extra = item.get("extra_info")
    if not isinstance(extra, dict):
        extra = {}
    input_name = extra.get("input_name")
    message = str(item.get("message") or item.get("type") or "invalid")
    text = f"input {input_name!r}: {message}" if input_name else message
    text = _join(text, item, skip={str(input_name)} if input_name else set())
    if "received_value" in extra and str(extra["received_value"]) not in text:
        text += f" (got {extra['received_value']!r})"
    return text


def _join(text: object, error: dict[str, Any], skip: set[str] | None = None) -> str:
    """`text`, plus `details` when they add something to it."""
    out = str(text)
    details = error.get("details")
    if details and str(details) not in (skip or set()) and str(details) not in out:
        out += f" ({details})"
    return out


class PromptLost(Exception):
    """ComfyUI knows nothing of a prompt it was given (it restarted)."""


class ComfyGone(Exception):
    """ComfyUI's process exited or never answered: this worker cannot run anything."""


class HistoryMissing(Exception):
    """The prompt ended but ComfyUI wrote no history entry for it in time."""


# -- S3 --------------------------------------------------------------------------------------


class TooManyParts(ValueError):
    """The stream is longer than S3's 10,000 parts of the upload's part size: no retry fits it."""
