"""Free loopback ports and a stack config that uses only them, for private local stacks.

The integration tests (tests/conftest.py) and `make bench` (bench/stack.py) each start stacks of
their own beside whatever else runs on the machine: every port is picked here, on 127.0.0.1,
and the state goes where the caller says.
"""

from __future__ import annotations

import functools
import os
import random
import socket
from pathlib import Path

from devstack.config import PoolConfig, StackConfig, load_stack_config
from devstack.stack import stack_ports

ROOT = Path(__file__).resolve().parent.parent
DEV_CONFIG = ROOT / "temporal-dev.yaml"
HOST = "127.0.0.1"
# `weed mini` binds its admin gRPC server at admin_port + 10000, whatever it is told.
ADMIN_GRPC_OFFSET = 10000

_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def port_is_free(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@functools.cache
def _shipped_ports() -> frozenset[int]:
    """The ports of the shipped stack (temporal-dev.yaml): `make demo` may take them at any
    time, and a test holds them all to prove that a moved stack binds none of them
    (tests/tooling/test_devstack.py), so no private stack gets one."""
    bound = stack_ports(load_stack_config(DEV_CONFIG)).values()
    return frozenset(port for ports in bound for _, port in ports)


def free_port(host: str = HOST) -> int:
    """A port nobody listens on now, never handed out twice in this process, and never one of
    the shipped stack's.

    Chosen below the kernel's ephemeral range: the Temporal dev server takes random ephemeral
    ports for its internal services, and every outgoing connection takes one too, so a port picked
    by binding to port 0 could be gone again by the time the service starts.
    """
    low, _ = _ephemeral_range()
    rng = random.SystemRandom()
    reserved = _shipped_ports()
    index, share = _process_share()
    for _ in range(1000):
        port = rng.randrange(10000, min(low, 65535 - ADMIN_GRPC_OFFSET) - share)
        port += (index - port) % share
        if port not in _handed_out and port not in reserved and port_is_free(port, host):
            _handed_out.add(port)
            return port
    raise RuntimeError("no free port found")


def _process_share() -> tuple[int, int]:
    """(i, n): this process picks only ports equal to i modulo n. Under pytest-xdist, n is the
    number of test processes and i this one's: each starts a stack of its own at the same
    moment, and a port two of them picked before either bound it failed a whole stack
    ("address already in use"). Elsewhere (0, 1): any port."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 0:
        return int(worker[2:]) % int(count), int(count)
    return 0, 1


def _admin_port() -> int:
    while True:
        port = free_port()
        if port + ADMIN_GRPC_OFFSET not in _handed_out and port_is_free(port + ADMIN_GRPC_OFFSET):
            _handed_out.add(port + ADMIN_GRPC_OFFSET)
            return port


def make_stack_config(state_dir: Path, step_delay_ms: int = 20) -> StackConfig:
    """temporal-dev.yaml with every port free and the state in `state_dir`."""
    base = load_stack_config(DEV_CONFIG)
    temporal = base.temporal.model_copy(
        update={
            "host": HOST,
            "port": free_port(),
            "ui_port": free_port(),
            "http_port": free_port(),
            "metrics_port": free_port(),
        }
    )
    s3 = base.s3.model_copy(
        update={
            "host": HOST,
            "s3_port": free_port(),
            "s3_grpc_port": free_port(),
            "master_port": free_port(),
            "master_grpc_port": free_port(),
            "volume_port": free_port(),
            "volume_grpc_port": free_port(),
            "filer_port": free_port(),
            "filer_grpc_port": free_port(),
            "admin_port": _admin_port(),
            "webdav_port": free_port(),
        }
    )
    sim = base.comfyui_sim.model_copy(
        update={"host": HOST, "port": free_port(), "step_delay_ms": step_delay_ms}
    )
    rp_sim = base.runpod_sim.model_copy(
        update={"host": HOST, "port": free_port(), "comfyui_step_delay_ms": step_delay_ms}
    )
    pools = {
        name: pool.model_copy(update={"url": rp_sim.api_url})
        if pool.kind == "runpod" and pool.url == base.runpod_sim.api_url
        else pool
        for name, pool in base.worker.pools.items()
    }
    pools["comfyui"] = PoolConfig(kind="comfyui", url=sim.url)
    worker = base.worker.model_copy(update={"pools": pools})
    return base.model_copy(
        update={
            "state_dir": str(state_dir),
            "temporal": temporal,
            "s3": s3,
            "comfyui_sim": sim,
            "runpod_sim": rp_sim,
            "worker": worker,
        }
    )
