"""A synchronous handler that returns its input: `{"echo": input}`."""

from __future__ import annotations

from typing import Any

import runpod  # type: ignore[import-not-found]


def handler(job: dict[str, Any]) -> dict[str, Any]:
    return {"echo": job["input"]}


if __name__ == "__main__":
    runpod.serverless.start({"handler": handler})
