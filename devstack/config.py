"""temporal-dev.yaml: the one file that describes the local stack and the worker's pools."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from configuration.files import WorkerSection
from configuration.pools import PoolConfig as PoolConfig

# The worker's own section belongs to the product, which reads it without the dev stack; the
# stack file embeds it. Re-exported for the dev stack's users.
from configuration.sources import Settings

DEFAULT_CONFIG_PATH = Path("temporal-dev.yaml")
# What `durable-comfy dev` and `make demo` read when no --config is given; .devstack/env exports it.
CONFIG_ENV = "DURABLE_COMFY_CONFIG"


class StackFileSettings(Settings):
    """Which stack file to use without --config: $DURABLE_COMFY_CONFIG, else temporal-dev.yaml.

    (`durable-comfy dev` gets the same from its --config option's envvar.)
    """

    config_file: Path = Field(DEFAULT_CONFIG_PATH, validation_alias=CONFIG_ENV)


Port = Annotated[int, Field(ge=1, le=65535)]

# weed's own rule (GrpcPortOffset): a component's gRPC port is its HTTP port + 10000.
SEAWEED_GRPC_OFFSET = 10000


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _derive_missing(data: Any, model: type[BaseModel], rules: Mapping[str, tuple[str, int]]) -> Any:
    """Fill each omitted port from the port it belongs with (`key: (base_key, offset)`).

    A file written before a port was listed must not keep that port on its default when the
    file's other ports are moved: an omitted port follows its base port instead.
    """
    if not isinstance(data, dict):
        return data
    filled = dict(data)
    for key, (base_key, offset) in rules.items():
        if key in filled:
            continue
        base = filled.get(base_key, model.model_fields[base_key].default)
        try:
            filled[key] = int(base) + offset
        except (TypeError, ValueError):
            pass  # the base port itself is invalid, and its own validation says so
    return filled


class TemporalSection(_Section):
    host: str = "127.0.0.1"
    port: Port = 7233
    # The dev server's own default for the UI is port + 1000; HTTP API and metrics it would put on
    # random ports. Omitted, each follows `port` (the defaults are port + 1000, + 10, + 11).
    ui_port: Port = 8233
    http_port: Port = 7243
    metrics_port: Port = 7244
    namespace: str = "default"
    db_filename: str = "temporal.db"
    log_level: Literal["debug", "info", "warn", "error"] = "warn"
    search_attributes: dict[str, str] = Field(default_factory=dict)
    dynamic_config: dict[str, Any] = Field(default_factory=dict)
    # `--sqlite-pragma NAME=VALUE` for the dev server's database (it accepts journal_mode and
    # synchronous).
    sqlite_pragmas: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _derive_ports(cls, data: Any) -> Any:
        return _derive_missing(
            data,
            cls,
            {"ui_port": ("port", 1000), "http_port": ("port", 10), "metrics_port": ("port", 11)},
        )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def ui_url(self) -> str:
        return f"http://{self.host}:{self.ui_port}"


class S3Section(_Section):
    host: str = "127.0.0.1"
    s3_port: Port = 8333
    master_port: Port = 9333
    volume_port: Port = 18080
    filer_port: Port = 8888
    # The admin server listens even with its UI off, on admin_port and admin_port + 10000 (its
    # maintenance workers assume that offset whatever -admin.port.grpc says), so its gRPC port is
    # not a setting of its own: moving admin_port moves both.
    admin_port: Annotated[int, Field(ge=1, le=65535 - SEAWEED_GRPC_OFFSET)] = 23646
    # `weed mini` checks this port even with WebDAV off.
    webdav_port: Port = 7333
    # `weed mini` opens a gRPC port next to each HTTP one. Omitted, each is its HTTP port + 10000,
    # as weed itself would have it; the launcher always passes them, so a clash is found before
    # start and never "solved" by weed quietly moving to another port.
    master_grpc_port: Port = 19333
    volume_grpc_port: Port = 28080
    filer_grpc_port: Port = 18888
    s3_grpc_port: Port = 18333
    admin_ui: bool = False
    webdav: bool = False
    bucket: str = "durable-comfy-artifacts"
    region: str = "us-east-1"
    data_dir: str = "seaweedfs"

    @model_validator(mode="before")
    @classmethod
    def _derive_grpc_ports(cls, data: Any) -> Any:
        return _derive_missing(
            data,
            cls,
            {
                f"{name}_grpc_port": (f"{name}_port", SEAWEED_GRPC_OFFSET)
                for name in ("master", "volume", "filer", "s3")
            },
        )

    @property
    def admin_grpc_port(self) -> int:
        return self.admin_port + SEAWEED_GRPC_OFFSET

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.s3_port}"


class ComfySimSection(_Section):
    host: str = "127.0.0.1"
    port: Port = 8188
    output_dir: str = "comfy-sim/output"
    input_dir: str = "comfy-sim/input"
    step_delay_ms: int = 100
    # Image nodes' time per megapixel; None leaves the simulator's own default.
    ms_per_megapixel: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class RunpodSimSection(_Section):
    """The RunPod serverless simulator (devstack/runpod_sim): RunPod's API and worker loop, with
    our handler (endpoint/) in a worker process per RunPod worker, each with a ComfyUI simulator
    of its own on a free port the simulator picks."""

    host: str = "127.0.0.1"
    port: Port = 8288  # the public API (/v2/...), the workers' API and /sim/ (ledger, faults)
    endpoint_id: str = Field("local-sim", pattern=r"^[A-Za-z0-9_-]+$")
    # Seconds a worker stays up (and billed) after its last job, as on a RunPod endpoint.
    idle_timeout_s: float = Field(5.0, ge=0)
    max_workers: int = Field(2, ge=1)
    # The per-worker ComfyUI simulator's time per sampler step.
    comfyui_step_delay_ms: int = Field(100, ge=0)
    # Worker logs and each worker's ComfyUI files.
    work_dir: str = "runpod-sim"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def api_url(self) -> str:
        """What a runpod pool's `url` is: RunPod's `https://api.runpod.ai/v2`, here."""
        return f"{self.base_url}/v2"


class CodecSection(_Section):
    """Payload encryption for the stack (docs/security.md), off unless `enabled`.

    On, `up` makes a key file in the state dir (once, 0600), exports it to workers and the CLI
    through the env file (DURABLE_COMFY_CODEC_KEYS_FILE), starts `durable-comfy codec-server`
    on `port` for the UI's origin, and gives the Temporal UI that endpoint.
    """

    enabled: bool = False
    host: str = "127.0.0.1"
    port: Port = 8234
    keys_file: str = "codec-keys"
    # The variable holding a bearer token the codec server then requires (the UI must send it:
    # its codec settings' "pass access token"); None: no auth on loopback.
    auth_token_env: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class StackConfig(_Section):
    state_dir: str = ".devstack"
    temporal: TemporalSection = Field(default_factory=TemporalSection)
    s3: S3Section = Field(default_factory=S3Section)
    comfyui_sim: ComfySimSection = Field(default_factory=ComfySimSection)
    runpod_sim: RunpodSimSection = Field(default_factory=RunpodSimSection)
    codec: CodecSection = Field(default_factory=CodecSection)
    worker: WorkerSection = Field(default_factory=WorkerSection)

    @model_validator(mode="after")
    def _runpod_pools_match_the_simulator(self) -> StackConfig:
        """A runpod pool on the simulator's URL must name the endpoint the simulator serves (a
        copy with the port moved in one place only would otherwise fail job by job)."""
        sim = self.runpod_sim
        for name, pool in self.worker.pools.items():
            if pool.kind == "runpod" and pool.url == sim.api_url:
                if pool.endpoint_id != sim.endpoint_id:
                    raise ValueError(
                        f"worker.pools.{name} points at the RunPod simulator ({sim.api_url}) but "
                        f"names endpoint {pool.endpoint_id!r}; runpod_sim.endpoint_id is "
                        f"{sim.endpoint_id!r}"
                    )
        return self

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
