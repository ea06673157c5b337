"""`durable-comfy doctor`: one line per check (starter.doctor), exit 0, 2 or 3."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from starter.cli.common import echo_json
from starter.doctor import CheckResult, Doctor, Inputs, exit_code


def doctor(
    json_output: Annotated[
        bool, typer.Option("--json", help="One JSON document per check on stdout.")
    ] = False,
) -> None:
    """Check Temporal, the namespace and its search attributes, a polling worker, the bucket,
    each RunPod endpoint and the encryption keys, as the worker would use them.

    Exit 0 when every check passes, 2 when a setting or a registration needs fixing, 3 when
    something is unreachable or no worker polls.
    """
    results = asyncio.run(_checks(json_output))
    raise typer.Exit(int(exit_code(results)))


async def _checks(json_output: bool) -> list[CheckResult]:
    results: list[CheckResult] = []
    async for result in Doctor(Inputs.from_environment()).run():
        # As each check ends: a slow one shows what has passed so far.
        if json_output:
            echo_json(result.model_dump_json())
        else:
            typer.echo(result.line())
        results.append(result)
    return results
