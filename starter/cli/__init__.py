"""`durable-comfy`: the command line. This module only wires the commands together."""

from __future__ import annotations

import os
from importlib.metadata import entry_points

import typer

from activities.log_setup import configure_logging
from starter.cli import control, jobs, submit
from starter.exit import exit_without_finalizing

PLUGIN_GROUP = "durable_comfy.cli"


def build_app() -> typer.Typer:
    app = typer.Typer(
        help="Durable ComfyUI jobs on disposable GPU workers, orchestrated by Temporal.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
    )
    app.command("submit")(submit.submit)
    app.command("watch")(jobs.watch)
    app.command("status")(jobs.status)
    app.command("result")(jobs.result)
    app.command("cancel")(control.cancel)
    app.command("resume")(control.resume)
    app.command("list")(control.list_jobs)
    _add_plugins(app)
    return app


def _add_plugins(app: typer.Typer) -> None:
    """Commands other parts of the distribution register (pyproject's `durable_comfy.cli`
    entry points): `worker` (worker.py) and `dev` (the local stack). The client library
    imports neither, so it installs and runs without them."""
    for entry in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        target = entry.load()
        if isinstance(target, typer.Typer):
            app.add_typer(target, name=entry.name)
        else:
            app.command(entry.name)(target)


def main() -> None:
    # Logs go to stderr only; stdout is the commands' output. Quiet unless something is off.
    configure_logging(os.environ.get("DURABLE_COMFY_LOG_LEVEL", "WARNING"))
    try:
        build_app()()
    except SystemExit as exc:
        exit_without_finalizing(exc.code)
    exit_without_finalizing(0)
