"""`durable-comfy gateway`: what the CLI loads by its entry point, light enough for any install.

The server itself (FastAPI, uvicorn: the `gateway` extra) is imported only when it is started,
so a client or worker install without the extra keeps a working `durable-comfy` and is told
what to install when it asks for the gateway.
"""

from __future__ import annotations

from typing import Annotated

import typer

GATEWAY_EXTRA_HINT = "pip install 'durable-comfy[gateway]'"

app = typer.Typer(
    help="Serve the HTTP API and the browser page (docs/http-api.md).",
    no_args_is_help=False,
    pretty_exceptions_enable=False,
)


@app.callback(invoke_without_command=True)
def serve(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8080,
) -> None:
    """Serve the HTTP API and the browser page (docs/http-api.md)."""
    if ctx.invoked_subcommand is not None:
        return
    try:
        from gateway.cli import command
    except ModuleNotFoundError as exc:
        typer.echo(
            f"error: the gateway needs {exc.name}, which comes with the gateway extra: "
            f"{GATEWAY_EXTRA_HINT}",
            err=True,
        )
        raise typer.Exit(2) from exc
    command(host=host, port=port)


@app.command("new-key")
def new_key(tenant: Annotated[str, typer.Argument(help="The tenant the key lets in.")]) -> None:
    """Make an API key for TENANT: the key (give it to the tenant, shown once) and the line for
    DURABLE_COMFY_API_KEYS_FILE, which holds only its hash."""
    from gateway.auth import new_key_line

    try:
        key, line = new_key_line(tenant)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"key:  {key}")
    typer.echo(f"line: {line}")
