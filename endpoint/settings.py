"""The handler's settings, read once from the worker's environment.

Bucket credentials come only from here (worker-comfyui's `BUCKET_*` names), never from a job.
Plain pydantic rather than pydantic-settings: the endpoint's venv keeps to its four requirements.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from endpoint.errors import SettingsError
from endpoint.fence_file import DEFAULT_FENCE_FILE

DEFAULT_COMFY_URL = "http://127.0.0.1:8188"
# ComfyUI's root in worker-comfyui's images, which endpoint/Dockerfile builds on.
DEFAULT_COMFY_DIR = Path("/comfyui")


@dataclass(frozen=True)
class ComfyFolders:
    """ComfyUI's three file folders on this worker (its `input`, `output` and `temp` types)."""

    input: Path
    output: Path
    temp: Path


class BucketSettings(BaseModel):
    """The S3-compatible bucket service the handler writes artifacts and claims to."""

    model_config = ConfigDict(frozen=True)

    endpoint_url: str
    access_key_id: SecretStr
    secret_access_key: SecretStr
    region: str | None = None
    # SeaweedFS, MinIO and R2 want path-style; AWS accepts it too.
    addressing_style: Literal["path", "virtual", "auto"] = "path"
    # Only for stock inputs (no `durable_comfy` block, so no bucket in the job): without it they
    # get base64 results, as with worker-comfyui and no bucket.
    default_bucket: str | None = None
    stock_prefix: str = "runpod"


class EndpointSettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    comfy_url: str = DEFAULT_COMFY_URL
    # ComfyUI's process: while it lives the handler waits for it without a cap (a cold start of a
    # large model image can take many minutes); without it, `comfy_start_timeout_s` applies.
    comfy_pid: int | None = Field(None, gt=0)
    comfy_start_timeout_s: float = Field(900.0, gt=0)
    bucket: BucketSettings | None = None
    # The RunPod worker (pod) running this handler; recorded in claims.
    worker_id: str = Field(default_factory=socket.gethostname)
    # How long the socket may stay silent before /queue and /history are asked.
    silence_check_s: float = Field(5.0, gt=0)
    # How long ComfyUI may stay unreachable mid-job before the worker is given up.
    comfy_lost_after_s: float = Field(60.0, gt=0)
    # worker-comfyui's REFRESH_WORKER: replace the worker after every job.
    refresh_worker: bool = False
    # BUCKET_RETRY_S: how long each S3 call (and each output file) keeps retrying through a
    # storage outage, from its first failure, before the job gives up on it (StorageError).
    bucket_retry_s: float = Field(300.0, ge=0)
    # RUNPOD_ENDPOINT_ID: the endpoint this worker serves (set by the platform).
    endpoint_id: str = ""
    # DURABLE_COMFY_BUCKET: the orchestrator's default bucket; when set, the worker publishes
    # its ComfyUI's node registry there at start (`contract.nodes_key(endpoint_id)`).
    nodes_bucket: str | None = None
    # Where ComfyUI keeps files, so that each job's can be removed (endpoint/job_files.py):
    # COMFY_DIR, its root; the others as given to ComfyUI's --input-directory,
    # --output-directory and --temp-directory when it runs with them.
    comfy_dir: Path = DEFAULT_COMFY_DIR
    comfy_input_dir: Path | None = None
    comfy_output_dir: Path | None = None
    comfy_temp_dir: Path | None = None
    # DURABLE_COMFY_FENCE_FILE: where the handler tells its watchdog (endpoint/watchdog.py) until
    # when the claim it holds is surely its own (endpoint/fence_file.py); None writes none.
    fence_file: Path | None = DEFAULT_FENCE_FILE

    @property
    def comfy_folders(self) -> ComfyFolders:
        """The folders ComfyUI reads inputs from and writes outputs and previews to."""
        return ComfyFolders(
            input=self.comfy_input_dir or self.comfy_dir / "input",
            output=self.comfy_output_dir or self.comfy_dir / "output",
            # ComfyUI puts its temp folder *inside* --temp-directory (main.py joins "temp").
            temp=(self.comfy_temp_dir or self.comfy_dir) / "temp",
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EndpointSettings:
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        optional = {
            "COMFY_URL": "comfy_url",
            "COMFY_PID": "comfy_pid",
            "COMFY_START_TIMEOUT_S": "comfy_start_timeout_s",
            "COMFY_SILENCE_CHECK_S": "silence_check_s",
            "COMFY_LOST_AFTER_S": "comfy_lost_after_s",
            "RUNPOD_POD_ID": "worker_id",
            "BUCKET_RETRY_S": "bucket_retry_s",
            "RUNPOD_ENDPOINT_ID": "endpoint_id",
            "DURABLE_COMFY_BUCKET": "nodes_bucket",
            "COMFY_DIR": "comfy_dir",
            "COMFY_INPUT_DIR": "comfy_input_dir",
            "COMFY_OUTPUT_DIR": "comfy_output_dir",
            "COMFY_TEMP_DIR": "comfy_temp_dir",
            "DURABLE_COMFY_FENCE_FILE": "fence_file",
        }
        for variable, field in optional.items():
            if env.get(variable):
                values[field] = env[variable]
        values["refresh_worker"] = env.get("REFRESH_WORKER", "false").lower() == "true"
        values["bucket"] = _bucket_from_env(env)
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            names = {field: variable for variable, field in optional.items()}
            problems = "; ".join(
                f"{names.get(str(err['loc'][0]), err['loc'][0])}: {err['msg']}"
                for err in exc.errors()
            )
            raise SettingsError(f"bad handler environment: {problems}") from exc


def _bucket_from_env(env: Mapping[str, str]) -> BucketSettings | None:
    endpoint = env.get("BUCKET_ENDPOINT_URL", "")
    key_id = env.get("BUCKET_ACCESS_KEY_ID", "")
    secret = env.get("BUCKET_SECRET_ACCESS_KEY", "")
    if not endpoint:
        return None
    if not (key_id and secret):
        raise SettingsError(
            "BUCKET_ENDPOINT_URL is set but BUCKET_ACCESS_KEY_ID / BUCKET_SECRET_ACCESS_KEY "
            "are not: set both, or unset BUCKET_ENDPOINT_URL for base64 results"
        )
    style = env.get("BUCKET_ADDRESSING_STYLE", "path")
    if style not in ("path", "virtual", "auto"):
        raise SettingsError("BUCKET_ADDRESSING_STYLE must be path, virtual or auto")
    return BucketSettings(
        endpoint_url=endpoint,
        access_key_id=SecretStr(key_id),
        secret_access_key=SecretStr(secret),
        region=env.get("BUCKET_REGION") or None,
        addressing_style=style,
        default_bucket=env.get("BUCKET_NAME") or None,
        stock_prefix=env.get("BUCKET_PREFIX") or "runpod",
    )
