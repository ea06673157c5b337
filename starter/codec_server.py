"""The Temporal codec-server protocol over `EncryptionCodec`, for the Temporal UI and CLI.

    POST /encode, POST /decode   body and answer `{"payloads": [...]}`, Temporal's proto JSON
                                 (each payload's `metadata` values and `data` in base64)
    OPTIONS (either path)        the browser's CORS preflight
    GET /health                  "ok", for probes (no auth, no payloads)

The browser calls it from the UI's page, so CORS answers only the configured UI origin (never
`*`): another site the operator visits cannot read decoded payloads through their browser. With
a bearer token configured, /encode and /decode want `Authorization: Bearer TOKEN` (compared in
constant time); preflights carry no credentials, so they need none. Neither the token nor any
payload is ever logged: a request's log line holds its path, status, payload count and namespace.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import hdrs, web
from google.protobuf import json_format
from pydantic import SecretStr
from temporalio.api.common.v1 import Payloads

from configuration.errors import CodecError, DecryptionFailed, UnknownKeyId
from starter.codec import EncryptionCodec

log = structlog.get_logger("codec_server")

ALLOWED_HEADERS = "content-type,x-namespace,authorization"
ALLOWED_METHODS = "POST,OPTIONS"
# A payload is at most 2 MiB by Temporal's default limit, and the UI sends a page of them.
MAX_BODY_BYTES = 16 * 1024 * 1024
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_codec_app(
    codec: EncryptionCodec, ui_origin: str, auth_token: SecretStr | None = None
) -> web.Application:
    """The app; `ui_origin` is the one origin CORS allows (`http://127.0.0.1:8233`)."""
    origin = ui_origin.rstrip("/")
    token = auth_token.get_secret_value().encode() if auth_token is not None else None

    @web.middleware
    async def cors(request: web.Request, handler: Handler) -> web.StreamResponse:
        allowed = request.headers.get(hdrs.ORIGIN) == origin
        if request.method == hdrs.METH_OPTIONS:
            # A preflight from any other origin gets no CORS headers: the browser refuses.
            response: web.StreamResponse = web.Response(status=204 if allowed else 403)
        else:
            try:
                response = await handler(request)
            except web.HTTPException as exc:  # 404, 405: answered with CORS headers too
                response = web.Response(status=exc.status, text=exc.text, headers=exc.headers)
        if allowed:
            response.headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = origin
            response.headers[hdrs.ACCESS_CONTROL_ALLOW_METHODS] = ALLOWED_METHODS
            response.headers[hdrs.ACCESS_CONTROL_ALLOW_HEADERS] = ALLOWED_HEADERS
        response.headers[hdrs.VARY] = hdrs.ORIGIN
        return response

    def authorized(request: web.Request) -> bool:
        if token is None:
            return True
        scheme, _, presented = request.headers.get(hdrs.AUTHORIZATION, "").partition(" ")
        # compare_digest on bytes: the time taken does not say how much of the token matched.
        return scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), token)

    async def convert(request: web.Request, decode: bool) -> web.Response:
        namespace = request.headers.get("X-Namespace")
        if not authorized(request):
            log.warning("codec_request", path=request.path, status=401, namespace=namespace)
            return _error(401, "Unauthorized", "missing or wrong bearer token", bearer=True)
        payloads = Payloads()
        try:
            json_format.Parse(await request.text(), payloads)
        except (json_format.ParseError, UnicodeDecodeError) as exc:
            log.warning("codec_request", path=request.path, status=400, namespace=namespace)
            return _error(400, "BadRequest", f'expected {{"payloads": [...]}}: {exc}')
        try:
            if decode:
                converted = await codec.decode(payloads.payloads)
            else:
                converted = await codec.encode(payloads.payloads)
        except (UnknownKeyId, DecryptionFailed) as exc:
            log.warning(
                "codec_request",
                path=request.path,
                status=422,
                namespace=namespace,
                error=type(exc).__name__,
                key_id=exc.key_id,
            )
            return _error(422, type(exc).__name__, str(exc))
        except CodecError as exc:
            return _error(422, type(exc).__name__, str(exc))
        log.info(
            "codec_request",
            path=request.path,
            status=200,
            namespace=namespace,
            payloads=len(converted),
        )
        body = json_format.MessageToJson(Payloads(payloads=converted), indent=None)
        return web.Response(text=body, content_type="application/json")

    async def encode(request: web.Request) -> web.Response:
        return await convert(request, decode=False)

    async def decode(request: web.Request) -> web.Response:
        return await convert(request, decode=True)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(middlewares=[cors], client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/encode", encode)
    app.router.add_post("/decode", decode)
    app.router.add_get("/health", health)
    return app


def _error(status: int, kind: str, message: str, bearer: bool = False) -> web.Response:
    response = web.json_response({"error": {"type": kind, "message": message}}, status=status)
    if bearer:
        response.headers[hdrs.WWW_AUTHENTICATE] = 'Bearer realm="durable-comfy codec"'
    return response


async def serve_codec(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Start serving `app` (no access log: it would print request lines); the caller cleans up
    the runner."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
