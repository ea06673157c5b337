"""Bounds on the parts of a `JobRequest` that are not the graph (workflows/graph.py checks that).

Pure functions, run by `JobRequest`'s validators: in the client before anything is sent, and
again when the workflow reads its input. A hostile request (a million labels, a segment list of
a megabyte of nesting, a deadline of a thousand years) is refused with a `RequestRefused` naming
the field, before it costs a workflow task or a timer Temporal cannot represent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from workflows.errors import RequestRefused
from workflows.graph import (
    MAX_NODE_ID_CHARS,
    MAX_STRING_CHARS,
    file_input_problem,
    is_unicode,
    name_problem,
    value_problem,
)

MAX_SEGMENTS = 10_000
MAX_INPUTS = 100
MAX_INPUT_NAME_CHARS = 255
MAX_LABELS = 64
MAX_LABEL_KEY_CHARS = 64
MAX_LABEL_VALUE_CHARS = 256
# Temporal timers and timeouts are protobuf Durations; a year is past any GPU job.
MAX_POLICY_SECONDS = 366 * 24 * 3600.0
POLICY_DURATIONS = (
    "execution_timeout_s",
    "start_by_s",
    "queue_timeout_s",
    "heartbeat_timeout_s",
    "abandon_after_s",
    "progress_interval_s",
    "teardown_horizon_s",
)
RECONNECT_DURATIONS = ("base_delay_s", "max_delay_s", "horizon_s")


def check_segments(segments: Sequence[Any]) -> None:
    """Each segment is `{node_id: {input: value}}`, with values bounded like graph inputs."""
    if len(segments) > MAX_SEGMENTS:
        raise RequestRefused("segments", f"{len(segments):,} segments; at most {MAX_SEGMENTS:,}")
    for index, overrides in enumerate(segments):
        for node_id, values in overrides.items():
            field = f"segments.{index}.{str(node_id)[:MAX_NODE_ID_CHARS]}"
            problem = name_problem(node_id, MAX_NODE_ID_CHARS)
            if problem:
                raise RequestRefused(field, f"node id {problem}")
            if not isinstance(values, dict):
                raise RequestRefused(
                    field, 'an override is an object of inputs, e.g. {"3": {"seed": 1}}'
                )
            for name, value in values.items():
                problem = name_problem(name, MAX_STRING_CHARS) or value_problem(value)
                if problem:
                    raise RequestRefused(f"{field}.{str(name)[:MAX_NODE_ID_CHARS]}", problem)


def check_input_names(inputs: Mapping[str, Any]) -> None:
    if len(inputs) > MAX_INPUTS:
        raise RequestRefused("inputs", f"{len(inputs)} inputs; at most {MAX_INPUTS}")
    for name in inputs:
        problem = name_problem(name, MAX_INPUT_NAME_CHARS)
        if problem:
            raise RequestRefused(f"inputs.{name[:MAX_NODE_ID_CHARS]}", f"input name {problem}")
        # The name is the file's name on the backend, where a path or an annotation would
        # point outside the input folder.
        problem = file_input_problem(name)
        if problem:
            raise RequestRefused(
                f"inputs.{name[:MAX_NODE_ID_CHARS]}",
                f"input name {problem}: an input is named like a file (cat.png)",
            )


def check_labels(labels: Mapping[str, str]) -> None:
    if len(labels) > MAX_LABELS:
        raise RequestRefused("labels", f"{len(labels)} labels; at most {MAX_LABELS}")
    for key, value in labels.items():
        field = f"labels.{key[:MAX_LABEL_KEY_CHARS]}"
        problem = name_problem(key, MAX_LABEL_KEY_CHARS)
        if problem:
            raise RequestRefused(field, f"label name {problem}")
        if len(value) > MAX_LABEL_VALUE_CHARS:
            raise RequestRefused(
                field, f"{len(value):,} characters; at most {MAX_LABEL_VALUE_CHARS}"
            )
        if not is_unicode(value):
            raise RequestRefused(field, "a lone surrogate (not Unicode text)")


def check_policy(policy: Any) -> None:
    """Every duration of the policy at most `MAX_POLICY_SECONDS` (they become timers)."""
    durations = [(f"policy.{name}", getattr(policy, name)) for name in POLICY_DURATIONS]
    durations += [
        (f"policy.reconnect.{name}", getattr(policy.reconnect, name))
        for name in RECONNECT_DURATIONS
    ]
    for field, seconds in durations:
        if seconds is not None and not seconds <= MAX_POLICY_SECONDS:
            raise RequestRefused(
                field, f"{seconds} s; at most {MAX_POLICY_SECONDS:,.0f} s (366 days)"
            )
