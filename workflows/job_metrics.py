"""The workflow's own metrics, on the SDK's workflow meter (silent while replaying)."""

from __future__ import annotations

from temporalio import workflow
from temporalio.common import MetricCounter


def counter(name: str, description: str) -> MetricCounter:
    """A counter named durable_comfy_<name>."""
    return workflow.metric_meter().create_counter("durable_comfy_" + name, description)
