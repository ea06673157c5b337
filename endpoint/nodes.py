"""Publishing the worker's ComfyUI node registry (`GET /object_info`) to the bucket, so the
orchestrator checks a graph against the endpoint's real nodes before a job reaches a paid worker.

A `contract.PublishedNodes` document goes to each target once per handler process: to
`Orchestration.nodes` when a durable job names one (once ComfyUI answers), and, when the worker
has DURABLE_COMFY_BUCKET, to `nodes_key(RUNPOD_ENDPOINT_ID)` in that bucket as the worker
starts, before any job. Always in a daemon thread of its own with its own HTTP and S3 clients:
it never delays or fails a job, never keeps the process alive, and a failure is only logged
(a later job may try again).
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from typing import Any

import httpx
import structlog

from endpoint.comfy import POLL_S, process_alive
from endpoint.s3 import S3
from endpoint.settings import EndpointSettings
from protocol.runpod.contract import NodesTarget, PublishedNodes, nodes_key

log = structlog.get_logger(__name__)

HTTP_TIMEOUT_S = 60.0


class NodesPublisher:
    """Publishes to each target once per process (again only after a failure)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken: set[tuple[str, str]] = set()

    def publish(self, settings: EndpointSettings, target: NodesTarget) -> threading.Thread | None:
        """Start publishing to `target` in the background; None when it is done or under way
        already, or when the endpoint has no bucket to publish with."""
        if settings.bucket is None:
            return None
        where = (target.bucket, target.key)
        with self._lock:
            if where in self._taken:
                return None
            self._taken.add(where)
        thread = threading.Thread(
            target=self._run, args=(settings, target), name="publish object_info", daemon=True
        )
        thread.start()
        return thread

    def _run(self, settings: EndpointSettings, target: NodesTarget) -> None:
        try:
            publish_nodes(settings, target)
        except Exception as exc:  # never the job's problem: logged, and tried by a later job
            log.warning(
                "nodes_not_published",
                bucket=target.bucket,
                key=target.key,
                error=f"{type(exc).__name__}: {exc}",
            )
            with self._lock:
                self._taken.discard((target.bucket, target.key))


PUBLISHER = NodesPublisher()


def publish_nodes(settings: EndpointSettings, target: NodesTarget) -> PublishedNodes:
    """Wait for ComfyUI, read its /object_info and put it at `target` (blocking)."""
    assert settings.bucket is not None
    object_info = _object_info(settings)
    document = PublishedNodes(
        endpoint_id=settings.endpoint_id,
        worker_id=settings.worker_id,
        published_at=datetime.now(UTC),
        object_info=object_info,
    )
    s3 = S3(settings.bucket, retry_s=settings.bucket_retry_s)
    s3.call_blocking(
        "put_object",
        Bucket=target.bucket,
        Key=target.key,
        Body=document.model_dump_json().encode(),
        ContentType="application/json",
    )
    log.info("nodes_published", bucket=target.bucket, key=target.key, classes=len(object_info))
    return document


def publish_at_start(settings: EndpointSettings) -> threading.Thread | None:
    """The worker's start: publish to DURABLE_COMFY_BUCKET, if the endpoint has one."""
    if settings.nodes_bucket is None:
        return None
    if settings.bucket is None or not settings.endpoint_id:
        log.warning(
            "nodes_not_published",
            reason="DURABLE_COMFY_BUCKET needs BUCKET_ENDPOINT_URL (and its keys) and "
            "RUNPOD_ENDPOINT_ID",
        )
        return None
    target = NodesTarget(bucket=settings.nodes_bucket, key=nodes_key(settings.endpoint_id))
    return PUBLISHER.publish(settings, target)


def _object_info(settings: EndpointSettings) -> dict[str, Any]:
    """ComfyUI's /object_info once it answers (a cold start may take minutes: no cap while its
    process lives, `comfy_start_timeout_s` without one)."""
    started = time.monotonic()
    url = settings.comfy_url.rstrip("/")
    with httpx.Client(timeout=HTTP_TIMEOUT_S, trust_env=False) as http:
        while True:
            try:
                http.get(f"{url}/system_stats").raise_for_status()
                break
            except httpx.HTTPError as exc:
                reason = str(exc)
            pid = settings.comfy_pid
            if pid is not None and not process_alive(pid):
                raise RuntimeError(f"ComfyUI (pid {pid}) exited before answering: {reason}")
            if pid is None and time.monotonic() - started > settings.comfy_start_timeout_s:
                raise RuntimeError(f"ComfyUI did not answer: {reason}")
            time.sleep(POLL_S)
        response = http.get(f"{url}/object_info")
        response.raise_for_status()
        info = response.json()
    if not isinstance(info, dict):
        raise RuntimeError(f"/object_info is not an object: {type(info).__name__}")
    return info
