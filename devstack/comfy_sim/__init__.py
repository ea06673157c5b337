"""durable-comfy's ComfyUI simulator: speaks ComfyUI's HTTP + WebSocket protocol
(docs/comfyui-protocol.md) and "renders" deterministic PNGs over simulated progress steps, with
fault knobs under /sim/, and `GET /sim/progress?prompt_id=ID`: when each progress event of a
prompt was sent (epoch seconds), from which `make bench` times the way to a client.

Simulator-only options beside ComfyUI's own flags (SimSettings, `python -m devstack.comfy_sim
--help`): `--step-delay-ms` / `--ms-per-megapixel` (time per step and per image),
`--parallel N` (N prompts run at once, standing for N GPU workers behind one API; the default 1
is ComfyUI's one at a time) and `--progress-log-prompts N` (how many prompts /sim/progress keeps,
32 by default).

Every route our handler, the orchestrator and the stock worker-comfyui handler call answers as
ComfyUI 0.8.0's does (status, content type, body; tests/tooling/test_comfy_sim_conformance.py
checks them against a real one), `GET /` among them: a small page in place of the front end.

It is a simulator, not ComfyUI: /system_stats reports `sim-0.1 (durable-comfy ComfyUI
simulator)` and no model is ever loaded. Run it with `python -m devstack.comfy_sim`, or build the
aiohttp application in-process with `create_app(SimSettings(...))`.
"""

from .server import create_app
from .settings import SIM_VERSION, SimSettings

__all__ = ["SIM_VERSION", "SimSettings", "create_app"]
