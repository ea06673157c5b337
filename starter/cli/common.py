"""What every command shares: exit codes, running async code, reporting errors, opening clients.

Settings come from `configuration.processes.CliConfig`, built once when a job command starts and
passed down (`config_of(ctx)`); nothing here reads the environment.

Every command follows one exit-code table (docs/cli.md, "Exit codes"): `ExitCode` below, and
`exit_code_for` for the errors. Errors are one `error:` line on stderr, sometimes followed by
one `hint:` line; never a traceback, and never anything on stdout.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from enum import IntEnum
from typing import NoReturn, TypeVar

import typer
from pydantic import ValidationError
from temporalio.client import RPCTimeoutOrCancelledError
from temporalio.service import RPCError, RPCStatusCode

from configuration.processes import CliConfig
from starter.client import JobClient
from starter.errors import (
    BatchConflict,
    BudgetExceeded,
    ClientError,
    ContactLost,
    JobAlreadyEnded,
    JobConflict,
    JobUnanswered,
    QueueFull,
    ResumeRefused,
    StorageFailed,
    TemporalRefused,
    TemporalUnreachable,
)
from workflows.errors import GraphFormatError, StorageConfigError, StorageError

T = TypeVar("T")


class ExitCode(IntEnum):
    OK = 0
    # The job ended, but not COMPLETED (watch, result, submit --watch).
    JOB_NOT_COMPLETED = 1
    # Bad input (request, graph, job ID, option, size, missing S3 settings, a bad setting, search
    # attributes the namespace lacks) or no such job. `doctor`: a configuration problem.
    BAD_INPUT = 2
    # Temporal unreachable, or no worker answering for the job. `doctor`: something does not
    # answer, or no worker polls.
    UNREACHABLE = 3
    # The ID or the job's state does not allow it: another request under the ID (another batch
    # under a batch ID), cancel or resume of an ended job (cancel of an ended batch), a refused
    # resume.
    CONFLICT = 4
    # Refused for capacity: the pool's queue is full for the tenant (`QueueFull`), or the
    # tenant's daily budget is spent and its settings refuse new jobs (`BudgetExceeded`); try
    # later.
    QUEUE_FULL = 5
    # Artifacts could not be downloaded, or their bytes do not match the recorded sha256.
    STORAGE = 6
    INTERRUPTED = 130


STACK_HINT = "is the stack up? `durable-comfy dev up` (or set TEMPORAL_ADDRESS)"
# A TLS connection that fails is rarely a server that is down: the front refused the handshake.
TLS_HINT = (
    "check the profile's TLS settings: the server CA (server_ca_cert_path), the client "
    "certificate and key the front requires (client_cert_path, client_key_path) and server_name"
)
_UNREACHABLE_CODES = frozenset(
    {RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED}
)


def exit_code_for(exc: BaseException) -> ExitCode:
    """The table's row for an error a command can meet."""
    match exc:
        case TemporalUnreachable() | TemporalRefused() | ContactLost() | JobUnanswered():
            return ExitCode.UNREACHABLE
        case RPCError() | RPCTimeoutOrCancelledError():
            return ExitCode.UNREACHABLE
        case JobConflict() | BatchConflict() | JobAlreadyEnded() | ResumeRefused():
            return ExitCode.CONFLICT
        case QueueFull() | BudgetExceeded():
            return ExitCode.QUEUE_FULL
        case StorageConfigError():
            return ExitCode.BAD_INPUT
        case StorageError() | StorageFailed():
            return ExitCode.STORAGE
        case ClientError() | ValidationError() | GraphFormatError():
            return ExitCode.BAD_INPUT
        case KeyboardInterrupt():
            return ExitCode.INTERRUPTED
    raise TypeError(f"no exit code for {type(exc).__name__}") from exc


def fail(message: str, hint: str | None = None, code: int = ExitCode.BAD_INPUT) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    if hint:
        typer.echo(f"hint: {hint}", err=True)
    raise typer.Exit(int(code))


def run(coro_fn: Callable[[], Awaitable[T]], on_interrupt: Callable[[], str] | None = None) -> T:
    """Run a command's coroutine, turning known failures into a message and an exit code.

    `on_interrupt` says what Ctrl-C leaves behind (an attached job is abandoned later).
    """
    with reported(on_interrupt):
        return asyncio.run(_call(coro_fn))


@contextmanager
def reported(on_interrupt: Callable[[], str] | None = None) -> Iterator[None]:
    """Known failures become a message, a hint and an exit code; no traceback."""
    try:
        yield
    except ValidationError as exc:
        fail(problems(exc), "fix the request; nothing was submitted", exit_code_for(exc))
    except RPCError as exc:
        if exc.status in _UNREACHABLE_CODES:
            fail(f"Temporal did not answer: {exc.message}", STACK_HINT, exit_code_for(exc))
        fail(f"Temporal refused: {exc.status.name}: {exc.message}", code=exit_code_for(exc))
    except RPCTimeoutOrCancelledError as exc:
        fail(f"Temporal did not answer in time: {exc}", STACK_HINT, exit_code_for(exc))
    except TemporalUnreachable as exc:
        fail(str(exc), TLS_HINT if exc.tls else STACK_HINT, exit_code_for(exc))
    except (GraphFormatError, ClientError, StorageError) as exc:
        fail(str(exc), code=exit_code_for(exc))
    except KeyboardInterrupt as exc:
        note = on_interrupt() if on_interrupt else "the job (if any) keeps running server-side"
        typer.echo(f"interrupted; {note}", err=True)
        raise typer.Exit(exit_code_for(exc)) from None


def problems(exc: ValidationError, what: str = "request") -> str:
    """Each problem with where it is: a field of the request, or a variable of the settings."""
    return "; ".join(problem_lines(exc, what))


def problem_lines(exc: ValidationError, what: str = "request") -> list[str]:
    """`problems`, one line each."""
    return [f"{'.'.join(str(p) for p in err['loc']) or what}: {err['msg']}" for err in exc.errors()]


def load_config() -> CliConfig:
    """The job commands' settings from the environment, or exit 2 naming the bad variable."""
    try:
        return CliConfig.load()
    except ValidationError as exc:
        *first, last = problem_lines(exc, "settings")
        for line in first:
            typer.echo(f"error: invalid settings: {line}", err=True)
        fail(
            f"invalid settings: {last}",
            "fix the environment variable; nothing was done",
            ExitCode.BAD_INPUT,
        )


def config_of(ctx: typer.Context) -> CliConfig:
    """What the root command's callback built for this command."""
    config = ctx.find_object(CliConfig)
    if config is None:
        raise RuntimeError("no CliConfig: run the command through starter.cli.build_app()")
    return config


async def _call(coro_fn: Callable[[], Awaitable[T]]) -> T:
    return await coro_fn()


@asynccontextmanager
async def job_client(config: CliConfig, with_store: bool = False) -> AsyncIterator[JobClient]:
    """A JobClient; with an artifact bucket configured it can presign and download.

    Credentials follow botocore's default chain: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, else a
    shared credentials file or profile (AWS_PROFILE), an instance role, ...
    """
    client = await JobClient.connect(
        config.temporal.address,
        config.temporal.namespace,
        task_queue=config.settings.task_queue,
        query_timeout_s=config.settings.query_timeout_s,
        s3=config.artifact_store_settings() if with_store else None,
        s3_from_environment=False,
    )
    async with client:
        yield client


def echo_json(text: str) -> None:
    """The only way anything reaches stdout in --json mode: one document per line."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
