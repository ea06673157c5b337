"""The stack's codec server (`durable-comfy codec-server`), when `codec.enabled` in the stack file.

It is not one of the stack's services (their names are fixed): `up` starts it detached after
them, `down` stops it by PID with them. Its key file is made once in the state dir (0600) and
named to it, to workers and to the CLI by DURABLE_COMFY_CODEC_KEYS_FILE (the stack's env file).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from configuration.codec_keys import KEYS_ENV, KEYS_FILE_ENV
from devstack.config import StackConfig
from devstack.errors import ServiceStartError, StackError
from devstack.files import write_atomic
from devstack.probes import ProbeFailed, http_get_ok
from devstack.processes import (
    check_port_free,
    is_alive,
    log_tail,
    read_pid_file,
    spawn_detached,
    terminate,
)
from devstack.services import PROJECT_ROOT, StackPaths
from starter.codec import new_entry

NAME = "codec_server"
FIRST_KEY_ID = "dev-1"
START_DEADLINE_S = 30.0


def keys_file(config: StackConfig, base_dir: Path) -> Path:
    return config.path(base_dir, config.codec.keys_file).resolve()


def ensure_keys_file(path: Path) -> None:
    """A fresh key ring the first time; kept afterwards (histories encrypted with it stay
    readable). Rotate by putting a `durable-comfy codec-key ID` line first in it."""
    if path.exists():
        path.chmod(0o600)
        return
    write_atomic(
        path,
        "# Written by `durable-comfy dev up`: the stack's payload keys, newest first.\n"
        f"{new_entry(FIRST_KEY_ID)}\n",
        mode=0o600,
    )


def codec_server_argv(config: StackConfig) -> tuple[str, ...]:
    codec = config.codec
    auth = ("--auth-token-env", codec.auth_token_env) if codec.auth_token_env else ()
    return (
        sys.executable,
        "-m",
        "starter.cli",
        "codec-server",
        "--host",
        codec.host,
        "--port",
        str(codec.port),
        "--ui-origin",
        config.temporal.ui_url,
        *auth,
    )


def _files(config: StackConfig, base_dir: Path) -> tuple[Path, Path]:
    paths = StackPaths.of(config, base_dir)
    return paths.pids / f"{NAME}.pid", paths.logs / f"{NAME}.log"


async def start_codec_server(config: StackConfig, base_dir: Path) -> tuple[int, str]:
    """Start it unless ours runs with these settings; (pid, what was done) once /health answers."""
    codec = config.codec
    pid_file, log_file = _files(config, base_dir)
    argv = codec_server_argv(config)
    record = read_pid_file(pid_file)
    if record is not None and is_alive(record):
        if record.argv[1:] != list(argv[1:]):
            raise StackError(
                f"{NAME} is already running (pid {record.pid}) with other settings",
                hint="run `durable-comfy dev down`, then `up` again",
            )
        return record.pid, "already running"
    check_port_free(codec.host, codec.port, NAME, "codec.port")
    path = keys_file(config, base_dir)
    ensure_keys_file(path)
    pythonpath = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p)
    record = spawn_detached(
        argv,
        log_file,
        StackPaths.of(config, base_dir).state_dir,
        pid_file,
        env={KEYS_FILE_ENV: str(path), "PYTHONPATH": pythonpath},
        # The stack's key file is the one the server decodes with, whatever the shell holds.
        unset_env=(KEYS_ENV,),
    )
    deadline = time.monotonic() + START_DEADLINE_S
    last = "no answer yet"
    while time.monotonic() < deadline:
        if not is_alive(record):
            raise ServiceStartError(
                NAME, f"it exited (last probe: {last})", str(log_file), log_tail(log_file)
            )
        try:
            await http_get_ok(f"{codec.url}/health")
            return record.pid, "started"
        except ProbeFailed as exc:
            last = str(exc)
        await asyncio.sleep(0.1)
    await terminate(record)
    raise ServiceStartError(
        NAME, f"no answer within {START_DEADLINE_S:.0f} s", str(log_file), log_tail(log_file)
    )


async def stop_codec_server(config: StackConfig, base_dir: Path) -> int | None:
    """Stop ours if it runs (by its PID file; also after `codec.enabled` was turned off)."""
    pid_file, _ = _files(config, base_dir)
    record = read_pid_file(pid_file)
    if record is None:
        return None
    if is_alive(record):
        await terminate(record, grace_s=5.0)
    pid_file.unlink(missing_ok=True)
    return record.pid
