"""The worker's settings: which pools it serves and where artifacts go.

Pools come from the `worker:` section of temporal-dev.yaml (`DURABLE_COMFY_CONFIG`) or from
`DURABLE_COMFY_POOLS` (JSON `{name: {kind, url}}`), which wins. Credentials come only from the
environment and are never part of a request, a result or a log line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from workflows.shared import DEFAULT_TASK_QUEUE


class PoolConfig(BaseModel):
    """A named backend the worker may run jobs on. Requests name pools, never URLs."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["comfyui", "runpod"] = "comfyui"
    url: str | None = None
    endpoint_id: str | None = None


class WorkerSection(BaseModel):
    """The `worker:` section of a stack file (temporal-dev.yaml): what this worker serves."""

    model_config = ConfigDict(extra="forbid")

    task_queue: str = DEFAULT_TASK_QUEUE
    default_pool: str = "comfyui"
    pools: dict[str, PoolConfig] = Field(default_factory=dict)


def read_worker_section(path: Path) -> WorkerSection:
    """Only the worker's own section: the rest of the file describes the local stack."""
    data: Any = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return WorkerSection.model_validate(data.get("worker") or {})


class WorkerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_queue: str = DEFAULT_TASK_QUEUE
    default_pool: str = "comfyui"
    pools: dict[str, PoolConfig] = Field(default_factory=dict)
    max_concurrent_activities: int = 100
    # How often each worker looks for prompts whose job is over (0: never).
    orphan_sweep_interval_s: float = Field(60.0, ge=0)
    # Serve Prometheus metrics (Temporal's and ours) on 127.0.0.1:<port>/metrics.
    metrics_port: int | None = Field(None, ge=1, le=65535)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> WorkerSettings:
        settings = cls()
        config_path = environ.get("DURABLE_COMFY_CONFIG")
        if config_path:
            worker = read_worker_section(Path(config_path))
            settings = cls(
                task_queue=worker.task_queue,
                default_pool=worker.default_pool,
                pools=dict(worker.pools),
            )
        pools_json = environ.get("DURABLE_COMFY_POOLS")
        if pools_json:
            pools = TypeAdapter(dict[str, PoolConfig]).validate_python(json.loads(pools_json))
            settings = settings.model_copy(update={"pools": pools})
        if environ.get("DURABLE_COMFY_TASK_QUEUE"):
            settings = settings.model_copy(
                update={"task_queue": environ["DURABLE_COMFY_TASK_QUEUE"]}
            )
        if environ.get("DURABLE_COMFY_DEFAULT_POOL"):
            settings = settings.model_copy(
                update={"default_pool": environ["DURABLE_COMFY_DEFAULT_POOL"]}
            )
        if environ.get("DURABLE_COMFY_METRICS_PORT"):
            settings = settings.model_copy(
                update={"metrics_port": int(environ["DURABLE_COMFY_METRICS_PORT"])}
            )
        if environ.get("DURABLE_COMFY_ORPHAN_SWEEP_S"):
            settings = settings.model_copy(
                update={"orphan_sweep_interval_s": float(environ["DURABLE_COMFY_ORPHAN_SWEEP_S"])}
            )
        return settings
