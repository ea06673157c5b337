"""A thin async client for one ComfyUI server's HTTP API (docs/comfyui-protocol.md).

httpx's exceptions become protocol.errors' `ComfyError`s at this edge: `ComfyUnavailable`
(connection refused/reset, timeouts, 5xx: worth retrying later), `ComfyPromptRejected` (400
from /prompt: the graph is wrong, retrying cannot help), `ComfyHTTPError` (any other unexpected
status). The client never retries on its own: Temporal owns retries.

`UnsafeOutputName` (a `ValueError`, not a `ComfyError`: no retry changes a name) is raised before
any request when an output record asks `/view` for something outside ComfyUI's output and temp
folders (`check_view_request`).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlencode, urlsplit, urlunsplit

import httpcore
import httpx

from protocol.errors import ComfyHTTPError, ComfyPromptRejected, ComfyUnavailable, UnsafeOutputName
from protocol.keys import shown

# httpcore reads an HTTP/1.1 response 64 KiB at a time, and each read goes through anyio, a
# timeout scope and h11: about 2 s of event-loop CPU per GiB of `/view`, on the loop that also
# sends the parts to S3 (bench group 5). asyncio's transport receives up to 256 KiB per recv, so
# reads of that size take whatever has arrived in one go: about 0.7 s per GiB. Process-wide (the
# attribute is httpcore's class constant, read as `self.READ_NUM_BYTES`), harmless to every other
# client: a read still returns what is there, h11 takes any amount, nothing waits to fill it.
HTTP11_READ_BYTES = 256 * 1024
if getattr(httpcore.AsyncHTTP11Connection, "READ_NUM_BYTES", 0) < HTTP11_READ_BYTES:
    httpcore.AsyncHTTP11Connection.READ_NUM_BYTES = HTTP11_READ_BYTES


# ComfyUI's folder types are output, input and temp; `input` holds what clients uploaded (other
# jobs' files on a shared server), never an output of ours.
VIEW_TYPES = frozenset({"output", "temp"})
MAX_NAME_BYTES = 255  # NAME_MAX: no real file has a longer name
MAX_SUBFOLDER_BYTES = 1024
_SEPARATORS = re.compile(r"[\\/]")
_DRIVE = re.compile(r"^[A-Za-z]:")
# ComfyUI reads `name [input]` from the input folder whatever `type` says (annotated_filepath).
_ANNOTATION = re.compile(r"\[(input|output|temp)\]\s*$", re.IGNORECASE)
# Control, format (bidi overrides, zero-width), surrogate, line and paragraph separators.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def check_view_request(filename: str, subfolder: str, kind: str) -> None:
    """Refuse (`UnsafeOutputName`) a `/view` request that could read outside the output folders.

    The names come from ComfyUI's events and history, which a custom node or a hostile backend
    writes: ComfyUI's own `/view` guards traversal, but ours must not depend on it. `kind` must
    be output or temp. `filename` is one name: no separator, not dots only, no `[input]`-style
    annotation (ComfyUI would take the folder from it, not from `kind`), at most 255 bytes.
    `subfolder` is relative: not absolute (`/x`, `\\x`, `C:`), no dots-only level, at most 1024
    bytes. Neither may hold NUL, control, format or line-separator characters. Each value is also
    checked percent-decoded and NFKC-normalised, so `%2e%2e` or fullwidth dots that a proxy or a
    filesystem would turn into `..` are refused too.
    """
    if kind not in VIEW_TYPES:
        raise UnsafeOutputName(filename, subfolder, kind, "type must be output or temp")
    reason = _filename_problem(filename) or _subfolder_problem(subfolder)
    if reason is not None:
        raise UnsafeOutputName(filename, subfolder, kind, reason)


def _filename_problem(filename: str) -> str | None:
    if not filename:
        return "empty filename"
    if len(filename.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return f"filename longer than {MAX_NAME_BYTES} bytes"
    for form in _readings(filename):
        if problem := _character_problem(form):
            return problem
        if _SEPARATORS.search(form):
            return "a path separator in the filename"
        if _dots_only(form):
            return "the filename is a `.` or `..` level"
        if _ANNOTATION.search(form):
            return "a folder annotation (`[input]`) that would override the type"
    return None


def _subfolder_problem(subfolder: str) -> str | None:
    if len(subfolder.encode("utf-8", "surrogatepass")) > MAX_SUBFOLDER_BYTES:
        return f"subfolder longer than {MAX_SUBFOLDER_BYTES} bytes"
    for form in _readings(subfolder):
        if problem := _character_problem(form):
            return problem
        if form[:1] in ("/", "\\") or _DRIVE.match(form):
            return "an absolute subfolder"
        if any(_dots_only(level) for level in _SEPARATORS.split(form)):
            return "a `.` or `..` level in the subfolder"
    return None


def _dots_only(level: str) -> bool:
    # Windows drops trailing dots and spaces, so `... ` can mean `..` there.
    return bool(level) and not level.strip(". ")


def _readings(value: str) -> list[str]:
    """`value` as given, percent-decoded (repeatedly), and each NFKC-normalised."""
    forms = [value]
    for _ in range(3):
        decoded = unquote(forms[-1], errors="replace")
        if decoded == forms[-1]:
            break
        forms.append(decoded)
    return forms + [unicodedata.normalize("NFKC", form) for form in forms]


def _character_problem(value: str) -> str | None:
    for ch in value:
        if unicodedata.category(ch) in _UNSAFE_CATEGORIES:
            return f"a control or format character ({ch!a})"
    return None


@dataclass(frozen=True)
class QueuePlace:
    """`where` is 'running', 'pending' or None; `position` 1 means next to run."""

    where: str | None
    position: int | None = None
    running: tuple[str, ...] = ()

    @classmethod
    def of(cls, prompt_id: str, queue: dict[str, list[list[Any]]]) -> QueuePlace:
        running = tuple(str(item[1]) for item in queue.get("queue_running", []))
        if prompt_id in running:
            return cls("running", None, running)
        # ComfyUI runs pending prompts in `number` order; /queue does not promise that order.
        pending = sorted(queue.get("queue_pending", []), key=lambda item: item[0])
        for index, item in enumerate(pending):
            if item[1] == prompt_id:
                return cls("pending", index + 1, running)
        return cls(None, None, running)


@dataclass(frozen=True)
class JobLookup:
    """What `GET /api/jobs/{id}` says of one prompt: its `status` (pending, in_progress,
    completed, failed, ...; None: ComfyUI knows no such prompt, in its queue or its history)."""

    status: str | None


class ComfyClient:
    """HTTP calls to one ComfyUI base URL. Build with a shared `httpx.AsyncClient`."""

    def __init__(self, base_url: str, http: httpx.AsyncClient) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = http
        # False once this ComfyUI answered /api/jobs as a route it does not have (before 0.8):
        # from then on `job` says so without asking.
        self._jobs_api = True

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
        self,
        graph: dict[str, Any],
        *,
        prompt_id: str,
        client_id: str,
        extra_data: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"prompt": graph, "prompt_id": prompt_id, "client_id": client_id}
        if extra_data:
            body["extra_data"] = extra_data
        response = await self._request("POST", "/prompt", json=body)
        if response.status_code == 400:
            data = response.json()
            raise ComfyPromptRejected(data.get("error", {}), data.get("node_errors", {}))
        if response.status_code != 200:
            raise ComfyHTTPError(
                f"POST /prompt: HTTP {response.status_code}: {response.text[:300]}",
                response.status_code,
            )
        result: dict[str, Any] = response.json()
        return result

    async def queue(self) -> dict[str, list[list[Any]]]:
        result: dict[str, list[list[Any]]] = await self._json("GET", "/queue")
        return result

    async def queue_place(self, prompt_id: str) -> QueuePlace:
        """Where the prompt is in the queue; pending prompts also get their place in line."""
        return QueuePlace.of(prompt_id, await self.queue())

    async def history(self, prompt_id: str) -> dict[str, Any] | None:
        """The history entry, or None: `{}` means queued, running, never submitted or lost."""
        data: dict[str, Any] = await self._json("GET", f"/history/{prompt_id}")
        entry = data.get(prompt_id)
        return entry if isinstance(entry, dict) else None

    async def job_state(self, prompt_id: str) -> str | None:
        """`/api/jobs/{id}` status; None when unknown or this ComfyUI has no jobs API."""
        lookup = await self.job(prompt_id)
        return None if lookup is None else lookup.status

    async def job(self, prompt_id: str) -> JobLookup | None:
        """One prompt's status from `/api/jobs/{id}`: a small answer, where `/queue` sends every
        queued prompt's whole graph. None: this ComfyUI has no jobs API (any answer but 200 or
        the API's own JSON 404, "Job not found")."""
        if not self._jobs_api:
            return None
        path = f"/api/jobs/{prompt_id}"
        response = await self._request("GET", path)
        try:
            data = response.json()
        except ValueError:
            data = None
        if response.status_code == 200 and isinstance(data, dict):
            status = data.get("status")
            return JobLookup(status if isinstance(status, str) else "unknown")
        if response.status_code == 404 and isinstance(data, dict) and "error" in data:
            return JobLookup(None)
        # No such route (ComfyUI before 0.8), or something in front of it that refuses it:
        # /queue and /history answer instead, from now on.
        self._jobs_api = False
        return None

    async def pending_jobs(self) -> list[dict[str, Any]]:
        """The pending prompts as `/api/jobs?status=pending` lists them: id and priority each,
        without their graphs."""
        data = await self._json("GET", "/api/jobs", params={"status": "pending"})
        jobs = data.get("jobs") if isinstance(data, dict) else None
        return [job for job in jobs or [] if isinstance(job, dict)]

    async def delete_pending(self, prompt_id: str) -> None:
        # ComfyUI answers an empty 200: nothing to read as JSON.
        response = await self._request("POST", "/queue", json={"delete": [prompt_id]})
        if response.status_code != 200:
            raise ComfyHTTPError(
                f"POST /queue: HTTP {response.status_code}: {response.text[:300]}",
                response.status_code,
            )

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
        """Stream an output file's bytes without holding it in memory; `UnsafeOutputName`, with
        nothing sent, for a name `check_view_request` refuses."""
        check_view_request(filename, subfolder, kind)
        params = {"filename": filename, "subfolder": subfolder, "type": kind}
        try:
            async with self._http.stream("GET", self.base_url + "/view", params=params) as response:
                if response.status_code >= 500:
                    raise ComfyUnavailable(f"GET /view: HTTP {response.status_code}")
                if response.status_code != 200:
                    raise ComfyHTTPError(
                        f"GET /view {shown(filename)}: HTTP {response.status_code}",
                        response.status_code,
                    )
                # Chunks as they come off the socket (up to HTTP11_READ_BYTES), decoded but not
                # re-chunked: httpx's ByteChunker would copy every byte twice more, about a
                # second of event-loop CPU per GiB, and the uploader cuts its own parts anyway.
                yield response.aiter_bytes()
        except httpx.TransportError as exc:
            raise ComfyUnavailable(f"GET /view: {type(exc).__name__}: {exc}") from exc
