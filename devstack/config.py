"""temporal-dev.yaml: the one file that describes the local stack and the worker's pools."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

DEFAULT_CONFIG_PATH = Path("temporal-dev.yaml")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TemporalSection(_Section):
    host: str = "127.0.0.1"
    port: int = 7233
    ui_port: int = 8233
    # The dev server picks these at random unless told; explicit ports make conflicts visible.
    http_port: int = 7243
    metrics_port: int = 7244
    namespace: str = "default"
    db_filename: str = "temporal.db"
    log_level: Literal["debug", "info", "warn", "error"] = "warn"
    search_attributes: dict[str, str] = Field(default_factory=dict)
    dynamic_config: dict[str, Any] = Field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def ui_url(self) -> str:
        return f"http://{self.host}:{self.ui_port}"


class S3Section(_Section):
    host: str = "127.0.0.1"
    s3_port: int = 8333
    master_port: int = 9333
    volume_port: int = 18080
    filer_port: int = 8888
    admin_port: int = 23646
    webdav_port: int = 7333
    # `weed mini` opens a gRPC port next to each HTTP one (default HTTP port + 10000); they are set
    # explicitly so that a clash is found before start, not in the middle of it.
    master_grpc_port: int = 19333
    volume_grpc_port: int = 28080
    filer_grpc_port: int = 18888
    s3_grpc_port: int = 18333
    # The admin server listens even with its UI off, on admin_port and admin_port + 10000 (its
    # maintenance workers assume that offset whatever -admin.port.grpc says). webdav_port must be
    # free even with WebDAV off: `weed mini` checks it anyway.
    admin_ui: bool = False
    webdav: bool = False

    @property
    def admin_grpc_port(self) -> int:
        return self.admin_port + 10000

    bucket: str = "durable-comfy-artifacts"
    region: str = "us-east-1"
    data_dir: str = "seaweedfs"

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.s3_port}"


class ComfySimSection(_Section):
    host: str = "127.0.0.1"
    port: int = 8188
    output_dir: str = "comfy-sim/output"
    input_dir: str = "comfy-sim/input"
    step_delay_ms: int = 100
    # Image nodes' time per megapixel; None leaves the simulator's own default.
    ms_per_megapixel: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class PoolConfig(_Section):
    """A named backend the worker may run jobs on. Requests name pools, never URLs."""

    kind: Literal["comfyui", "runpod"] = "comfyui"
    url: str | None = None
    endpoint_id: str | None = None


class WorkerSection(_Section):
    task_queue: str = "durable-comfy"
    default_pool: str = "comfyui"
    pools: dict[str, PoolConfig] = Field(default_factory=dict)


class StackConfig(_Section):
    state_dir: str = ".devstack"
    temporal: TemporalSection = Field(default_factory=TemporalSection)
    s3: S3Section = Field(default_factory=S3Section)
    comfyui_sim: ComfySimSection = Field(default_factory=ComfySimSection)
    worker: WorkerSection = Field(default_factory=WorkerSection)

    def path(self, base: Path, relative: str) -> Path:
        """Resolve a path from this file against the state dir (itself relative to `base`)."""
        candidate = Path(relative)
        if candidate.is_absolute():
            return candidate
        state = Path(self.state_dir)
        if not state.is_absolute():
            state = base / state
        return state / candidate


def load_stack_config(path: Path = DEFAULT_CONFIG_PATH) -> StackConfig:
    with path.open() as f:
        raw = yaml.safe_load(f) or {}
    return StackConfig.model_validate(raw)
