"""Which IP addresses a URL input may make the worker connect to: public unicast ones only.

A URL in a request is chosen by whoever sends the request, and the worker fetches it from inside
our network. So every address a name resolves to is checked here, and one refused address
refuses the name (DNS answers rotate: the next lookup could return the other one).

`refusal(address)` names the rule that refuses an address, or returns None for a public one;
`first_refused(answers)` finds the answer of a lookup that refuses the name.
The ranges are listed rather than taken from `ipaddress`'s `is_global`, which calls
`::127.0.0.1` and `2002:c0a8:101::1` (6to4 around 192.168.1.1) global. IPv6 must be global
unicast (2000::/3); the forms that carry an IPv4 address inside (IPv4-mapped, NAT64, 6to4) are
judged by that IPv4 address, and Teredo is refused outright (its client address is obfuscated,
and no image host needs it).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Final

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Cloud instance metadata services: the first thing an SSRF goes for. Most sit in ranges refused
# anyway; they are named so that the error says what was at stake.
METADATA_ADDRESSES: Final = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean, Oracle
        "169.254.170.2",  # AWS ECS task metadata
        "169.254.169.123",  # AWS time sync
        "100.100.100.200",  # Alibaba Cloud
        "192.0.0.192",  # Oracle Cloud (classic)
        "fd00:ec2::254",  # AWS IMDS over IPv6
        "fd00:ec2::23",  # AWS DNS over IPv6
    )
)

_V4: Final = tuple(
    (ipaddress.IPv4Network(net), label)
    for net, label in (
        ("0.0.0.0/8", "unspecified ('this network')"),
        ("10.0.0.0/8", "private (10/8)"),
        ("100.64.0.0/10", "carrier-grade NAT (100.64/10)"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local (169.254/16)"),
        ("172.16.0.0/12", "private (172.16/12)"),
        ("192.0.0.0/24", "IETF protocol assignments (192.0.0/24)"),
        ("192.0.2.0/24", "documentation (TEST-NET-1)"),
        ("192.88.99.0/24", "6to4 relay anycast"),
        ("192.168.0.0/16", "private (192.168/16)"),
        ("198.18.0.0/15", "benchmarking (198.18/15)"),
        ("198.51.100.0/24", "documentation (TEST-NET-2)"),
        ("203.0.113.0/24", "documentation (TEST-NET-3)"),
        ("224.0.0.0/4", "multicast"),
        ("240.0.0.0/4", "reserved (240/4, broadcast)"),
    )
)

_V6_GLOBAL_UNICAST: Final = ipaddress.IPv6Network("2000::/3")
_V6_UNWRAP: Final = ipaddress.IPv6Network("64:ff9b::/96")  # NAT64, well-known prefix
_V6: Final = tuple(
    (ipaddress.IPv6Network(net), label)
    for net, label in (
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("64:ff9b:1::/48", "local-use NAT64"),
        ("fc00::/7", "unique local (fc00::/7)"),
        ("fe80::/10", "link-local (fe80::/10)"),
        ("fec0::/10", "site-local (deprecated)"),
        ("ff00::/8", "multicast"),
        ("2001::/32", "Teredo tunnel"),
        ("2001:db8::/32", "documentation (2001:db8::/32)"),
        ("2001::/23", "IETF protocol assignments (2001::/23)"),
        ("3fff::/20", "documentation (3fff::/20)"),
    )
)


def parse(text: str) -> IPAddress:
    """An address as a resolver or a URL gives it; a zone (`fe80::1%eth0`) is dropped."""
    return ipaddress.ip_address(text.split("%", 1)[0])


def refusal(address: IPAddress) -> str | None:
    """Why the worker must not connect to `address`, or None when it is public."""
    if address in METADATA_ADDRESSES:
        return "cloud metadata service"
    if isinstance(address, ipaddress.IPv4Address):
        return _v4_refusal(address)
    return _v6_refusal(address)


def first_refused(answers: Iterable[str]) -> tuple[str, str] | None:
    """The first of `answers` (addresses as a resolver or a URL gives them) that the worker must
    not connect to, with why; None when every one is public."""
    for answer in answers:
        try:
            why = refusal(parse(answer))
        except ValueError:
            why = "not an IP address"
        if why is not None:
            return answer, why
    return None


def _v4_refusal(address: ipaddress.IPv4Address) -> str | None:
    for network, label in _V4:
        if address in network:
            return label
    return None if address.is_global else "not globally routable"


def _v6_refusal(address: ipaddress.IPv6Address) -> str | None:
    embedded = _embedded_v4(address)
    if embedded is not None:
        form, inner = embedded
        inner_refusal = refusal(inner)
        return f"{form} of {inner} ({inner_refusal})" if inner_refusal else None
    for network, label in _V6:
        if address in network:
            return label
    if address not in _V6_GLOBAL_UNICAST:
        return "not global unicast IPv6 (outside 2000::/3)"
    return None


def _embedded_v4(address: ipaddress.IPv6Address) -> tuple[str, ipaddress.IPv4Address] | None:
    if address.ipv4_mapped is not None:
        return "IPv4-mapped form", address.ipv4_mapped
    if address.sixtofour is not None:
        return "6to4 form", address.sixtofour
    if address in _V6_UNWRAP:
        return "NAT64 form", ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None
