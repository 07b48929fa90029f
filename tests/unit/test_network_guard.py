"""The suite's "no outbound network" guard (tests/support/network_guard.py): it refuses a connect to
a non-loopback address before the system call, fails the test that tried (by name, with the
address) even when the code swallowed the error, and lets loopback and Unix sockets through.

192.0.2.1 is TEST-NET-1 (RFC 5737): never routed, and never contacted here."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.support.network_guard import NetworkGuard, OutboundRefused, stays_on_this_machine

OUTSIDE = "192.0.2.1"


def test_the_session_runs_under_the_guard(no_outbound_network: NetworkGuard) -> None:
    with pytest.raises(OutboundRefused, match=OUTSIDE):
        socket.create_connection((OUTSIDE, 9), timeout=1)
    assert no_outbound_network.take(no_outbound_network.current_test) == [f"connect to '{OUTSIDE}' port 9"]


@pytest.mark.parametrize(
    ("host", "local"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("localhost", True),
        ("LOCALHOST.", True),
        ("api.localhost", True),
        ("0.0.0.0", True),
        (None, True),
        (OUTSIDE, False),
        ("::ffff:192.0.2.1", False),
        ("2001:db8::1", False),
        ("10.0.0.1", False),
        ("pypi.org", False),
        ("localhost.example.com", False),
        ("-unresolvable", True),  # the resolver refuses these without asking a server
        ("user:secret@127.0.0.1", True),
        ("x.-y.example", False),  # this one it asks a server about
        ("bücher.example", False),
    ],
)
def test_what_stays_on_this_machine(host: str | None, local: bool) -> None:
    assert stays_on_this_machine(host) is local


def test_the_guard_refuses_before_the_system_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the guard sits a stand-in for the real call: an outside address never reaches it."""
    reached: list[Any] = []

    def stand_in(sock: socket.socket, address: Any) -> None:
        reached.append(address)

    def resolve_stand_in(host: Any, *args: Any, **kwargs: Any) -> list[Any]:
        reached.append(host)
        return []

    monkeypatch.setattr(socket.socket, "connect", stand_in)
    monkeypatch.setattr(socket.socket, "connect_ex", stand_in)
    monkeypatch.setattr(socket, "getaddrinfo", resolve_stand_in)
    guard = NetworkGuard(current_test="the test")
    with guard.installed(), socket.socket() as sock, socket.socket(socket.AF_INET6) as sock6:
        for call in (sock.connect, sock.connect_ex):
            with pytest.raises(OutboundRefused):
                call((OUTSIDE, 443))
        with pytest.raises(OutboundRefused):
            sock6.connect(("2001:db8::1", 443, 0, 0))
        with pytest.raises(OutboundRefused):
            socket.getaddrinfo("api0.prismacloud.io", 443)
        assert reached == []
        sock.connect(("127.0.0.1", 6379))
        sock6.connect(("::1", 6379, 0, 0))
        socket.getaddrinfo("localhost", 6379)
    assert reached == [("127.0.0.1", 6379), ("::1", 6379, 0, 0), "localhost"]
    assert guard.take("the test") == [
        f"connect to '{OUTSIDE}' port 443",
        f"connect_ex to '{OUTSIDE}' port 443",
        "connect to '2001:db8::1' port 443",
        "getaddrinfo of 'api0.prismacloud.io'",
    ]
    assert socket.socket.connect is stand_in  # uninstalled: what was there is back


def test_loopback_and_unix_sockets_pass() -> None:
    for family, host, name in ((socket.AF_INET, "127.0.0.1", "localhost"), (socket.AF_INET6, "::1", "::1")):
        with socket.socket(family) as server:
            server.bind((host, 0))
            server.listen()
            port = server.getsockname()[1]
            for target in (host, name):  # a loopback name is resolved, then connected to
                with socket.create_connection((target, port), timeout=5):
                    server.accept()[0].close()
    with tempfile.TemporaryDirectory() as folder, socket.socket(socket.AF_UNIX) as server:
        path = str(Path(folder) / "s")
        server.bind(path)
        server.listen()
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(path)


def test_a_test_that_reaches_out_fails_by_name_with_the_address(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner=f"""
        import socket

        def test_swallows_the_error():
            try:
                socket.create_connection(("{OUTSIDE}", 80), timeout=1)
            except OSError:
                pass  # the guard fails the test all the same

        def test_stays_home():
            with socket.socket() as server:
                server.bind(("127.0.0.1", 0))
                server.listen()
                socket.create_connection(server.getsockname(), timeout=5).close()
        """
    )
    plugins = ("-p", "tests.support.network_guard", "-p", "no:cacheprovider", "-p", "no:asyncio")
    result = pytester.runpytest_inprocess(*plugins)
    result.assert_outcomes(passed=1, failed=1)
    named = "*test_inner.py::test_swallows_the_error tried to reach beyond this machine:"
    result.stdout.fnmatch_lines([f"{named} connect to '{OUTSIDE}' port 80*"])
