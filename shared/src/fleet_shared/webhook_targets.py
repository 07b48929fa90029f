"""Where a webhook may go (SSRF): checked when a Turn or a session names the URL, and again for
every connection, against the addresses its host resolves to at that moment. A name that passed
the first check and then resolves to a private address (DNS rebinding) reaches nothing.

Refused unless `webhooks.allowed_networks` names them: loopback, private, link-local, shared,
reserved, multicast and unspecified addresses (anything `ipaddress` does not call global), and an
IPv4 address written as IPv6. http:// is refused unless `webhooks.allow_http`.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpcore

from fleet_shared.config_file import WebhooksSection

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]
MAX_URL_CHARS = 2048
LOCAL_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


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
        if not host or any(c.isspace() for c in url):
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
        mapped = getattr(address, "ipv4_mapped", None)
        if mapped is not None or not address.is_global or address.is_multicast:
            raise TargetRefused(f"{address} is not a public address (webhooks.allowed_networks)")


def literal_address(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


async def system_resolve(host: str, port: int) -> list[IPAddress]:
    """Every address the system resolver gives for `host` (TCP)."""
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
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
