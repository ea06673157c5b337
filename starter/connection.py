"""One way to reach Temporal for the worker, the CLI and the library alike.

Connection settings come from Temporal's environment configuration: `TEMPORAL_ADDRESS`,
`TEMPORAL_NAMESPACE`, `TEMPORAL_API_KEY`, TLS variables, or a profile in a `temporal.toml`
(`TEMPORAL_CONFIG_FILE` + `TEMPORAL_PROFILE`; `durable-comfy dev up` writes one). The same file
serves the `temporal` CLI, so both see the same server.
"""

from __future__ import annotations

from collections.abc import Mapping

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.envconfig import ClientConfig

DEFAULT_ADDRESS = "127.0.0.1:7233"


async def connect_temporal(
    address: str | None = None,
    namespace: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Client:
    """Connect with the pydantic data converter every durable-comfy payload needs."""
    config = ClientConfig.load_client_connect_config(override_env_vars=environ)
    if address:
        config["target_host"] = address
    if namespace:
        config["namespace"] = namespace
    config.setdefault("target_host", DEFAULT_ADDRESS)
    return await Client.connect(**config, data_converter=pydantic_data_converter)
