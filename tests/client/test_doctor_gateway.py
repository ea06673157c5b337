"""`durable-comfy doctor --gateway URL`: the gateway's line (deploy.md, step 7).

A gateway run as a user runs it (`durable-comfy gateway`, a subprocess) on the session's stack:
ready; the same gateway without Temporal's address: it serves but is not ready (exit 3); no
gateway at the URL: unreachable (exit 3); a server that is not a gateway (the ComfyUI
simulator): a configuration problem (exit 2). Without `--gateway` there is no gateway line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from devstack.models import RunningStack
from starter.doctor import DoctorExit
from tests.conftest import HOST, free_port
from tests.gateway.test_gateway_page import running_gateway
from tests.support.cli import cli_env, json_lines, run_cli


def gateway_line(out: str) -> dict[str, Any]:
    [line] = [d for d in json_lines(out) if d["check"] == "gateway"]
    return line


async def test_doctor_checks_the_gateway_it_is_given(
    local_stack: RunningStack, tmp_path: Path
) -> None:
    env = cli_env(local_stack, f"doctor-gateway-{free_port()}")
    port, lost = free_port(), free_port()
    without_temporal = {**env, "TEMPORAL_ADDRESS": f"{HOST}:{lost}"}
    async with running_gateway(env, port, tmp_path / "ready.log"):
        code, out, err = await run_cli(
            "doctor", "--json", "--gateway", f"http://{HOST}:{port}/", env=env
        )
    ready = gateway_line(out)
    assert ready["outcome"] == "ok" and f"http://{HOST}:{port}" in ready["message"], (out, err)
    assert not [d for d in json_lines(out) if d["outcome"] == "fail" and d["check"] == "gateway"]

    port = free_port()
    async with running_gateway(without_temporal, port, tmp_path / "not-ready.log", "/healthz"):
        code, out, _ = await run_cli(
            "doctor", "--json", "--gateway", f"http://{HOST}:{port}", env=env
        )
    not_ready = gateway_line(out)
    assert not_ready["outcome"] == "fail" and not_ready["problem"] == "unreachable", not_ready
    assert "not ready" in not_ready["message"] and code == DoctorExit.UNREACHABLE

    code, out, _ = await run_cli("doctor", "--json", "--gateway", f"http://{HOST}:{lost}", env=env)
    nobody = gateway_line(out)
    assert nobody["problem"] == "unreachable" and "nothing answers" in nobody["message"], nobody

    code, out, _ = await run_cli("doctor", "--json", "--gateway", local_stack.comfyui_url, env=env)
    other = gateway_line(out)
    assert other["problem"] == "configuration" and "404" in other["message"], other
    assert code == DoctorExit.CONFIGURATION

    code, out, _ = await run_cli("doctor", "--json", env=env)
    assert "gateway" not in [d["check"] for d in json_lines(out)]
