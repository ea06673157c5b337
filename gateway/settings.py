"""What the gateway reads from the environment (docs/http-api.md; docs/configuration.md).

    GatewaySettings  the gateway's own DURABLE_COMFY_GATEWAY_* variables, the API keys
                     (gateway.auth.AuthSettings) and the limits (gateway.limits.LimitSettings)

Temporal's connection comes the CLI's way (`starter.connection.TemporalSettings` and the SDK's
environment configuration), and the task queue, query timeout and bucket are `JobClient`'s
(`JobClient.connect`): a gateway sees the jobs the CLI sees.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from gateway.auth import AuthSettings
from gateway.limits import LimitSettings

MiB = 1024 * 1024
GiB = 1024 * MiB


class GatewaySettings(AuthSettings, LimitSettings):
    """Every gateway variable. Empty counts as unset; read only under these names."""

    # A job request is at most Temporal's 2 MiB payload; JSON framing and a graph pasted with
    # indentation fit in twice that. Larger bodies are refused before they are read.
    max_body_bytes: int = Field(
        4 * MiB, ge=1024, validation_alias="DURABLE_COMFY_GATEWAY_MAX_BODY_BYTES"
    )
    # A comment line on an idle event stream, so proxies (nginx: 60 s) keep it open.
    heartbeat_s: float = Field(15.0, gt=0, validation_alias="DURABLE_COMFY_GATEWAY_HEARTBEAT_S")
    # A GET counts as client contact at most this often per job (each contact is a signal, a
    # history event); never less often than a quarter of the job's abandonment horizon.
    client_seen_interval_s: float = Field(
        5.0, gt=0, validation_alias="DURABLE_COMFY_GATEWAY_CLIENT_SEEN_S"
    )
    # How long a job's follower outlives its last subscriber: a client reconnecting within it
    # finds the follower still there. Past it an attached job hears from nobody, as it should.
    follower_grace_s: float = Field(
        10.0, ge=0, validation_alias="DURABLE_COMFY_GATEWAY_FOLLOWER_GRACE_S"
    )
    # How often a follower polls its job (JobClient.watch's poll interval).
    poll_interval_s: float = Field(0.5, gt=0, validation_alias="DURABLE_COMFY_GATEWAY_POLL_S")
    # Events a subscriber may have waiting; one that falls further behind is dropped (its stream
    # ends and it reconnects with Last-Event-ID), never the follower held up.
    subscriber_queue: int = Field(
        1000, ge=10, validation_alias="DURABLE_COMFY_GATEWAY_SUBSCRIBER_QUEUE"
    )
    # The path the gateway is served under behind a proxy (`/comfy`): the links it gives.
    base_path: str = Field(
        "", pattern=r"^(/[A-Za-z0-9._~-]+)*$", validation_alias="DURABLE_COMFY_GATEWAY_BASE_PATH"
    )
    # How long a WebSocket client that sent no Authorization header has to send its key.
    ws_auth_timeout_s: float = Field(
        10.0, gt=0, validation_alias="DURABLE_COMFY_GATEWAY_WS_AUTH_TIMEOUT_S"
    )
    # How long /readyz waits for Temporal's answer.
    ready_timeout_s: float = Field(
        2.0, gt=0, validation_alias="DURABLE_COMFY_GATEWAY_READY_TIMEOUT_S"
    )
    # The largest file `POST /v1/uploads` presigns a PUT for: ComfyUI's own upload limit
    # (--max-upload-size), which is also what a worker reads of one input. One PUT carries at
    # most 5 GiB (S3's limit without multipart).
    upload_max_bytes: int = Field(
        100 * MiB, ge=1, le=5 * GiB, validation_alias="DURABLE_COMFY_GATEWAY_UPLOAD_MAX_BYTES"
    )
    # How long an upload's presigned PUT works: long enough for a slow link to send the largest
    # file, short enough that a leaked URL soon stops working (it can only ever store that file).
    upload_ttl_s: int = Field(
        900, ge=1, le=7 * 24 * 3600, validation_alias="DURABLE_COMFY_GATEWAY_UPLOAD_TTL_S"
    )
    log_level: str = Field("INFO", validation_alias="DURABLE_COMFY_LOG_LEVEL")
    # The worker's development allow-list of webhook hosts (activities.settings.WebhookSettings):
    # the gateway must refuse no URL the worker would take.
    webhook_allow_hosts: Annotated[tuple[str, ...], NoDecode] = Field(
        (), validation_alias="DURABLE_COMFY_WEBHOOK_ALLOW_HOSTS"
    )

    @field_validator("webhook_allow_hosts", mode="before")
    @classmethod
    def _comma_separated_hosts(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(h.strip().lower() for h in value.split(",") if h.strip())
        return value
