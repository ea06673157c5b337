"""The value types settings share with the production file's model, and the in-variable formats.

A value is checked the same way wherever it comes from (a variable, the production file, the
stack file, code): the settings classes (configuration.settings) and the file's sections
(configuration.files) both use these types.
"""

from __future__ import annotations

import base64
import binascii
import re
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BeforeValidator, Field

from workflows.tenancy import normalised_allowed_prefix

DEFAULT_DEPLOYMENT_NAME = "durable-comfy"
PACKAGE = "durable-comfy"
# A version's canonical name is `deployment.build_id`, split at the first dot: a dot in the
# deployment's name would move part of it into the build ID.
DeploymentName = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[^.\s]+$")]
BuildId = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^\S+$")]
SetCurrent = Literal["first", "always", "never"]
Port = Annotated[int, Field(ge=1, le=65535)]
# An IP address to bind (not a host name: the SDK's Prometheus server binds "ip:port").
MetricsHost = Annotated[str, Field(pattern=r"^(\d{1,3}(\.\d{1,3}){3}|\[?[0-9a-fA-F:]+\]?)$")]
# A gateway connects to it with the key: ws:// on a private network, wss:// across one.
LiveProgressUrl = Annotated[str, Field(pattern=r"^wss?://[^\s/?#]+(/[^\s?#]*)?$", max_length=500)]
# The live-progress key is a shared secret between workers and gateways.
MIN_LIVE_KEY_CHARS = 16
Concurrency = Annotated[int, Field(ge=1)]
SweepInterval = Annotated[float, Field(ge=0)]
HeartbeatThrottle = Annotated[float, Field(gt=0, le=60)]
HeartbeatBudgetRate = Annotated[float, Field(gt=0, le=100_000)]
# A tenant's budget day (workflows/budgets.py): a second at the least (tests), a year at most.
BudgetDayLength = Annotated[float, Field(ge=1, le=366 * 86400)]

_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def comma_separated(text: str) -> list[str]:
    """A variable's comma-separated items, each stripped; empty items are dropped."""
    return [item.strip() for item in text.split(",") if item.strip()]


def _lower_case_items(value: Any) -> Any:
    if isinstance(value, str):
        return tuple(item.lower() for item in comma_separated(value))
    return value


# A comma-separated variable of names compared without case (hosts, media types, ports); a
# value given in code or a file as a list is taken as it is.
LowerCaseItems = BeforeValidator(_lower_case_items)


def _bucket_name(value: str) -> str:
    if not _BUCKET_NAME.match(value) or ".." in value:
        raise ValueError("not a valid S3 bucket name")
    return value


def _endpoint_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("endpoint must be an http(s) URL")
    if parts.username or parts.password:
        # Credentials in a URL end up in logs and error messages.
        raise ValueError("endpoint must not carry credentials")
    return value.rstrip("/")


def _allowed_prefixes(value: Any) -> Any:
    """A variable's comma-separated entries, or the file's list, each a folder
    (`workflows.tenancy.normalised_allowed_prefix`)."""
    if isinstance(value, str):
        value = comma_separated(value)
    if not isinstance(value, list | tuple):
        return value
    return tuple(
        normalised_allowed_prefix(entry) if isinstance(entry, str) else entry for entry in value
    )


BucketName = Annotated[str, AfterValidator(_bucket_name)]
EndpointUrl = Annotated[str, AfterValidator(_endpoint_url)]
# Folders any tenant's job may read `s3://` inputs from, beside its own area.
AllowedInputPrefixes = Annotated[tuple[str, ...], BeforeValidator(_allowed_prefixes)]


def package_build_id() -> str:
    """The installed durable-comfy package's version: the default build ID."""
    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        raise ValueError(
            f"the {PACKAGE} package is not installed, so it has no version to be the build ID: "
            "set DURABLE_COMFY_BUILD_ID (or `worker --build-id`)"
        ) from None


# --- webhook secrets --------------------------------------------------------------------------

TENANT_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_WEBHOOK_SECRET_PREFIX = "whsec_"
# Standard Webhooks asks for 24 to 64 random bytes; fewer than 16 is not a secret.
_MIN_SECRET_BYTES = 16


def webhook_signing_key(secret: str) -> bytes:
    """The HMAC key of a `whsec_<base64>` secret (its base64 part, decoded)."""
    if not secret.startswith(_WEBHOOK_SECRET_PREFIX):
        raise ValueError("a webhook secret is whsec_ followed by base64")
    try:
        key = base64.b64decode(secret.removeprefix(_WEBHOOK_SECRET_PREFIX), validate=True)
    except binascii.Error:
        raise ValueError("a webhook secret's part after whsec_ is not base64") from None
    if len(key) < _MIN_SECRET_BYTES:
        raise ValueError(f"a webhook secret must hold at least {_MIN_SECRET_BYTES} bytes")
    return key
