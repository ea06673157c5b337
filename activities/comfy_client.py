"""A thin async client for one ComfyUI server's HTTP API (PROTOCOLS.md).

Exceptions (translated from httpx at this edge):
    ComfyError
    ├── ComfyUnavailable      connection refused/reset, timeouts, 5xx: worth retrying later
    ├── ComfyPromptRejected   400 from /prompt: the graph is wrong, retrying cannot help
    └── ComfyHTTPError        any other unexpected status
The client never retries on its own: Temporal owns retries.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

import httpx


class ComfyError(Exception):
    """Base of every error talking to ComfyUI."""


class ComfyUnavailable(ComfyError):
    """The server could not be reached or answered 5xx."""


class ComfyHTTPError(ComfyError):
    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class ComfyPromptRejected(ComfyError):
    """/prompt answered 400: `error` and `node_errors` are ComfyUI's own."""

    def __init__(self, error: dict[str, Any], node_errors: dict[str, Any]) -> None:
        self.error = error
        self.node_errors = node_errors
        super().__init__(describe_rejection(error, node_errors))


def describe_rejection(error: dict[str, Any], node_errors: dict[str, Any]) -> str:
    parts = [str(error.get("message") or error.get("type") or "prompt rejected")]
    if error.get("details"):
        parts.append(str(error["details"]))
    for node_id, entry in node_errors.items():
        for item in entry.get("errors", []):
            detail = item.get("details") or item.get("message")
            parts.append(f"node {node_id} ({entry.get('class_type', '?')}): {detail}")
    return "; ".join(parts)


class ComfyClient:
    """HTTP calls to one ComfyUI base URL. Build with a shared `httpx.AsyncClient`."""

    def __init__(self, base_url: str, http: httpx.AsyncClient) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = http

    def ws_url(self, client_id: str) -> str:
        parts = urlsplit(self.base_url)
        scheme = "wss" if parts.scheme == "https" else "ws"
        query = urlencode({"clientId": client_id})
        return urlunsplit((scheme, parts.netloc, parts.path + "/ws", query, ""))

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._http.request(method, self.base_url + path, **kwargs)
        except httpx.TransportError as exc:
            raise ComfyUnavailable(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            raise ComfyUnavailable(f"{method} {path}: HTTP {response.status_code}")
        return response

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self._request(method, path, **kwargs)
        if response.status_code != 200:
            raise ComfyHTTPError(
                f"{method} {path}: HTTP {response.status_code}: {response.text[:300]}",
                response.status_code,
            )
        return response.json()

    async def system_stats(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._json("GET", "/system_stats")
        return result

    async def object_info(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._json("GET", "/object_info")
        return result

    async def post_prompt(
        self, graph: dict[str, Any], *, prompt_id: str, client_id: str
    ) -> dict[str, Any]:
        body = {"prompt": graph, "prompt_id": prompt_id, "client_id": client_id}
        response = await self._request("POST", "/prompt", json=body)
        if response.status_code == 400:
            data = response.json()
            raise ComfyPromptRejected(data.get("error", {}), data.get("node_errors", {}))
        if response.status_code != 200:
            raise ComfyHTTPError(f"POST /prompt: HTTP {response.status_code}", 0)
        result: dict[str, Any] = response.json()
        return result

    async def queue(self) -> dict[str, list[list[Any]]]:
        result: dict[str, list[list[Any]]] = await self._json("GET", "/queue")
        return result

    async def queue_position(self, prompt_id: str) -> str | None:
        """'running', 'pending' or None when the prompt is not in the queue."""
        queue = await self.queue()
        if any(item[1] == prompt_id for item in queue.get("queue_running", [])):
            return "running"
        if any(item[1] == prompt_id for item in queue.get("queue_pending", [])):
            return "pending"
        return None

    async def history(self, prompt_id: str) -> dict[str, Any] | None:
        """The history entry, or None: `{}` means queued, running, never submitted or lost."""
        data: dict[str, Any] = await self._json("GET", f"/history/{prompt_id}")
        entry = data.get(prompt_id)
        return entry if isinstance(entry, dict) else None

    async def job_state(self, prompt_id: str) -> str | None:
        """`/api/jobs/{id}` status on newer ComfyUI; None when unknown or not supported."""
        response = await self._request("GET", f"/api/jobs/{prompt_id}")
        if response.status_code != 200:
            return None
        try:
            state = response.json().get("status")
        except ValueError:
            return None
        return state if isinstance(state, str) else None

    async def delete_pending(self, prompt_id: str) -> None:
        await self._json("POST", "/queue", json={"delete": [prompt_id]})

    async def interrupt(self, prompt_id: str) -> None:
        await self._request("POST", "/interrupt", json={"prompt_id": prompt_id})

    async def free(self, *, unload_models: bool, free_memory: bool) -> None:
        await self._request(
            "POST", "/free", json={"unload_models": unload_models, "free_memory": free_memory}
        )

    async def upload_image(self, name: str, data: bytes, *, overwrite: bool = True) -> str:
        files = {"image": (name, data, "application/octet-stream")}
        result = await self._json(
            "POST", "/upload/image", files=files, data={"overwrite": str(overwrite).lower()}
        )
        subfolder = str(result.get("subfolder") or "")
        stored = str(result["name"])
        return f"{subfolder}/{stored}" if subfolder else stored

    @asynccontextmanager
    async def view(
        self, filename: str, subfolder: str, kind: str
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """Stream an output file's bytes without holding it in memory."""
        params = {"filename": filename, "subfolder": subfolder, "type": kind}
        try:
            async with self._http.stream("GET", self.base_url + "/view", params=params) as response:
                if response.status_code >= 500:
                    raise ComfyUnavailable(f"GET /view: HTTP {response.status_code}")
                if response.status_code != 200:
                    raise ComfyHTTPError(
                        f"GET /view {filename!r}: HTTP {response.status_code}",
                        response.status_code,
                    )
                yield response.aiter_bytes(1024 * 1024)
        except httpx.TransportError as exc:
            raise ComfyUnavailable(f"GET /view: {type(exc).__name__}: {exc}") from exc
