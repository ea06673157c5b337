"""`durable-comfy worker`: the same as `python worker.py`."""

from __future__ import annotations


def worker() -> None:
    """Run the Temporal worker (pools from temporal-dev.yaml or the environment)."""
    import worker as worker_module

    worker_module.main()
