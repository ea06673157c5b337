"""GET /view and POST /upload/image, with ComfyUI's path checks (400 for `..` or absolute names,
403 for a subfolder escaping its directory, 404 when missing)."""

from __future__ import annotations

import asyncio
import mimetypes
import os

from aiohttp import web

from .files import annotated_filepath, directory_by_type, is_within, subfolder_path, upload_name
from .runtime import runtime_of

routes = web.RouteTableDef()
# Types a browser would render or run: ComfyUI forces them to download.
_FORCE_DOWNLOAD = {
    "text/html",
    "text/html-sandboxed",
    "application/xhtml+xml",
    "text/javascript",
    "text/css",
}


@routes.get("/view")
async def view(request: web.Request) -> web.StreamResponse:
    settings = runtime_of(request).settings
    query = request.rel_url.query
    if "filename" not in query:
        return web.Response(status=404)
    filename, folder = annotated_filepath(query["filename"], settings)
    if not filename or filename[0] == "/" or ".." in filename:
        return web.Response(status=400)
    if folder is None:
        folder = directory_by_type(settings, query.get("type", "output"))
    if folder is None:
        return web.Response(status=400)
    if "subfolder" in query:
        candidate = os.path.join(folder, query["subfolder"])
        if not is_within(folder, candidate):
            return web.Response(status=403)
        folder = type(folder)(candidate)
    filename = os.path.basename(filename)
    path = folder / filename
    if not path.is_file():
        return web.Response(status=404)
    content_type = mimetypes.guess_type(filename)[0] or "application/octet-stream"
    if content_type in _FORCE_DOWNLOAD:
        content_type = "application/octet-stream"
    headers = {"Content-Disposition": f'filename="{filename}"', "Content-Type": content_type}
    return web.FileResponse(path, headers=headers)


@routes.post("/upload/image")
async def upload_image(request: web.Request) -> web.Response:
    settings = runtime_of(request).settings
    post = await request.post()  # beyond --max-upload-size this raises 413
    image = post.get("image")
    if not isinstance(image, web.FileField):
        return web.Response(status=400)
    if not image.filename:
        return web.Response(status=400)
    kind = str(post.get("type") or "input")
    folder = directory_by_type(settings, kind)
    if folder is None:
        return web.Response(status=400)
    subfolder = str(post.get("subfolder", ""))
    target_dir = subfolder_path(folder, subfolder)
    if not is_within(folder, target_dir / image.filename):
        return web.Response(status=400)
    content = image.file.read()
    overwrite = str(post.get("overwrite", "")) in ("true", "1")

    def store() -> str:
        target_dir.mkdir(parents=True, exist_ok=True)
        name, duplicate = upload_name(target_dir, image.filename, content, overwrite)
        if not duplicate:
            (target_dir / name).write_bytes(content)
        return name

    name = await asyncio.to_thread(store)
    return web.json_response({"name": name, "subfolder": subfolder, "type": kind})
