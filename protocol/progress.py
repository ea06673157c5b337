"""Progress bookkeeping for one prompt: units, fraction, and when to tell the workflow.

Heartbeats carry every step (they cost no history); `progress` signals cost ~4 history events
each, so they are throttled by fraction moved, not by time: at most ~200 per segment.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

MIN_FRACTION_DELTA = 0.005


class ProgressTracker:
    def __init__(
        self,
        sampler_steps: Mapping[str, int],
        nodes_total: int,
        *,
        min_interval_s: float = 1.0,
        min_fraction: float = MIN_FRACTION_DELTA,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sampler_steps = dict(sampler_steps)
        self.total_steps = sum(self._sampler_steps.values())
        self.nodes_total = nodes_total
        self.node_steps: dict[str, int] = {}
        self.nodes_done: list[str] = []
        self._min_interval_s = min_interval_s
        self._min_fraction = min_fraction
        self._clock = clock
        self._signalled_fraction = -1.0
        self._signalled_at = float("-inf")

    def restore(self, node_steps: Mapping[str, int], nodes_done: list[str]) -> None:
        """Continue from a checkpoint instead of from step 0."""
        self.node_steps = {k: v for k, v in node_steps.items() if k in self._sampler_steps}
        self.nodes_done = list(nodes_done)

    @property
    def unit(self) -> str:
        return "steps" if self.total_steps > 0 else "nodes"

    @property
    def step(self) -> int:
        if self.total_steps > 0:
            return sum(self.node_steps.values())
        return len(self.nodes_done)

    @property
    def total(self) -> int:
        return self.total_steps if self.total_steps > 0 else self.nodes_total

    @property
    def fraction(self) -> float:
        if self.total <= 0:
            return 0.0
        return min(1.0, self.step / self.total)

    def on_progress(self, node: str | None, value: int) -> bool:
        """Record a sampler step; False for progress bars of nodes that are not samplers."""
        if node is None or node not in self._sampler_steps:
            return False
        bounded = max(0, min(value, self._sampler_steps[node]))
        if bounded <= self.node_steps.get(node, 0):
            return False
        self.node_steps[node] = bounded
        return True

    def on_node_done(self, node: str) -> bool:
        if node in self.nodes_done:
            return False
        self.nodes_done.append(node)
        if node in self._sampler_steps:
            self.node_steps[node] = self._sampler_steps[node]
        return True

    def complete(self) -> None:
        self.node_steps = dict(self._sampler_steps)

    def should_signal(self, *, force: bool = False) -> bool:
        """True when the workflow should hear of it; marks it as told."""
        now = self._clock()
        moved = self.fraction - self._signalled_fraction
        due = (
            moved > 0
            and moved >= self._min_fraction
            and now - self._signalled_at >= self._min_interval_s
        )
        if force or due:
            self._signalled_fraction = self.fraction
            self._signalled_at = now
            return True
        return False
