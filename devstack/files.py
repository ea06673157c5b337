"""Atomic writes of the small state files (PID files, env file, credentials, client profile)."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Replace `path` in one step, created with `mode`: a secret is never briefly world-readable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    # os.open's mode is filtered by the umask; set exactly what was asked.
    os.chmod(tmp, mode)
    tmp.replace(path)
