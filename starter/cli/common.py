"""What every command shares: running async code, reporting errors, opening clients."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import NoReturn, TypeVar

import typer
from pydantic import ValidationError
from temporalio.service import RPCError

from starter.client import JobClient
from starter.errors import ClientError
from workflows.graph import GraphFormatError
from workflows.shared import DEFAULT_TASK_QUEUE

T = TypeVar("T")

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_UNREACHABLE = 3


def fail(message: str, hint: str | None = None, code: int = EXIT_FAILED) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    if hint:
        typer.echo(f"hint: {hint}", err=True)
    raise typer.Exit(code)


def run(coro_fn: Callable[[], Awaitable[T]]) -> T:
    """Run a command's coroutine, turning known failures into a message and an exit code."""
    with reported():
        return asyncio.run(_call(coro_fn))


@contextmanager
def reported() -> Iterator[None]:
    """Known failures become a message, a hint and an exit code; no traceback."""
    try:
        yield
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'request'}: {err['msg']}"
            for err in exc.errors()
        )
        fail(problems, "fix the request; nothing was submitted", EXIT_BAD_INPUT)
    except (GraphFormatError, ClientError) as exc:
        fail(str(exc), code=EXIT_BAD_INPUT)
    except RPCError as exc:
        fail(
            f"Temporal: {exc}",
            "is the stack up? `durable-comfy dev up` (or set TEMPORAL_ADDRESS)",
            EXIT_UNREACHABLE,
        )
    except KeyboardInterrupt:
        typer.echo("interrupted; the job keeps running server-side", err=True)
        raise typer.Exit(130) from None


async def _call(coro_fn: Callable[[], Awaitable[T]]) -> T:
    return await coro_fn()


@asynccontextmanager
async def job_client(with_store: bool = False) -> AsyncIterator[JobClient]:
    """A JobClient; with S3 credentials in the environment it can presign and download."""
    task_queue = os.environ.get("DURABLE_COMFY_TASK_QUEUE", DEFAULT_TASK_QUEUE)
    try:
        client = await JobClient.connect(task_queue=task_queue)
    except RuntimeError as exc:  # the SDK reports a refused connection as RuntimeError
        fail(
            f"cannot reach Temporal: {exc}",
            "is the stack up? `durable-comfy dev up` (or set TEMPORAL_ADDRESS)",
            EXIT_UNREACHABLE,
        )
    if not with_store or not os.environ.get("AWS_ACCESS_KEY_ID"):
        yield client
        return
    from activities.storage import ArtifactStore, S3Settings

    async with ArtifactStore(S3Settings.from_env()) as store:
        client.store = store
        yield client


def echo_json(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
