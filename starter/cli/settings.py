"""What the job commands read from the environment: built once, when the command starts.

    CliSettings       DURABLE_COMFY_TASK_QUEUE, DURABLE_COMFY_QUERY_TIMEOUT_S (the library's
                      `ClientSettings`, starter.settings), DURABLE_COMFY_LOG_LEVEL
    TemporalSettings  TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TEMPORAL_UI_URL (starter.connection)
    S3Settings        DURABLE_COMFY_BUCKET, DURABLE_COMFY_S3_ENDPOINT, AWS_* (activities.settings):
                      only for a command that presigns or downloads, only with a bucket set

The root command's callback builds a `CliConfig` and hands it to the command (`ctx.obj`); no
command reads the environment itself. A bad value stops the command before it does anything,
naming the variable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import Field

from starter.connection import TemporalSettings
from starter.settings import ClientSettings

if TYPE_CHECKING:
    from activities.storage import S3Settings


class CliSettings(ClientSettings):
    """The library's variables, and the CLI's own. Empty counts as unset."""

    # Quiet unless something is off; unknown names fall back to INFO (activities.log_setup).
    log_level: str = Field("WARNING", validation_alias="DURABLE_COMFY_LOG_LEVEL")


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
        """The S3 settings when DURABLE_COMFY_BUCKET is set, else None (nothing to presign).

        Built on first need, as before: only `result` and `submit --watch` open a store, and
        only they import aioboto3. Without AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY the settings
        hold no keys, so the S3 client gets none and botocore's default chain applies (a shared
        credentials file or AWS_PROFILE, web identity, an instance role, ...). A bad value is a
        `StorageConfigError` naming the variable (exit 2).
        """
        from activities.storage import S3Settings

        return S3Settings.from_env_if_configured()
