"""`pool queue`, `pool status`, `pool release`, `pool drain` and `pool undrain`: a bounded
pool's queue (docs/queue.md).

`queue` lists who holds a slot and who waits; `status` is the pool in a line (running, waiting,
its bound, drained by whom) and, for a comfyui pool of many servers (`urls`), a line per server
(health, jobs on it of its slots, jobs started there, failures, its last error and since when).
`release` settles a slot whose teardown was never confirmed. `drain` gives a server (`--server`)
or the whole pool no new job until `undrain`; jobs running there finish. All of them ask the
pool's dispatcher, which runs once a job has asked for one of the pool's slots.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated

import typer

from starter.cli.common import ExitCode, config_of, echo_json, fail, job_client, run
from starter.errors import NoPoolQueue, UnknownServer
from workflows.admission import EndpointHealth, PoolQueueView, ServerView

app = typer.Typer(
    help="A bounded pool's queue: who runs, who waits, its servers, settling a slot, draining."
)

PoolArg = Annotated[str, typer.Argument(help="The pool's name, as the worker's settings have it.")]
ServerOpt = Annotated[
    str | None,
    typer.Option(
        "--server",
        metavar="URL",
        help="One server of the pool (a URL of its `urls`, as `pool status` lists them); "
        "without it, the whole pool.",
    ),
]
NO_QUEUE = (
    "pool {pool!r} has no queue: it is not bounded (max_running, or urls), or no job has asked "
    "for one of its slots yet"
)


@app.command("queue")
def queue(
    ctx: typer.Context,
    pool: PoolArg,
    as_json: Annotated[bool, typer.Option("--json", help="The whole queue as JSON.")] = False,
) -> None:
    """Every job that holds a slot of POOL or waits for one, waiting ones in the order they
    will start (position, tenant, priority, age)."""
    _show_queue(ctx, pool, as_json, queue_lines)


@app.command("status")
def status(
    ctx: typer.Context,
    pool: PoolArg,
    as_json: Annotated[bool, typer.Option("--json", help="The whole queue as JSON.")] = False,
) -> None:
    """POOL in a line (running, waiting, its bound, drained by whom), then each of its servers:
    health, running/slots, jobs started there, failures, last error and since when."""
    _show_queue(ctx, pool, as_json, status_lines)


def _show_queue(
    ctx: typer.Context,
    pool: str,
    as_json: bool,
    lines: Callable[[PoolQueueView, datetime], list[str]],
) -> None:
    """The pool's queue as its dispatcher has it: JSON, or `lines` of it."""
    config = config_of(ctx)

    async def go() -> PoolQueueView:
        async with job_client(config) as client:
            try:
                return await client.pool_queue(pool)
            except NoPoolQueue:
                fail(NO_QUEUE.format(pool=pool), code=ExitCode.BAD_INPUT)

    view = run(go)
    if as_json:
        echo_json(view.model_dump_json())
        return
    for line in lines(view, datetime.now(UTC)):
        typer.echo(line)


@app.command("drain")
def drain(
    ctx: typer.Context,
    pool: PoolArg,
    server: ServerOpt = None,
    by: Annotated[
        str | None,
        typer.Option(
            "--by",
            metavar="NAME",
            help="Who drains, as `pool status` shows it (default: your user name).",
        ),
    ] = None,
) -> None:
    """No new job for a server of POOL (--server URL), or for the whole pool, until `pool
    undrain`: jobs running there finish; waiting jobs go to the pool's other servers, or wait."""
    view = _drained(ctx, pool, server, drain=True, by=by)
    typer.echo(drain_line(view, server, drain=True))


@app.command("undrain")
def undrain(ctx: typer.Context, pool: PoolArg, server: ServerOpt = None) -> None:
    """Undo `pool drain`: the server (--server URL), or the whole pool, takes new jobs again."""
    view = _drained(ctx, pool, server, drain=False, by=None)
    typer.echo(drain_line(view, server, drain=False))


def _drained(
    ctx: typer.Context, pool: str, server: str | None, *, drain: bool, by: str | None
) -> PoolQueueView:
    config = config_of(ctx)
    action = "drain" if drain else "undrain"

    async def go() -> PoolQueueView:
        async with job_client(config) as client:
            try:
                if drain:
                    return await client.drain_pool(pool, server, by=by)
                return await client.undrain_pool(pool, server, by=by)
            except NoPoolQueue:
                fail(
                    NO_QUEUE.format(pool=pool) + f": nothing to {action}",
                    f"{action} it once its first job has asked (`pool queue {pool}` then "
                    "answers); a pool without a bound has no queue to drain",
                    code=ExitCode.BAD_INPUT,
                )
            except UnknownServer as exc:
                hint = f"`durable-comfy pool status {pool}` lists its servers"
                fail(str(exc), hint if exc.servers else None, code=ExitCode.BAD_INPUT)

    return run(go)


@app.command("release")
def release(
    ctx: typer.Context,
    pool: PoolArg,
    job_id: Annotated[str, typer.Argument(help="The job whose slot to settle.")],
) -> None:
    """Settle JOB's slot of POOL: for a job whose teardown stayed UNCONFIRMED or FAILED, once
    you know its prompt no longer runs (the slot goes to the next job at once)."""
    config = config_of(ctx)

    async def go() -> bool:
        async with job_client(config) as client:
            try:
                return await client.release_slot(pool, job_id)
            except NoPoolQueue:
                fail(f"pool {pool!r} has no queue", code=ExitCode.BAD_INPUT)

    if not run(go):
        fail(f"{job_id} holds no slot of pool {pool!r} and is not in its line")
    typer.echo(f"released {job_id}'s slot of pool {pool}")


def queue_lines(view: PoolQueueView, now: datetime) -> list[str]:
    bound = "unbounded" if view.max_running is None else f"max_running {view.max_running}"
    lines = [f"pool {view.pool}: {view.running} running, {view.waiting} waiting ({bound})"]
    header = ("position", "job", "tenant", "priority", "state", "age")
    rows = [header]
    for entry in view.entries:
        age = max((now - entry.since).total_seconds(), 0.0)
        rows.append(
            (
                "" if entry.position is None else str(entry.position),
                entry.job_id,
                entry.tenant,
                str(entry.priority),
                entry.state,
                f"{age:.0f}s",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return lines


def _finishing(count: int) -> str:
    """ "1 running job finishes", "2 running jobs finish", "nothing runs"."""
    if count == 0:
        return "nothing runs"
    return "1 running job finishes" if count == 1 else f"{count} running jobs finish"


def drain_line(view: PoolQueueView, server: str | None, *, drain: bool) -> str:
    """What a drain or undrain left: the pool's, or the server's, state in a sentence."""
    if server is None:
        if drain:
            return (
                f"drained pool {view.pool}: no new job starts until `pool undrain "
                f"{view.pool}`; {_finishing(view.running)}, {view.waiting} waiting"
            )
        held = "" if view.drained is None else f" (still drained by {view.drained})"
        return f"undrained pool {view.pool}: its jobs start again{held}, {view.waiting} waiting"
    shown = next((s for s in view.servers if s.url in (server, server.rstrip("/"))), None)
    name = shown.url if shown is not None else server
    if drain:
        where = _finishing(shown.running if shown is not None else 0)
        return f"drained server {name} of pool {view.pool}: no new job goes there; {where} there"
    line = f"undrained server {name} of pool {view.pool}: "
    if shown is not None and shown.health == "unhealthy":
        return line + f"it takes new jobs once healthy again (unhealthy: {shown.last_error})"
    if shown is not None and shown.health == "drained":
        return line + "it is still drained"
    if view.drained is not None:
        return line + f"it takes new jobs once the pool is undrained (drained by {view.drained})"
    return line + "it takes new jobs again"


def status_lines(view: PoolQueueView, now: datetime) -> list[str]:
    """The pool in a line, then a line per server (none for a pool of one backend)."""
    bound = "unbounded" if view.max_running is None else f"max_running {view.max_running}"
    line = f"pool {view.pool}: {view.running} running, {view.waiting} waiting ({bound})"
    if view.drained is not None:
        line += f", drained by {view.drained}"
    lines = [line]
    if view.unhealthy is not None:
        lines.append(f"takes no work now: {view.unhealthy}")
    if view.endpoint is not None:
        lines.append(endpoint_line(view.endpoint))
    if not view.servers:
        return lines
    header = ("server", "health", "running", "started", "failures", "since", "last error")
    rows = [header] + [_server_row(server, now) for server in view.servers]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return lines


def endpoint_line(health: EndpointHealth) -> str:
    """A runpod pool's endpoint as its queue last read `/health`."""
    line = (
        f"endpoint: {health.idle} idle, {health.initializing} starting, {health.running} "
        f"running, {health.unhealthy_workers} unhealthy, {health.throttled} throttled; "
        f"{health.in_queue} in its queue, {health.in_progress} in progress"
    )
    if health.cold:
        line += " (cold: no worker up yet)"
    return line


def _server_row(server: ServerView, now: datetime) -> tuple[str, ...]:
    since = "-"
    if server.since is not None:
        since = f"{max((now - server.since).total_seconds(), 0.0):.0f}s ago"
    health: str = server.health
    if server.drained_by is not None:
        health = f"drained by {server.drained_by}"
    return (
        server.url,
        health,
        f"{server.running}/{server.slots}",
        str(server.started),
        str(server.failures),
        since,
        server.last_error or "-",
    )
