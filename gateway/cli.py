"""`durable-comfy gateway`: the HTTP API on uvicorn (the CLI finds it by its entry point)."""

from __future__ import annotations

import asyncio
from typing import Annotated

import structlog
import typer
import uvicorn
from pydantic import ValidationError

from activities.log_setup import configure_logging
from configuration.processes import GatewayConfig
from gateway.app import create_app, default_client_factory
from gateway.auth import ApiKeys
from starter.errors import SettingsError

log = structlog.get_logger("gateway")


class _Server(uvicorn.Server):
    """uvicorn's server, saying once where it listens when it does."""

    async def startup(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        await super().startup(sockets=sockets)  # type: ignore[arg-type]
        if self.started:
            config = self.config
            log.info("gateway_started", address=f"http://{config.host}:{config.port}")


def command(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8080,
) -> None:
    """Serve the HTTP API and the browser page (docs/http-api.md)."""
    try:
        gateway = GatewayConfig.load()
        settings = gateway.settings
        keys = ApiKeys.from_settings(settings)
        keys.check_bind(host)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        _refuse(f"invalid settings: {problems}")
    except (SettingsError, ValueError) as exc:
        _refuse(str(exc))
    configure_logging(settings.log_level)
    app = create_app(settings, default_client_factory(gateway.temporal), keys=keys)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        # Our own request line (gateway.middleware.RequestLog) leaves query strings out.
        access_log=False,
        log_config=None,
        proxy_headers=True,
        lifespan="on",
    )
    asyncio.run(_Server(config).serve())


def _refuse(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)
