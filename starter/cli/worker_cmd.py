"""`durable-comfy worker`: the same as `python worker.py`."""

from __future__ import annotations

from typing import Annotated

import typer


def worker(
    metrics_port: Annotated[
        int | None,
        typer.Option(help="Serve Prometheus metrics on 127.0.0.1:PORT/metrics."),
    ] = None,
) -> None:
    """Run the Temporal worker (pools from temporal-dev.yaml or the environment)."""
    import worker as worker_module

    worker_module.main([] if metrics_port is None else ["--metrics-port", str(metrics_port)])
