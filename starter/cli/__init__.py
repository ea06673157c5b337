"""`durable-comfy`: the command line. This module only wires the commands together."""

from __future__ import annotations

import os

import typer

from activities.log_setup import configure_logging
from starter.cli import control, jobs, submit, worker_cmd
from starter.exit import exit_without_finalizing


def build_app() -> typer.Typer:
    app = typer.Typer(
        help="Durable ComfyUI jobs on disposable GPU workers, orchestrated by Temporal.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
    )
    from devstack.cli import app as dev_app

    app.add_typer(dev_app, name="dev", help="The local stack: Temporal, S3, ComfyUI simulator.")
    app.command("submit")(submit.submit)
    app.command("watch")(jobs.watch)
    app.command("status")(jobs.status)
    app.command("result")(jobs.result)
    app.command("cancel")(control.cancel)
    app.command("resume")(control.resume)
    app.command("list")(control.list_jobs)
    app.command("worker")(worker_cmd.worker)
    return app


def main() -> None:
    # Logs go to stderr only; stdout is the commands' output. Quiet unless something is off.
    configure_logging(os.environ.get("DURABLE_COMFY_LOG_LEVEL", "WARNING"))
    try:
        build_app()()
    except SystemExit as exc:
        exit_without_finalizing(exc.code)
    exit_without_finalizing(0)
