"""`durable-comfy doctor`: one line per check (starter.doctor), exit 0, 2 or 3."""

from __future__ import annotations

import asyncio
import importlib
from importlib.metadata import entry_points
from typing import Annotated

import typer

from starter.cli.common import echo_json
from starter.doctor import CheckResult, Doctor, Inputs, RunPodCheck, exit_code

# The entry-point group of the CLI's plugins (starter.cli); not imported from there, which
# imports this module.
PLUGIN_GROUP = "durable_comfy.cli"


def doctor(
    json_output: Annotated[
        bool, typer.Option("--json", help="One JSON document per check on stdout.")
    ] = False,
    gateway: Annotated[
        str | None,
        typer.Option(
            "--gateway",
            metavar="URL",
            help="Also check the HTTP gateway at URL (its /readyz), e.g. https://api.example.",
        ),
    ] = None,
) -> None:
    """Check Temporal, the namespace and its search attributes, a polling worker, the bucket,
    each RunPod endpoint and the encryption keys, as the worker would use them; with
    --gateway, the HTTP gateway too.

    Exit 0 when every check passes, 2 when a setting or a registration needs fixing, 3 when
    something is unreachable or no worker polls.
    """
    results = asyncio.run(_checks(json_output, gateway))
    raise typer.Exit(int(exit_code(results)))


def _worker_check(name: str) -> RunPodCheck | None:
    """The worker's check `name` (`doctor_runpod_check`, `doctor_pools_check`), from the
    `worker` plugin this install registers (None without it). Found through the plugin, as the
    command itself is: the client library imports no worker code (tests/test_layers.py)."""
    for entry in entry_points(group=PLUGIN_GROUP, name="worker"):
        check = getattr(importlib.import_module(entry.module), name, None)
        if check is not None:
            made: RunPodCheck = check()
            return made
    return None


async def _checks(json_output: bool, gateway: str | None) -> list[CheckResult]:
    results: list[CheckResult] = []
    inputs = Inputs.from_environment(
        runpod=_worker_check("doctor_runpod_check"),
        gateway_url=gateway,
        pools=_worker_check("doctor_pools_check"),
    )
    async for result in Doctor(inputs).run():
        # As each check ends: a slow one shows what has passed so far.
        if json_output:
            echo_json(result.model_dump_json())
        else:
            typer.echo(result.line())
        results.append(result)
    return results
