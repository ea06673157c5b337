"""URL inputs cannot be turned against the worker (activities/url_fetch.py, public_address.py).

A real HTTPS server on 127.0.0.1 with a certificate (trustme) for made-up public names; the
fetcher's resolver is stubbed (names -> the addresses a test chooses) and its dialer connects
whatever *checked public* address it is given to that local server, so every check runs on the
public address and only the last step of the dial is redirected. No Temporal, no network.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import httpcore
import pytest
import pytest_asyncio
import trustme
from temporalio.exceptions import ApplicationError

from activities.inputs import input_bytes
from activities.pinned_connection import PinnedBackend
from activities.public_address import parse, refusal
from activities.storage import ArtifactStore
from activities.url_fetch import UrlFetcher
from configuration.settings import UrlFetchSettings
from workflows.contracts import UrlInput
from workflows.errors import FetchFailed, UnacceptableBody, UnsafeUrl
from workflows.shared import ErrorType

NAME = "images.example.test"
PUBLIC = "93.184.215.14"
PUBLIC_V6 = "2606:2800:21f:cb07:6820:80da:af6b:8b2c"
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40
CHUNK = 16 * 1024


# --- a local HTTPS server ----------------------------------------------------------------------


@dataclass
class Route:
    status: int = 200
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "image/png"})
    body: bytes = PNG
    endless: bool = False  # chunked, never ends: the client must stop reading


@dataclass
class Server:
    port: int
    routes: dict[str, Route]
    hosts: list[str] = field(default_factory=list)  # Host header of each request
    streamed: int = 0  # bytes of endless bodies written before the client hung up


async def _serve(
    server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, *lines = head.decode("latin-1").split("\r\n")
        path = request_line.split(" ")[1].split("?")[0]
        headers = dict(line.split(": ", 1) for line in lines if ": " in line)
        server.hosts.append(headers.get("Host", ""))
        route = server.routes.get(path, Route(404, {"Content-Type": "text/plain"}, b"no"))
        fields = dict(route.headers)
        if route.endless:
            fields["Transfer-Encoding"] = "chunked"
        else:
            fields.setdefault("Content-Length", str(len(route.body)))
        status = f"HTTP/1.1 {route.status} X\r\n"
        writer.write(
            (status + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n").encode()
        )
        if route.endless:
            chunk = b"%x\r\n" % CHUNK + b"\0" * CHUNK + b"\r\n"
            while True:  # until the client closes the connection
                writer.write(chunk)
                await writer.drain()
                server.streamed += CHUNK
        writer.write(route.body)
        await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
        pass
    finally:
        writer.close()


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest_asyncio.fixture
async def server(ca: trustme.CA) -> AsyncIterator[Server]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(NAME, "cdn.example.test", "internal.example.test").configure_cert(context)
    state = Server(port=0, routes={"/face.png": Route()})
    listener = await asyncio.start_server(
        lambda r, w: _serve(state, r, w), "127.0.0.1", 0, ssl=context
    )
    state.port = listener.sockets[0].getsockname()[1]
    async with listener:
        yield state
        listener.close()


@dataclass
class Network:
    """The stubbed DNS and dialer: what was asked, and where the fetcher connected."""

    answers: dict[str, list[list[str]]]  # name -> successive answers (the last one repeats)
    port: int
    lookups: list[str] = field(default_factory=list)
    dialed: list[tuple[str, int]] = field(default_factory=list)

    async def resolve(self, host: str, port: int) -> Sequence[str]:
        self.lookups.append(host)
        queue = self.answers[host]
        return queue.pop(0) if len(queue) > 1 else queue[0]

    async def dial(
        self, address: str, port: int, connect_timeout: float | None
    ) -> httpcore.AsyncNetworkStream:
        self.dialed.append((address, port))
        # Only the last step is local: the address was checked as the public one it is.
        local = httpcore.AnyIOBackend()
        return await local.connect_tcp("127.0.0.1", self.port, timeout=connect_timeout)


def fetcher(ca: trustme.CA, network: Network, **settings: object) -> UrlFetcher:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return UrlFetcher(
        UrlFetchSettings.from_env({}, **settings),
        resolver=network.resolve,
        dialer=network.dial,
        ssl_context=context,
    )


def network(server: Server, **answers: list[str] | list[list[str]]) -> Network:
    table = {
        name.replace("_", "."): (value if value and isinstance(value[0], list) else [value])
        for name, value in answers.items()
    }
    return Network(answers=table, port=server.port)  # type: ignore[arg-type]


# --- success ------------------------------------------------------------------------------------


async def test_a_public_name_is_fetched_over_a_connection_to_the_address_that_was_checked(
    ca: trustme.CA, server: Server
) -> None:
    net = network(server, images_example_test=[PUBLIC])
    fetched = await fetcher(ca, net).fetch(f"https://{NAME}/face.png?sig=secret", limit=1 << 20)
    assert fetched.data == PNG and fetched.content_type == "image/png"
    assert (fetched.address, net.lookups, net.dialed) == (PUBLIC, [NAME], [(PUBLIC, 443)])
    assert server.hosts == [NAME]  # and TLS verified the certificate for NAME, not the address


# --- refused addresses --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "rule"),
    [
        ("127.0.0.1", "loopback"),
        ("10.20.30.40", "private (10/8)"),
        ("169.254.169.254", "cloud metadata"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "IPv4-mapped form of 127.0.0.1 (loopback)"),
    ],
)
async def test_a_name_resolving_to_a_private_address_is_refused_before_any_connection(
    ca: trustme.CA, server: Server, answer: str, rule: str
) -> None:
    net = network(server, images_example_test=[answer])
    with pytest.raises(UnsafeUrl) as refused:
        await fetcher(ca, net).fetch(f"https://{NAME}/face.png", limit=1 << 20)
    assert (refused.value.reason, refused.value.address, refused.value.host) == (
        "address",
        answer,
        NAME,
    )
    assert rule in str(refused.value) and f"{NAME} resolves to {answer}" in str(refused.value)
    assert net.dialed == [] and server.hosts == []


async def test_one_private_address_among_public_ones_refuses_the_name(
    ca: trustme.CA, server: Server
) -> None:
    net = network(server, images_example_test=[PUBLIC, PUBLIC_V6, "192.168.1.10"])
    with pytest.raises(UnsafeUrl, match=r"192\.168\.1\.10: private \(192\.168/16\)"):
        await fetcher(ca, net).fetch(f"https://{NAME}/face.png", limit=1 << 20)
    assert net.dialed == []


@pytest.mark.parametrize("url", ["https://127.0.0.1/face.png", "https://[::1]/face.png"])
async def test_an_address_literal_in_the_url_is_checked_without_a_lookup(
    ca: trustme.CA, server: Server, url: str
) -> None:
    net = network(server)
    with pytest.raises(UnsafeUrl, match="loopback") as refused:
        await fetcher(ca, net).fetch(url, limit=1 << 20)
    assert refused.value.reason == "address"
    assert net.lookups == [] and net.dialed == []


async def test_a_dns_answer_that_changes_after_the_check_is_never_used(
    ca: trustme.CA, server: Server
) -> None:
    """Rebinding: public for the check, private for a second lookup. There is no second
    lookup: the name is resolved once and the connection goes to the address checked."""
    net = network(server, images_example_test=[[PUBLIC], ["127.0.0.1"]])
    fetched = await fetcher(ca, net).fetch(f"https://{NAME}/face.png", limit=1 << 20)
    assert fetched.data == PNG
    assert net.lookups == [NAME]
    assert net.dialed == [(PUBLIC, 443)]


async def test_a_redirect_to_a_private_address_is_refused(ca: trustme.CA, server: Server) -> None:
    server.routes["/moved"] = Route(302, {"Location": "https://internal.example.test/face.png"})
    net = network(server, images_example_test=[PUBLIC], internal_example_test=["10.0.0.5"])
    with pytest.raises(UnsafeUrl) as refused:
        await fetcher(ca, net).fetch(f"https://{NAME}/moved", limit=1 << 20)
    assert (refused.value.host, refused.value.address) == ("internal.example.test", "10.0.0.5")
    assert net.dialed == [(PUBLIC, 443)]  # the first hop only
    assert server.hosts == [NAME]


async def test_a_redirect_to_a_public_name_is_followed_and_checked_again(
    ca: trustme.CA, server: Server
) -> None:
    server.routes["/moved"] = Route(301, {"Location": "//cdn.example.test/face.png"})
    net = network(server, images_example_test=[PUBLIC], cdn_example_test=[PUBLIC_V6])
    fetched = await fetcher(ca, net).fetch(f"https://{NAME}/moved", limit=1 << 20)
    assert (fetched.data, fetched.host, fetched.redirects) == (PNG, "cdn.example.test", 1)
    assert net.lookups == [NAME, "cdn.example.test"]
    assert net.dialed == [(PUBLIC, 443), (PUBLIC_V6, 443)]


async def test_a_redirect_to_an_invalid_url_fails_typed(ca: trustme.CA, server: Server) -> None:
    server.routes["/moved"] = Route(302, {"Location": "https://[::1/x"})
    net = network(server, images_example_test=[PUBLIC])
    with pytest.raises(FetchFailed, match="redirect to an invalid URL") as failed:
        await fetcher(ca, net).fetch(f"https://{NAME}/moved", limit=1 << 20)
    assert failed.value.retryable is False and len(net.dialed) == 1


async def test_redirects_are_bounded(ca: trustme.CA, server: Server) -> None:
    server.routes["/loop"] = Route(302, {"Location": "/loop"})
    net = network(server, images_example_test=[PUBLIC])
    with pytest.raises(UnsafeUrl, match="more than 2 redirects") as refused:
        await fetcher(ca, net, max_redirects=2).fetch(f"https://{NAME}/loop", limit=1 << 20)
    assert refused.value.reason == "redirects" and len(server.hosts) == 3


async def test_the_pinned_connection_serves_only_the_host_it_was_checked_for(
    server: Server,
) -> None:
    net = network(server)
    backend = PinnedBackend(NAME, [PUBLIC], net.dial)
    with pytest.raises(httpcore.ConnectError, match=f"pinned to {NAME}, not elsewhere.test"):
        await backend.connect_tcp("elsewhere.test", 443)
    with pytest.raises(httpcore.ConnectError, match="never use unix sockets"):
        await backend.connect_unix_socket("/run/docker.sock")
    assert net.dialed == []


# --- refused URLs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        (f"http://{NAME}/face.png", "scheme"),
        (f"https://user:pw@{NAME}/face.png", "credentials"),
        (f"https://{NAME}:8443/face.png", "port"),
    ],
)
async def test_urls_other_than_plain_https_on_an_allowed_port_are_refused(
    ca: trustme.CA, server: Server, url: str, reason: str
) -> None:
    net = network(server, images_example_test=[PUBLIC])
    with pytest.raises(UnsafeUrl) as refused:
        await fetcher(ca, net).fetch(url, limit=1 << 20)
    assert refused.value.reason == reason
    assert "pw" not in str(refused.value)
    assert net.lookups == [] and net.dialed == []


async def test_a_redirect_to_http_is_refused(ca: trustme.CA, server: Server) -> None:
    server.routes["/moved"] = Route(302, {"Location": f"http://{NAME}/face.png"})
    net = network(server, images_example_test=[PUBLIC])
    with pytest.raises(UnsafeUrl, match="only https") as refused:
        await fetcher(ca, net).fetch(f"https://{NAME}/moved", limit=1 << 20)
    assert refused.value.reason == "scheme" and len(net.dialed) == 1


# --- refused answers ----------------------------------------------------------------------------


async def test_a_body_past_the_limit_stops_being_read_while_it_streams(
    ca: trustme.CA, server: Server
) -> None:
    """The body never ends, so a fetcher reading to the end would never return."""
    server.routes["/endless.png"] = Route(endless=True)
    net = network(server, images_example_test=[PUBLIC])
    limit = 256 * 1024
    async with asyncio.timeout(10):
        with pytest.raises(UnacceptableBody, match="stopped reading at") as refused:
            await fetcher(ca, net).fetch(f"https://{NAME}/endless.png", limit=limit)
    assert refused.value.reason == "too_large" and refused.value.address == PUBLIC
    stopped = re.search(r"stopped reading at ([\d,]+) bytes", str(refused.value))
    assert stopped is not None
    read = int(stopped[1].replace(",", ""))
    assert limit < read <= limit + 64 * 1024  # one read past the limit at most
    assert server.streamed > 0


async def test_a_declared_length_past_the_limit_is_refused_before_reading(
    ca: trustme.CA, server: Server
) -> None:
    net = network(server, images_example_test=[PUBLIC])
    with pytest.raises(UnacceptableBody, match=f"declares {len(PNG):,} bytes") as refused:
        await fetcher(ca, net).fetch(f"https://{NAME}/face.png", limit=1000)
    assert refused.value.reason == "too_large"


async def test_the_fetchers_own_cap_applies_under_a_larger_caller_limit(
    ca: trustme.CA, server: Server
) -> None:
    net = network(server, images_example_test=[PUBLIC])
    with pytest.raises(UnacceptableBody, match="1,000-byte limit"):
        await fetcher(ca, net, max_bytes=1000).fetch(f"https://{NAME}/face.png", limit=1 << 20)


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({"Content-Type": "text/html; charset=utf-8"}, "content_type"),
        ({}, "content_type"),
        ({"Content-Type": "image/png", "Content-Encoding": "gzip"}, "content_encoding"),
    ],
)
async def test_a_body_of_the_wrong_type_or_encoding_is_refused(
    ca: trustme.CA, server: Server, headers: dict[str, str], reason: str
) -> None:
    server.routes["/thing"] = Route(headers=headers)
    net = network(server, images_example_test=[PUBLIC])
    with pytest.raises(UnacceptableBody) as refused:
        await fetcher(ca, net).fetch(f"https://{NAME}/thing", limit=1 << 20)
    assert refused.value.reason == reason


async def test_the_content_type_allow_list_is_a_setting(ca: trustme.CA, server: Server) -> None:
    server.routes["/model.bin"] = Route(headers={"Content-Type": "application/x-safetensors"})
    net = network(server, images_example_test=[PUBLIC])
    only_safetensors = fetcher(ca, net, content_types="application/x-safetensors")
    fetched = await only_safetensors.fetch(f"https://{NAME}/model.bin", limit=1 << 20)
    assert fetched.content_type == "application/x-safetensors"
    with pytest.raises(UnacceptableBody, match="image/png; accepted: application/x-safetensors"):
        await only_safetensors.fetch(f"https://{NAME}/face.png", limit=1 << 20)


async def test_a_certificate_for_another_name_is_refused(ca: trustme.CA, server: Server) -> None:
    net = network(server, other_example_test=[PUBLIC])
    with pytest.raises(FetchFailed, match=r"does not verify for other\.example\.test") as failed:
        await fetcher(ca, net).fetch("https://other.example.test/face.png", limit=1 << 20)
    assert (failed.value.reason, failed.value.retryable) == ("tls", False)


# --- as a job sees it ---------------------------------------------------------------------------


async def _input_error(fetch: UrlFetcher, url: str) -> ApplicationError:
    store = ArtifactStore.__new__(ArtifactStore)  # never used for URL inputs
    with pytest.raises(ApplicationError) as failed:
        await input_bytes(store, "face.png", UrlInput(url=url), limit=1 << 20, fetcher=fetch)
    return failed.value


async def test_input_bytes_serves_url_inputs_and_types_each_refusal(
    ca: trustme.CA, server: Server
) -> None:
    server.routes["/busy"] = Route(503, {"Content-Type": "text/plain"}, b"later")
    net = network(server, images_example_test=[PUBLIC], internal_example_test=["172.16.0.9"])
    fetch = fetcher(ca, net)
    store = ArtifactStore.__new__(ArtifactStore)
    ref = UrlInput(url=f"https://{NAME}/face.png")
    assert await input_bytes(store, "face.png", ref, limit=1 << 20, fetcher=fetch) == PNG

    unsafe = await _input_error(fetch, "https://internal.example.test/face.png")
    assert (unsafe.type, unsafe.non_retryable) == (ErrorType.INVALID_REQUEST, True)
    assert "input 'face.png': internal.example.test resolves to 172.16.0.9" in unsafe.message
    assert unsafe.details[0] == {
        "reason": "address",
        "host": "internal.example.test",
        "address": "172.16.0.9",
    }
    missing = await _input_error(fetch, f"https://{NAME}/gone.png")
    assert (missing.type, missing.non_retryable) == (ErrorType.MISSING_INPUT, True)
    assert "answered HTTP 404" in missing.message
    busy = await _input_error(fetch, f"https://{NAME}/busy")
    assert (busy.type, busy.non_retryable) == (ErrorType.MISSING_INPUT, False)


# --- the address rules --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "rule"),
    [
        ("0.0.0.0", "unspecified"),
        ("10.0.0.1", "private (10/8)"),
        ("100.64.0.1", "carrier-grade NAT"),
        ("100.100.100.200", "cloud metadata"),
        ("127.8.9.10", "loopback"),
        ("169.254.10.10", "link-local"),
        ("169.254.169.254", "cloud metadata"),
        ("172.31.255.255", "private (172.16/12)"),
        ("192.0.0.192", "cloud metadata"),
        ("192.0.2.1", "documentation"),
        ("192.168.0.1", "private (192.168/16)"),
        ("198.18.0.1", "benchmarking"),
        ("203.0.113.9", "documentation"),
        ("224.0.0.251", "multicast"),
        ("255.255.255.255", "reserved"),
        ("::", "unspecified"),
        ("::1", "loopback"),
        ("::127.0.0.1", "outside 2000::/3"),  # IPv4-compatible (deprecated)
        ("::ffff:10.0.0.1", "IPv4-mapped form of 10.0.0.1"),
        ("::ffff:169.254.169.254", "cloud metadata"),
        ("64:ff9b::7f00:1", "NAT64 form of 127.0.0.1"),
        ("64:ff9b:1::a00:1", "local-use NAT64"),
        ("2002:c0a8:101::1", "6to4 form of 192.168.1.1"),
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo"),
        ("2001:db8::1", "documentation"),
        ("fc00::1", "unique local"),
        ("fd00:ec2::254", "cloud metadata"),
        ("fe80::1%eth0", "link-local"),
        ("ff02::1", "multicast"),
        ("5f00::1", "outside 2000::/3"),
    ],
)
def test_non_public_addresses_are_refused_by_name(address: str, rule: str) -> None:
    why = refusal(parse(address))
    assert why is not None and rule in why


@pytest.mark.parametrize(
    "address",
    [
        "8.8.8.8",
        PUBLIC,
        "1.1.1.1",
        PUBLIC_V6,
        "::ffff:8.8.8.8",
        "64:ff9b::808:808",
        "2002:808:808::1",
    ],
)
def test_public_addresses_pass(address: str) -> None:
    assert refusal(parse(address)) is None


async def test_the_production_resolver_is_checked_too() -> None:
    """`localhost` comes from /etc/hosts through the event loop's getaddrinfo: refused."""
    production = UrlFetcher(UrlFetchSettings.from_env({}))
    with pytest.raises(UnsafeUrl, match=r"localhost resolves to .*loopback") as refused:
        await production.fetch("https://localhost/face.png", limit=1 << 20)
    assert refused.value.reason == "address"
