"""`durable-comfy codec-server` (the Temporal codec server for the UI and the `temporal` CLI)
and `durable-comfy codec-key` (a fresh key ring entry)."""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING, Annotated

import structlog
import typer
from pydantic import SecretStr, ValidationError

from activities.log_setup import configure_logging
from configuration.codec_keys import KEYS_ENV, KEYS_FILE_ENV, TOKEN_ENV
from configuration.errors import CodecSettingsError
from configuration.settings import CodecServerSettings, CodecSettings, TemporalSettings
from starter.cli.common import ExitCode, fail, problems
from starter.codec import EncryptionCodec, new_entry

if TYPE_CHECKING:
    from aiohttp import web

log = structlog.get_logger("codec_server")

DEFAULT_PORT = 8234


def codec_server(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = DEFAULT_PORT,
    ui_origin: Annotated[
        str | None,
        typer.Option(help="The one origin CORS allows (default: TEMPORAL_UI_URL's)."),
    ] = None,
    auth_token_env: Annotated[
        str | None,
        typer.Option(
            help="Require `Authorization: Bearer TOKEN`, TOKEN read from this variable "
            f"(default: {TOKEN_ENV} when it is set, else no auth)."
        ),
    ] = None,
) -> None:
    """Decode (and encode) payloads for the Temporal UI and CLI with the configured keys."""
    try:
        server = CodecServerSettings.load(auth_token_env)
        configure_logging(server.log_level)
        ring = CodecSettings().key_ring()
        origin = ui_origin or TemporalSettings().ui_url
    except (CodecSettingsError, ValidationError) as exc:
        text = problems(exc, "settings") if isinstance(exc, ValidationError) else str(exc)
        fail(f"invalid settings: {text}", code=ExitCode.BAD_INPUT)
    if ring is None:
        fail(
            "no key configured: the codec server decodes with the keys the worker encrypts with",
            f"set {KEYS_ENV} (or {KEYS_FILE_ENV}) as for the worker",
        )
    # Imported here: every other command starts without aiohttp.
    from starter.codec_server import build_codec_app

    token = server.auth_token
    if token is None and auth_token_env is not None:
        fail(f"--auth-token-env names {auth_token_env}, which is not set", "export the token in it")
    app = build_codec_app(EncryptionCodec(ring), origin, token)
    log.info("codec_keys", active_key_id=ring.active_id, key_ids=ring.ids)
    asyncio.run(_serve(app, host, port, origin, token_env=_token_env(auth_token_env, token)))


def codec_key(
    key_id: Annotated[str, typer.Argument(help="The new key's id (stored in clear).")],
) -> None:
    """Print a fresh `ID:BASE64KEY` entry: put it first in DURABLE_COMFY_CODEC_KEYS to rotate."""
    try:
        typer.echo(new_entry(key_id))
    except CodecSettingsError as exc:
        fail(str(exc))


def _token_env(name: str | None, token: SecretStr | None) -> str | None:
    return None if token is None else (name or TOKEN_ENV)


async def _serve(
    app: web.Application, host: str, port: int, origin: str, token_env: str | None
) -> None:
    from starter.codec_server import serve_codec

    try:
        runner = await serve_codec(app, host, port)
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror}", "pick another --port")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "codec_server_started",
        url=f"http://{host}:{port}",
        cors_origin=origin,
        auth=f"bearer token from ${token_env}" if token_env else "none",
    )
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        log.info("codec_server_stopped")
