"""Fetching a URL input: one public HTTPS URL, without letting its sender reach inside our network.

A request's `UrlInput` names a URL the worker downloads from wherever it runs, so each step that
could be steered somewhere private is checked:

- the URL: `https` only, no credentials in it, a port from the allowed list (443 by default:
  a public address can still be the worker's own host, whose other ports are not for callers);
- the host: resolved once, and every address it resolves to must be public
  (`activities.public_address`); the connection then goes to one of exactly those addresses.
  No second lookup happens between the check and the connect: the connection pool's network
  backend (`activities.pinned_connection.PinnedBackend`) dials the checked address, and TLS
  still verifies the certificate against the host name (SNI);
- redirects: followed here, one hop at a time (each is a new URL, checked like the first), at
  most `max_redirects`;
- the answer: status 200, a content type from the allow-list, no content encoding (nothing is
  decompressed, so the size bound is the size of the file), and at most `limit` bytes: a larger
  Content-Length is refused before reading, and the body stops being read once it passes the
  limit.

No proxy is used (a proxy would resolve the name again, out of our sight).

Resolution and dialing are injectable (`Resolver`, `Dialer`) so tests can map made-up public
names onto a local server while the checks still run on the public addresses.

Exceptions (workflows.errors'; `UrlFetchError.reason` is a stable code, `.host` and `.address`
say where):
    UrlFetchError          base
    ├── UnsafeUrl          the URL, a redirect, or an address the host resolves to is refused
    ├── UnacceptableBody   what the server sent cannot be an input (too large, type, encoding)
    └── FetchFailed        no file came back: status, DNS, TLS, connection, timeout;
                           `.retryable` says whether trying again may help
"""

from __future__ import annotations

import asyncio
import functools
import socket
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

import httpcore
import httpx
import structlog

from activities import public_address
from activities.pinned_connection import Dialer, PinnedBackend, Resolver, dial, resolve
from configuration.settings import UrlFetchSettings
from workflows.errors import FetchFailed, UnacceptableBody, UnsafeUrl

log = structlog.get_logger(__name__)

_REDIRECTS: Final = frozenset({301, 302, 303, 307, 308})
_USER_AGENT: Final = "durable-comfy-url-input"


@dataclass(frozen=True)
class Fetched:
    data: bytes
    content_type: str
    host: str  # where the bytes came from, after redirects
    address: str
    redirects: int


class UrlFetcher:
    """Fetches URL inputs. Holds only settings and a TLS context, so one per worker serves
    every fetch; each fetch opens its own connection pinned to the address it checked."""

    def __init__(
        self,
        settings: UrlFetchSettings,
        *,
        resolver: Resolver = resolve,
        dialer: Dialer = dial,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.settings = settings
        self._resolve = resolver
        self._dial = dialer
        self._ssl = ssl_context or httpx.create_ssl_context()

    async def fetch(self, url: str, *, limit: int) -> Fetched:
        limit = min(limit, self.settings.max_bytes)
        target = self._checked_url(_parse(url))
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                for hop in range(self.settings.max_redirects + 1):
                    result = await self._get(target, limit, hop)
                    if isinstance(result, Fetched):
                        return result
                    target = result
        except TimeoutError as exc:
            raise FetchFailed(
                "timeout",
                f"{_shown(target)} did not finish within {self.settings.timeout_s:g} s",
                host=_host(target),
                retryable=True,
            ) from exc
        raise UnsafeUrl(
            "redirects",
            f"more than {self.settings.max_redirects} redirects, the last to {_shown(target)}",
            host=_host(target),
        )

    def _checked_url(self, url: httpx.URL) -> httpx.URL:
        host = _host(url)
        if url.scheme != "https":
            raise UnsafeUrl(
                "scheme", f"{_shown(url)}: only https URLs are fetched, not {url.scheme}", host=host
            )
        if not host:
            raise UnsafeUrl("host", f"{_shown(url)} names no host", host=host)
        if url.userinfo:
            raise UnsafeUrl(
                "credentials", f"{_shown(url)}: credentials in a URL are not accepted", host=host
            )
        port = url.port or 443
        if port not in self.settings.ports:
            allowed = ", ".join(str(p) for p in self.settings.ports)
            raise UnsafeUrl(
                "port", f"{_shown(url)}: port {port} is not allowed (allowed: {allowed})", host=host
            )
        return url

    async def _addresses(self, host: str, port: int) -> list[str]:
        """Every address of `host`, each public; else the first refused one says why."""
        try:
            literal: str | None = str(public_address.parse(host))
        except ValueError:
            literal = None
        if literal is not None:
            answers = [literal]
        else:
            try:
                answers = list(await self._resolve(host, port))
            except socket.gaierror as exc:
                gone = exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None))
                raise FetchFailed(
                    "dns", f"{host} does not resolve: {exc}", host=host, retryable=not gone
                ) from exc
            if not answers:
                raise FetchFailed("dns", f"{host} resolved to nothing", host=host, retryable=True)
        refused = public_address.first_refused(answers)
        if refused is not None:
            answer, why = refused
            via = "" if literal is not None else f"{host} resolves to "
            raise UnsafeUrl(
                "address",
                f"{via}{answer}: {why}; only public addresses are fetched",
                host=host,
                address=answer,
            )
        return answers

    async def _get(self, url: httpx.URL, limit: int, hop: int) -> Fetched | httpx.URL:
        """One hop: the file, or the (checked) URL a redirect points to."""
        host, port = _host(url), url.port or 443
        addresses = await self._addresses(host, port)
        backend = PinnedBackend(host, addresses, self._dial)
        op_timeout = min(self.settings.timeout_s, 30.0)
        request = httpcore.Request(
            "GET",
            httpcore.URL(scheme=b"https", host=url.raw_host, port=port, target=url.raw_path),
            headers=[
                (b"Host", url.netloc),
                (b"User-Agent", _USER_AGENT.encode()),
                (b"Accept", b"image/*, video/*, audio/*, application/octet-stream;q=0.9"),
                (b"Accept-Encoding", b"identity"),
            ],
            extensions={"timeout": dict.fromkeys(("connect", "read", "write", "pool"), op_timeout)},
        )
        pool = httpcore.AsyncConnectionPool(
            ssl_context=self._ssl, network_backend=backend, max_connections=1, retries=0
        )
        try:
            async with pool:
                response = await pool.handle_async_request(request)
                try:
                    return await self._answer(url, response, backend, limit, hop)
                finally:
                    await response.aclose()
        except httpcore.TimeoutException as exc:
            raise FetchFailed(
                "timeout", f"{_shown(url)}: {type(exc).__name__}", host=host, retryable=True
            ) from exc
        except (httpcore.NetworkError, httpcore.ProtocolError) as exc:
            raise _connection_failure(url, backend.dialed, exc) from exc

    async def _answer(
        self,
        url: httpx.URL,
        response: httpcore.Response,
        backend: PinnedBackend,
        limit: int,
        hop: int,
    ) -> Fetched | httpx.URL:
        host, address = _host(url), backend.dialed
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in response.headers}
        if response.status in _REDIRECTS:
            location = headers.get("location")
            if not location:
                raise FetchFailed(
                    "status", f"{_shown(url)}: redirect without a Location", host=host
                )
            try:
                return self._checked_url(url.join(location.strip()))
            except httpx.InvalidURL as exc:
                raise FetchFailed(
                    "status", f"{_shown(url)}: redirect to an invalid URL: {exc}", host=host
                ) from exc
        if response.status != 200:
            raise FetchFailed(
                "status",
                f"{_shown(url)} answered HTTP {response.status}",
                host=host,
                address=address,
                retryable=response.status == 429 or response.status >= 500,
            )
        content_type = headers.get("content-type", "")
        media = content_type.split(";", 1)[0].strip().lower()
        if not _allowed(media, self.settings.content_types):
            raise UnacceptableBody(
                "content_type",
                f"{_shown(url)} is {media or 'of no stated type'}; accepted: "
                f"{', '.join(self.settings.content_types)}",
                host=host,
                address=address,
            )
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise UnacceptableBody(
                "content_encoding",
                f"{_shown(url)} came {encoding}-encoded; only unencoded files are accepted",
                host=host,
                address=address,
            )
        declared = headers.get("content-length", "").strip()
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(url, address, limit, f"it declares {int(declared):,} bytes")
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(url, address, limit, f"stopped reading at {size:,} bytes")
            chunks.append(chunk)
        log.info(
            "url_input.fetched", host=host, address=address, size=size, type=media, redirects=hop
        )
        return Fetched(b"".join(chunks), media, host, address or "", hop)


@functools.cache
def default_fetcher() -> UrlFetcher:
    """The worker's fetcher, built on first use from its environment."""
    return UrlFetcher(UrlFetchSettings())


def _parse(url: str) -> httpx.URL:
    try:
        return httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise UnsafeUrl("host", f"not a URL: {exc}", host="") from exc


def _host(url: httpx.URL) -> str:
    return url.raw_host.decode("ascii")


def _shown(url: httpx.URL) -> str:
    """The URL without its query: a signed URL's query is a credential, never logged."""
    return f"{url.scheme}://{url.netloc.decode('ascii')}{url.path}"


def _allowed(media: str, allowed: Iterable[str]) -> bool:
    for pattern in allowed:
        if pattern.endswith("/*") and media.startswith(pattern[:-1]) and "/" in media:
            return True
        if media == pattern:
            return True
    return False


def _too_large(url: httpx.URL, address: str | None, limit: int, what: str) -> UnacceptableBody:
    return UnacceptableBody(
        "too_large",
        f"{_shown(url)} is larger than the {limit:,}-byte limit for this input ({what})",
        host=_host(url),
        address=address,
    )


def _connection_failure(url: httpx.URL, address: str | None, exc: Exception) -> FetchFailed:
    host = _host(url)
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, ssl.SSLCertVerificationError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, ssl.SSLCertVerificationError):
        return FetchFailed(
            "tls",
            f"{_shown(url)}: the server's certificate does not verify for {host}: "
            f"{cause.verify_message}",
            host=host,
            address=address,
        )
    return FetchFailed(
        "connect",
        f"{_shown(url)}: {exc or type(exc).__name__}",
        host=host,
        address=address,
        retryable=True,
    )
