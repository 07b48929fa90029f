"""Where a webhook may go (SSRF): checked when a Turn or a session names the URL, and again for
every connection, against the addresses its host resolves to at that moment. A name that passed
the first check and then resolves to a private address (DNS rebinding) reaches nothing.

Refused unless `webhooks.allowed_networks` names them: loopback, private, link-local, shared,
reserved, multicast and unspecified addresses (anything `ipaddress` does not call global), and
every IPv6 range that carries an IPv4 address (mapped, compatible, NAT64, 6to4, Teredo): a fixed
table, not the interpreter's opinion, which differs between patch releases. A host written as a
legacy IPv4 number (`2130706433`, `127.1`, `0x7f.1`) is read as the system resolver would.
http:// is refused unless `webhooks.allow_http`. A URL must be printable ASCII (an
internationalised name goes in its `xn--` form).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import re
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpcore

from fleet_shared.config_file import WebhooksSection

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]
MAX_URL_CHARS = 2048
LOCAL_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")
PRINTABLE_ASCII = re.compile(r"[!-~]+")
LEGACY_IPV4 = re.compile(r"(0x[0-9a-f]+|[0-9]+)(\.(0x[0-9a-f]+|[0-9]+)){0,3}")
# IPv6 ranges that embed an IPv4 address (RFC 4291 compatible and mapped, RFC 6052 / 8215 NAT64,
# RFC 6145 SIIT, RFC 3056 6to4, RFC 4380 Teredo): refused whatever the address inside.
CARRIES_IPV4 = tuple(
    ipaddress.IPv6Network(net)
    for net in (
        "::/96",
        "::ffff:0:0/96",
        "::ffff:0:0:0/96",
        "64:ff9b::/96",
        "64:ff9b:1::/48",
        "2002::/16",
        "2001::/32",
    )
)


class TargetRefused(Exception):
    """The URL, or an address its host resolves to, is not one a webhook may reach."""


@dataclass(frozen=True)
class TargetPolicy:
    allow_http: bool = False
    allowed: tuple[IPNetwork, ...] = ()

    @classmethod
    def of(cls, section: WebhooksSection) -> TargetPolicy:
        networks = tuple(ipaddress.ip_network(entry, strict=False) for entry in section.allowed_networks)
        return cls(allow_http=section.allow_http, allowed=networks)

    def check_url(self, url: str) -> None:
        """The URL's own shape: scheme, no credentials, a host; an address written in it, or a
        name that is always local, is checked here too (every other name at each connection)."""
        if len(url) > MAX_URL_CHARS:
            raise TargetRefused(f"a webhook URL has at most {MAX_URL_CHARS} characters")
        if not PRINTABLE_ASCII.fullmatch(url):
            raise TargetRefused("a webhook URL is printable ASCII, with no spaces (a name in its xn-- form)")
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise TargetRefused(f"not a URL: {exc}") from None
        schemes = ("https", "http") if self.allow_http else ("https",)
        if parts.scheme not in schemes:
            raise TargetRefused(f"a webhook URL must be {' or '.join(schemes)}")
        if parts.username is not None or parts.password is not None:
            raise TargetRefused("a webhook URL may not carry credentials")
        host = (parts.hostname or "").rstrip(".").lower()
        if not host:
            raise TargetRefused("a webhook URL needs a host")
        if port == 0:
            raise TargetRefused("a webhook URL needs a port other than 0")
        if host in LOCAL_NAMES or host.endswith(".localhost"):
            self.check_address(ipaddress.ip_address("127.0.0.1"))
            return
        address = literal_address(host)
        if address is not None:
            self.check_address(address)

    def check_address(self, address: IPAddress) -> None:
        if any(address in network for network in self.allowed if network.version == address.version):
            return
        carries = address.version == 6 and any(address in network for network in CARRIES_IPV4)
        if carries or not address.is_global or address.is_multicast:
            raise TargetRefused(f"{address} is not a public address (webhooks.allowed_networks)")


def literal_address(host: str) -> IPAddress | None:
    """The address a host names by itself: an IP literal, or a legacy IPv4 number."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        pass
    if LEGACY_IPV4.fullmatch(host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


# Its own few threads: a name whose nameserver never answers holds one of these (the attempt's
# timeout ends the wait, not the lookup), never the loop's default executor, which the
# database and Redis drivers need.
RESOLVER = ThreadPoolExecutor(4, thread_name_prefix="fleet-webhook-dns")


async def system_resolve(host: str, port: int) -> list[IPAddress]:
    """Every address the system resolver gives for `host` (TCP)."""
    loop = asyncio.get_running_loop()
    lookup = functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    infos = await loop.run_in_executor(RESOLVER, lookup)
    return [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]


class CheckedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, resolving each host itself and connecting only to an address
    the policy allows, by that address (TLS still verifies the URL's host name)."""

    def __init__(self, policy: TargetPolicy, resolve: Resolver = system_resolve) -> None:
        self.policy = policy
        self.resolve = resolve
        self.inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        address = literal_address(host)
        addresses = [address] if address is not None else await self.resolve(host, port)
        if not addresses:
            raise TargetRefused(f"{host} resolves to no address")
        for each in addresses:  # one refused address refuses the name: no choosing the good one
            self.policy.check_address(each)
        return await self.inner.connect_tcp(str(addresses[0]), port, timeout, local_address, socket_options)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise TargetRefused("a webhook never goes to a Unix socket")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def connection_pool(policy: TargetPolicy, resolve: Resolver = system_resolve) -> httpcore.AsyncConnectionPool:
    """The pool deliveries go through: no proxy from the environment, no retries of its own (a
    failed attempt is recorded and tried again later), HTTP/1.1, the system's CAs."""
    return httpcore.AsyncConnectionPool(
        ssl_context=ssl.create_default_context(),
        max_connections=20,
        retries=0,
        network_backend=CheckedBackend(policy, resolve),
    )
