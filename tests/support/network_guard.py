"""The suite's "no outbound network" property, as a pytest plugin (registered by tests/conftest.py).

For the whole session, a socket in the pytest process may connect to (or send to) loopback
(127.0.0.0/8, ::1, `localhost`) or a Unix socket, and nothing else; a host name is resolved only
when it names this machine's loopback. Anything else is refused before the system call, so it
never leaves the machine, and the test during which it happened fails with its node id and the
address, even when the code under test caught the error. An attempt outside any test fails the
session.

What it cannot see: subprocesses (a `fleet gateway`, a worker, a private redis-server, node,
helm, checkov) are other interpreters, and the hook lives in this one. Those the suite starts
bind and talk to loopback (their URLs are `127.0.0.1`), and the ones that would reach out on
their own are told not to: checkov runs with `--skip-download` under `uvx --offline`, litellm
uses its bundled cost map (`LITELLM_LOCAL_MODEL_COST_MAP`, set in tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

# Hosts (names or addresses) the pytest process may reach beyond loopback. Empty: all the suite
# talks to runs on this machine. The package installs of .ci/run (apt-get, `uv sync`,
# .ci/tools.sh, `npm ci`) run before pytest starts, so none of them needs an entry here.
ALLOWED_OUTBOUND: frozenset[str] = frozenset()
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
INET_FAMILIES = (socket.AF_INET, socket.AF_INET6)
NOT_IN_A_HOST_NAME = re.compile(r"[^a-z0-9._-]")  # on a lower-cased name
GUARD_KEY = pytest.StashKey["NetworkGuard"]()


class OutboundRefused(ConnectionRefusedError):
    """Raised where a socket would have left the machine; the test fails whatever is done with it."""


def host_text(host: object) -> str:
    text = host.decode() if isinstance(host, bytes) else str(host)
    return text.split("%", 1)[0].rstrip(".").lower()  # an IPv6 zone or a root dot changes nothing


def is_address(host: object) -> bool:
    try:
        ipaddress.ip_address(host_text(host))
    except ValueError:
        return False
    return True


def refused_by_the_resolver(name: str) -> bool:
    """glibc fails a name that starts with a hyphen, or holds a character no host name has
    (`user:pw@host`, a space, a slash), as unknown without asking a server."""
    return name.isascii() and (name.startswith("-") or NOT_IN_A_HOST_NAME.search(name) is not None)


def stays_on_this_machine(host: object) -> bool:
    """Loopback or the unspecified address (this host); a loopback name, an allowed host, or a
    name the resolver refuses by its shape."""
    if host is None or host in ("", b""):
        return True
    text = host_text(host)
    try:
        address = ipaddress.ip_address(text)
    except ValueError:  # a name: any other would already ask a DNS server when resolved
        loopback = text in LOOPBACK_NAMES or text.endswith(".localhost")
        return loopback or text in ALLOWED_OUTBOUND or refused_by_the_resolver(text)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback or address.is_unspecified or text in ALLOWED_OUTBOUND


@dataclass
class NetworkGuard:
    """Wraps the socket calls that reach a host; `install` stacks over whatever is there."""

    current_test: str | None = None
    violations: list[tuple[str | None, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def refuse(self, what: str) -> OutboundRefused:
        with self.lock:
            self.violations.append((self.current_test, what))
        return OutboundRefused(
            f"no outbound network in the test suite: {what} (tests/support/network_guard.py)"
        )

    def take(self, test: str | None) -> list[str]:
        """What `test` (None: no test) tried, forgotten once taken."""
        with self.lock:
            mine = [what for owner, what in self.violations if owner == test]
            self.violations = [(owner, what) for owner, what in self.violations if owner != test]
        return mine

    def check_address(self, sock: socket.socket, address: Any, call: str) -> None:
        inet = sock.family in INET_FAMILIES and isinstance(address, tuple) and bool(address)
        if inet and not stays_on_this_machine(address[0]):
            port = f" port {address[1]}" if len(address) > 1 else ""
            raise self.refuse(f"{call} to {host_text(address[0])!r}{port}")

    def check_name(self, host: object, call: str) -> None:
        """A name is looked up only if it is loopback's; an address asks no DNS server (the
        connect that follows is checked)."""
        if not stays_on_this_machine(host) and not is_address(host):
            raise self.refuse(f"{call} of {host_text(host)!r}")

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        cls = socket.socket
        saved: dict[tuple[Any, str], Any] = {}

        def wrap(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
            saved[(owner, name)] = getattr(owner, name)
            setattr(owner, name, make(saved[(owner, name)]))

        def address_call(name: str, has_address: Callable[[int], bool], at: int) -> Callable[[Any], Any]:
            def make(original: Any) -> Any:
                def guarded(sock: socket.socket, *args: Any) -> Any:
                    if has_address(len(args)):
                        self.check_address(sock, args[at], name)
                    return original(sock, *args)

                return guarded

            return make

        def name_call(name: str) -> Callable[[Any], Any]:
            def make(original: Any) -> Any:
                def guarded(host: Any, *args: Any, **kwargs: Any) -> Any:
                    self.check_name(host, name)
                    return original(host, *args, **kwargs)

                return guarded

            return make

        wrap(cls, "connect", address_call("connect", lambda n: n >= 1, 0))
        wrap(cls, "connect_ex", address_call("connect_ex", lambda n: n >= 1, 0))
        # sendto(data, address) or sendto(data, flags, address); sendmsg(buffers, ancdata, flags, address)
        wrap(cls, "sendto", address_call("sendto", lambda n: n >= 2, -1))
        wrap(cls, "sendmsg", address_call("sendmsg", lambda n: n >= 4, 3))
        for name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex"):
            wrap(socket, name, name_call(name))
        try:
            yield
        finally:
            for (owner, name), original in saved.items():
                setattr(owner, name, original)


@pytest.fixture(scope="session", autouse=True)
def no_outbound_network(request: pytest.FixtureRequest) -> Generator[NetworkGuard, None, None]:
    """The guard, for the whole session: every test runs under it."""
    guard = request.config.stash.setdefault(GUARD_KEY, NetworkGuard())
    with guard.installed():
        yield guard


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    guard = item.config.stash.setdefault(GUARD_KEY, NetworkGuard())
    guard.current_test = item.nodeid
    try:
        return (yield)
    finally:
        guard.current_test = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    guard = item.config.stash.get(GUARD_KEY, None)
    tried = guard.take(item.nodeid) if guard is not None else []
    if tried:
        message = f"{item.nodeid} tried to reach beyond this machine: " + "; ".join(tried)
        if report.failed:
            report.sections.append(("outbound network", message))
        else:
            report.outcome, report.longrepr = "failed", message
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    guard = session.config.stash.get(GUARD_KEY, None)
    tried = guard.take(None) if guard is not None else []
    if tried:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                "outside any test, tried to reach beyond this machine: " + "; ".join(tried), red=True
            )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
