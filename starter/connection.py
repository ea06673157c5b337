"""One way to reach Temporal for the worker, the CLI and the library alike.

Connection settings come from Temporal's environment configuration: `TEMPORAL_ADDRESS`,
`TEMPORAL_NAMESPACE`, `TEMPORAL_API_KEY`, TLS variables, or a profile in a `temporal.toml`
(`TEMPORAL_CONFIG_FILE` + `TEMPORAL_PROFILE`; `durable-comfy dev up` writes one). The same file
serves the `temporal` CLI, so both see the same server.

`configuration.settings.TemporalSettings` holds the variables durable-comfy itself reads (the
address, the namespace and the UI's URL); the worker and the CLI build it once at start-up and pass
its address and namespace to `connect_temporal`, where, as in Temporal's own rules, they win over
the profile's. Everything else (API key, TLS, the profile) stays with the SDK's environment
configuration.

Payload encryption (`starter.codec`) is configured the same way for every caller:
`connect_temporal` reads DURABLE_COMFY_CODEC_KEYS / DURABLE_COMFY_CODEC_KEYS_FILE and, when a key
is set, encrypts every payload it sends and decrypts every one it reads. `TemporalSettings`
checks the same variables (and the production file's `codec.keys_file`) when it is built, so a
bad key stops the worker and the CLI at start-up, naming the variable or the file.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping
from functools import cache

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import (
    DataConverter,
    DefaultFailureConverterWithEncodedAttributes,
    PayloadCodec,
)
from temporalio.envconfig import ClientConfig
from temporalio.runtime import (
    LogForwardingConfig,
    LoggingConfig,
    Runtime,
    TelemetryConfig,
    TelemetryFilter,
)

from starter.codec import codec_from_environ

DEFAULT_ADDRESS = "127.0.0.1:7233"


def forwarded_core_logs() -> LoggingConfig:
    """Logging for the SDK's Rust core that hands its lines to Python logging.

    By default the core prints its own warnings (a payload over 512 KiB, for one) to stdout,
    where they corrupt `--json` output; forwarded, they go wherever logging goes (stderr).
    Use it in any `TelemetryConfig` you build (one with metrics, say).
    """
    return LoggingConfig(
        filter=TelemetryFilter(core_level="WARN", other_level="ERROR"),
        forwarding=LogForwardingConfig(logger=logging.getLogger("temporalio.core")),
    )


@cache
def sdk_runtime() -> Runtime:
    """The runtime clients get unless given one: one per process, core logs forwarded."""
    return Runtime(telemetry=TelemetryConfig(logging=forwarded_core_logs()))


async def connect_temporal(
    address: str | None = None,
    namespace: str | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    runtime: Runtime | None = None,
    codec: PayloadCodec | None = None,
) -> Client:
    """Connect with the pydantic data converter every durable-comfy payload needs.

    `runtime` defaults to `sdk_runtime()`; build your own with `forwarded_core_logs()` to keep
    the core's log lines off stdout. Payloads are encrypted with `codec`, else with the codec
    the environment configures (`environ`, else the process's; `starter.codec`), else not at all.
    A configured key that is unusable raises `CodecSettingsError` before anything connects.
    """
    codec = codec or codec_from_environ(environ)
    config = ClientConfig.load_client_connect_config(override_env_vars=environ)
    if address:
        config["target_host"] = address
    if namespace:
        config["namespace"] = namespace
    config.setdefault("target_host", DEFAULT_ADDRESS)
    return await Client.connect(
        **config, data_converter=data_converter(codec), runtime=runtime or sdk_runtime()
    )


def connect_target(address: str | None = None) -> tuple[str, bool]:
    """Where `connect_temporal(address)` connects (the address given, else the profile's or
    the variables', else the default), and whether over TLS: what a failure should name."""
    try:
        config = ClientConfig.load_client_connect_config()
    except Exception:  # a broken profile: connecting says so in its own words
        config = {}
    return str(address or config.get("target_host") or DEFAULT_ADDRESS), bool(config.get("tls"))


def dialled_by_default(address: str | None = None) -> bool:
    """Whether `connect_temporal(address)` dials `DEFAULT_ADDRESS` because nothing named an
    address (no `address`, no TEMPORAL_ADDRESS, no profile's): on a shared machine that may be
    someone else's server, so a failure says so."""
    if address:
        return False
    try:
        config = ClientConfig.load_client_connect_config()
    except Exception:  # a broken profile names something: connecting says what
        return False
    return not config.get("target_host")


def connect_failure_gist(exc: BaseException) -> str:
    """The gist of the SDK's connect error ("Connection refused", "400 Bad Request"): its last
    quoted message, not its nested Rust debug rendering."""
    text = re.sub(r"\s+", " ", str(exc)).strip()
    found: list[str] = re.findall(r'message: "([^"]+)"', text)
    if found:
        return found[-1]
    return (text if len(text) <= 300 else text[:299] + "…") or "no answer in time"


def data_converter(codec: PayloadCodec | None) -> DataConverter:
    """The pydantic data converter, with `codec` over every payload when there is one.

    With a codec, failures' messages and stack traces move into their encoded attributes as
    well: an error from ComfyUI can quote the graph's inputs.
    """
    if codec is None:
        return pydantic_data_converter
    return dataclasses.replace(
        pydantic_data_converter,
        payload_codec=codec,
        failure_converter_class=DefaultFailureConverterWithEncodedAttributes,
    )
