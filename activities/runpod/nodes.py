"""A RunPod pool's node registry: what its endpoint's ComfyUI has installed, known before any
RunPod job exists, so a typo'd class or a missing input costs no paid worker.

A RunPod worker's ComfyUI is not up before a job reaches it, so the registry comes from
elsewhere, as the pool's `node_registry` says:

    published   the `PublishedNodes` document our handler's workers write to
                `s3://{default bucket}/{nodes_key(endpoint_id)}` (the default)
    <path>      a captured `/object_info` (JSON) on the worker's disk: for stock endpoints
    off         no check before the job

Each worker process keeps the registry a minute (`FRESH_S`) per source, and reads it again at
once when a graph names a class it lacks, so a new image's registry is picked up as soon as one
of its workers has published it. Nothing published yet: the check is skipped (logged) and the job
goes on; ComfyUI's own validation on the RunPod worker refuses a bad graph there.
"""

from __future__ import annotations

import json
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog
from pydantic import ValidationError
from pydantic_settings import SettingsError

from activities.comfyui.graph import lacks_a_class, registry_problems
from activities.comfyui.registry import FRESH_S  # one freshness rule for both kinds of pool
from activities.errors import fatal
from configuration.pools import PoolConfig
from configuration.settings import S3Settings
from protocol.runpod.contract import NodesTarget, PublishedNodes, nodes_key
from workflows.errors import ObjectMissing, StorageError
from workflows.shared import ErrorType

log = structlog.get_logger(__name__)

# A real ComfyUI's `/object_info` with many custom node packs is a few MB.
MAX_REGISTRY_BYTES = 64 * 1024 * 1024


class RegistryStore(Protocol):
    """What the registry reads of `ArtifactStore`."""

    settings: S3Settings

    async def read_bytes(self, key: str, *, limit: int, bucket: str | None = None) -> bytes: ...


@dataclass(frozen=True)
class Registry:
    object_info: dict[str, Any]
    source: str  # where it was read, for messages and logs
    read_at: float  # monotonic


def published_target(pool: PoolConfig, default_bucket: str) -> NodesTarget | None:
    """Where the pool's workers are asked to publish their registry (None: not this pool's
    source)."""
    if pool.kind != "runpod" or pool.endpoint_id is None:
        return None
    if (pool.node_registry or "published") != "published":
        return None
    return NodesTarget(bucket=default_bucket, key=nodes_key(pool.endpoint_id))


def parse_registry(data: bytes | str) -> tuple[dict[str, Any], PublishedNodes | None]:
    """A registry document (ours, `PublishedNodes`; or a bare captured `/object_info`) as the
    `{class_type: spec}` that `registry_problems` reads, and the publication when it is one.
    Every spec is reduced to the parts that check reads, each of the right type: a worker wrote
    it, and a malformed entry must not crash a prepare. A `ValueError` when it is no registry."""
    try:
        document = json.loads(data)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    published = None
    if "object_info" in document and "published_at" in document:
        try:
            published = PublishedNodes.model_validate(document)
        except ValidationError as exc:
            raise ValueError(f"not a published node registry: {exc}") from None
        document = published.object_info
    classes: dict[str, Any] = {}
    for class_type, spec in document.items():
        if not isinstance(spec, dict):
            continue
        inputs = spec.get("input")
        required = inputs.get("required") if isinstance(inputs, dict) else None
        # (optional inputs only for their markers: workflows.graph.registry_file_inputs)
        optional = inputs.get("optional") if isinstance(inputs, dict) else None
        output = spec.get("output")
        classes[str(class_type)] = {
            "input": {
                "required": required if isinstance(required, dict) else {},
                "optional": optional if isinstance(optional, dict) else {},
            },
            "output": output if isinstance(output, list) else [],
            "output_node": bool(spec.get("output_node")),
        }
    if not classes:
        raise ValueError("no node classes in it")
    return classes, published


def read_captured(path: Path) -> dict[str, Any]:
    """A captured registry file, or a `SettingsError` saying why it cannot be one."""
    try:
        return parse_registry(path.read_bytes())[0]
    except (OSError, ValueError) as exc:
        raise SettingsError(f"node_registry {str(path)!r}: {exc}") from None


def check_captured_registries(pools: Mapping[str, PoolConfig]) -> None:
    """At start-up: every pool's captured registry file is readable and is one (a worker that
    would refuse, or skip checking, every job says so at once instead)."""
    for name, pool in pools.items():
        if isinstance(pool.node_registry, Path):
            try:
                read_captured(pool.node_registry)
            except SettingsError as exc:
                raise SettingsError(f"pool {name!r}: {exc}") from None


class NodeRegistries:
    """Each RunPod pool's registry, as this worker process last read it."""

    def __init__(self, store: RegistryStore, *, clock: Callable[[], float] = time.monotonic):
        self._store = store
        self._clock = clock
        self._cache: dict[str, Registry] = {}

    async def check(
        self, graph: Mapping[str, Any], pool_name: str, pool: PoolConfig
    ) -> dict[str, Any] | None:
        """Refuse `graph` (`InvalidGraph`, every problem named) if the pool's registry says it
        cannot run there; return the registry it was checked against when it can, or None when
        no registry is known."""
        source = pool.node_registry or "published"
        if source == "off" or pool.kind != "runpod":
            return None
        registry, read_now = await self._registry(pool_name, pool, fresh=False)
        if registry is None:
            return None
        problems = registry_problems(graph, registry.object_info)
        if problems and not read_now and lacks_a_class(graph, registry.object_info):
            # A class the registry lacks may have come with a new image: read it once more.
            registry = (await self._registry(pool_name, pool, fresh=True))[0] or registry
            problems = registry_problems(graph, registry.object_info)
        if problems:
            log.info("graph_refused_by_registry", pool=pool_name, source=registry.source)
            raise fatal(
                ErrorType.INVALID_GRAPH,
                "; ".join(problems),
                problems=problems,
                registry=registry.source,
            )
        return registry.object_info

    async def _registry(
        self, pool_name: str, pool: PoolConfig, *, fresh: bool
    ) -> tuple[Registry | None, bool]:
        """The registry to check against, and whether it was read just now."""
        source = pool.node_registry or "published"
        cache_key = f"{pool_name}:{source}"
        cached = self._cache.get(cache_key)
        if cached is not None and not fresh and self._clock() - cached.read_at < FRESH_S:
            return cached, False
        try:
            registry = (
                self._captured(source) if isinstance(source, Path) else await self._published(pool)
            )
        except (OSError, ValueError, StorageError) as exc:
            # A registry that cannot be read now: the last good one, or no check.
            log.warning("node_registry_unreadable", pool=pool_name, error=str(exc))
            return cached, False
        if registry is None:
            log.info(
                "node_registry_unknown",
                pool=pool_name,
                detail="no worker of the endpoint has published its nodes yet: the graph is "
                "checked by ComfyUI on the RunPod worker",
            )
            return cached, False
        self._cache[cache_key] = registry
        return registry, True

    def _captured(self, path: Path) -> Registry:
        return Registry(parse_registry(path.read_bytes())[0], f"file {path}", self._clock())

    async def _published(self, pool: PoolConfig) -> Registry | None:
        bucket = self._store.settings.bucket
        target = published_target(pool, bucket)
        assert target is not None
        try:
            data = await self._store.read_bytes(
                target.key, limit=MAX_REGISTRY_BYTES, bucket=target.bucket
            )
        except ObjectMissing:
            return None
        classes, published = parse_registry(data)
        source = f"s3://{target.bucket}/{target.key}"
        if published is not None:
            source += f" (published {published.published_at:%Y-%m-%d %H:%M:%S} UTC"
            source += f" by worker {published.worker_id})" if published.worker_id else ")"
        return Registry(classes, source, self._clock())


# One set of registries per store (a worker has one): the backend's prepare finds them here.
_BY_STORE: weakref.WeakKeyDictionary[Any, NodeRegistries] = weakref.WeakKeyDictionary()


def registries_for(store: RegistryStore) -> NodeRegistries:
    found = _BY_STORE.get(store)
    if found is None:
        found = _BY_STORE[store] = NodeRegistries(store)
    return found
