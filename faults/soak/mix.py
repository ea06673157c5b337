"""The job mix: what each submitted job is, drawn from the run's seeded random generator.

Three graph kinds, all model-free (examples/txt2img.json on the simulators):
- short: a few sampler steps (about a second of "GPU");
- long: hundreds of steps, so faults land mid-run;
- multi: a medium sampler plus one or two quick EmptyImage -> SaveImage branches, so a job has
  several outputs (and a cancel keeps the ones that finished).
Pools are drawn evenly. About `cancel_fraction` of all jobs are cancelled a few seconds after
they start running (long and multi ones only: a short one ends before the cancel lands).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

from faults.graphs import SAMPLER_NODE, sampler_graph
from workflows.contracts import JobPolicy, JobRequest, ReconnectPolicy

GraphKind = Literal["short", "long", "multi"]
KIND_WEIGHTS: dict[GraphKind, float] = {"short": 0.4, "long": 0.35, "multi": 0.25}
STEPS: dict[GraphKind, tuple[int, int]] = {"short": (4, 12), "long": (200, 500), "multi": (40, 160)}


@dataclass(frozen=True)
class PoolChoice:
    name: str
    kind: str  # comfyui | runpod
    claims: bool


@dataclass(frozen=True)
class JobPlan:
    job_id: str
    pool: PoolChoice
    kind: GraphKind
    steps: int
    outputs: int  # SaveImage nodes: what a completed job must have stored
    request: JobRequest
    # Seconds after the job is first seen RUNNING to send the cancel (None: never).
    cancel_after_s: float | None


def soak_policy() -> JobPolicy:
    """Detached, with timeouts that ride out the faults: a 20 s S3 outage, a Temporal restart,
    a RunPod worker's claim lease (60 s) running out after a crash."""
    return JobPolicy(
        execution_timeout_s=1200.0,
        heartbeat_timeout_s=10.0,
        reconnect=ReconnectPolicy(base_delay_s=0.5, max_delay_s=5.0, horizon_s=300.0),
        abandon_after_s=None,
        progress_interval_s=1.0,
        teardown_horizon_s=180.0,
    )


def graph_for(kind: GraphKind, steps: int, extra_outputs: int, seed: int) -> dict[str, Any]:
    graph = sampler_graph(steps, seed=seed)
    for n in range(extra_outputs):
        image, save = str(30 + 2 * n), str(31 + 2 * n)
        graph[image] = {
            "class_type": "EmptyImage",
            "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 0x3366CC + n},
        }
        graph[save] = {
            "class_type": "SaveImage",
            "inputs": {"images": [image, 0], "filename_prefix": f"extra{n + 1}"},
        }
    assert SAMPLER_NODE in graph
    return graph


class JobMix:
    def __init__(
        self, rng: random.Random, run_id: str, pools: list[PoolChoice], cancel_fraction: float
    ) -> None:
        self.rng = rng
        self.run_id = run_id
        self.pools = pools
        self.count = 0
        # Only long and multi jobs are cancelled, so their share is scaled up to reach the
        # fraction of all jobs.
        cancellable = KIND_WEIGHTS["long"] + KIND_WEIGHTS["multi"]
        self.cancel_share = min(1.0, cancel_fraction / cancellable)

    def next(self) -> JobPlan:
        rng = self.rng
        self.count += 1
        pool = rng.choice(self.pools)
        kinds = list(KIND_WEIGHTS)
        kind: GraphKind = rng.choices(kinds, weights=[KIND_WEIGHTS[k] for k in kinds])[0]
        low, high = STEPS[kind]
        steps = rng.randint(low, high)
        extra = rng.randint(1, 2) if kind == "multi" else 0
        graph = graph_for(kind, steps, extra, seed=rng.randrange(1, 2**48))
        cancel_after_s = None
        if kind != "short" and rng.random() < self.cancel_share:
            cancel_after_s = round(rng.uniform(0.5, 6.0), 2)
        request = JobRequest(graph=graph, pool=pool.name, policy=soak_policy())
        return JobPlan(
            job_id=f"soak-{self.run_id}-{self.count:04d}",
            pool=pool,
            kind=kind,
            steps=steps,
            outputs=1 + extra,
            request=request,
            cancel_after_s=cancel_after_s,
        )
