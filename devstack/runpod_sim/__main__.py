"""`python -m devstack.runpod_sim`: run the RunPod serverless simulator until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
from pathlib import Path

from aiohttp import web
from pydantic import ValidationError

from devstack.sim_logging import configure_sim_logging

from .server import create_app
from .settings import SIM_VERSION, RateLimits, SimSettings

API_KEY_VARIABLE = "RUNPOD_SIM_API_KEY"


def _env_pair(text: str) -> tuple[str, str]:
    """KEY=VALUE, or KEY alone for the simulator's own value (a secret stays off the command
    line, which any local user can read)."""
    key, sep, value = text.partition("=")
    if not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE or KEY, got {text!r}")
    if not sep:
        if key not in os.environ:
            raise argparse.ArgumentTypeError(f"{key} is not set in the simulator's environment")
        value = os.environ[key]
    return key, value


def _parser() -> argparse.ArgumentParser:
    d = SimSettings()
    p = argparse.ArgumentParser(
        prog="python -m devstack.runpod_sim",
        description=f"RunPod serverless simulator for durable-comfy ({SIM_VERSION}); not RunPod.",
    )
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument(
        "--api-key", default=os.environ.get(API_KEY_VARIABLE, d.api_key),
        help=f"the public API's Bearer key (default: ${API_KEY_VARIABLE}, else {d.api_key})",
    )  # fmt: skip
    p.add_argument("--endpoint-id", default=d.endpoint_id)
    p.add_argument(
        "--worker-command",
        default=shlex.join(d.worker_command),
        help="the worker process, run in --worker-cwd (a shell-quoted command line; default: "
        "%(default)s)",
    )
    p.add_argument("--worker-cwd", type=Path, default=d.worker_cwd)
    p.add_argument(
        "--worker-env", type=_env_pair, action="append", default=[], metavar="KEY[=VALUE]",
        help="a variable for every worker; KEY alone passes the simulator's own (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--worker-env-factory", default=None, metavar="MODULE:ATTR",
        help="a callable returning a WorkerEnvFactory: per-worker variables",
    )  # fmt: skip
    p.add_argument(
        "--comfy-sim-per-worker", action="store_true",
        help="start a ComfyUI simulator for each worker (COMFY_URL, COMFY_HOST)",
    )  # fmt: skip
    p.add_argument(
        "--comfy-sim-args", default="", help="extra arguments for each ComfyUI simulator (quoted)"
    )
    p.add_argument("--work-dir", type=Path, default=None, help="worker logs (default: a temp dir)")
    p.add_argument(
        "--watchdog", choices=["auto", "on", "off"], default=d.watchdog,
        help="a watchdog beside each worker's handler (auto: when the worker runs "
        "endpoint/handler.py and endpoint/watchdog.py exists)",
    )  # fmt: skip
    p.add_argument(
        "--watchdog-command", default=None,
        help="the watchdog (quoted; `--pid PID` is appended; default: the worker command's "
        "interpreter running endpoint/watchdog.py)",
    )  # fmt: skip
    p.add_argument(
        "--no-s3-proxy", dest="s3_proxy", action="store_false",
        help="give workers the bucket's own URL (no `partition` fault then)",
    )  # fmt: skip
    p.add_argument(
        "--clock-speed", type=float, default=d.clock_speed,
        help="simulated seconds per real second for the platform's timers",
    )  # fmt: skip
    p.add_argument("--max-workers", type=int, default=d.max_workers)
    p.add_argument(
        "--min-workers", type=int, default=d.min_workers,
        help="active workers: always running, never idle-stopped",
    )  # fmt: skip
    p.add_argument("--idle-timeout", type=float, default=d.idle_timeout_s, help="simulated s")
    p.add_argument("--cold-start", type=float, default=d.cold_start_s, help="simulated s")
    p.add_argument("--stop-grace", type=float, default=d.stop_grace_s, help="real s")
    p.add_argument("--ping-interval-ms", type=int, default=d.ping_interval_ms)
    p.add_argument("--runpod-log-level", default=d.runpod_log_level)
    p.add_argument(
        "--worker-death", choices=["timed_out", "redeliver", "stuck"], default=d.worker_death,
        help="what a job whose worker dies becomes (the crash fault chooses its own)",
    )  # fmt: skip
    p.add_argument(
        "--execution-timeout-status", choices=["TIMED_OUT", "FAILED"],
        default=d.execution_timeout_status,
    )  # fmt: skip
    p.add_argument("--take-poll", type=float, default=d.take_poll_s, help="real s")
    p.add_argument("--stop-poll", type=float, default=d.stop_poll_s, help="real s")
    p.add_argument("--stream-poll", type=float, default=d.stream_poll_s, help="real s")
    p.add_argument("--default-execution-timeout-ms", type=int,
                   default=d.default_execution_timeout_ms)  # fmt: skip
    p.add_argument("--default-ttl-ms", type=int, default=d.default_ttl_ms)
    p.add_argument("--run-retention", type=float, default=d.run_retention_s, help="simulated s")
    p.add_argument(
        "--runsync-retention", type=float, default=d.runsync_retention_s, help="simulated s"
    )
    p.add_argument("--max-run-body-mb", type=float, default=d.max_run_body_mb)
    p.add_argument("--max-runsync-body-mb", type=float, default=d.max_runsync_body_mb)
    p.add_argument("--max-stream-chunk-mb", type=float, default=d.max_stream_chunk_mb)
    p.add_argument("--max-result-mb", type=float, default=d.max_result_mb)
    limits = d.rate_limits
    p.add_argument("--rate-window", type=float, default=limits.window_s, help="real s")
    p.add_argument("--rate-limit-run", type=int, default=limits.run)
    p.add_argument("--rate-limit-status", type=int, default=limits.status)
    p.add_argument("--rate-limit-cancel", type=int, default=limits.cancel)
    return p


def parse_args(argv: list[str] | None = None) -> SimSettings:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return _settings(args)
    except ValidationError as exc:
        parser.error(str(exc))


def _settings(args: argparse.Namespace) -> SimSettings:
    return SimSettings(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        endpoint_id=args.endpoint_id,
        worker_command=tuple(shlex.split(args.worker_command)),
        worker_cwd=args.worker_cwd.expanduser().resolve(),
        worker_env=dict(args.worker_env),
        worker_env_factory=args.worker_env_factory,
        comfy_sim_per_worker=args.comfy_sim_per_worker,
        comfy_sim_args=tuple(shlex.split(args.comfy_sim_args)),
        work_dir=args.work_dir,
        watchdog=args.watchdog,
        watchdog_command=tuple(shlex.split(args.watchdog_command))
        if args.watchdog_command
        else None,
        s3_proxy=args.s3_proxy,
        clock_speed=args.clock_speed,
        max_workers=args.max_workers,
        min_workers=args.min_workers,
        idle_timeout_s=args.idle_timeout,
        cold_start_s=args.cold_start,
        stop_grace_s=args.stop_grace,
        ping_interval_ms=args.ping_interval_ms,
        runpod_log_level=args.runpod_log_level,
        worker_death=args.worker_death,
        execution_timeout_status=args.execution_timeout_status,
        take_poll_s=args.take_poll,
        stop_poll_s=args.stop_poll,
        stream_poll_s=args.stream_poll,
        default_execution_timeout_ms=args.default_execution_timeout_ms,
        default_ttl_ms=args.default_ttl_ms,
        run_retention_s=args.run_retention,
        runsync_retention_s=args.runsync_retention,
        max_run_body_mb=args.max_run_body_mb,
        max_runsync_body_mb=args.max_runsync_body_mb,
        max_stream_chunk_mb=args.max_stream_chunk_mb,
        max_result_mb=args.max_result_mb,
        rate_limits=RateLimits(
            window_s=args.rate_window,
            run=args.rate_limit_run,
            status=args.rate_limit_status,
            cancel=args.rate_limit_cancel,
        ),
    )


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    configure_sim_logging("runpod-sim")
    app = create_app(settings)
    # run_app turns SIGINT/SIGTERM into a graceful shutdown: on_shutdown stops every worker.
    web.run_app(
        app,
        host=settings.host,
        port=settings.port,
        shutdown_timeout=settings.stop_grace_s + 5,
        print=lambda msg: logging.info("%s (%s)", msg.strip(), SIM_VERSION),
    )


if __name__ == "__main__":
    main()
