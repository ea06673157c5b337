"""`python -m devstack.comfy_sim`: run the ComfyUI simulator until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from aiohttp import web

from devstack.sim_logging import configure_sim_logging

from .server import create_app
from .settings import DEFAULT_MS_PER_MEGAPIXEL, SIM_VERSION, SimSettings
from .state import PROGRESS_LOG_PROMPTS


def parse_args(argv: list[str] | None = None) -> SimSettings:
    parser = argparse.ArgumentParser(
        prog="python -m devstack.comfy_sim",
        description=f"ComfyUI simulator for durable-comfy ({SIM_VERSION}); not ComfyUI.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8188)
    parser.add_argument("--output-dir", type=Path, default=Path("output"))
    parser.add_argument("--input-dir", type=Path, default=Path("input"))
    parser.add_argument(
        "--temp-dir",
        type=Path,
        default=None,
        help="previews (default: 'temp' next to the output directory)",
    )
    parser.add_argument(
        "--step-delay-ms",
        type=float,
        default=100,
        help="time per KSampler step (per prompt: extra_data.sim.step_delay_ms)",
    )
    parser.add_argument(
        "--ms-per-megapixel",
        type=float,
        default=DEFAULT_MS_PER_MEGAPIXEL,
        help="time an image node takes per megapixel (width*height*batch), without progress "
        "hook or interrupt check (per prompt: extra_data.sim.ms_per_megapixel)",
    )
    parser.add_argument(
        "--max-upload-size",
        type=float,
        default=100,
        help="largest request body in MB (bigger: 413), as ComfyUI's flag",
    )
    parser.add_argument(
        "--cache-none",
        action="store_true",
        help="never reuse node outputs between prompts, as ComfyUI's flag",
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="simulator only: prompts run at once, each in an executor of its own, standing for "
        "N GPU workers behind one API (1, the default, is ComfyUI: one at a time)",
    )
    parser.add_argument(
        "--progress-log-prompts",
        type=int,
        default=PROGRESS_LOG_PROMPTS,
        help="simulator only: prompts whose progress event times GET /sim/progress keeps",
    )
    args = parser.parse_args(argv)
    return SimSettings(
        host=args.host,
        port=args.port,
        output_dir=args.output_dir,
        input_dir=args.input_dir,
        temp_dir=args.temp_dir,
        step_delay_ms=args.step_delay_ms,
        ms_per_megapixel=args.ms_per_megapixel,
        max_upload_size_mb=args.max_upload_size,
        cache_none=args.cache_none,
        parallel=args.parallel,
        progress_log_prompts=args.progress_log_prompts,
    )


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    configure_sim_logging("comfy-sim")
    app = create_app(settings)
    # run_app turns SIGINT/SIGTERM into a graceful shutdown (sockets closed, tasks cancelled).
    web.run_app(
        app,
        host=settings.host,
        port=settings.port,
        shutdown_timeout=5,
        # A benchmark's batch connects a thousand clients at once; aiohttp's default backlog
        # (128) resets the rest.
        backlog=2048,
        print=lambda msg: logging.info("%s (%s)", msg.strip(), SIM_VERSION),
    )


if __name__ == "__main__":
    main()
