"""What each process reads at its start: its section of the configuration, read once.

    the worker       WorkerConfig   the production file's worker, pools, storage and codec
                                    sections (or the stack file's worker section)
    the job commands CliConfig      its client, storage (on demand), codec and worker.task_queue
    the gateway      GatewayConfig  its own variables and Temporal's; its JobClient reads the
                                    client's, as `JobClient.connect()` does for any script

Each `load()` reads the environment now and raises the settings' own error (a pydantic
`ValidationError` naming the variable, `SettingsError`, `StorageConfigError`): the process says
so and stops before it does anything. Nothing is read later but what a process only needs on
demand (the CLI's bucket, the worker's URL-input limits at its first URL input).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import SecretStr

from configuration.settings import (
    CliSettings,
    GatewaySettings,
    S3Settings,
    TemporalSettings,
    WebhookSettings,
    WorkerSettings,
    runpod_api_keys,
)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything the worker is configured with."""

    settings: WorkerSettings
    s3: S3Settings
    temporal: TemporalSettings
    # Each runpod pool's API key, by pool.
    runpod_keys: Mapping[str, SecretStr]
    webhooks: WebhookSettings

    @classmethod
    def load(cls, **flags: Any) -> WorkerConfig:
        """From the process's environment, `flags` (the worker's options) winning over it."""
        settings = WorkerSettings(**flags)
        s3 = S3Settings.from_env()
        temporal = TemporalSettings()
        runpod_keys = runpod_api_keys(settings.pools)
        return cls(settings, s3, temporal, runpod_keys, WebhookSettings())


@dataclass(frozen=True)
class CliConfig:
    """Everything a job command is configured with."""

    settings: CliSettings
    temporal: TemporalSettings

    @classmethod
    def load(cls) -> CliConfig:
        """From the process's environment; a `ValidationError` names the variable."""
        return cls(CliSettings(), TemporalSettings())

    def artifact_store_settings(self) -> S3Settings | None:
        """The S3 settings when DURABLE_COMFY_BUCKET (or the file's `storage.bucket`) is set,
        else None (nothing to presign).

        Read on first need: only `result`, `submit --watch` and staged inputs open a store, and a
        bad S3 variable must not stop a command that has none. Without AWS_ACCESS_KEY_ID/
        AWS_SECRET_ACCESS_KEY the settings hold no keys, so the S3 client gets none and botocore's
        default chain applies (a shared credentials file or AWS_PROFILE, web identity, an instance
        role, ...). A bad value is a `StorageConfigError` naming the variable (exit 2).
        """
        return S3Settings.from_env_if_configured()


@dataclass(frozen=True)
class GatewayConfig:
    """Everything `durable-comfy gateway` is configured with, besides its JobClient's."""

    settings: GatewaySettings
    temporal: TemporalSettings

    @classmethod
    def load(cls) -> GatewayConfig:
        """From the process's environment; a `ValidationError` names the variable."""
        return cls(GatewaySettings(), TemporalSettings())
