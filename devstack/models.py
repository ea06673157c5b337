"""What the launcher returns: endpoints and credentials for code, a secret-free view to print."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr

from devstack.services import ServiceName


class ServiceState(BaseModel):
    name: ServiceName
    state: Literal["running", "unhealthy", "stopped"]
    # What this call did: None for `status`.
    action: Literal["started", "already running", "stopped", "was not running"] | None = None
    pid: int | None = None
    url: str
    # What the URL alone does not say (the RunPod simulator's endpoint id).
    note: str | None = None
    log_file: Path
    # Seconds from spawn until the health probe passed, for services this call started.
    ready_s: float | None = None
    detail: str | None = None


class StackStatus(BaseModel):
    state_dir: Path
    env_file: Path
    services: dict[ServiceName, ServiceState]

    @property
    def all_running(self) -> bool:
        return all(s.state == "running" for s in self.services.values())


_SECRET_FIELDS = frozenset({"access_key_id", "secret_access_key", "runpod_api_key"})


class RunningStack(BaseModel):
    temporal_address: str
    namespace: str
    temporal_ui: str
    s3_endpoint: str
    bucket: str
    region: str
    access_key_id: str
    secret_access_key: SecretStr
    comfyui_url: str
    # The RunPod simulator's API base (a runpod pool's `url`; RunPod's is
    # https://api.runpod.ai/v2), its endpoint, and the key its public API wants.
    runpod_url: str
    runpod_endpoint_id: str
    runpod_api_key: SecretStr
    state_dir: Path
    env_file: Path
    temporal_config_file: Path
    temporal_profile: str
    config_file: Path
    services: dict[ServiceName, ServiceState] = Field(default_factory=dict)
    # With the stack file's `codec.enabled`: the payload keys and the codec server for the UI.
    codec_keys_file: Path | None = None
    codec_endpoint: str | None = None

    def worker_env(self) -> dict[str, str]:
        """The environment a worker or CLI needs to use this stack (what STATE/env exports)."""
        return {
            "TEMPORAL_ADDRESS": self.temporal_address,
            "TEMPORAL_NAMESPACE": self.namespace,
            "TEMPORAL_CONFIG_FILE": str(self.temporal_config_file),
            "TEMPORAL_PROFILE": self.temporal_profile,
            "TEMPORAL_UI_URL": self.temporal_ui,
            "DURABLE_COMFY_CONFIG": str(self.config_file),
            "DURABLE_COMFY_S3_ENDPOINT": self.s3_endpoint,
            "DURABLE_COMFY_BUCKET": self.bucket,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key.get_secret_value(),
            "AWS_REGION": self.region,
            # botocore reads AWS_DEFAULT_REGION, other SDKs AWS_REGION.
            "AWS_DEFAULT_REGION": self.region,
            # botocore >= 1.31 sends S3 calls here even when the code names no endpoint.
            "AWS_ENDPOINT_URL_S3": self.s3_endpoint,
            # The RunPod simulator's key, for the stack file's runpod pool (its api_key_env).
            "RUNPOD_API_KEY": self.runpod_api_key.get_secret_value(),
        } | self._codec_env()

    def _codec_env(self) -> dict[str, str]:
        if self.codec_keys_file is None:
            return {}
        return {"DURABLE_COMFY_CODEC_KEYS_FILE": str(self.codec_keys_file)}

    def env_file_text(self) -> str:
        lines = [
            "# Written by `durable-comfy dev up`. Contains the local S3 secret and the RunPod",
            "# simulator's API key: keep it 0600. Sourcing it sets RUNPOD_API_KEY to the",
            "# simulator's key in that shell (a real one there is replaced).",
            f"# Use: . {shlex.quote(str(self.env_file))}",
        ]
        if self.codec_endpoint is not None:
            lines += [
                "# Payloads are encrypted; the temporal CLI decodes them through the codec server:",
                f"#   temporal --codec-endpoint {self.codec_endpoint} workflow show -w JOB_ID",
            ]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in self.worker_env().items()]
        return "\n".join(lines) + "\n"

    def public_view(self) -> dict[str, Any]:
        """Everything worth printing, without the credentials."""
        return self.model_dump(mode="json", exclude=set(_SECRET_FIELDS))
