"""Connections that go only where they were checked to go.

`UrlFetcher` resolves a host once and checks every address; the connection must then go to one
of those addresses and nowhere else, without a second lookup that could answer differently
(DNS rebinding). `PinnedBackend` is the httpcore network backend that does this: the pool asks
it for `host:port`, and it dials the checked addresses in order. TLS is unaffected: the pool
still starts TLS with the host name (SNI), and the certificate is verified against that name.

`resolve` (the event loop's getaddrinfo) and `dial` (a TCP connect to an address literal) are
the production `Resolver` and `Dialer`; tests pass their own.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import httpcore

# (host, port) -> the addresses it resolves to, as text.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
# (address, port, connect timeout) -> an open TCP stream to that address.
Dialer = Callable[[str, int, float | None], Awaitable[httpcore.AsyncNetworkStream]]


async def resolve(host: str, port: int) -> list[str]:
    """The event loop's getaddrinfo: every address, in the resolver's order, each once."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


async def dial(
    address: str, port: int, connect_timeout: float | None
) -> httpcore.AsyncNetworkStream:
    """A TCP connection to an address (never a name: nothing is resolved here)."""
    return await httpcore.AnyIOBackend().connect_tcp(address, port, timeout=connect_timeout)


class PinnedBackend(httpcore.AsyncNetworkBackend):
    """The pool's network: connects `host` to its checked addresses and nothing else."""

    def __init__(self, host: str, addresses: Sequence[str], dial: Dialer) -> None:
        self._host = host
        self._addresses = list(addresses)
        self._dial = dial
        self.dialed: str | None = None

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        if host != self._host:
            raise httpcore.ConnectError(f"this connection is pinned to {self._host}, not {host}")
        failure: Exception | None = None
        for address in self._addresses:
            try:
                stream = await self._dial(address, port, timeout)
            except (httpcore.ConnectError, httpcore.ConnectTimeout, OSError) as exc:
                failure = exc
                continue
            self.dialed = address
            return stream
        raise httpcore.ConnectError(f"no address of {host} accepted a connection: {failure}")

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("URL inputs never use unix sockets")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
