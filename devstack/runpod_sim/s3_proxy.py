"""A worker's road to S3: a TCP forwarder on 127.0.0.1 that the simulator owns, one per worker,
so that the `partition` fault can cut one worker off from the bucket while its ComfyUI runs on
and everyone else (the orchestrator, the other workers) keeps it.

The worker (its handler and its watchdog) is given BUCKET_ENDPOINT_URL pointing here instead of
at the bucket. Bytes are forwarded as they are: an S3 client signs the Host it connects to,
which is the one the server then sees, so signatures hold. Only http upstreams: a TLS client
would check the bucket's certificate against 127.0.0.1.

`shut()` resets every open connection and every new one (accepted, then closed with RST: the
client sees "connection reset" at once); `reopen()` forwards again. The listening socket stays
bound throughout, so no other process can take the port meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import structlog

log = structlog.get_logger("runpod_sim.s3_proxy")
CHUNK = 64 * 1024
CONNECT_TIMEOUT_S = 10.0


@dataclass
class ProxyCounters:
    accepted: int = 0  # connections forwarded
    refused: int = 0  # connections reset on arrival while shut
    cut: int = 0  # open connections reset by a shut


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST rather than FIN: a cut cable, not a polite goodbye."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class TcpProxy:
    def __init__(self, upstream_host: str, upstream_port: int, name: str = "") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.name = name
        self.open = True
        self.counters = ProxyCounters()
        self._server: asyncio.Server | None = None
        # Both ends of every forwarded connection, so that a shut can cut them.
        self._links: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()

    @property
    def port(self) -> int:
        assert self._server is not None, "not started"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self.port

    def shut(self) -> None:
        """From now on this worker has no S3: open connections are cut, new ones reset."""
        self.open = False
        for client, upstream in list(self._links):
            self.counters.cut += 1
            _reset(client)
            upstream.transport.abort()
        self._links.clear()

    def reopen(self) -> None:
        self.open = True

    async def close(self) -> None:
        """Stop listening and cut whatever is open (the worker is gone)."""
        self.shut()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.open:
            self.counters.refused += 1
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.upstream), CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError) as exc:
            # The bucket itself is down: the worker sees what it would see without the proxy.
            log.info("upstream unreachable", proxy=self.name, error=repr(exc))
            _reset(writer)
            return
        if not self.open:  # shut while connecting
            self.counters.refused += 1
            _reset(writer)
            up_writer.transport.abort()
            return
        self.counters.accepted += 1
        link = (writer, up_writer)
        self._links.add(link)
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self._links.discard(link)
            for end in link:
                end.close()


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while data := await source.read(CHUNK):
            sink.write(data)
            await sink.drain()
        if sink.can_write_eof():
            sink.write_eof()  # a half-close passes through: HTTP/1.0 clients rely on it
    except (OSError, asyncio.IncompleteReadError):
        pass  # the other side went (or was cut): the pipe is over


def proxied_url(url: str, port: int) -> str:
    """`url` with its host and port replaced by the proxy's (path and query kept)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"127.0.0.1:{port}"))


def upstream_of(url: str) -> tuple[str, int] | None:
    """(host, port) for an http URL the proxy can forward to; None otherwise (https)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        return None
    return parts.hostname, parts.port or 80
