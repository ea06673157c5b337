"""Which node runs next, and which outputs can come from the cache.

Mirrors comfy_execution.graph.ExecutionList (a topological dissolve that prefers output nodes and
their direct inputs, so a preview appears as early as possible) and the classic output cache keyed
by each node's input signature: an identical node (same class, same constants, same upstream
signatures) reuses its previous outputs, and only the latest prompt's entries are kept.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from .files import input_file_path
from .nodes import REGISTRY
from .settings import SimSettings


def is_link(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2


@dataclass
class CacheEntry:
    outputs: tuple[Any, ...]
    ui: dict[str, Any] | None


def _is_changed(node: dict[str, Any], settings: SimSettings) -> str:
    spec = REGISTRY[node["class_type"]]
    if spec.always_run:
        return uuid.uuid4().hex  # like IS_CHANGED returning NaN: never equal to anything
    if spec.name == "LoadImage":
        try:
            path = input_file_path(str(node["inputs"]["image"]), settings)
            return hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            return uuid.uuid4().hex
    return ""


def signatures(prompt: dict[str, Any], roots: list[str], settings: SimSettings) -> dict[str, str]:
    """Input signature of every node reachable from `roots`."""
    out: dict[str, str] = {}
    visiting: set[str] = set()

    def sig(node_id: str) -> str:
        if node_id in out:
            return out[node_id]
        visiting.add(node_id)
        node = prompt[node_id]
        parts: list[Any] = [node["class_type"], _is_changed(node, settings)]
        for name in sorted(node["inputs"]):
            value = node["inputs"][name]
            if is_link(value) and value[0] in prompt and value[0] not in visiting:
                parts.append([name, "link", sig(value[0]), value[1]])
            else:
                parts.append([name, "value", value])
        visiting.discard(node_id)
        text = json.dumps(parts, sort_keys=True, default=str)
        out[node_id] = hashlib.sha256(text.encode()).hexdigest()
        return out[node_id]

    for root in roots:
        sig(root)
    return out


@dataclass
class ExecutionList:
    prompt: dict[str, Any]
    cached: set[str]
    pending: dict[str, bool] = field(default_factory=dict)  # insertion-ordered set
    block_count: dict[str, int] = field(default_factory=dict)
    blocking: dict[str, dict[str, bool]] = field(default_factory=dict)

    def add_node(self, root: str) -> None:
        stack, links = [root], []
        while stack:
            unique_id = stack.pop()
            if unique_id in self.pending:
                continue
            self.pending[unique_id] = True
            self.block_count[unique_id] = 0
            self.blocking[unique_id] = {}
            for value in self.prompt[unique_id]["inputs"].values():
                if is_link(value) and value[0] not in self.cached:
                    stack.append(value[0])
                    links.append((value[0], unique_id))
        for source, target in links:
            if target not in self.blocking[source]:
                self.blocking[source][target] = True
                self.block_count[target] += 1

    def is_empty(self) -> bool:
        return not self.pending

    def _is_output(self, node_id: str) -> bool:
        return REGISTRY[self.prompt[node_id]["class_type"]].output_node

    def next_node(self) -> str:
        ready = [n for n in self.pending if self.block_count[n] == 0]
        if not ready:  # validation rejects cycles, so this is a bug, not a user error
            raise RuntimeError("Dependency cycle detected")
        for node_id in ready:
            if self._is_output(node_id):
                return node_id
        for node_id in ready:
            if any(self._is_output(b) for b in self.blocking[node_id]):
                return node_id
        for node_id in ready:
            for blocked in self.blocking[node_id]:
                if any(self._is_output(b) for b in self.blocking[blocked]):
                    return node_id
        return ready[0]

    def complete(self, node_id: str) -> None:
        del self.pending[node_id]
        for blocked in self.blocking.pop(node_id):
            self.block_count[blocked] -= 1
