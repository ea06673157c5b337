"""`durable-comfy dev up|down|status`: the local stack from temporal-dev.yaml.

Human lines by default; with --json exactly one JSON object on stdout (errors included), never a
secret. Exit codes: 0 ok, 1 stack error (message and hint on stderr), 3 `status` with a service
that is not running.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import structlog
import typer
from pydantic import ValidationError

from devstack.config import CONFIG_ENV, DEFAULT_CONFIG_PATH, StackConfig, load_stack_config
from devstack.errors import PortInUseError, StackError
from devstack.models import RunningStack, ServiceState, StackStatus
from devstack.services import endpoint_venv_missing
from devstack.stack import stack_status, start_stack, stop_stack
from devstack.worker_process import WorkerProcessState, stop_worker, worker_state

app = typer.Typer(
    help="The local stack: Temporal dev server, SeaweedFS S3, ComfyUI and RunPod simulators."
)

T = TypeVar("T")

ConfigOpt = Annotated[
    Path,
    typer.Option(
        "--config",
        "-c",
        # .devstack/env exports it: a shell set up for a moved stack runs `dev` against that stack.
        envvar=CONFIG_ENV,
        help="Stack config file.",
        show_default=True,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Logs and tracebacks.")]

EXIT_STACK_ERROR = 1
EXIT_NOT_RUNNING = 3


def _configure_logging(verbose: bool) -> None:
    # stdout belongs to the result (one JSON object with --json); logs go to stderr.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.DEBUG if verbose else logging.WARNING
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def _load(config_path: Path) -> tuple[StackConfig, Path, Path]:
    path = config_path.expanduser().resolve()
    try:
        config = load_stack_config(path)
    except FileNotFoundError as exc:
        raise StackError(f"config file {path} not found", hint="pass --config PATH") from exc
    except ValidationError as exc:
        raise StackError(f"config file {path} is invalid:\n{exc}") from exc
    # Relative paths in the file (state_dir first) are relative to the file, not to the cwd.
    return config, path.parent, path


def _fail(exc: StackError, as_json: bool, verbose: bool) -> NoReturn:
    if verbose:
        raise exc
    if as_json:
        error: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
        if exc.hint:
            error["hint"] = exc.hint
        if isinstance(exc, PortInUseError):
            error |= {"port": exc.port, "config_key": exc.config_key, "service": exc.service}
        typer.echo(json.dumps({"error": error}))
    typer.echo(f"error: {exc}", err=True)
    if exc.hint:
        typer.echo(f"hint: {exc.hint}", err=True)
    raise typer.Exit(EXIT_STACK_ERROR) from None


def _run(coro: Coroutine[Any, Any, T], as_json: bool, verbose: bool) -> T:
    try:
        return asyncio.run(coro)
    except StackError as exc:
        _fail(exc, as_json, verbose)


def _load_or_fail(config: Path, as_json: bool, verbose: bool) -> tuple[StackConfig, Path, Path]:
    try:
        return _load(config)
    except StackError as exc:
        _fail(exc, as_json, verbose)


def _service_line(state: ServiceState) -> str:
    what = state.action or state.state
    pid = f"pid {state.pid}" if state.pid is not None else "no pid"
    ready = f", ready in {state.ready_s:.1f} s" if state.ready_s is not None else ""
    note = f"  {state.note}" if state.note else ""
    detail = f"  ({state.detail})" if state.detail else ""
    return f"  {state.name:<12} {what:<16} {pid}{ready:<18} {state.url}{note}{detail}"


def _worker_line(worker: WorkerProcessState | None) -> str:
    if worker is None:
        return (
            f"  {'worker':<12} {'not started':<16} (make demo starts one; `durable-comfy worker`)"
        )
    what = "running" if worker.alive else "not running"
    gone = "" if worker.alive else " (gone)"
    return (
        f"  {'worker':<12} {what:<16} pid {worker.pid}{gone}  task queue {worker.task_queue!r}"
        f"  log {worker.log_file}"
    )


def _print_stack(stack: RunningStack) -> None:
    typer.echo("Services:")
    for state in stack.services.values():
        typer.echo(_service_line(state))
    typer.echo("")
    typer.echo(f"  Temporal      {stack.temporal_address}  (namespace {stack.namespace})")
    typer.echo(f"  Temporal UI   {stack.temporal_ui}")
    typer.echo(f"  S3            {stack.s3_endpoint}  (bucket {stack.bucket})")
    typer.echo(f"  ComfyUI sim   {stack.comfyui_url}")
    typer.echo(
        f"  RunPod sim    runpod_url {stack.runpod_url}  endpoint {stack.runpod_endpoint_id}"
        "  (key: RUNPOD_API_KEY in the env file)"
    )
    typer.echo("")
    typer.echo(f"Environment for workers and the CLI: . {stack.env_file}")
    if stack.codec_endpoint is not None:
        typer.echo(
            f"  Codec server  {stack.codec_endpoint}  (payloads are encrypted; keys in"
            f" {stack.codec_keys_file})"
        )
    typer.echo(
        f"temporal CLI: temporal --config-file {stack.temporal_config_file}"
        f" --profile {stack.temporal_profile} workflow list"
    )
    if stack.codec_endpoint is not None:
        # The profile names the codec server too; said here for other ways of connecting.
        typer.echo(
            f"  decoded: temporal --address {stack.temporal_address}"
            f" --codec-endpoint {stack.codec_endpoint} workflow show -w JOB_ID"
        )


@app.command()
def up(
    config: ConfigOpt = DEFAULT_CONFIG_PATH, json_: JsonOpt = False, verbose: VerboseOpt = False
) -> None:
    """Start whatever is not running and wait until every service answers."""
    _configure_logging(verbose)
    stack_config, base_dir, config_file = _load_or_fail(config, json_, verbose)
    stack = _run(start_stack(stack_config, base_dir, config_file), json_, verbose)
    if (missing := endpoint_venv_missing()) is not None:
        typer.echo(f"warning: the RunPod simulator's workers cannot start: {missing}", err=True)
    if json_:
        typer.echo(json.dumps(stack.public_view()))
    else:
        _print_stack(stack)


@app.command()
def down(
    config: ConfigOpt = DEFAULT_CONFIG_PATH, json_: JsonOpt = False, verbose: VerboseOpt = False
) -> None:
    """Stop the services this stack started (by PID); data and logs stay."""
    _configure_logging(verbose)
    stack_config, base_dir, _ = _load_or_fail(config, json_, verbose)
    # The worker first: its SIGTERM handler hands running prompts over while Temporal is up.
    worker_pid = _run(stop_worker(stack_config, base_dir), json_, verbose)
    states = _run(stop_stack(stack_config, base_dir), json_, verbose)
    if json_:
        payload = {name: state.model_dump(mode="json") for name, state in states.items()}
        typer.echo(json.dumps({"services": payload, "worker_pid": worker_pid}))
    else:
        if worker_pid is not None:
            typer.echo(f"worker       stopped  (pid {worker_pid})")
        for state in states.values():
            typer.echo(_service_line(state))


@app.command()
def status(
    config: ConfigOpt = DEFAULT_CONFIG_PATH, json_: JsonOpt = False, verbose: VerboseOpt = False
) -> None:
    """Report each service as running, unhealthy or stopped (exit 3 unless all run), and the
    stack's background worker (its PID, alive or not, its task queue)."""
    _configure_logging(verbose)
    stack_config, base_dir, _ = _load_or_fail(config, json_, verbose)
    report: StackStatus = _run(stack_status(stack_config, base_dir), json_, verbose)
    # The worker `make demo` starts in the background is not a service: whether it runs does
    # not change the exit code, but a job that waits for a worker is explained here.
    worker = worker_state(stack_config, base_dir)
    if json_:
        payload = json.loads(report.model_dump_json())
        payload["worker"] = worker.model_dump(mode="json") if worker is not None else None
        typer.echo(json.dumps(payload))
    else:
        for state in report.services.values():
            typer.echo(_service_line(state))
        typer.echo(_worker_line(worker))
    if not report.all_running:
        raise typer.Exit(EXIT_NOT_RUNNING)


if __name__ == "__main__":
    app()
