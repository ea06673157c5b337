"""GET / (and /api/): the front end's page. ComfyUI serves its web root's index.html there,
uncached; nothing here draws a graph, but the stock worker-comfyui handler waits for `/` to
answer 200 before its first job, so the simulator must answer it as ComfyUI does."""

from __future__ import annotations

from aiohttp import web

from .settings import SIM_VERSION

routes = web.RouteTableDef()

PAGE = (
    '<!doctype html><html lang="en"><head><meta charset="UTF-8">'
    f"<title>ComfyUI</title></head><body><p>{SIM_VERSION}: no front end, the API only.</p>"
    "</body></html>"
)
# ComfyUI's get_root sets these, so a browser never keeps a stale front end.
NO_CACHE = {"Cache-Control": "no-cache", "Pragma": "no-cache", "Expires": "0"}


@routes.get("/")
async def root(request: web.Request) -> web.Response:
    return web.Response(body=PAGE.encode(), content_type="text/html", headers=NO_CACHE)
