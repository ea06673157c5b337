"""The soak's command line: `python -m faults.soak --minutes N --fault-every F [...]`."""

from __future__ import annotations

import argparse
import secrets
from typing import Literal

from pydantic import BaseModel, Field

StockMode = Literal["auto", "real", "standin", "off"]


class SoakOptions(BaseModel):
    minutes: float = Field(15.0, gt=0)
    fault_every_s: float = Field(20.0, gt=0)
    seed: int = Field(default_factory=lambda: secrets.randbelow(2**31))
    jobs_per_minute: float = Field(6.0, gt=0)
    # Of all jobs, about this many are cancelled mid-run (only long ones: a short one would end
    # before the cancel lands).
    cancel_fraction: float = Field(0.15, ge=0, le=1)
    # How long the drain may wait for the last jobs to end once the faults stop.
    drain_timeout_s: float = Field(600.0, gt=0)
    # A claims: false pool on a stock worker-comfyui endpoint (endpoints.py).
    stock: StockMode = "auto"
    # The simulated GPU's time per sampler step, on every ComfyUI simulator.
    step_delay_ms: int = Field(50, ge=0)
    keep: bool = False


def parse_args(argv: list[str] | None = None) -> SoakOptions:
    defaults = SoakOptions(seed=0)
    parser = argparse.ArgumentParser(
        prog="python -m faults.soak",
        description="Mixed detached jobs on both pool kinds with a random fault every F seconds, "
        "then an audit of what the system promises (docs/reliability.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=defaults.minutes,
        help="how long jobs are submitted and faults injected",
    )
    parser.add_argument(
        "--fault-every",
        type=float,
        default=defaults.fault_every_s,
        help="seconds between faults (jittered +-50%%)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="the seed of the job mix and the faults; None: a random one, printed at the start",
    )
    parser.add_argument(
        "--jobs-per-minute",
        type=float,
        default=defaults.jobs_per_minute,
        help="jobs submitted per minute (jittered +-50%%)",
    )
    parser.add_argument(
        "--cancel-fraction",
        type=float,
        default=defaults.cancel_fraction,
        help="the share of all jobs cancelled mid-run",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=defaults.drain_timeout_s,
        help="seconds to wait for the last jobs once the faults stop",
    )
    parser.add_argument(
        "--stock",
        choices=["auto", "real", "standin", "off"],
        default=defaults.stock,
        help="a claims: false pool: the real worker-comfyui handler (.venv-stock), "
        "the project's stand-in (tests/runpod_handlers/stock_comfyui.py), or "
        "none; auto: real when its venv and launcher exist, else none",
    )
    parser.add_argument(
        "--step-delay-ms",
        type=int,
        default=defaults.step_delay_ms,
        help="each ComfyUI simulator's time per sampler step",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the run's directory (logs, evidence.json) even when it passed",
    )
    args = parser.parse_args(argv)
    fields = {
        "minutes": args.minutes,
        "fault_every_s": args.fault_every,
        "jobs_per_minute": args.jobs_per_minute,
        "cancel_fraction": args.cancel_fraction,
        "drain_timeout_s": args.drain_timeout,
        "stock": args.stock,
        "step_delay_ms": args.step_delay_ms,
        "keep": args.keep,
    }
    if args.seed is not None:
        fields["seed"] = args.seed
    try:
        return SoakOptions.model_validate(fields)
    except ValueError as exc:
        parser.error(str(exc))
