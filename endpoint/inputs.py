"""Reading `job["input"]`: the contract's EndpointInput, and input files as bytes.

Every problem becomes an `InputProblem` whose message says what to fix, since it is returned to
whoever sent the job as `{"error": ...}`.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from pydantic import ValidationError

from endpoint.errors import InputProblem
from protocol.runpod.contract import EndpointInput, InputImage


def read_input(raw: Any) -> EndpointInput:
    if raw is None:
        raise InputProblem("no input: send {'input': {'workflow': {...}}}")
    if isinstance(raw, str):
        # worker-comfyui accepts the whole input as a JSON string too.
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise InputProblem(f"input is a string but not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise InputProblem(f"input must be an object, not {type(raw).__name__}")
    if "workflow" not in raw:
        raise InputProblem(
            "missing 'workflow': send the ComfyUI graph in API format (an object or a JSON "
            "string), e.g. from ComfyUI's 'Export (API)'"
        )
    try:
        return EndpointInput.model_validate(raw)
    except ValidationError as exc:
        raise InputProblem(f"invalid input: {describe(exc)}") from exc


def describe(exc: ValidationError) -> str:
    """`field.path: reason` for each error, without pydantic's URLs and input echoes."""
    parts = []
    for error in exc.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in error["loc"]) or "input"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


def decode_image(index: int, image: InputImage) -> bytes:
    """The file of `images[index]`: plain base64 or a `data:...;base64,` URI."""
    data = image.image.strip()
    if data.startswith("data:"):
        header, sep, data = data.partition(",")
        if not sep or not header.endswith(";base64"):
            raise InputProblem(
                f"images[{index}] ({image.name!r}): a data URI must be base64 "
                "('data:image/png;base64,...')"
            )
    try:
        # Line breaks (MIME-style base64) are not errors.
        return base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InputProblem(
            f"images[{index}] ({image.name!r}): 'image' is not valid base64 ({exc})"
        ) from exc
